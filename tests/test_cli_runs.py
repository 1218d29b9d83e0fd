"""The CLI's long runs and its bare call: the demo's seed and verdict, the soak's progress in
a log and its planted leaks said first, `rocmforge-raw` with no command."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from rocmforge_raw.cli.main import main
from rocmforge_raw.demo import TIMINGS, failures


def cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", *argv],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_a_bare_command_prints_a_short_usage_that_points_to_help():
    result = cli()
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and result.stdout == ""
    assert lines[0].startswith("usage: rocmforge-raw ") and lines[1] == "commands:"
    assert [line.split()[0] for line in lines[2:6]] == ["info", "demo", "bench", "soak"]
    assert lines[-1] == ("rocmforge-raw: no command given: run `rocmforge-raw --help` for more, "
                         "`rocmforge-raw COMMAND --help` for a command's flags and examples")


# --- the demo --------------------------------------------------------------------------------
DEMO = ["demo", "--backend", "host", "--scale", "0.1"]


def test_the_demo_prints_its_seed_first_and_ends_with_one_verdict_line(capsys):
    assert main([*DEMO, "--seed", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "seed 5 (rerun with --seed 5)"
    assert re.fullmatch(r"demo: OK \(12/12 requests finished, \d+ attention results matched "
                        r"the NumPy reference, the prefix cache served \d+ prompt tokens, no "
                        r"buffer live after teardown\)", lines[-1]), lines[-1]
    assert not any(line.startswith("demo: ") for line in lines[1:-1])


def test_without_a_seed_the_demo_draws_one_and_says_it(capsys):
    assert main([*DEMO, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # stdout: the JSON alone; the seed's line went to stderr
    seed = result["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    assert f"seed {seed} (rerun with --seed {seed})" in err.splitlines()
    assert result["verdict"] == "OK" and result["failures"] == []


def test_two_runs_of_one_seed_report_the_same_figures_but_the_timings(capsys):
    runs = []
    for _ in range(2):
        assert main([*DEMO, "--seed", "11", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert set(TIMINGS) & set(runs[0]), "the timings left out are the summary's"
    first, second = ({k: v for k, v in run.items() if k not in TIMINGS} for run in runs)
    assert first == second and first["seed"] == 11
    other = main([*DEMO, "--seed", "12", "--json"])
    assert other == 0 and json.loads(capsys.readouterr().out)["prefill_tokens"] != \
        first["prefill_tokens"]


def test_a_demo_whose_check_fails_ends_with_failed_and_exits_1(capsys, monkeypatch):
    from rocmforge_raw.demo import run

    def mismatch(*args):
        raise AssertionError("attention of request 3 differs from the reference: relative "
                             "error 1.00e-01 > 1e-05")

    monkeypatch.setattr(run, "run_demo", mismatch)
    assert main([*DEMO, "--seed", "5"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "seed 5 (rerun with --seed 5)"
    assert lines[-1] == ("demo: FAILED: attention of request 3 differs from the reference: "
                         "relative error 1.00e-01 > 1e-05")


GOOD = {"requests": 12, "finished": 12, "reference_checks_passed": 3, "fp8_checks_passed": 4,
        "turn_checks_passed": 5, "prefill_tokens_saved": 4000, "turn_cached_prompt_tokens": 900,
        "live_buffers_after_teardown": 0}


@pytest.mark.parametrize("change, why", [
    ({"finished": 10}, "2 of 12 requests did not finish"),
    ({"reference_checks_passed": 0}, "no attention result of the decode steps was checked "
                                     "against the reference"),
    ({"fp8_checks_passed": 0}, "no attention result of the fp8 cache was checked"),
    ({"turn_checks_passed": 0}, "no attention result of the multi-turn conversations"),
    ({"prefill_tokens_saved": 0}, "the prefix cache served none of the shared system prompt"),
    ({"turn_cached_prompt_tokens": 0}, "the prefix cache served none of the multi-turn"),
    ({"live_buffers_after_teardown": 2}, "2 buffers were still live after teardown"),
], ids=["unfinished", "no-decode-check", "no-fp8-check", "no-turn-check", "no-prefix-hit",
        "no-turn-hit", "live-buffers"])
def test_the_demo_fails_on_each_thing_it_requires(change, why, capsys, monkeypatch):
    from rocmforge_raw.demo import run

    assert failures(GOOD) == []
    assert any(why in found for found in failures({**GOOD, **change}))
    monkeypatch.setattr(run, "run_demo", lambda *a: {**GOOD, **change})
    assert main([*DEMO, "--seed", "1"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("demo: FAILED: ") and why in last


# --- the soak --------------------------------------------------------------------------------
def test_a_piped_soak_reports_progress_on_stderr_and_its_json_stays_whole(tmp_path):
    result = cli("soak", "--backend", "host", "--json", "--seconds", "10", "--out",
                 str(tmp_path), env={"RF_PROGRESS_EVERY": "2"})
    assert json.loads(result.stdout)["cycles"] > 0
    lines = result.stderr.splitlines()
    steps = [line for line in lines if re.fullmatch(
        r"soak host:0: \d+/10 s, \d+ cycles, RSS [+-]\d+\.\d MiB", line)]
    assert len(steps) >= 3, lines
    assert lines[-1].startswith("soak host:0: done, ")


def test_a_planted_host_leak_is_said_before_the_run_with_its_rate():
    from rocmforge_raw.cli.runs import planted

    args = argparse.Namespace(inject_leak=False, inject_rss_leak_mib=2.5, max_rss_drift_mib=8.0)
    assert planted(args, "cuda") == [
        "soak: --inject-rss-leak-mib plants a host leak of 2.5 MiB/s that the library does not "
        "know of: only the RSS drift can find it; this run must FAIL if that drift passes "
        "--max-rss-drift-mib (8 MiB)"]
    args.inject_leak, args.inject_rss_leak_mib = True, None
    line, = planted(args, "cuda")
    assert "one 64 KiB buffer of device memory kept every cycle" in line
    assert line.endswith("this run must FAIL")


def test_the_soaks_progress_names_a_planted_leaks_rate():
    from rocmforge_raw.soak.run import _status

    rows = [(0.0, 0, 0, None, 100 << 20), (4.0, 0, 0, None, (100 << 20) + (3 << 19))]
    assert _status(rows, 1234, 0) == "1234 cycles, RSS +1.5 MiB"
    assert _status(rows, 1234, 160 << 20) == ("1234 cycles, RSS +1.5 MiB, planted leak 160 MiB "
                                              "(40.0 MiB/s)")


def test_the_demo_off_a_terminal_reports_progress_on_stderr(capsys, monkeypatch):
    monkeypatch.setenv("RF_PROGRESS_EVERY", "0.01")
    monkeypatch.delenv("RF_PROGRESS", raising=False)
    assert main([*DEMO, "--seed", "5", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["verdict"] == "OK"
    lines = err.splitlines()
    assert lines[0] == "seed 5 (rerun with --seed 5)"
    assert any(re.fullmatch(r"demo: \d+/12 req, blocks \d+/\d+, preemptions \d+, \d+ s", line)
               for line in lines), lines
    assert any(line.startswith("demo: done in ") for line in lines)
    assert any(line.startswith("demo: multi-turn conversations: done in ") for line in lines)
