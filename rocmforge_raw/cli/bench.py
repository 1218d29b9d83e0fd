"""``rocmforge-raw bench``: runs the benchmarks the flags select and lays out their rows.

Rows a backend cannot run (attention and the decode step need a GPU) are not silently left
out: ``skipped`` in the result names each and says why. A row that misses its target says so
(``met_target`` false, MISSED in the text). Every table has a legend under it (``tables``),
and each phase shows its progress on stderr (a line every 10 s in a log: ``progress``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..bench import attention, cache, timing
from ..common import progress
from ..runtime import Backend
from . import tables
from .tables import attention_table


def _alloc(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    rows = result["alloc"] = timing.bench_alloc(backend, device, iters * 40)
    return tables.alloc_table(rows, iters)


def _attention(backend: Backend, device: int, iters: int, sweep: bool,
               result: dict[str, Any]) -> list[str]:
    with progress.ticking("bench --attention: copy and read bandwidth", leave=False):
        copy = result["copy_gb_per_s"] = timing.copy_bandwidth(backend, device)
        read = result["read_gb_per_s"] = timing.read_bandwidth(backend, device)
    rows = result["attention"] = attention.bench_attention(
        backend, device, copy, iters,
        attention.SHAPES + attention.FP8_SHAPES + attention.WINDOW_SHAPES, read_gbs=read)
    lines = [f"copy bandwidth: {copy:.0f} GB/s (read + write, 1 GiB device copy); "
             f"read bandwidth: {read:.0f} GB/s (1 GiB read-only)", *attention_table(rows)]
    if sweep:
        rows = result["sweep"] = attention.bench_attention(
            backend, device, copy, iters, attention.sweep_shapes(), read_gbs=read)
        lines.append("sweep: bf16, 8 kv heads, q heads = 8 x GQA ratio")
        lines += attention_table(rows)
    return lines + tables.legend_lines(tables.attention_legend(iters))


def _step(backend: Backend, device: int, result: dict[str, Any]) -> list[str]:
    from ..bench.step import STEP_SHAPES, bench_step

    rows = result["step"] = [bench_step(backend, device, shape) for shape in
                             progress.track(STEP_SHAPES, "bench --step", unit="shapes")]
    lines = [f"decode step, {STEP_SHAPES[0].layers} layers, bf16, 32/8 heads, head_dim "
             f"128, block 16 (targets: plain step <= 1.05 x kernels, the best variant "
             f"<= 1.03, <= 10 us host per call); ahead: the next step planned while the "
             f"device runs this one; graph: ahead, the launches replayed as a graph"]
    return lines + tables.step_table(rows)


#: Timed runs per measurement of the benches whose runs each move or compute a whole
#: workload (--prefill, --transfer, --offload): more asked for are capped, and said.
HEAVY_ITERS = 20


def _heavy(iters: int, what: str, lines: list[str]) -> int:
    """``iters`` capped at HEAVY_ITERS for bench ``what``, a line in ``lines`` saying so."""
    if iters > HEAVY_ITERS:
        lines.append(f"bench {what}: --iters {iters} capped at {HEAVY_ITERS} (each run "
                     "times a whole workload)")
    return min(iters, HEAVY_ITERS)


def _prefill(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    from ..bench.prefill import BANDWIDTH_TARGET_PCT, bench_mixed_step, bench_prefill

    notes: list[str] = []
    iters = _heavy(iters, "--prefill", notes)
    with progress.ticking("bench --prefill", leave=False):
        copy = result.get("copy_gb_per_s") or timing.copy_bandwidth(backend, device)
        result["copy_gb_per_s"] = copy
        found = bench_prefill(backend, device, copy, iters)
        step = bench_mixed_step(backend, device)
    result["prefill"] = {**found, "mixed_step": step}
    lines = [*notes, f"attention over many query tokens, bf16, 32/8 heads, head_dim 128, "
             "block 16: "
             "TFLOP/s over causal FLOPs; % of the matrix units' rate measured now "
             f"({found['matrix_tflops']:.0f} TFLOP/s); P4/P5 also % of copy bandwidth "
             f"({copy:.0f} GB/s; target {BANDWIDTH_TARGET_PCT:.0f} %)",
             *tables.prefill_table(found["rows"], iters)]
    lines.append(f"mixed step through the cache ({step['layers']} layers of P5): kernels "
                 f"{step['kernels_ms']:.3f} ms; plain {step['step_ms']:.3f} ms (ratio "
                 f"{step['step_over_kernels']:.3f}, batch {step['batch_host_us']:.0f} us "
                 f"host); planned ahead {step['ahead_step_ms']:.3f} ms (ratio "
                 f"{step['ahead_over_kernels']:.3f}); graph replay {step['graph_step_ms']:.3f}"
                 f" ms (ratio {step['graph_over_kernels']:.3f}); one graph for its token "
                 f"budget {step['budget_step_ms']:.3f} ms (ratio "
                 f"{step['budget_over_kernels']:.3f}); target <= {step['target']}"
                 + ("" if step["met_target"] else "  MISSED"))
    return lines


def _cache(result: dict[str, Any]) -> list[str]:
    with progress.ticking("bench --cache", leave=False):
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

    notes: list[str] = []
    iters = _heavy(iters, "--transfer", notes)
    with progress.ticking(f"bench --transfer over {transport}", leave=False):
        rows = result["transfer"] = bench_transfer(backend, device, transport, iters,
                                                   sender_device)
    lines = [*notes, f"a sequence's KV between two processes over {transport}, or two caches "
             "of one process (peer) (median; copy: the same bytes through the same copy "
             "engine, a peer copy across devices)", *tables.transfer_table(rows, iters)]
    ours = [r for r in rows if "engine_gb_per_s" in r]
    if not ours:
        return lines
    staging = ours[0]["staging"] or "none: the slabs are host memory"
    return [*lines, "mooncake against its ceilings, in the same run (TCP on loopback; "
            f"device<->host staging: {staging})", *tables.mooncake_table(ours, iters)]


def _offload(backend: Backend, device: int, iters: int, result: dict[str, Any]) -> list[str]:
    from ..bench.offload import TARGET_PCT, bench_offload

    notes: list[str] = []
    iters = _heavy(iters, "--offload", notes)
    with progress.ticking("bench --offload", leave=False):
        rows = result["offload"] = bench_offload(backend, device, iters)
    what = ("memcpy between host buffers (the host backend has no copy engine)"
            if backend.name == "host" else "pinned host <-> device copies of the same bytes")
    lines = [*notes, f"a sequence's KV swapped to the host tier and back (median; copy: "
             f"{what}; target {TARGET_PCT:.0f} % each way)"]
    return lines + tables.offload_table(rows, iters)


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
