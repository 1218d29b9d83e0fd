#!/usr/bin/env python3
"""The README's first example (the ``python`` block under "## A first example"), as a user
copies it.

    python tools/readme_example.py --mypy              # against this source tree
    python tools/readme_example.py --mypy --installed  # against the installed package
    python tools/readme_example.py                     # print it

The example is written to a temporary folder and checked from there with mypy's default
settings, so that this project's own (pyproject.toml) play no part: what passes is what a
user's mypy sees of the package's types (py.typed, the .pyi stubs of the compiled core).
mypy cannot see through an editable install's import hook, so by default it is pointed at
this tree (MYPYPATH) and, as it treats an installed package, reports no error inside it
(``--follow-imports=silent``); ``--installed`` checks the package as installed
(tools/wheel_check.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## A first example"


def example() -> str:
    """The first ```python block after the README's ``HEADING``."""
    text = README.read_text()
    start = text.find(HEADING)
    found = re.compile(r"^```python\n(.*?)^```", re.M | re.S).search(text, max(start, 0))
    if start < 0 or found is None:
        raise SystemExit(f"no ```python block under {HEADING!r} in {README}")
    return found.group(1)


def check_with_mypy(installed: bool) -> int:
    """mypy's exit status on the example, run as a user would, outside this tree."""
    env = {**os.environ, **({} if installed else {"MYPYPATH": str(README.parent)})}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "readme_example.py"
        path.write_text(example())
        silent = [] if installed else ["--follow-imports=silent"]
        done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", *silent,
                               path.name], cwd=folder, capture_output=True, text=True, env=env)
    print(f"mypy on the README's example: {done.stdout.strip() or done.stderr.strip()}")
    return done.returncode


if __name__ == "__main__":
    if "--mypy" not in sys.argv[1:]:
        print(example())
        sys.exit(0)
    sys.exit(check_with_mypy(installed="--installed" in sys.argv[1:]))
