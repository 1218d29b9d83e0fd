"""The README's example runs as written (on the default backend)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_readme_example_runs(capsys):
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    found, last = capsys.readouterr().out.strip().split("\n")
    # the second prompt's 64-token prefix was found (4 full blocks of 16), so only its
    # 20-token tail was prefilled
    assert found == "req-2 found 64 of its 84 prompt tokens in the cache"
    # 103 tokens in 7 blocks, and 23 tokens past the 4 shared blocks in 2
    assert last.endswith("] 9")


def test_readme_serving_example_runs_as_a_script(tmp_path):
    """The prefill and decode processes of "Serving across processes", run as a person runs
    the example: saved as a script (its worker is spawned), on the default backend."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Serving across processes"):]
    script = tmp_path / "serve.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "7 [1 1]"  # 100 tokens: 7 blocks; V is all ones
