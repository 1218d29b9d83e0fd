"""tools/decode_side_by_side.py on the host: its options, the rows they select, the bytes and
tolerances a row is judged by, and its message where torch or FlashInfer is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rocmforge_raw import bench

TOOL = Path(__file__).resolve().parents[1] / "tools" / "decode_side_by_side.py"
#: Runs the tool's main with torch and flashinfer unimportable (None in sys.modules).
WITHOUT_TORCH = f"""
import importlib.util, sys
sys.modules["torch"] = sys.modules["flashinfer"] = None
spec = importlib.util.spec_from_file_location("tool", {str(TOOL)!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
sys.exit(tool.main(sys.argv[1:]))
"""


def _tool():
    spec = importlib.util.spec_from_file_location("decode_side_by_side", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_without_torch(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True,
                          text=True, timeout=120)


def test_help_works_without_torch():
    done = _run_without_torch("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--shapes", "--sweep", "--fp8", "--iters", "--no-xqa", "--json"):
        assert option in done.stdout


def test_without_torch_it_exits_with_one_line_naming_what_is_missing():
    done = _run_without_torch("--shapes", "S1")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "needs torch and flashinfer" in done.stderr


def test_an_unknown_shape_is_an_argument_error_that_names_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        _tool().parse_args(["--shapes", "S1,S9"])
    assert exit_.value.code == 2
    assert "unknown shape(s) S9" in capsys.readouterr().err


def test_fewer_than_one_timed_run_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        _tool().parse_args(["--iters", "0"])
    assert exit_.value.code == 2
    assert "--iters must be at least 1, got 0" in capsys.readouterr().err


def test_the_default_rows_are_the_benchs_six_then_the_extra_sweep_rows():
    tool = _tool()
    _, shapes = tool.parse_args([])
    assert shapes[:6] == list(bench.SHAPES)
    sweep = {s.name: s for s in bench.sweep_shapes()}
    assert shapes[6:] == [sweep[name] for name in tool.EXTRA_ROWS]


def test_fp8_rows_are_the_benchs_own_and_sweep_rows_get_an_e4m3fn_cache():
    shapes = _tool().select_shapes("S1,S4,d64-r8-b32-8x16384", fp8=True)
    fp8 = {s.name: s for s in bench.FP8_SHAPES}
    assert shapes[:2] == [fp8["S1-fp8"], fp8["S4-fp8"]]
    assert shapes[2].name == "d64-r8-b32-8x16384-fp8"
    assert shapes[2].cache == "float8_e4m3fn" and shapes[2].head_dim == 64


def test_sweep_adds_every_sweep_row_once_after_the_named_ones():
    shapes = _tool().select_shapes("S2,d64-r1-b16-128x2048", sweep=True)
    names = [s.name for s in shapes]
    assert names[:2] == ["S2", "d64-r1-b16-128x2048"]
    assert len(names) == len(set(names)) == 1 + len(bench.sweep_shapes())


def test_bytes_count_k_and_v_once_a_group_plus_q_and_out():
    shape = bench.SHAPES[0]  # S1: 64 x 4096, 32 q / 8 kv heads of 128, bf16
    lens = np.full(64, 4096, np.int32)
    expected = 64 * 4096 * 8 * 128 * 2 * 2 + 2 * 64 * 32 * 128 * 2
    tool = _tool()
    assert tool.work_bytes(shape, lens) == expected
    assert tool.work_bytes(tool.as_fp8(shape), lens) == expected - 64 * 4096 * 8 * 128 * 2


def test_only_xqa_over_fp8_gets_the_quantized_tolerance():
    tool = _tool()
    s1, s3 = bench.SHAPES[0], bench.SHAPES[2]  # bf16, f16
    assert tool.tolerance(s1, "xqa_diff") == 2e-2
    assert tool.tolerance(s3, "wrapper_tc_diff") == 1e-2
    assert tool.tolerance(tool.as_fp8(s1), "wrapper_cc_diff") == 2e-2
    assert tool.tolerance(tool.as_fp8(s1), "xqa_diff") == tool.XQA_FP8_TOLERANCE


def test_an_output_past_its_tolerance_or_nan_disagrees_and_a_missing_one_does_not():
    check, s3 = _tool().check, bench.SHAPES[2]
    row = {"launch_diff": 0.0, "wrapper_cc_diff": 0.02, "wrapper_tc_diff": float("nan"),
           "xqa_diff": None, "ours_us": 1.0}
    assert check(s3, row) == ["wrapper_cc_diff 0.02 > 0.01", "wrapper_tc_diff nan > 0.01"]


def test_a_table_line_shows_a_dash_where_a_kernel_did_not_run():
    row = {"name": "S1", "ours_us": 362.54, "wrapper_us": 363.51, "wrapper_kernel": "tc",
           "xqa_us": None, "ours_over_wrapper": 0.99733, "ours_over_xqa": None,
           "ours_pct_copy": 98.12, "wrapper_pct_copy": 97.9, "xqa_pct_copy": None,
           "disagrees": [], "xqa_error": "RuntimeError('no')"}
    tool = _tool()
    assert tool.table_line(row).split() == ["S1", "362.5", "363.5", "tc", "-", "0.997", "-",
                                            "98.1", "97.9", "-", "ok"]
    assert tool.table_notes(row) == ["  xqa: failed: RuntimeError('no')"]
