"""``bench --prefill``: attention over many query tokens per sequence (prefill, a prefix hit's
tail, prefill chunks, speculative verification, chunks mixed with decodes) on bf16 caches of
32 query and 8 kv heads of 128, block 16, pages in random order.

Each row is timed as a step runs it: planned and uploaded once, then launched (the decode
kernel for the leading decodes, the multi-token kernel, its combine), device time between
events (``timing.time_ms``). Reported: TFLOP/s over the causal FLOPs (4 x head_dim per query
head and visible position: QK and PV), the share of the dense 16-bit matrix rate measured in
the same run (``matrix_rate``: the matrix units on register operands, the ceiling of any
kernel on them), and for the shapes that read more than they compute (P4, P5) the share of
the copy bandwidth, counting K and V once per kv head plus q and out. ``mixed_step`` times a
32-layer step of P5 through the cache's API (batch, then per layer write + attention; or
the layers replayed as one graph, ``KvCache.step_graph``) against its kernels alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..kernels import planning
from ..kernels.module import load_kernels
from ..kernels.planning.prefill import WARPS, leading_decodes, prefill_launch
from ..memory.array import DeviceArray
from ..runtime import Backend
from .attention import AttentionLaunch
from .timing import fill_random, time_ms

BF16 = np.dtype(ml_dtypes.bfloat16)
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
#: Rows that read more bytes than they compute for: their share of the copy bandwidth too,
#: and its target.
BANDWIDTH_ROWS = ("P4", "P5")
BANDWIDTH_TARGET_PCT = 85.0


@dataclass(frozen=True)
class PrefillShape:
    """One row: each sequence's query rows (``q_lens``) and tokens in the cache
    (``kv_lens``), decodes first."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    what: str

    def flops(self) -> int:
        """Causal FLOPs: row i of a sequence sees kv - q + i + 1 positions."""
        total = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(self.q_lens, self.kv_lens))
        return int(4 * HEAD_DIM * Q_HEADS * total)

    def bytes(self) -> int:
        item = int(BF16.itemsize)
        kv = sum(self.kv_lens) * KV_HEADS * HEAD_DIM * 2 * item
        return kv + 2 * sum(self.q_lens) * Q_HEADS * HEAD_DIM * item


PREFILL_SHAPES = (
    PrefillShape("P1", (8192,), (8192,), "a long prompt"),
    PrefillShape("P2", (512,) * 8, (4096,) * 8, "prefix hits: 3584 cached"),
    PrefillShape("P3", (256,) * 32, (2048,) * 32, "prefill chunks"),
    PrefillShape("P4", (4,) * 64, (4096,) * 64, "speculative verify"),
    PrefillShape("P5", (1,) * 56 + (256,) * 8, (2048,) * 56 + (1024,) * 8,
                 "56 decodes + 8 chunks"),
)


def _leading(array: DeviceArray, rows: int) -> DeviceArray:
    """A view of ``array``'s first ``rows`` rows (its leading dimension)."""
    return DeviceArray(array.buffer, array.dtype, (rows, *array.shape[1:]), 0)


class PrefillLaunch:
    """One layer's attention of a multi-token step, planned and uploaded once (the decode
    launch of the leading decodes, the multi-token launch, its combine): each call launches
    them. ``close()`` frees what it uploaded."""

    def __init__(self, out: DeviceArray, q: DeviceArray, k: DeviceArray, v: DeviceArray,
                 tables: np.ndarray, lens: np.ndarray, q_lens: np.ndarray) -> None:
        backend, device = q.backend, q.device
        decodes = leading_decodes(q_lens)
        self.decode = None
        if decodes:
            self.decode = AttentionLaunch(_leading(out, decodes), _leading(q, decodes), k, v,
                                          tables[:decodes], lens[:decodes])
        ratio = q.shape[1] // k.shape[1]
        rest_q, rest_lens = q_lens[decodes:], lens[decodes:]
        found, work = prefill_launch(backend, device, q.dtype, q.shape[2], k.dtype, rest_q,
                                     rest_lens, k.shape[1], ratio)
        self.arrays = [DeviceArray.from_numpy(a, device, backend)
                       for a in (tables[decodes:], rest_lens, *work.arrays)]
        self.partials = DeviceArray.empty((max(work.partial_bytes(found.shape.bm,
                                                                  q.shape[2]), 4),),
                                          np.uint8, device, backend)
        tables_d, lens_d, starts, items, *combines = [a.ptr for a in self.arrays]
        row_bytes = q.shape[1] * q.shape[2] * q.dtype.itemsize
        out_at, q_at = out.ptr + decodes * row_bytes, q.ptr + decodes * row_bytes
        i32, f32 = np.int32, np.float32
        self.prefill = found.kernel.prepare(
            len(work.items), found.threads, out_at, self.partials.ptr, q_at, k, v, tables_d,
            lens_d, starts, items, f32(planning.default_scale(q.shape[2], None)),
            i32(q.shape[1]), i32(k.shape[1]), i32(tables.shape[1]),
            i32(k.shape[2].bit_length() - 1), f32(1.0), f32(0.0), 0, i32(0),
            shared_bytes=found.shape.shared_bytes)
        self.combine = None
        if combines:
            self.combine = found.combine.prepare(
                len(work.combines), found.threads, out_at, self.partials.ptr, items,
                combines[0], starts, i32(q.shape[1]), i32(k.shape[1]), i32(found.shape.bm), 0)
        self.items, self.wm = len(work.items), found.wm

    def __call__(self) -> None:
        if self.decode is not None:
            self.decode()
        self.prefill()
        if self.combine is not None:
            self.combine()

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()
        for array in (*self.arrays, self.partials):
            array.buffer.root.close()


def matrix_rate(backend: Backend, device: int, iters: int = 20) -> float:
    """The 16-bit matrix units' rate in TFLOP/s: ``rf_matrix_rate_bf16`` over 8 CTAs per
    multiprocessor, register operands only."""
    props = backend.cached_properties(device)
    kernel = load_kernels("basic", device, backend).function("rf_matrix_rate_bf16")
    blocks, rounds = 8 * props.multiprocessors, 4096
    sink = DeviceArray.empty((1,), np.float32, device, backend)
    args = (np.int32(rounds), np.float32(-1.0), sink)
    ms = time_ms(backend, device, lambda: kernel.launch(blocks, WARPS * props.warp_size, *args),
                 iters).ms
    sink.buffer.close()
    return blocks * WARPS * rounds * 8 * 8192 / (ms * 1e-3) / 1e12


def prefill_inputs(shape: PrefillShape, rng: np.random.Generator, backend: Backend, device: int
            ) -> tuple[Any, ...]:
    kv_lens, q_lens = (np.asarray(a, np.int32) for a in (shape.kv_lens, shape.q_lens))
    need = -(-kv_lens // BLOCK)
    num_blocks = int(need.sum()) + 1
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(kv_lens), int(need.max())), np.int32)
    for s, start in enumerate(np.concatenate([[0], np.cumsum(need)[:-1]])):
        tables[s, : need[s]] = ids[start: start + need[s]]
    k, v = (DeviceArray.empty((num_blocks, KV_HEADS, BLOCK, HEAD_DIM), BF16, device, backend)
            for _ in range(2))
    q, out = (DeviceArray.empty((int(q_lens.sum()), Q_HEADS, HEAD_DIM), BF16, device, backend)
              for _ in range(2))
    for array in (k, v, q):
        fill_random(array.buffer, rng, BF16)
    return q, out, k, v, tables, kv_lens, q_lens


def bench_prefill(backend: Backend, device: int, copy_gbs: float, iters: int = 20,
                  shapes: tuple[PrefillShape, ...] = PREFILL_SHAPES) -> dict[str, Any]:
    """The rows (module docstring) and the matrix rate they are measured against."""
    rate = matrix_rate(backend, device)
    rows = []
    for shape in shapes:
        rng = np.random.default_rng(sum(map(ord, shape.name)))
        q, out, k, v, tables, lens, q_lens = prefill_inputs(shape, rng, backend, device)
        launch = PrefillLaunch(out, q, k, v, tables, lens, q_lens)
        timing = time_ms(backend, device, launch, iters)
        seconds = timing.ms * 1e-3
        row: dict[str, Any] = {"shape": shape.name, "what": shape.what, "batch": len(q_lens),
               "query_rows": int(q_lens.sum()), "ms": timing.ms, "host_us": timing.host_us,
               "tflops": shape.flops() / seconds / 1e12, "items": launch.items, "wm": launch.wm}
        row["pct_matrix"] = 100 * row["tflops"] / rate
        if shape.name in BANDWIDTH_ROWS:
            row["pct_copy"] = 100 * shape.bytes() / seconds / 1e9 / copy_gbs
            row["met_target"] = row["pct_copy"] >= BANDWIDTH_TARGET_PCT
        rows.append(row)
        launch.close()
        for array in (q, out, k, v):
            array.buffer.root.close()
    return {"matrix_tflops": rate, "rows": rows}


def bench_mixed_step(backend: Backend, device: int, layers: int = 32, steps: int = 10
                     ) -> dict[str, Any]:
    """A ``layers``-layer step of P5 through the cache (``batch(query_lens=)``, then per
    layer ``write`` + ``attention``, then a wait: ``plain``; the next step planned before the
    wait: ``ahead``; as ahead, the layers replayed as one graph: ``graph``; as graph, one
    capture for any step of up to its tokens: ``budget``), its wall time against its
    kernels' device time (the same launches between events)."""
    from ..cache import CacheConfig, KvCache

    shape = PREFILL_SHAPES[-1]
    q_lens, kv_lens = np.asarray(shape.q_lens, np.int32), np.asarray(shape.kv_lens)
    blocks = int((-(-kv_lens // BLOCK)).sum()) + 2
    config = CacheConfig(layers, KV_HEADS, HEAD_DIM, BLOCK, blocks, BF16, num_q_heads=Q_HEADS)
    rng = np.random.default_rng(5)
    with KvCache(config, device, backend, strict=True) as cache:
        fill_random(cache.slab.buffer, rng, BF16)
        ids = list(range(len(kv_lens)))
        for seq_id, n in zip(ids, kv_lens):
            cache.add_sequence(seq_id, int(n))
        rows = int(q_lens.sum())
        key, value = (DeviceArray.empty((rows, KV_HEADS, HEAD_DIM), BF16, device, backend)
                      for _ in range(2))
        query, out = (DeviceArray.empty((rows, Q_HEADS, HEAD_DIM), BF16, device, backend)
                      for _ in range(2))
        for array in (key, value, query):
            fill_random(array.buffer, rng, BF16)

        def launches(meta: Any) -> None:
            for layer in range(layers):
                cache.write(layer, key, value, meta)
                cache.attention(layer, out, query, meta)

        meta = cache.batch(ids, query_lens=q_lens)
        kernels = time_ms(backend, device, lambda: launches(meta), max(steps // 2, 3))
        walls, plans = [], []
        for _ in range(steps + 2):  # plain: plan, launch, wait
            start = time.perf_counter()
            meta = cache.batch(ids, query_lens=q_lens)
            plans.append(time.perf_counter() - start)
            launches(meta)
            backend.synchronize(device)
            walls.append(time.perf_counter() - start)
        ends = []
        meta = cache.batch(ids, query_lens=q_lens)
        for _ in range(steps + 2):  # ahead: the next step planned while the device runs
            launches(meta)
            meta = cache.batch(ids, query_lens=q_lens)
            backend.synchronize(device)
            ends.append(time.perf_counter())
        per_layer = [(key, value, query, out)] * layers

        def replayed(**budget: int) -> tuple[float, int]:
            """As ahead, the layers replayed as one graph: (ms a step, captures)."""
            nonlocal meta
            replays = []
            with cache.step_graph(**budget) as graph:
                for _ in range(steps + 2):
                    graph.run(meta, per_layer)
                    meta = cache.batch(ids, query_lens=q_lens)
                    backend.synchronize(device)
                    replays.append(time.perf_counter())
                return 1e3 * float(np.median(np.diff(replays)[1:])), graph.captures

        graph_ms, captures = replayed()
        # one capture for any step of up to these tokens (padded grids and regions)
        budget_ms, budget_captures = replayed(token_budget=rows, max_seqs=len(ids))
        for array in (key, value, query, out):
            array.buffer.close()
    wall_ms = 1e3 * float(np.median(walls[2:]))
    ahead_ms = 1e3 * float(np.median(np.diff(ends)[1:]))
    return {"shape": shape.name, "layers": layers, "kernels_ms": kernels.ms,
            "step_ms": wall_ms, "step_over_kernels": wall_ms / kernels.ms,
            "ahead_step_ms": ahead_ms, "ahead_over_kernels": ahead_ms / kernels.ms,
            "graph_step_ms": graph_ms, "graph_over_kernels": graph_ms / kernels.ms,
            "graph_captures": captures, "budget_step_ms": budget_ms,
            "budget_over_kernels": budget_ms / kernels.ms, "budget_captures": budget_captures,
            "batch_host_us": 1e6 * float(np.median(plans[2:])), "target": 1.05,
            "met_target": min(wall_ms, ahead_ms, graph_ms) / kernels.ms <= 1.05}
