"""tools/decode_side_by_side.py (and its FlashInfer side, tools/flashinfer_decode.py) on the
host: its options, the rows they select, the bytes, tolerances and windows a row is judged by,
and its message where torch or FlashInfer is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rocmforge_raw import bench

TOOL = Path(__file__).resolve().parents[1] / "tools" / "decode_side_by_side.py"
#: Runs the tool's main with torch and flashinfer unimportable (None in sys.modules), its
#: folder first on the path as when it runs as a script (it imports flashinfer_decode there).
WITHOUT_TORCH = f"""
import importlib.util, sys
sys.modules["torch"] = sys.modules["flashinfer"] = None
sys.path.insert(0, {str(TOOL.parent)!r})
spec = importlib.util.spec_from_file_location("tool", {str(TOOL)!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
sys.exit(tool.main(sys.argv[1:]))
"""


def _load(name):
    """tools/``name``.py, loaded with its folder first on the path (as a script run has it)."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, TOOL.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOL.parent))
    return module


def _tool():
    return _load("decode_side_by_side")


def _run_without_torch(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True,
                          text=True, timeout=120)


def test_help_works_without_torch():
    done = _run_without_torch("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--shapes", "--sweep", "--window", "--fp8", "--iters", "--no-xqa", "--json"):
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
    """The tool's rows count bytes as the bench's do (``bench.attention_bytes``)."""
    shape = bench.SHAPES[0]  # S1: 64 x 4096, 32 q / 8 kv heads of 128, bf16
    lens = np.full(64, 4096, np.int32)
    expected = 64 * 4096 * 8 * 128 * 2 * 2 + 2 * 64 * 32 * 128 * 2
    tool = _tool()
    assert bench.attention_bytes(shape, lens) == expected
    assert bench.attention_bytes(tool.as_fp8(shape), lens) == expected - 64 * 4096 * 8 * 128 * 2


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


# --- the sliding-window rows ------------------------------------------------------------------
def test_window_adds_the_benchs_window_rows_after_the_named_ones():
    args, shapes = _tool().parse_args(["--shapes", "S2", "--window"])
    assert args.window
    assert shapes == [bench.SHAPES[1], *bench.WINDOW_SHAPES]
    assert [(s.name, s.batch, s.context, s.window) for s in shapes[1:]] == [
        ("W1", 8, 32768, 4096), ("W2", 32, 32768, 4096)]


def test_window_rows_can_be_named_and_keep_their_window_over_fp8():
    tool = _tool()
    _, shapes = tool.parse_args(["--shapes", "W2,W1"])
    assert [s.name for s in shapes] == ["W2", "W1"]
    assert tool.select_shapes("W1", window=True) == list(bench.WINDOW_SHAPES)  # each once
    (fp8,) = tool.select_shapes("W1", fp8=True)
    assert (fp8.name, fp8.cache, fp8.window) == ("W1-fp8", "float8_e4m3fn", 4096)


def test_an_unknown_shape_error_lists_the_window_rows(capsys):
    with pytest.raises(SystemExit):
        _tool().parse_args(["--shapes", "W3"])
    assert "unknown shape(s) W3: S1-S6, their -fp8 rows, W1, W2 and" in capsys.readouterr().err


def test_a_window_rows_bytes_are_its_windows():
    w1 = bench.WINDOW_SHAPES[0]  # 8 x 32768 tokens, window 4096, 32 q / 8 kv heads of 128
    lens = np.full(8, 32768, np.int32)
    window_kv = 8 * 4096 * 8 * 128 * 2 * 2  # sequences x window x kv heads x head_dim x bf16 x K, V
    assert bench.attention_bytes(w1, lens) == window_kv + 2 * 8 * 32 * 128 * 2


def test_flashinfers_window_left_counts_the_keys_left_of_the_query():
    fi = _load("flashinfer_decode")
    assert fi.window_left(4096) == 4095  # with the query itself: 4096 keys, as ours
    assert fi.window_left(1) == 0
    assert fi.window_left(0) == -1  # no window


def test_the_nearest_window_is_the_one_whose_output_of_ours_lies_closest(monkeypatch):
    fi = _load("flashinfer_decode")
    monkeypatch.setattr(fi, "relative_diff", lambda got, want: abs(got - want))
    edges = {4095: 10.0, 4097: 12.0}  # ours one key shorter, one longer
    assert fi.nearest_window(10.1, 11.0, 4096, edges) == 4095
    assert fi.nearest_window(11.2, 11.0, 4096, edges) == 4096
    assert fi.nearest_window(11.9, 11.0, 4096, edges) == 4097


def test_a_window_row_matching_ours_one_key_off_disagrees_even_within_tolerance():
    check, w1 = _tool().check, bench.WINDOW_SHAPES[0]
    row = {"launch_diff": 0.0, "wrapper_cc_diff": 0.013, "wrapper_cc_window": 4097,
           "wrapper_tc_diff": 0.002, "wrapper_tc_window": 4096, "xqa_diff": 0.003,
           "xqa_window": 4096, "window": 4096}
    assert check(w1, row) == ["wrapper_cc_window 4097 != 4096"]
    assert check(w1, {**row, "wrapper_cc_window": 4096}) == []
