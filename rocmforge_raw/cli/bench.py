"""``rocmforge-raw bench``: runs the benchmarks the flags select and lays out their rows.

Rows a backend cannot run (attention and the decode step need a GPU) are not silently left
out: ``skipped`` in the result names each and says why. A row that misses its target says so
(``met_target`` false, MISSED in the text).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..bench import attention, cache, timing
from ..runtime import Backend


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def attention_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per attention row: time, bandwidth, % of copy and of read (with targets; an
    fp8 row gives its time over its 16-bit shape's instead)."""
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'shape':{width}} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'% read':>7} "
             f"{'target':>7} {'host us':>8}"]
    for r in rows:
        target = (f"{r['read_target_pct']:6}%" if r["read_target_pct"] is not None else
                  f"x{r['time_vs_16bit']:.2f}t" if r.get("time_vs_16bit") else "      -")
        lines.append(f"{r['name']:{width}} {r['ms']:8.3f} {r['gb_per_s']:8.0f} "
                     f"{r['pct_of_copy']:6.1f}% {r['pct_of_read']:6.1f}% {target:>7} "
                     f"{r['host_us']:8.1f}")
    return lines


def _alloc(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    rows = result["alloc"] = timing.bench_alloc(backend, device, iters * 40)
    lines = [f"{'bytes':>10} {'bare us':>9} {'C us':>9} {'raw us':>9} {'raw/bare':>9} "
             f"{'pooled us':>10} {'pool a+f us':>12} {'cupy pool us':>13}"]
    return lines + [f"{r['bytes']:>10} {r['bare_us']:9.2f} {r['c_us']:9.2f} {r['raw_us']:9.2f} "
                    f"{r['raw_over_bare']:9.2f} {r['pooled_us']:10.2f} "
                    f"{r['pool_allocate_free_us']:12.2f} {_us(r['cupy_pooled_us']):>13}"
                    for r in rows]


def _attention(backend: Backend, device: int, iters: int, sweep: bool,
               result: dict[str, Any]) -> list[str]:
    copy = result["copy_gb_per_s"] = timing.copy_bandwidth(backend, device)
    read = result["read_gb_per_s"] = timing.read_bandwidth(backend, device)
    rows = result["attention"] = attention.bench_attention(
        backend, device, copy, iters, attention.SHAPES + attention.FP8_SHAPES, read_gbs=read)
    lines = [f"copy bandwidth: {copy:.0f} GB/s (read + write, 1 GiB device copy); "
             f"read bandwidth: {read:.0f} GB/s (1 GiB read-only)", *attention_table(rows)]
    if sweep:
        rows = result["sweep"] = attention.bench_attention(
            backend, device, copy, iters, attention.sweep_shapes(), read_gbs=read)
        lines.append("sweep: bf16, 8 kv heads, q heads = 8 x GQA ratio")
        lines += attention_table(rows)
    return lines


def _step(backend: Backend, device: int, result: dict[str, Any]) -> list[str]:
    from ..bench.step import STEP_SHAPES, VARIANTS, bench_step
    from ..common import progress

    rows = result["step"] = [bench_step(backend, device, shape) for shape in
                             progress.track(STEP_SHAPES, "bench --step", unit="shape")]
    lines = [f"decode step, {STEP_SHAPES[0].layers} layers, bf16, 32/8 heads, head_dim "
             f"128, block 16 (targets: plain step <= 1.05 x kernels, the best variant "
             f"<= 1.03, <= 10 us host per call); ahead: the next step planned while the "
             f"device runs this one; graph: ahead, the launches replayed as a graph",
             f"{'batch x ctx':>12} {'kernels ms':>10}"
             + "".join(f" {v + ' ms':>9} {'ratio':>6} {'host us':>8}" for v in VARIANTS)
             + f" {'append us':>9} {'batch us':>8} {'write us':>8} {'attn us':>8}"]
    return lines + [f"{r['batch']:>5} x {r['context']:<5} {r['kernels_ms']:10.3f}"
                    + "".join(f" {r[v + '_step_ms']:9.3f} {r[v + '_step_over_kernels']:6.3f} "
                              f"{r[v + '_host_us']:8.1f}" for v in VARIANTS)
                    + f" {r['append_host_us']:9.1f} {r['batch_host_us']:8.1f} "
                    f"{r['write_host_us']:8.2f} {r['attention_host_us']:8.2f}" for r in rows]


def _prefill(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    from ..bench.prefill import BANDWIDTH_TARGET_PCT, bench_mixed_step, bench_prefill

    copy = result.get("copy_gb_per_s") or timing.copy_bandwidth(backend, device)
    result["copy_gb_per_s"] = copy
    found = bench_prefill(backend, device, copy, min(iters, 20))
    step = bench_mixed_step(backend, device)
    result["prefill"] = {**found, "mixed_step": step}
    lines = [f"attention over many query tokens, bf16, 32/8 heads, head_dim 128, block 16: "
             f"TFLOP/s over causal FLOPs; % of the matrix units' rate measured now "
             f"({found['matrix_tflops']:.0f} TFLOP/s); P4/P5 also % of copy bandwidth "
             f"({copy:.0f} GB/s; target {BANDWIDTH_TARGET_PCT:.0f} %)",
             f"{'shape':>5} {'what':<22} {'rows':>6} {'ms':>8} {'TFLOP/s':>8} {'% matrix':>8} "
             f"{'% copy':>7}"]
    for r in found["rows"]:
        pct = f"{r['pct_copy']:6.1f}%" if "pct_copy" in r else f"{'-':>7}"
        mark = "  MISSED" if r.get("met_target") is False else ""
        lines.append(f"{r['shape']:>5} {r['what']:<22} {r['query_rows']:6} {r['ms']:8.3f} "
                     f"{r['tflops']:8.1f} {r['pct_matrix']:7.1f}% {pct}{mark}")
    lines.append(f"mixed step through the cache ({step['layers']} layers of P5): kernels "
                 f"{step['kernels_ms']:.3f} ms; plain {step['step_ms']:.3f} ms (ratio "
                 f"{step['step_over_kernels']:.3f}, batch {step['batch_host_us']:.0f} us "
                 f"host); planned ahead {step['ahead_step_ms']:.3f} ms (ratio "
                 f"{step['ahead_over_kernels']:.3f}); target <= {step['target']}"
                 + ("" if step["met_target"] else "  MISSED"))
    return lines


def _cache(result: dict[str, Any]) -> list[str]:
    row = result["cache"] = cache.bench_cache()
    verdict = ("met" if row["met_target"] else
               f"MISSED: {row['median_us'] / row['target_us']:.1f}x the target")
    return [f"cache decode step ({row['num_seqs']} seqs x ~{row['context']} tokens, "
            f"block {row['block_size']}): append + batch median {row['median_us']:.1f} us "
            f"(append {row['append_us']:.1f}, batch {row['batch_us']:.1f}; the best of "
            f"{row['runs']} runs of {row['steps']} steps, whose medians were "
            f"{', '.join(f'{m:.1f}' for m in row['run_medians_us'])}), over every step: "
            f"median {row['median_all_us']:.1f}, p90 {row['p90_us']:.1f} us "
            f"(target {row['target_us']:.0f} us: {verdict})"]


def _transfer(backend: Backend, device: int, transport: str, iters: int,
              sender_device: int | None, result: dict[str, Any]) -> list[str]:
    from ..bench.transfer import bench_transfer

    rows = result["transfer"] = bench_transfer(backend, device, transport, min(iters, 20),
                                               sender_device)
    lines = [f"a sequence's KV between two processes over {transport}, or two caches of one "
             "process (peer) (median; copy: the same bytes through the same copy engine, a "
             "peer copy across devices)",
             f"{'transport':>9} {'devices':>7} {'peer':>5} {'blocks':>11} {'MiB':>7} "
             f"{'spans':>6} {'transfer GB/s':>14} {'import GB/s':>12} {'copy GB/s':>10} "
             f"{'% copy':>7}"]
    peer = {None: "-", True: "on", False: "off"}
    return lines + [f"{r['transport']:>9} {r['sender_device']:>3}->{r['receiver_device']:<2} "
                    f"{peer[r['peer_access']]:>5} {r['layout']:>11} "
                    f"{r['bytes'] / 2**20:7.0f} {r['spans']:6} "
                    f"{r['transfer_gb_per_s']:14.2f} {r['import_gb_per_s']:12.2f} "
                    f"{r['copy_gb_per_s']:10.2f} {r['pct_of_copy']:6.1f}%" for r in rows]


def _offload(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    from ..bench.offload import TARGET_PCT, bench_offload

    rows = result["offload"] = bench_offload(backend, device, min(iters, 20))
    what = ("memcpy between host buffers (the host backend has no copy engine)"
            if backend.name == "host" else "pinned host <-> device copies of the same bytes")
    lines = [f"a sequence's KV swapped to the host tier and back (median; copy: {what}; "
             f"target {TARGET_PCT:.0f} % each way)",
             f"{'blocks':>11} {'MiB':>6} {'copies':>6} {'out GB/s':>9} {'d2h GB/s':>9} "
             f"{'% d2h':>6} {'in GB/s':>8} {'h2d GB/s':>9} {'% h2d':>6} {'exact':>5}"]
    return lines + [f"{r['layout']:>11} {r['bytes'] / 2**20:6.0f} {r['copies']:6} "
                    f"{r['swap_out_gb_per_s']:9.2f} {r['d2h_gb_per_s']:9.2f} "
                    f"{r['swap_out_pct']:5.1f}% {r['swap_in_gb_per_s']:8.2f} "
                    f"{r['h2d_gb_per_s']:9.2f} {r['swap_in_pct']:5.1f}% "
                    f"{'yes' if r['verified'] else 'NO':>5}"
                    + ("" if r["met_target"] else "  MISSED") for r in rows]


def run(args: argparse.Namespace, backend: Backend, device: int, where: str
        ) -> tuple[dict[str, Any], list[str]]:
    """The result (for --json) and the text lines of ``bench`` with ``args``' selection on
    ``device`` of ``backend``; ``where`` names the target (the host says why it is used)."""
    attention = args.attention or args.sweep
    everything = not (args.alloc or attention or args.cache or args.step or args.transfer
                      or args.offload or args.prefill)
    result: dict[str, Any] = {"backend": backend.name, "where": where,
                              "device": backend.properties(device).name, "skipped": {}}
    lines = [f"device: {where} {result['device']}"]
    if args.alloc or everything:
        lines += _alloc(backend, device, args.iters, result)
    gpu_rows = {"attention": attention or everything, "step": args.step or everything,
                "prefill": args.prefill or everything}
    if backend.name == "host":
        for name in (n for n, wanted in gpu_rows.items() if wanted):
            why = (f"needs a GPU backend: on the {where} the operations run as the NumPy "
                   f"reference, whose timing says nothing about the kernels")
            result["skipped"][name] = why
            lines.append(f"{name} bench skipped: {why}")
    else:
        if gpu_rows["attention"]:
            lines += _attention(backend, device, args.iters, args.sweep, result)
        if gpu_rows["step"]:
            lines += _step(backend, device, result)
        if gpu_rows["prefill"]:
            lines += _prefill(backend, device, args.iters, result)
    if args.cache or everything:
        lines += _cache(result)
    if args.transfer:
        lines += _transfer(backend, device, args.transport, args.iters, args.from_device, result)
    if args.offload:
        lines += _offload(backend, device, args.iters, result)
    return result, lines
