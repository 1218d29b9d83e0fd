"""The bench's sliding-window rows (issue 47): W1 and W2 are regular ``bench --attention`` rows
whose bytes are their window's; their launch plans its split over the window and passes the
window to the kernel. On the host the launch and its timing are stubbed (the host has no
kernel); on a GPU the windowed launch is checked against ``ops.paged_attention(window=)``."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw import bench, ops
from rocmforge_raw.bench import attention, timing
from rocmforge_raw.kernels import planning

KV_BYTES_W = 4096 * 8 * 128 * 2 * 2  # a sequence's window: tokens x kv heads x dim x bf16 x K, V
Q_BYTES = 32 * 128 * 2  # one sequence's q (or out): q heads x dim x bf16


def test_the_window_rows_are_8_and_32_sequences_of_32768_tokens_seeing_their_last_4096():
    assert [(s.name, s.batch, s.context, s.window) for s in bench.WINDOW_SHAPES] == [
        ("W1", 8, 32768, 4096), ("W2", 32, 32768, 4096)]
    for s in bench.WINDOW_SHAPES:
        assert (s.q_heads, s.kv_heads, s.head_dim, s.block_size, s.dtype, s.cache) == (
            32, 8, 128, 16, "bf16", None)
        assert attention.TARGETS[s.name] == 85  # % of copy
    assert all(s.window == 0 for s in (*bench.SHAPES, *bench.FP8_SHAPES, *bench.sweep_shapes()))


def test_a_window_rows_bytes_and_tokens_are_its_windows():
    w2 = bench.WINDOW_SHAPES[1]
    lens = np.full(32, 32768, np.int32)
    assert bench.attention_bytes(w2, lens) == 32 * KV_BYTES_W + 2 * 32 * Q_BYTES
    assert int(bench.attended(w2, lens).sum()) == 32 * 4096


def test_a_sequence_shorter_than_the_window_counts_whole():
    shape = bench.Shape("T", 3, 0, 8, 2, "f16", window=300)
    lens = np.array([100, 300, 5000], np.int32)
    np.testing.assert_array_equal(bench.attended(shape, lens), [100, 300, 300])
    assert bench.attention_bytes(shape, lens) == 700 * 2 * 128 * 2 * 2 + 2 * 3 * 8 * 128 * 2
    unwindowed = bench.Shape("T", 3, 0, 8, 2, "f16")
    assert bench.attention_bytes(unwindowed, lens) == (
        5400 * 2 * 128 * 2 * 2 + 2 * 3 * 8 * 128 * 2)


class _Launch:
    """A stand-in for ``AttentionLaunch`` that records the window it was made with."""

    windows: dict[int, int] = {}

    def __init__(self, out, q, k, v, tables, lens, num_partitions=None, window=0):
        _Launch.windows[len(lens)] = window

    def __call__(self):
        pass

    def close(self):
        pass


def _stub_rows(monkeypatch, ms=1.0):
    """The bench's attention rows with tiny arrays, a stub launch and a fixed time (ms): the
    lengths and page tables are each shape's own (``attention_inputs``)."""
    host = rf.get_backend("host")

    def inputs(shape, backend, device):
        tables, lens, _ = attention.attention_inputs(shape, attention.shape_rng(shape))
        arrays = [rf.DeviceArray.empty((1,), np.float32, 0, host) for _ in range(4)]
        return attention.AttentionInputs(tables, lens, *arrays)

    _Launch.windows = {}
    monkeypatch.setattr(attention, "row_inputs", inputs)
    monkeypatch.setattr(attention, "AttentionLaunch", _Launch)
    monkeypatch.setattr(attention, "time_ms", lambda *args: bench.Timing(ms, 5.0))
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *args, **kw: 4000.0)
    monkeypatch.setattr(timing, "read_bandwidth", lambda *args, **kw: 4400.0)


def test_a_window_row_is_timed_with_its_window_and_judged_by_its_windows_bytes(monkeypatch):
    _stub_rows(monkeypatch, ms=0.05)
    rows = bench.bench_attention(rf.get_backend("host"), 0, 4000.0, 3, bench.WINDOW_SHAPES,
                                 read_gbs=4400.0)
    assert _Launch.windows == {8: 4096, 32: 4096}
    for row, batch in zip(rows, (8, 32), strict=True):
        assert row["window"] == 4096 and row["tokens"] == batch * 4096
        assert row["bytes"] == batch * (KV_BYTES_W + 2 * Q_BYTES)
        assert row["gb_per_s"] == pytest.approx(row["bytes"] / 0.05e-3 / 1e9)
        assert row["pct_of_copy"] == pytest.approx(row["gb_per_s"] / 40)
        assert row["target_pct"] == 85 and row["read_target_pct"] is None


class _Named:
    """The host backend under another name: the bench runs its GPU rows on it."""

    name = "stub"

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def _bench_attention(monkeypatch, capsys, *flags):
    cli_main = importlib.import_module("rocmforge_raw.cli.main")  # (cli.main: the function)
    _stub_rows(monkeypatch)
    monkeypatch.setattr(cli_main, "target", lambda args: (_Named(rf.get_backend("host")), 0))
    assert cli_main.main(["bench", "--attention", *flags]) == 0
    return capsys.readouterr().out


def test_bench_attention_json_carries_the_window_rows_after_the_others(monkeypatch, capsys):
    result = json.loads(_bench_attention(monkeypatch, capsys, "--json"))
    names = [row["name"] for row in result["attention"]]
    assert names == [s.name for s in (*bench.SHAPES, *bench.FP8_SHAPES, *bench.WINDOW_SHAPES)]
    w1 = result["attention"][-2]
    assert (w1["name"], w1["window"], w1["tokens"]) == ("W1", 4096, 8 * 4096)
    assert w1["bytes"] == 8 * (KV_BYTES_W + 2 * Q_BYTES)
    assert w1["pct_of_copy"] == pytest.approx(w1["bytes"] / 1e-3 / 1e9 / 4000.0 * 100)
    s2 = result["attention"][1]  # S2 is 1 x 32768: every token counts
    assert (s2["window"], s2["tokens"], s2["read_target_pct"]) == (0, 32768, 80)


def test_bench_attention_text_shows_the_window_rows_copy_target(monkeypatch, capsys):
    lines = _bench_attention(monkeypatch, capsys).splitlines()
    w1 = next(line for line in lines if line.startswith("W1 "))
    assert w1.split()[-2] == "85%c"  # target, then host us
    s1 = next(line for line in lines if line.startswith("S1 "))
    assert s1.split()[-2] == "93%"  # a 16-bit row's % read target, as before
    assert any("W1 8 x 32768, window 4096" in line for line in lines)  # the legend


# --- the launch -------------------------------------------------------------------------------
class _Kernel:
    """A stand-in kernel that records the arguments a launch was prepared with."""

    def __init__(self):
        self.args = None

    def prepare(self, grid, threads, *args, shared_bytes=0):
        self.args = args
        return lambda: None


def test_the_launch_plans_over_the_window_and_passes_it_to_the_kernel(monkeypatch):
    from rocmforge_raw.kernels.planning import attention as plans

    kernel = _Kernel()
    found = planning.AttentionKernel(kernel, group=4, groups=1, shared_bytes=0, slots=264,
                                     sms=132)
    monkeypatch.setattr(plans, "attention_kernel", lambda *args, **kw: found)
    host = rf.get_backend("host")
    shape = bench.Shape("T", 3, 4000, 8, 2, "bf16", window=1000)
    inputs = bench.row_inputs(shape, host, 0)
    q, k = inputs.q, inputs.k
    launch = bench.AttentionLaunch(inputs.out, q, k, inputs.v, inputs.tables, inputs.lens,
                                   None, 1000)
    try:
        assert kernel.args[plans.WINDOW_ARG] == 1000
        width = inputs.tables.shape[1]
        windowed, whole = (planning.plan_attention(host, 0, q.dtype, 3, 8, 2, 128, 16, width,
                                                   inputs.lens, None, k.dtype, window=w).work
                           for w in (1000, 0))
        fields = ("num_ctas", "per_cta", "total", "groups", "uniform16")
        assert [getattr(launch.plan.work, f) for f in fields] == [
            getattr(windowed, f) for f in fields]
        assert windowed.total < whole.total / 3  # the window's work, not the whole context
        got = tuple(int(kernel.args[i]) for i in planning.WORK_ARGS)
        assert got == (windowed.uniform16, windowed.per_cta, windowed.total)
    finally:
        launch.close()
        inputs.close()


def test_the_launch_refuses_a_window_below_one_token():
    host = rf.get_backend("host")
    inputs = bench.row_inputs(bench.Shape("T", 2, 64, 8, 2, "f16"), host, 0)
    try:
        with pytest.raises(ValueError, match="window"):
            bench.AttentionLaunch(inputs.out, inputs.q, inputs.k, inputs.v, inputs.tables,
                                  inputs.lens, None, -1)
    finally:
        inputs.close()


def test_a_windowed_launch_writes_what_the_op_writes(gpu):
    shape = bench.Shape("T", 3, 1000, 8, 2, "bf16", window=200)
    inputs = bench.row_inputs(shape, gpu, DEVICE)
    q, k, v, tables, lens = inputs.q, inputs.k, inputs.v, inputs.tables, inputs.lens
    want, whole = (rf.DeviceArray.empty(q.shape, q.dtype, DEVICE, gpu) for _ in range(2))
    ops.paged_attention(want, q, k, v, tables, lens, window=200)
    ops.paged_attention(whole, q, k, v, tables, lens)
    launch = bench.AttentionLaunch(inputs.out, q, k, v, tables, lens, None, 200)
    try:
        launch()
        got, expected, unwindowed = (a.to_numpy().astype(np.float32)
                                     for a in (inputs.out, want, whole))
        np.testing.assert_allclose(got, expected, atol=2e-2, rtol=2e-2)
        assert np.abs(got - unwindowed).max() > 0.05  # the window changed the result
    finally:
        launch.close()
        inputs.close()
        for array in (want, whole):
            array.buffer.root.close()
