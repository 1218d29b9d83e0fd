"""Every fenced block of the README and of docs/ is what it claims to be.

- Each ```python block runs as shown: saved alone as a script (its own imports, no state from
  another block) and run in a fresh process on the host backend, it exits 0. Where the README
  states what a block prints, the test holds it to that.
- Each shell block (```bash, ```console, ```sh) names only what exists: every ``make X`` a
  target of the Makefile, every ``rocmforge-raw ...`` a command line the CLI parses (run with
  ``--help`` appended, each of its flags in that help) and ``info`` and ``--version`` run for
  real, every ``python tools/X.py`` / ``bash tools/X.sh`` a file of the repository, every
  ``pip install`` extra one of pyproject.toml's. A line the test has no check for fails it,
  so no command goes unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELLS = ("bash", "console", "sh", "shell")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def blocks(path: Path, languages: tuple[str, ...]) -> list[tuple[str, str]]:
    """(``file:line``, code) of each fenced block of ``path`` in one of ``languages``."""
    text = path.read_text()
    return [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2))
            for m in FENCE.finditer(text) if m.group(1) in languages]


def run_block(code: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``code`` run as a script of its own in ``folder``, on the host backend, this tree's
    package first on the path."""
    script = folder / "block.py"
    script.write_text(code)
    env = {**os.environ, "RF_BACKEND": "host", "RF_PROGRESS": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [
               os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


PYTHON_BLOCKS = [b for page in PAGES for b in blocks(page, ("python",))]


def test_the_pages_have_python_blocks():
    """The README's tour and the architecture page are made of examples (a pattern that
    stopped matching them would leave the tests below with nothing to run)."""
    places = {where.split(":")[0] for where, _ in PYTHON_BLOCKS}
    assert {"README.md", "docs/architecture.md"} <= places
    assert len([b for b in PYTHON_BLOCKS if b[0].startswith("README.md")]) >= 4


@pytest.mark.parametrize("where, code", PYTHON_BLOCKS, ids=[w for w, _ in PYTHON_BLOCKS])
def test_python_block_runs_alone(where, code, tmp_path):
    done = run_block(code, tmp_path)
    assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"


def _readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = README.read_text()
    return FENCE.search(text, text.index(heading)).group(2)


def test_the_first_example_prints_what_it_says(tmp_path):
    done = run_block(_readme_block("## A first example"), tmp_path)
    found, last = done.stdout.strip().split("\n")
    # the second prompt's 64-token prefix was found (4 full blocks of 16), so only its
    # 20-token tail was prefilled
    assert found == "req-2 found 64 of its 84 prompt tokens in the cache"
    # 103 tokens in 7 blocks, and 23 tokens past the 4 shared blocks in 2
    assert last.endswith("] 9")


def test_the_tour_prints_what_it_says(tmp_path):
    text = README.read_text()
    tour = text[text.index("## A tour"):]
    memory, serving, processes = (m.group(2) for m in list(FENCE.finditer(tour))[:3])
    out = run_block(memory, tmp_path).stdout.split("\n")
    assert out[:2] == ["[0 1 2 3 4 5 6 7]",
                       "copy of 32 bytes at offset 4080 overruns a 4096-byte buffer"]
    assert out[2:5] == ["[0 1 2 3 4 5 6 7]", "0", "2 1"]
    assert run_block(serving, tmp_path).stdout.split("\n")[-2] == "4 0"
    # 100 tokens: 7 blocks moved; V is all ones
    assert run_block(processes, tmp_path).stdout.split("\n")[-2] == "7 [1 1]"


# --- shell blocks ------------------------------------------------------------------------------
SHELL_LINES = [(where, line) for page in PAGES for where, code in blocks(page, SHELLS)
               for line in code.split("\n") if line.strip() and not line.lstrip().startswith("#")]


def make_targets() -> set[str]:
    """The Makefile's explicit targets (rules whose name has no pattern or variable)."""
    text = (ROOT / "Makefile").read_text()
    return {name for names in re.findall(r"^([\w .-]+?)\s*:(?!=)", text, re.M)
            for name in names.split()}


def commands(line: str) -> list[list[str]]:
    """The commands of one shell line: split at ``&&``, ``||``, ``;`` and ``|``, a ``$``
    prompt, ``VAR=value`` prefixes, comments and redirections dropped."""
    line = re.sub(r"^\s*\$\s+", "", line)
    words = shlex.split(line, comments=True)
    found, current = [], []
    for word in [*words, ";"]:
        if word in ("&&", "||", ";", "|"):
            if current:
                found.append(current)
            current = []
        elif not current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word):
            continue
        else:
            current.append(word)
    return [[w for w in c if not re.match(r"^\d?[<>]", w)] for c in found]


def cli_problem(args: list[str]) -> str | None:
    """What is wrong with ``rocmforge-raw ARGS``, or None."""
    env = {**os.environ, "RF_BACKEND": "host", "RF_PROGRESS": "0"}
    base = [sys.executable, "-m", "rocmforge_raw.cli"]
    if args in (["info"], ["--version"]):
        done = subprocess.run(base + args, capture_output=True, text=True, env=env, cwd=ROOT)
        return None if done.returncode == 0 else done.stderr
    done = subprocess.run(base + args + ["--help"], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode != 0:
        return done.stderr.strip()
    flags = [a.split("=")[0] for a in args if a.startswith("-")]
    unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])",
                                                 done.stdout)]
    return f"flags not in its --help: {unknown}" if unknown else None


def command_problem(command: list[str]) -> str | None:
    """What is wrong with one command of a shell block, or None; an unknown kind of command
    is a problem too (the test must know how to check every line)."""
    name = command[0]
    if name == "make":
        missing = [t for t in command[1:] if "=" not in t and not t.startswith("-")
                   and t not in make_targets()]
        return f"no such make target: {missing}" if missing else None
    if name.endswith("rocmforge-raw"):
        return cli_problem(command[1:])
    if re.fullmatch(r"(\S*/)?python3?", name) or name == "bash":
        script = next((w for w in command[1:] if not w.startswith("-")), None)
        if script is None or not script.startswith("tools/"):
            return f"only tools/ scripts are checked, not {script!r}"
        return None if (ROOT / script).is_file() else f"{script} does not exist"
    if name.endswith("pip") and command[1:2] == ["install"]:
        extras = re.findall(r"\[([\w,-]+)\]", " ".join(command[2:]))
        declared = (ROOT / "pyproject.toml").read_text()
        missing = [e for group in extras for e in group.split(",")
                   if not re.search(rf"^{e}\s*=", declared, re.M)]
        return f"no such extra: {missing}" if missing else None
    return f"no check for the command {name!r}"


@pytest.mark.parametrize("where, line", SHELL_LINES, ids=[w for w, _ in SHELL_LINES])
def test_shell_line_names_what_exists(where, line):
    problems = [p for c in commands(line) if (p := command_problem(c))]
    assert not problems, f"{where}: {line}\n{problems}"


def test_the_checks_catch_what_does_not_exist():
    """A test that cannot fail is a defect: each check refuses a broken line."""
    assert command_problem(["make", "no-such-target"])
    assert command_problem(["rocmforge-raw", "bench", "--no-such-flag"])
    assert command_problem(["rocmforge-raw", "no-such-command"])
    assert command_problem(["python", "tools/no_such_tool.py"])
    assert command_problem(["pip", "install", ".[no-such-extra]"])
    assert command_problem(["curl", "example.org"])
    assert command_problem(["make", "demo"]) is None
    assert command_problem(["rocmforge-raw", "bench", "--attention", "--sweep"]) is None


def test_a_broken_python_block_fails(tmp_path):
    """The runner reports a block that needs another block's names, or that raises."""
    assert run_block("print(cache.stats())\n", tmp_path).returncode != 0
    assert run_block("import rocmforge_raw as rf\nrf.HipBuffer(-1)\n", tmp_path).returncode != 0
    assert run_block("import rocmforge_raw as rf\nrf.HipBuffer(8).close()\n",
                     tmp_path).returncode == 0
