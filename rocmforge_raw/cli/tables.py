"""The tables ``rocmforge-raw bench`` prints, each with its legend under it: one line per
column (``  bare us: ...``) that says what the column measures, how it was timed and over
how many runs. ``LEGENDS`` holds each table's (column names, meaning) pairs; a test checks
that every column of every header is explained and nothing else is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..bench.attention import FP8_TIME_TARGET, SHAPES, WINDOW_SHAPES, WINDOW_TARGET
from ..bench.step import VARIANTS

Legend = list[tuple[tuple[str, ...], str]]


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def legend_lines(legend: Legend) -> list[str]:
    return [f"  {', '.join(names)}: {meaning}" for names, meaning in legend]


# --- alloc --------------------------------------------------------------------------------------
def alloc_runs(iters: int, big: bool) -> tuple[int, int]:
    """(samples, round trips a sample) of ``bench --alloc`` for ``--iters iters``: it times
    ``40 x iters`` round trips a size, a tenth of that (50 at least) for 64 MiB, in samples
    of up to 100 back-to-back round trips (``timing.medians_us``)."""
    calls = iters * 40 if not big else max(iters * 40 // 10, 50)
    batch = max(1, min(100, calls // 20))
    return -(-calls // batch), batch


def alloc_legend(iters: int) -> Legend:
    samples, batch = alloc_runs(iters, False)
    big_samples, big_batch = alloc_runs(iters, True)
    return [
        (("bytes",), "the allocation's size; every other column (but raw/bare) is microseconds "
                     f"of one alloc+free round trip on the host clock: the median of {samples} "
                     f"samples, each the mean of {batch} back-to-back round trips (64 MiB: "
                     f"{big_samples} samples of {big_batch})"),
        (("bare us",), "the runtime's own malloc and free (hipMalloc/hipFree, cuMemAlloc/"
                       "cuMemFree, libc malloc/free) called from Python through the bindings"),
        (("C us",), "the same calls made from C by the allocator HipBuffer uses: the floor "
                    "HipBuffer cannot go below"),
        (("raw us",), "HipBuffer(bytes) and its close(), no pool"),
        (("raw/bare",), "raw us over bare us"),
        (("pooled us",), "HipBuffer(bytes, pool=pool) and its close(): a block from a "
                         "MemoryPool's cache"),
        (("pool a+f us",), "the pool's own allocate and free, no HipBuffer around them"),
        (("cupy pool us",), "CuPy's memory pool for the same size, as a reference (-: no CuPy "
                            "drives this backend)"),
    ]


def alloc_table(rows: list[dict[str, Any]], iters: int) -> list[str]:
    lines = [f"{'bytes':>10} {'bare us':>9} {'C us':>9} {'raw us':>9} {'raw/bare':>9} "
             f"{'pooled us':>10} {'pool a+f us':>12} {'cupy pool us':>13}"]
    lines += [f"{r['bytes']:>10} {r['bare_us']:9.2f} {r['c_us']:9.2f} {r['raw_us']:9.2f} "
              f"{r['raw_over_bare']:9.2f} {r['pooled_us']:10.2f} "
              f"{r['pool_allocate_free_us']:12.2f} {_us(r['cupy_pooled_us']):>13}"
              for r in rows]
    return lines + legend_lines(alloc_legend(iters))


# --- attention ----------------------------------------------------------------------------------
def _shapes() -> str:
    """S1-S6 in a few words each."""
    return "; ".join(f"{s.name} {s.batch} x {s.context or f'U[1, {s.max_context}]'}, "
                     f"{s.q_heads}/{s.kv_heads} heads, {s.dtype}" for s in SHAPES)


def _window_shapes() -> str:
    """The sliding-window rows (W1, W2) in a few words each."""
    return "; ".join(f"{s.name} {s.batch} x {s.context}, window {s.window}, {s.q_heads}/"
                     f"{s.kv_heads} heads, {s.dtype}" for s in WINDOW_SHAPES)


def attention_legend(iters: int) -> Legend:
    fp8 = ", ".join(name.removesuffix("-fp8") for name in FP8_TIME_TARGET)
    targets = sorted(set(FP8_TIME_TARGET.values()))
    return [
        (("shape",), f"{_shapes()} (head_dim 128, block 16, pages in random order); -fp8: the "
                     f"same over an e4m3fn cache; {_window_shapes()} (each query attends to "
                     "its last <window> tokens); sweep rows: d<head_dim>-r<GQA ratio>-b<block>-"
                     "<sequences>x<tokens> (U: lengths uniform up to it)"),
        (("ms",), f"device time of one attention launch between two events, median of {iters} "
                  f"runs after 5 warm-up ones (each queued behind a hold kernel, so the events "
                  f"time device work only)"),
        (("GB/s",), "bytes read and written (K and V once per kv-head group, q and out; a W "
                    "row's K and V of its window only) over ms"),
        (("% copy", "% read"), "GB/s over the copy and the read bandwidth measured above"),
        (("target",), "the % read a 16-bit row should reach; a W row shows <t>%c, the % copy "
                      f"it should reach ({WINDOW_TARGET} %); an fp8 row shows x<t>t instead, "
                      f"its time over its 16-bit row's (target x{targets[-1]:.2f} on {fp8})"),
        (("host us",), "the host's time to enqueue the launch, median"),
    ]


def attention_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per attention row: time, bandwidth, % of copy and of read (with targets: of
    read, of copy for a sliding-window row; an fp8 row gives its time over its 16-bit shape's
    instead)."""
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'shape':{width}} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'% read':>7} "
             f"{'target':>7} {'host us':>8}"]
    for r in rows:
        target = (f"{r['read_target_pct']:6}%" if r["read_target_pct"] is not None else
                  f"{r['target_pct']}%c" if r.get("window") and r.get("target_pct") else
                  f"x{r['time_vs_16bit']:.2f}t" if r.get("time_vs_16bit") else "      -")
        lines.append(f"{r['name']:{width}} {r['ms']:8.3f} {r['gb_per_s']:8.0f} "
                     f"{r['pct_of_copy']:6.1f}% {r['pct_of_read']:6.1f}% {target:>7} "
                     f"{r['host_us']:8.1f}")
    return lines


# --- step ---------------------------------------------------------------------------------------
def step_legend() -> Legend:
    return [
        (("batch x ctx",), "sequences x tokens each (about: each step adds one)"),
        (("kernels ms",), "device time of the step's launches alone (every layer's write and "
                          "attention) between two events, median of 15 runs"),
        (tuple(f"{v} ms" for v in VARIANTS), "the step's wall time in each variant (above), "
                                             "median of 30 steps after 5 warm-up ones; ahead "
                                             "and graph: the time between two steps' ends"),
        (("ratio",), "the variant's ms over kernels ms (1.0: the host is wholly hidden)"),
        (("host us",), "the host's time per step in that variant, before the wait"),
        (("append us", "batch us"), "plain's host time per append and batch call, medians"),
        (("write us", "attn us"), "plain's host time per layer's write and attention call, "
                                  "medians"),
    ]


def step_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'batch x ctx':>12} {'kernels ms':>10}"
             + "".join(f" {v + ' ms':>9} {'ratio':>6} {'host us':>8}" for v in VARIANTS)
             + f" {'append us':>9} {'batch us':>8} {'write us':>8} {'attn us':>8}"]
    lines += [f"{r['batch']:>5} x {r['context']:<5} {r['kernels_ms']:10.3f}"
              + "".join(f" {r[v + '_step_ms']:9.3f} {r[v + '_step_over_kernels']:6.3f} "
                        f"{r[v + '_host_us']:8.1f}" for v in VARIANTS)
              + f" {r['append_host_us']:9.1f} {r['batch_host_us']:8.1f} "
              f"{r['write_host_us']:8.2f} {r['attention_host_us']:8.2f}" for r in rows]
    return lines + legend_lines(step_legend())


# --- prefill ------------------------------------------------------------------------------------
def prefill_legend(iters: int) -> Legend:
    return [
        (("shape", "what"), "P1-P5: what the step's sequences hold (decodes first)"),
        (("rows",), "query rows in the step"),
        (("ms",), "device time of the step's attention launches (the decode kernel for the "
                  "leading decodes, the multi-token kernel, its combine) between two events, "
                  f"median of {iters} runs"),
        (("TFLOP/s",), "causal FLOPs (4 x head_dim per query head and visible position: QK "
                       "and PV) over ms"),
        (("% matrix",), "TFLOP/s over the matrix units' rate measured above"),
        (("% copy",), "P4, P5 (they read more than they compute): bytes (K and V once per kv "
                      "head, q and out) a second over the copy bandwidth above; MISSED: under "
                      "the target"),
    ]


def prefill_table(rows: list[dict[str, Any]], iters: int) -> list[str]:
    lines = [f"{'shape':>5} {'what':<22} {'rows':>6} {'ms':>8} {'TFLOP/s':>8} {'% matrix':>8} "
             f"{'% copy':>7}"]
    for r in rows:
        pct = f"{r['pct_copy']:6.1f}%" if "pct_copy" in r else f"{'-':>7}"
        mark = "  MISSED" if r.get("met_target") is False else ""
        lines.append(f"{r['shape']:>5} {r['what']:<22} {r['query_rows']:6} {r['ms']:8.3f} "
                     f"{r['tflops']:8.1f} {r['pct_matrix']:7.1f}% {pct}{mark}")
    return lines + legend_lines(prefill_legend(iters))


# --- transfer -----------------------------------------------------------------------------------
def transfer_legend(iters: int) -> Legend:
    return [
        (("transport",), "ipc or mooncake: between two processes; peer: between two caches of "
                         "this process on two devices"),
        (("devices",), "the sender's device -> the receiver's"),
        (("peer",), "peer access between the two devices (off: the runtime stages the copies "
                    "through host memory; -: one device)"),
        (("blocks",), "the sequence's blocks consecutive, or scattered (every block its own "
                      "span), on both sides"),
        (("MiB",), "the sequence's bytes"),
        (("spans",), "the contiguous copies they take (runs of blocks x 2 x layers)"),
        (("transfer GB/s", "import GB/s"), "the bytes over the transport's read alone, and over "
                                           "the whole import_sequence (checks and bookkeeping "
                                           f"too): medians of {iters} imports after a first"),
        (("copy GB/s",), "one copy of the same bytes through the same copy engine (a peer copy "
                         f"across devices), median of {iters}"),
        (("% copy",), "transfer GB/s over copy GB/s"),
        (("host us",), "the host's work in one read (checks, the piece table, queuing the "
                       "copies, the sender's checks), median; the rest is waiting for the "
                       "device (on the host backend the copies are host work too; -: the "
                       "transport does not say)"),
        (("import host us",), "the fixed host time of one whole import_sequence (the "
                              "import less the read's wait for the device: checks, "
                              "allocation, bookkeeping and the read's host work), median"),
    ]


def transfer_table(rows: list[dict[str, Any]], iters: int) -> list[str]:
    lines = [f"{'transport':>9} {'devices':>7} {'peer':>5} {'blocks':>11} {'MiB':>7} "
             f"{'spans':>6} {'transfer GB/s':>14} {'import GB/s':>12} {'copy GB/s':>10} "
             f"{'% copy':>7} {'host us':>8} {'import host us':>14}"]
    peer = {None: "-", True: "on", False: "off"}
    lines += [f"{r['transport']:>9} {r['sender_device']:>3}->{r['receiver_device']:<2} "
              f"{peer[r['peer_access']]:>5} {r['layout']:>11} "
              f"{r['bytes'] / 2**20:7.0f} {r['spans']:6} "
              f"{r['transfer_gb_per_s']:14.2f} {r['import_gb_per_s']:12.2f} "
              f"{r['copy_gb_per_s']:10.2f} {r['pct_of_copy']:6.1f}% "
              f"{_us(r.get('host_us')):>8} {_us(r.get('import_host_us')):>14}" for r in rows]
    return lines + legend_lines(transfer_legend(iters))


def mooncake_legend(iters: int) -> Legend:
    return [
        (("blocks",), "the rows above: consecutive or scattered blocks"),
        (("ours GB/s",), "the transfer GB/s above: MooncakeTransport's read"),
        (("engine GB/s",), "Mooncake's engine called plainly, one registered buffer on each "
                           "side (the slabs' size and memory kind, the sender's in the sender "
                           "process): the descriptors ours posted as one batch, posted and "
                           f"waited for, median of {iters} after a first"),
        (("% engine",), "ours over the engine's batch (target >= 85 %; MISSED: under it)"),
        (("tcp GB/s",), "a plain TCP socket copy of the same bytes on 127.0.0.1, a sender "
                        f"thread to a preallocated host buffer, median of {iters}"),
        (("% tcp",), "ours over the TCP copy"),
        (("descs",), "descriptors in each batch: the spans merged where they continue"),
        (("reg ms", "eng reg ms"), "registering the slabs (ours), the plain buffers (the "
                                   "engine's) with the engine, both sides, once"),
        (("post ms", "eng post ms"), "building the descriptor lists and the batch submit, "
                                     "median"),
        (("wire ms", "eng wire ms"), "from the submit's return until every byte arrived, "
                                     "median"),
    ]


def mooncake_table(rows: list[dict[str, Any]], iters: int) -> list[str]:
    """Mooncake's rows beside the engine's own batch and a TCP copy of the same bytes."""
    lines = [f"{'blocks':>11} {'ours GB/s':>10} {'engine GB/s':>12} {'% engine':>9} "
             f"{'tcp GB/s':>9} {'% tcp':>6} {'descs':>6} {'reg ms':>7} {'eng reg ms':>11} "
             f"{'post ms':>8} {'eng post ms':>12} {'wire ms':>8} {'eng wire ms':>12}"]
    lines += [f"{r['layout']:>11} {r['transfer_gb_per_s']:10.2f} {r['engine_gb_per_s']:12.2f} "
              f"{r['pct_of_engine']:8.1f}% {r['tcp_gb_per_s']:9.2f} {r['pct_of_tcp']:5.1f}% "
              f"{r['descriptors']:6} {r['registration_ms']:7.2f} "
              f"{r['engine_registration_ms']:11.2f} {r['post_ms']:8.3f} "
              f"{r['engine_post_ms']:12.3f} {r['wire_ms']:8.2f} {r['engine_wire_ms']:12.2f}"
              + ("" if r["met_target"] else "  MISSED") for r in rows]
    return lines + legend_lines(mooncake_legend(iters))


# --- offload ------------------------------------------------------------------------------------
def offload_legend(iters: int) -> Legend:
    return [
        (("blocks",), "the sequence's device blocks consecutive, or scattered (every other "
                      "one)"),
        (("MiB",), "the sequence's bytes"),
        (("copies",), "the 2-D copies a swap takes (one per run of consecutive blocks)"),
        (("out GB/s", "in GB/s"), "swap_out and swap_in of the sequence, each from the call to "
                                  "the end of a wait for the cache's stream: medians of "
                                  f"{iters} after a first"),
        (("d2h GB/s", "h2d GB/s"), "one copy of the same bytes between the slab and the host "
                                   "tier's pinned memory, each way, median"),
        (("% d2h", "% h2d"), "out GB/s over d2h GB/s, in GB/s over h2d GB/s (MISSED: under the "
                             "target)"),
        (("exact",), "the bytes swapped back in equal those swapped out"),
    ]


def offload_table(rows: list[dict[str, Any]], iters: int) -> list[str]:
    lines = [f"{'blocks':>11} {'MiB':>6} {'copies':>6} {'out GB/s':>9} {'d2h GB/s':>9} "
             f"{'% d2h':>6} {'in GB/s':>8} {'h2d GB/s':>9} {'% h2d':>6} {'exact':>5}"]
    lines += [f"{r['layout']:>11} {r['bytes'] / 2**20:6.0f} {r['copies']:6} "
              f"{r['swap_out_gb_per_s']:9.2f} {r['d2h_gb_per_s']:9.2f} "
              f"{r['swap_out_pct']:5.1f}% {r['swap_in_gb_per_s']:8.2f} "
              f"{r['h2d_gb_per_s']:9.2f} {r['swap_in_pct']:5.1f}% "
              f"{'yes' if r['verified'] else 'NO':>5}"
              + ("" if r["met_target"] else "  MISSED") for r in rows]
    return lines + legend_lines(offload_legend(iters))


#: Each table's legend, by the bench flag that prints it (``iters``: the runs it times;
#: ``mooncake``: ``--transfer --transport mooncake``'s second table).
LEGENDS: dict[str, Callable[[int], Legend]] = {
    "alloc": alloc_legend, "attention": attention_legend, "step": lambda iters: step_legend(),
    "prefill": prefill_legend, "transfer": transfer_legend, "mooncake": mooncake_legend,
    "offload": offload_legend,
}
