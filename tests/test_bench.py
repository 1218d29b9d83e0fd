"""The bench's own measurements: timing in turns, the alloc rows, the hold kernel, the bandwidth
references, a shape row."""

import time

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw import bench, ops
from rocmforge_raw.bench import attention

MiB = 1 << 20


@pytest.mark.timing
def test_device_time_excludes_the_hosts_enqueue_time(gpu):
    # 3 ms of host work and no device work: the hold kernel covers the host time, so the
    # events around the region see (almost) nothing, and host_us sees the 3 ms
    timing = bench.time_ms(gpu, DEVICE, lambda: time.sleep(0.003), iters=5, warmup=2)
    assert timing.ms < 0.5 and timing.host_us > 2500


@pytest.mark.timing
def test_read_and_copy_bandwidths_are_consistent(gpu):
    read = bench.read_bandwidth(gpu, DEVICE, nbytes=256 * MiB, iters=5)
    copy = bench.copy_bandwidth(gpu, DEVICE, nbytes=256 * MiB, iters=5)
    # a read kernel that skipped its loads would be far above any copy; one that read a
    # byte at a time far below
    assert 0.3 * copy < read < 3 * copy


def test_an_attention_row_counts_the_bytes_it_read(gpu):
    shape = bench.Shape("T", 3, 300, 8, 2, "f16")
    (row,) = bench.bench_attention(gpu, DEVICE, copy_gbs=1000.0, iters=3, shapes=(shape,),
                                   read_gbs=2000.0)
    kv_bytes = 3 * 300 * 2 * 128 * 2 * 2  # tokens x kv heads x head_dim x 2 bytes x (K, V)
    assert row["bytes"] == kv_bytes + 2 * 3 * 8 * 128 * 2
    assert row["ms"] > 0 and row["gb_per_s"] == pytest.approx(row["bytes"] / row["ms"] / 1e6)
    assert row["pct_of_copy"] == pytest.approx(row["gb_per_s"] / 10)
    assert row["pct_of_read"] == pytest.approx(row["gb_per_s"] / 20)


def test_an_fp8_row_reads_the_lengths_and_pages_of_its_16bit_row():
    """S6's lengths are random: its fp8 row must time the same draw, or time_vs_16bit
    compares different work (it drew the next lengths of one shared source before)."""
    base, fp8 = bench.SHAPES[-1], bench.FP8_SHAPES[-1]
    assert fp8.name == f"{base.name}-fp8" and base.context == 0
    bench.attention_inputs(bench.SHAPES[0], bench.shape_rng(bench.SHAPES[0]))
    want = bench.attention_inputs(base, bench.shape_rng(base))
    got = bench.attention_inputs(fp8, bench.shape_rng(fp8))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    other = bench.attention_inputs(base, bench.shape_rng(bench.SHAPES[0]))
    assert not np.array_equal(other[1], want[1])  # each 16-bit shape draws its own


def test_each_row_of_one_run_draws_from_its_own_source(monkeypatch):
    """bench_attention's plumbing, with the launch and its timing stubbed (host memory): a
    ragged row's fp8 twin, timed after other rows, gets the very lengths its 16-bit row got."""
    class Launch:
        def __init__(self, *args):
            pass

        def __call__(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(attention, "AttentionLaunch", Launch)
    monkeypatch.setattr(attention, "time_ms", lambda *args: bench.Timing(1.0, 1.0))
    shapes = (bench.Shape("T", 6, 0, 8, 2, "f16", max_context=700),
              bench.Shape("U", 3, 0, 8, 2, "f16", max_context=700),
              bench.Shape("T-fp8", 6, 0, 8, 2, "f16", max_context=700, cache="float8_e4m3fn"))
    rows = bench.bench_attention(rf.get_backend("host"), 0, 1000.0, 1, shapes)
    assert rows[0]["tokens"] == rows[2]["tokens"]


def test_a_ragged_rows_fp8_twin_times_the_same_tokens_on_gpu(gpu):
    shape = bench.Shape("T", 6, 0, 8, 2, "f16", max_context=700)
    rows = bench.bench_attention(gpu, DEVICE, copy_gbs=1000.0, iters=2, shapes=(
        bench.Shape("U", 3, 0, 8, 2, "f16"), shape,
        bench.Shape("T-fp8", 6, 0, 8, 2, "f16", max_context=700, cache="float8_e4m3fn")))
    assert rows[1]["tokens"] == rows[2]["tokens"] > 0
    assert rows[2]["time_vs_16bit"] == pytest.approx(rows[2]["ms"] / rows[1]["ms"])


def test_medians_time_each_function_in_batches_and_turns():
    calls = {"slow": 0, "quick": 0}

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(300e-6)

    def quick() -> None:
        calls["quick"] += 1

    medians = bench.medians_us({"slow": slow, "quick": quick}, iters=40, batch=10, warmup=3)
    assert calls == {"slow": 43, "quick": 43}
    assert medians["slow"] >= 300 > medians["quick"]


def test_alloc_rows_compare_hipbuffer_with_the_bare_calls(backend):
    rows = bench.bench_alloc(backend, backend.get_device(), iters=60)
    assert [r["bytes"] for r in rows] == [256, 1 << 20, 64 << 20]
    for r in rows:
        assert r["raw_over_bare"] == pytest.approx(r["raw_us"] / r["bare_us"])
        assert all(r[k] > 0 for k in ("bare_us", "c_us", "raw_us", "pooled_us",
                                      "pool_allocate_free_us"))


def test_the_cache_row_times_append_and_batch_apart():
    row = bench.bench_cache(num_seqs=16, context=256, steps=20)
    assert row["append_us"] > 0 and row["batch_us"] > 0
    assert row["p90_us"] >= row["median_us"] > 0 and row["target_us"] == 20.0


def test_a_step_row_times_each_variant(gpu):
    from rocmforge_raw.bench.step import VARIANTS, StepShape, bench_step

    row = bench_step(gpu, DEVICE, StepShape(4, 256, layers=2), steps=4, warmup=2)
    for variant in VARIANTS:
        assert row[f"{variant}_step_ms"] > 0 and row[f"{variant}_host_us"] > 0
        assert row[f"{variant}_step_over_kernels"] > 0.5
    assert row["graph_captures"] == 1 and row["kernels_ms"] > 0


def test_a_prefill_shape_counts_each_causal_pair_once():
    from rocmforge_raw.bench.prefill import BF16, HEAD_DIM, KV_HEADS, Q_HEADS, PrefillShape

    shape = PrefillShape("T", (1, 3, 5), (7, 3, 9), "t")
    pairs = sum(kv - q + i + 1 for q, kv in zip(shape.q_lens, shape.kv_lens) for i in range(q))
    assert pairs == 7 + (1 + 2 + 3) + (5 + 6 + 7 + 8 + 9)
    assert shape.flops() == 4 * HEAD_DIM * Q_HEADS * pairs
    row = Q_HEADS * HEAD_DIM * BF16.itemsize
    assert shape.bytes() == 19 * KV_HEADS * HEAD_DIM * 2 * BF16.itemsize + 2 * 9 * row


def test_the_prefill_bench_times_what_the_op_computes(gpu):
    """PrefillLaunch (the bench's prepared launches: decodes, multi-token kernel, combine)
    writes what ops.paged_attention(query_lens=) writes for the same inputs, and its row's
    rate is its FLOPs over its time."""
    from rocmforge_raw.bench.prefill import (
        PrefillLaunch,
        PrefillShape,
        bench_prefill,
        prefill_inputs,
    )

    shape = PrefillShape("T", (1, 1, 37, 90), (300, 40, 37, 200), "t")
    q, out, k, v, tables, lens, q_lens = prefill_inputs(shape, np.random.default_rng(3), gpu,
                                                        DEVICE)
    want = rf.DeviceArray.empty(out.shape, out.dtype, DEVICE, gpu)
    ops.paged_attention(want, q, k, v, tables, lens, query_lens=q_lens)
    launch = PrefillLaunch(out, q, k, v, tables, lens, q_lens)
    launch()
    got, expected = (a.to_numpy().astype(np.float32) for a in (out, want))
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=2e-2)
    assert np.abs(expected).max() > 0
    launch.close()
    for array in (q, out, k, v, want):
        array.buffer.root.close()
    result = bench_prefill(gpu, DEVICE, copy_gbs=1000.0, iters=2, shapes=(shape,))
    (row,) = result["rows"]
    assert result["matrix_tflops"] > 0 and row["query_rows"] == 129 and row["batch"] == 4
    assert row["tflops"] == pytest.approx(shape.flops() / (row["ms"] * 1e-3) / 1e12)
    assert "pct_copy" not in row  # only P4 and P5 are measured against the copy bandwidth
