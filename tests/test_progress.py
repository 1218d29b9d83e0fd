"""Progress displays (rocmforge_raw.common.progress): a bar on a terminal; off a terminal a
plain line at most every interval, on stderr, and a last line if any was written."""

from __future__ import annotations

import time

import pytest

from rocmforge_raw.common import progress


@pytest.fixture(autouse=True)
def by_the_terminal(monkeypatch):
    """Each test starts deciding by the terminal (an in-process CLI run may have forced a
    mode) and without RF_PROGRESS/RF_PROGRESS_EVERY; the mode is restored after."""
    monkeypatch.delenv("RF_PROGRESS", raising=False)
    monkeypatch.delenv("RF_PROGRESS_EVERY", raising=False)
    monkeypatch.setattr(progress, "_forced", None)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress.time, "monotonic", fake)
    return fake


def test_off_a_terminal_displays_are_lines_every_ten_seconds_by_default(capsys):
    assert progress.mode() == "lines"  # pytest's stderr is not a terminal
    shown = progress.bar(3, "work")
    assert isinstance(shown, progress.Lines) and shown.every == progress.DEFAULT_INTERVAL == 10


def test_a_line_is_written_at_most_once_an_interval_and_flushed_to_stderr(capsys, clock):
    with progress.Lines(60, "soak host:0", "s", every=5) as shown:
        for second in range(1, 13):
            clock.now += 1
            shown.set_postfix_str(f"{second * 100} cycles, RSS +0.3 MiB", refresh=False)
            shown.update(1)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["soak host:0: 5/60 s, 500 cycles, RSS +0.3 MiB",
                                "soak host:0: 10/60 s, 1000 cycles, RSS +0.3 MiB",
                                "soak host:0: done, 12/60 s, 1200 cycles, RSS +0.3 MiB"]


def test_work_shorter_than_the_interval_leaves_no_line(capsys, clock):
    for _ in progress.track(range(4), "bench --alloc", unit="sizes"):
        clock.now += 1
    assert capsys.readouterr() == ("", "")


def test_a_count_not_in_seconds_says_the_time_elapsed(capsys, clock):
    with progress.bar(120, "demo", unit="req") as shown:
        clock.now += 12
        shown.set_postfix_str("blocks 30/50", refresh=False)
        shown.update(40)
        clock.now += 3
    assert capsys.readouterr().err.splitlines() == [
        "demo: 40/120 req, blocks 30/50, 12 s", "demo: done in 15 s, 40/120 req, blocks 30/50"]


def test_the_interval_is_rf_progress_every_when_it_is_a_positive_number(monkeypatch):
    monkeypatch.setenv("RF_PROGRESS_EVERY", "2.5")
    assert progress.interval() == 2.5 and progress.bar(1, "x").every == 2.5
    for bad in ("0", "-1", "nan", "soon"):
        monkeypatch.setenv("RF_PROGRESS_EVERY", bad)
        assert progress.interval() == progress.DEFAULT_INTERVAL


def test_rf_progress_0_turns_every_display_off(capsys, clock, monkeypatch):
    monkeypatch.setenv("RF_PROGRESS", "0")
    progress.set_mode("lines")
    with progress.bar(10, "work") as shown:
        clock.now += 100
        shown.update(5)
        assert shown.n == 5  # a hidden display still counts for its user
    with progress.ticking("compiling"):
        clock.now += 100
    assert capsys.readouterr() == ("", "")


def test_a_forced_mode_wins_over_the_terminal_and_a_bad_one_is_refused():
    progress.set_mode("bar")
    assert progress.mode() == "bar" and not isinstance(progress.bar(1, "x"), progress.Lines)
    progress.set_mode("off")
    assert not progress.enabled()
    with pytest.raises(ValueError, match="progress mode 'loud' is not one of bar, lines, off"):
        progress.set_mode("loud")


def test_a_blocking_call_off_a_terminal_is_ticked_from_a_thread(capsys, monkeypatch):
    monkeypatch.setenv("RF_PROGRESS_EVERY", "0.05")
    with progress.ticking("compiling paged_attention.cu for sm_90"):
        time.sleep(0.4)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and lines[0] == "compiling paged_attention.cu for sm_90: 0 s"
    assert lines[-1] == "compiling paged_attention.cu for sm_90: done in 0 s"
