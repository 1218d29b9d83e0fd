"""The soak's verdict calibrated on real host runs (tools/soak_calibrate.py): clean runs PASS
and a planted RSS leak of 1 MiB/s, unknown to the library, FAILs, each in a fresh process.

The issue's figure, 30 clean runs and 10 leaking ones of the default 60 s, takes about 20
minutes (`pytest --slow`, or `make soak-calibrate`); one of each, 45 s long, always runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "soak_calibrate.py"


def _tool():
    spec = importlib.util.spec_from_file_location("soak_calibrate", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _explain(found):
    tool = _tool()
    return "\n".join(tool._line(run) for run in found["runs"])


def test_clean_runs_pass_and_a_planted_leak_fails(tmp_path):
    found = _tool().calibrate(clean=1, leaky=1, seconds=45, jobs=2, root=tmp_path)
    assert found["right"], _explain(found)
    figures = found["figures"]
    assert figures["clean_verdicts"] == ["PASS"] and figures["leaky_verdicts"] == ["FAIL"]
    for run in found["runs"]:  # the leaky runs are caught by their drift, not live buffers
        assert run["final_live_buffers"] == run["baseline_live_buffers"]
        assert run["warmup_s"] is not None and run["rss_drift_bytes"] is not None
    assert found["runs"][1]["reasons"][0].startswith("RSS: drift ")
    clean = Path(found["runs"][0]["files"]["json"]).parent
    assert {p.name for p in clean.iterdir()} >= {"soak.csv", "soak.json"}
    pytest.importorskip("matplotlib")
    assert (clean / "soak.png").stat().st_size > 1000


@pytest.mark.slow
def test_thirty_clean_default_runs_pass_and_ten_leaking_ones_fail(tmp_path):
    found = _tool().calibrate(clean=30, leaky=10, seconds=60, jobs=2, root=tmp_path)
    print(_explain(found))
    print(found["figures"])
    assert found["right"], _explain(found)
