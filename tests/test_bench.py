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


# --- the tables' legends (rocmforge_raw.cli.tables) ---------------------------------------------
def _row(**extra):
    return {"ms": 1.0, "host_us": 2.0, **extra}


def _tables(iters):
    """Each table rendered from one made-up row, with its legend."""
    from rocmforge_raw.bench.step import VARIANTS
    from rocmforge_raw.cli import tables

    alloc = {"bytes": 256, "bare_us": 1.0, "c_us": 0.5, "raw_us": 1.5, "raw_over_bare": 1.5,
             "pooled_us": 0.3, "pool_allocate_free_us": 0.2, "cupy_pooled_us": None}
    attention = _row(name="S1", gb_per_s=3000.0, pct_of_copy=90.0, pct_of_read=88.0,
                     read_target_pct=93, time_vs_16bit=None)
    step = {"batch": 64, "context": 2048, "kernels_ms": 1.0, "append_host_us": 3.0,
            "batch_host_us": 4.0, "write_host_us": 1.0, "attention_host_us": 1.0,
            **{f"{v}_{k}": 1.0 for v in VARIANTS for k in ("step_ms", "step_over_kernels",
                                                          "host_us")}}
    prefill = _row(shape="P4", what="speculative verify", query_rows=256, tflops=100.0,
                   pct_matrix=40.0, pct_copy=80.0, met_target=False)
    transfer = {"transport": "ipc", "sender_device": 0, "receiver_device": 0,
                "peer_access": None, "layout": "consecutive", "bytes": 2**30, "spans": 64,
                "transfer_gb_per_s": 10.0, "import_gb_per_s": 9.0, "copy_gb_per_s": 11.0,
                "pct_of_copy": 91.0, "host_us": 40.0, "import_host_us": 90.0}
    mooncake = {**transfer, "engine_gb_per_s": 1.1, "pct_of_engine": 90.9, "tcp_gb_per_s": 3.0,
                "pct_of_tcp": 33.3, "descriptors": 16, "registration_ms": 0.1,
                "engine_registration_ms": 0.05, "post_ms": 2.0, "engine_post_ms": 2.0,
                "wire_ms": 60.0, "engine_wire_ms": 58.0, "met_target": True}
    offload = {"layout": "scattered", "bytes": 2**29, "copies": 128, "swap_out_gb_per_s": 20.0,
               "d2h_gb_per_s": 25.0, "swap_out_pct": 80.0, "swap_in_gb_per_s": 20.0,
               "h2d_gb_per_s": 25.0, "swap_in_pct": 80.0, "verified": True, "met_target": False}
    return {
        "alloc": tables.alloc_table([alloc], iters),
        "attention": tables.attention_table([attention])
        + tables.legend_lines(tables.attention_legend(iters)),
        "step": tables.step_table([step]),
        "prefill": tables.prefill_table([prefill], iters),
        "transfer": tables.transfer_table([transfer], iters),
        "mooncake": tables.mooncake_table([mooncake], iters),
        "offload": tables.offload_table([offload], iters),
    }


@pytest.mark.parametrize("name", ["alloc", "attention", "step", "prefill", "transfer",
                                  "mooncake", "offload"])
def test_every_column_of_every_bench_table_is_explained_under_it(name):
    from rocmforge_raw.cli import tables

    assert set(tables.LEGENDS) == set(_tables(7))  # every table the bench prints is here
    lines = _tables(7)[name]
    legend = tables.LEGENDS[name](7)
    header = lines[0]
    rest = header
    for term in sorted({t for names, _ in legend for t in names}, key=len, reverse=True):
        assert term in header, f"the {name} legend explains {term!r}, not in {header!r}"
        rest = rest.replace(term, "")
    assert rest.strip() == "", f"the {name} header's {rest.split()} have no legend"
    assert lines[-len(legend):] == tables.legend_lines(legend)  # under the table
    assert all(line.startswith("  ") and ": " in line for line in lines[-len(legend):])


def test_the_alloc_legend_counts_the_round_trips_bench_alloc_times(monkeypatch):
    """``--iters 1``: 40 round trips a size in 20 samples of 2; 64 MiB: 50 in 25 of 2."""
    from rocmforge_raw.bench import timing
    from rocmforge_raw.cli import tables

    calls: dict[int, int] = {}
    real = timing.medians_us

    def counted(fns, iters, batch=None, warmup=10):
        key = len(calls)
        calls[key] = 0

        def count(fn):
            def call():
                calls[key] += 1
                return fn()
            return call

        return real({name: count(fn) for name, fn in fns.items()}, iters, batch, warmup=0)

    monkeypatch.setattr(timing, "medians_us", counted)
    bench.bench_alloc(rf.get_backend("host"), 0, 40)
    small, big = tables.alloc_runs(1, False), tables.alloc_runs(1, True)
    assert (small, big) == ((20, 2), (25, 2))
    fns = 5  # bare, C, raw, pooled, pool a+f (CuPy never runs on the host backend)
    assert calls == {0: fns * 40, 1: fns * 40, 2: fns * 50}
    assert "(64 MiB: 25 samples of 2)" in tables.alloc_legend(1)[0][1]


@pytest.mark.parametrize("flag", ["alloc", "offload"])
def test_the_bench_prints_each_tables_legend_under_it(flag, capsys):
    from rocmforge_raw.cli import tables
    from rocmforge_raw.cli.main import main

    assert main(["bench", f"--{flag}", "--iters", "1", "--backend", "host"]) == 0
    out = capsys.readouterr().out.splitlines()
    legend = tables.legend_lines(tables.LEGENDS[flag](1))
    start = out.index(legend[0])
    assert out[start:start + len(legend)] == legend


def test_a_bench_phase_off_a_terminal_reports_progress_on_stderr_and_json_stays_whole(
        capsys, monkeypatch):
    import json

    from rocmforge_raw.cli.main import main

    monkeypatch.setenv("RF_PROGRESS_EVERY", "0.02")
    monkeypatch.delenv("RF_PROGRESS", raising=False)
    assert main(["bench", "--cache", "--backend", "host", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["cache"]["median_us"] > 0
    lines = err.splitlines()
    assert lines and all(line.startswith("bench --cache: ") for line in lines), lines
    assert lines[-1].startswith("bench --cache: done in ")
