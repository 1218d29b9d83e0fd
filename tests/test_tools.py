"""The build's progress display (tools/make_progress.py): make builds what is out of date,
its bar counts the objects as they appear, make's status and lines come through."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def _tool():
    spec = importlib.util.spec_from_file_location("make_progress", TOOLS / "make_progress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKEFILE = """\
%.o: %.src
\t@echo building $@
\tcp $< $@
bad.o:
\tfalse
%.slow: %.src
\tsleep 1
\tcp $< $@
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "Makefile").write_text(MAKEFILE)
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.src").write_text(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MAKEFLAGS", "-j3 --jobserver-auth=fifo:/nowhere FOO=1")
    return tmp_path


def test_builds_what_is_out_of_date_and_then_nothing(project, capsys):
    tool = _tool()
    (project / "a.o").write_text("a")  # newer than a.src: up to date
    assert tool.out_of_date(["a.o", "b.o", "c.o"]) == ["b.o", "c.o"]
    assert tool.build("objects", ["a.o", "b.o", "c.o"]) == 0
    out = capsys.readouterr().out
    assert "objects: building 2 of 3" in out and "building b.o" in out and "building c.o" in out
    assert (project / "c.o").read_text() == "c"
    assert tool.build("objects", ["a.o", "b.o", "c.o"]) == 0
    assert capsys.readouterr().out == "objects: all 3 up to date\n"


def test_a_failing_target_ends_with_makes_status(project, capsys):
    assert _tool().build("objects", ["b.o", "bad.o"]) != 0


def test_the_parent_makes_jobserver_is_not_passed_on_but_its_variables_are():
    env = _tool()._without_jobserver({"MAKEFLAGS": "j -j4 --jobserver-auth=3,4 FOO=1 -s",
                                      "PATH": "/bin"})
    assert env == {"MAKEFLAGS": "FOO=1 -s", "PATH": "/bin"}


def test_off_a_terminal_the_build_says_its_count_in_plain_lines(project, capsys, monkeypatch):
    """In a log (stderr not a terminal) the build is not silent: a line every interval on
    stderr, then a last one; make's own lines stay on stdout."""
    from rocmforge_raw.common import progress

    monkeypatch.setattr(progress, "_forced", None)
    monkeypatch.delenv("RF_PROGRESS", raising=False)
    monkeypatch.setenv("RF_PROGRESS_EVERY", "0.4")
    assert _tool().build("objects", ["a.slow", "b.slow"], jobs=1) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert "sleep 1" in out and "sleep 1" not in err
    assert len(lines) >= 3 and all(line.startswith("objects: ") for line in lines), lines
    assert lines[0].startswith("objects: 0/2 objects, a.slow, b.slow, ")
    assert any(line.startswith("objects: 1/2 objects, b.slow, ") for line in lines)
    assert lines[-1].startswith("objects: done in ") and lines[-1].endswith(", 2/2 objects")
