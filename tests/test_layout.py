"""The package's layout, read from its code: every module in a layer, imports only downward,
no import circle, no module above 400 lines, the GPU bindings imported by the runtime alone.

Layers, lowest first (README, "How the code is laid out"): the foundation (errors, common),
runtime, memory, kernels, cache, transport, the applications (cli, bench, demo, soak) and the
public facades (the package itself, ``array``, ``ops``). Imports are read from the source
(Python's ``ast`` for ``.py``; ``import``/``cimport`` lines for Cython's ``.pyx``/``.pxd``),
all of them: at module level, inside functions and under ``TYPE_CHECKING`` alike. Type stubs
(``.pyi``) describe compiled modules and are not imports that run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "rocmforge_raw"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
MAX_LINES = 400

#: Each layer and the module prefixes it holds, lowest first.
LAYERS = (
    ("foundation", ("errors", "_version", "common")),
    ("runtime", ("runtime",)),
    ("memory", ("memory",)),
    ("kernels", ("kernels",)),
    ("cache", ("cache",)),
    ("transport", ("transport",)),
    ("applications", ("cli", "bench", "demo", "soak")),
    ("public", ("", "array", "ops")),
)
#: Third-party modules only the runtime may import (DESIGN.md: nothing above ``runtime/``
#: imports hip-python or cuda-python).
BINDINGS = ("hip", "cuda")
_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w.]+))",
                            re.M)


def _module_name(path: Path, root: Path = ROOT) -> tuple[str, bool]:
    """(dotted name below the package at ``root``, whether it is a package's ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _sources() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(ROOT.rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd") and "__pycache__" not in path.parts:
            found.setdefault(_module_name(path)[0], []).append(path)
    return found


MODULES = _sources()


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The dotted name (below the package) a relative import in ``module`` names."""
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _within(absolute: str) -> str | None:
    """``absolute`` below the package, or None for another package's module."""
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1:]
    return None


def _imported(module: str, target: str, names: list[str]) -> set[str]:
    """The modules of this package that ``from target import names`` imports: each name
    that is a module of its own, else ``target``."""
    hits = {f"{target}.{n}".lstrip(".") for n in names if f"{target}.{n}".lstrip(".") in MODULES}
    return hits if hits else {target}


def imports_of(path: Path, root: Path = ROOT) -> tuple[set[str], set[str]]:
    """(modules of this package, top-level names of other packages) that ``path`` (a file
    of the package at ``root``) imports."""
    module, is_package = _module_name(path, root)
    text = path.read_text()
    inside, outside = set(), set()
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = _within(alias.name)
                    if name is None:
                        outside.add(alias.name.split(".")[0])
                    else:
                        inside.add(name)
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
                if node.level:
                    target = _resolve(module, is_package, node.level, node.module)
                else:
                    target = _within(node.module or "")
                    if target is None:
                        outside.add((node.module or "").split(".")[0])
                        continue
                inside |= _imported(module, target, names)
    else:
        for match in _CYTHON_IMPORT.finditer(text):
            source = match.group(1) or match.group(3)
            names = re.findall(r"\w+", (match.group(2) or "").split(" as ")[0])
            if source.startswith("."):
                level = len(source) - len(source.lstrip("."))
                target = _resolve(module, is_package, level, source.lstrip(".") or None)
            else:
                target = _within(source)
                if target is None:
                    outside.add(source.split(".")[0])
                    continue
            inside |= _imported(module, target, names)
    inside.discard(module)
    return inside, outside


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the layer ``module`` belongs to (its longest prefix)."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix and module.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, paths in MODULES.items():
        for path in paths:
            edges.setdefault(module, set()).update(imports_of(path)[0])
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer():
    assert MODULES, f"no modules found under {ROOT}"
    homeless = sorted(m for m in MODULES if layer_of(m) < 0)
    assert not homeless, f"modules in no layer of {[name for name, _ in LAYERS]}: {homeless}"


def test_imports_run_downward_only():
    """A module imports its own layer and the layers below it, never one above."""
    upward = []
    for module, targets in graph().items():
        for target in sorted(targets):
            if target in MODULES and layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_above_400_lines():
    long = [f"{path.relative_to(ROOT.parent)}: {n} lines" for paths in MODULES.values()
            for path in paths if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules above {MAX_LINES} lines:\n" + "\n".join(long)


def test_only_the_runtime_imports_the_gpu_bindings():
    runtime = layer_of("runtime")
    found = [f"{module} imports {name}" for module, paths in MODULES.items()
             if layer_of(module) != runtime for path in paths
             for name in sorted(imports_of(path)[1] & set(BINDINGS))]
    assert not found, "GPU bindings imported above the runtime:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from ..kernels import ops\n", {"kernels.ops"}),
    ("from . import buffer, stream\n", {"memory.buffer", "memory.stream"}),
    ("from .. import checks\n", {""}),  # no such module: the package itself (public layer)
    ("def f():\n    from ..cache.kv_cache import KvCache\n", {"cache.kv_cache"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cache import x\n",
     {"cache"}),
    ("import rocmforge_raw.soak.run\n", {"soak.run"}),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, source, expected):
    """The checks above are only as good as the reader: relative and absolute imports,
    imports inside functions and under TYPE_CHECKING all count (here in a module
    ``memory.probe``)."""
    probe = tmp_path / "memory" / "probe.py"
    probe.parent.mkdir()
    probe.write_text(source)
    assert imports_of(probe, tmp_path)[0] == expected


def test_the_reader_sees_cython_imports(tmp_path):
    probe = tmp_path / "memory" / "probe.pyx"
    probe.parent.mkdir()
    probe.write_text("from rocmforge_raw.memory._freelist cimport FreeList\n"
                     "from ..runtime import get_backend\nfrom hip import hip\n")
    assert imports_of(probe, tmp_path) == ({"memory._freelist", "runtime"}, {"hip"})


def test_a_circle_and_an_upward_import_are_found():
    """The circle finder and the layer order, on a made-up graph."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert layer_of("memory.buffer") < layer_of("kernels.ops") < layer_of("cache.kv_cache")
    assert layer_of("cli.main") > layer_of("transport.ipc") > layer_of("cache.kv_cache")
    assert layer_of("ops") == layer_of("") == len(LAYERS) - 1
