"""The package's version, from its one source: ``version`` in pyproject.toml's ``[project]``
table. Installed, it is read from the installed metadata (which pip wrote from that table);
in a source tree that was never installed, from pyproject.toml beside the package."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "rocmforge_raw"
UNKNOWN = "0+unknown"
_PROJECT_TABLE = re.compile(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", re.MULTILINE | re.DOTALL)
_VERSION_KEY = re.compile(r"""^version\s*=\s*["']([^"']+)["']""", re.MULTILINE)


def version() -> str:
    """The installed distribution's version, else the source tree's (``UNKNOWN`` if
    neither can be read)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return tree_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def tree_version(pyproject: Path) -> str:
    """``version`` of the ``[project]`` table in ``pyproject`` (``UNKNOWN`` if the file or the
    key is missing). Read with a pattern, not a TOML parser: Python 3.10 has no tomllib."""
    try:
        text = pyproject.read_text()
    except OSError:
        return UNKNOWN
    table = _PROJECT_TABLE.search(text)
    found = _VERSION_KEY.search(table.group(1)) if table else None
    return found.group(1) if found else UNKNOWN
