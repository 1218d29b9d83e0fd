"""A griffe extension for the API reference: docstrings of the compiled core.

griffe reads a compiled module (``HipBuffer``'s ``memory/buffer``, ``MemoryPool``'s
``memory/pool``, ...) from its ``.pyi`` stub: the signatures, but none of the docstrings,
which live in the ``.pyx`` source and the built module. For every object that a stub
declares without a docstring, this extension imports the built module and takes the
object's own docstring from it. Where the compiled core is not built (``make core``), the
stubs' signatures stay, without their docstrings.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

import griffe

_log = logging.getLogger(__name__)


def _documented(value: Any) -> bool:
    """Whether ``value``'s ``__doc__`` is its own (a module, class, routine or descriptor),
    not the docstring of its type (an ``int`` constant's would be ``int``'s)."""
    return (inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)
            or inspect.isdatadescriptor(value) or inspect.ismethoddescriptor(value))


def _runtime(obj: griffe.Object) -> Any:
    """The built object that ``obj`` (declared in a stub) describes, or None."""
    module = obj if obj.is_module else obj.module
    try:
        value: Any = importlib.import_module(module.path)
    except Exception as exc:  # the compiled core not built, or not importable here
        _log.info("compiled_docstrings: %s not importable (%s)", module.path, exc)
        return None
    for name in obj.path[len(module.path):].split(".")[1:]:
        value = inspect.getattr_static(value, name, None)
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if value is None:
            return None
    return value


class CompiledDocstrings(griffe.Extension):
    """Fills the docstrings of objects read from ``.pyi`` stubs from the built modules."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._fill(pkg)

    def _fill(self, obj: griffe.Object) -> None:
        stub = obj.filepath is not None and not isinstance(obj.filepath, list) \
            and obj.filepath.suffix == ".pyi"
        own = not obj.name.startswith("__")  # a slot's docstring is Python's generic one
        if stub and own and (obj.docstring is None or obj.is_module):
            value = _runtime(obj)
            text = getattr(value, "__doc__", None) if _documented(value) else None
            if isinstance(text, str) and text.strip():
                obj.docstring = griffe.Docstring(inspect.cleandoc(text), parent=obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._fill(member)
