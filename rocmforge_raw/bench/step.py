"""``bench --step``: a whole decode step through the KV cache's API, as a serving loop runs it.

A step of a ``layers``-layer model, in three variants on one cache:

- ``plain``: ``append`` one token to every sequence, ``batch`` (the step's plan), then per
  layer ``write`` (the new token's K/V) and ``attention``, then wait for the device;
- ``ahead``: the step's launches first, then the next step's ``append`` + ``batch`` while the
  device runs them (planning ahead, README), then the wait;
- ``graph``: as ``ahead``, with the launches replayed as one graph (``KvCache.step_graph``).

Reported per variant: the step's wall time (median; for ``ahead``/``graph`` the time between
two steps' ends, which is what a serving loop sees), its ratio to the device time of the
step's kernels alone (events, the region queued behind a hold kernel so that they time
device work; 1.0: the host is fully hidden) and the host's microseconds per step (the
work before the wait). ``plain`` also gives the host's time per ``append``, ``batch``,
``write`` and ``attention`` call (medians, taken while the device is busy with the step's
earlier launches). Inputs are random (the cache is filled with random K/V), never zeros.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..cache import CacheConfig, KvCache
from ..memory.array import DeviceArray
from ..runtime import Backend
from .timing import fill_random, time_ms


@dataclass(frozen=True)
class StepShape:
    """One decode-step shape: ``batch`` sequences of about ``context`` tokens."""

    batch: int
    context: int
    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


STEP_SHAPES = (StepShape(64, 2048), StepShape(8, 1024), StepShape(256, 512))
#: Targets: step wall time over the kernels' device time (the plain loop's; planned ahead
#: or replayed as a graph, at least one variant should reach ``BEST_RATIO_TARGET``), and
#: host microseconds per call.
STEP_RATIO_TARGET, BEST_RATIO_TARGET, HOST_US_TARGET = 1.05, 1.03, 10.0
VARIANTS = ("plain", "ahead", "graph")


def bench_step(backend: Backend, device: int, shape: StepShape, steps: int = 30,
               warmup: int = 5, dtype: Any = ml_dtypes.bfloat16) -> dict[str, Any]:
    """Time ``steps`` decode steps of ``shape`` (after ``warmup`` ones) in each variant;
    returns one row."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(2024)
    total_steps = len(VARIANTS) * (steps + warmup + 1)
    start_len = shape.context - total_steps // 2
    blocks = shape.batch * -(-(start_len + total_steps + 1) // shape.block_size) + 1
    config = CacheConfig(shape.layers, shape.kv_heads, shape.head_dim, shape.block_size,
                         blocks, dtype, num_q_heads=shape.q_heads)
    q_shape = (shape.batch, shape.q_heads, shape.head_dim)
    kv_shape = (shape.batch, shape.kv_heads, shape.head_dim)
    arrays, row = [], {}
    with KvCache(config, device, backend, strict=True) as cache:
        fill_random(cache.slab.buffer, rng, dtype)
        ids = list(range(shape.batch))
        for seq_id in ids:
            cache.add_sequence(seq_id, start_len)
        per_layer = []
        for _ in range(shape.layers):
            q, k, v = (_random(rng, s, dtype, device, backend) for s in (q_shape, kv_shape,
                                                                         kv_shape))
            out = DeviceArray.empty(q_shape, dtype, device, backend)
            per_layer.append((k, v, q, out))
            arrays += [q, k, v, out]
        loop = _StepLoop(cache, ids, per_layer, backend, device)
        row.update(loop.plain(steps, warmup))
        row.update(loop.ahead(steps, warmup))
        with cache.step_graph() as graph:
            row.update(loop.ahead(steps, warmup, graph))
            row["graph_captures"] = graph.captures
        meta = cache.batch(ids)
        kernels = time_ms(backend, device, lambda: loop.launch(meta), iters=max(steps // 2, 5))
    for array in arrays:
        array.buffer.root.close()
    for variant in VARIANTS:
        row[f"{variant}_step_over_kernels"] = row[f"{variant}_step_ms"] / kernels.ms
    return {
        "batch": shape.batch, "context": shape.context, "layers": shape.layers,
        "dtype": dtype.name, "kernels_ms": kernels.ms, **row,
        "step_ms": row["plain_step_ms"], "step_over_kernels": row["plain_step_over_kernels"],
        "target_ratio": STEP_RATIO_TARGET, "target_best_ratio": BEST_RATIO_TARGET,
        "target_host_us": HOST_US_TARGET,
    }


class _StepLoop:
    """The decode loops of ``bench_step`` over one cache and its per-layer arrays."""

    def __init__(self, cache: KvCache, ids: list[int], per_layer: list[tuple], backend: Backend,
                 device: int) -> None:
        self.cache, self.ids, self.per_layer = cache, ids, per_layer
        self.backend, self.device = backend, device
        self.clock = time.perf_counter_ns

    def launch(self, meta: Any, times: list | None = None) -> None:
        """Every layer's write and attention of ``meta``'s step (host ns per call into
        ``times``)."""
        cache, clock = self.cache, self.clock
        for layer, (k, v, q, out) in enumerate(self.per_layer):
            t0 = clock()
            cache.write(layer, k, v, meta)
            t1 = clock()
            cache.attention(layer, out, q, meta)
            if times is not None:
                times.append((t1 - t0, clock() - t1))

    def plain(self, steps: int, warmup: int) -> dict[str, float]:
        """Plan, launch, wait: the step as ``plain``."""
        clock, cache, ids = self.clock, self.cache, self.ids
        wall, total, host = [], [], {"append": [], "batch": [], "write": [], "attention": []}
        for step in range(steps + warmup):
            begin = clock()
            cache.append(ids)
            planned = clock()
            meta = cache.batch(ids)
            launched = clock()
            times: list = []
            self.launch(meta, times)
            queued = clock()
            self.backend.synchronize(self.device)
            if step >= warmup:
                wall.append(clock() - begin)
                total.append(queued - begin)
                host["append"].append(planned - begin)
                host["batch"].append(launched - planned)
                host["write"] += [w for w, _ in times]
                host["attention"] += [a for _, a in times]
        return {"plain_step_ms": statistics.median(wall) / 1e6,
                "plain_host_us": statistics.median(total) / 1e3,
                **{f"{name}_host_us": statistics.median(values) / 1e3
                   for name, values in host.items()}}

    def ahead(self, steps: int, warmup: int, graph: Any = None) -> dict[str, float]:
        """Launch (the layers, or ``graph``), plan the next step, wait: ``ahead``/``graph``."""
        clock, cache, ids = self.clock, self.cache, self.ids
        name = "ahead" if graph is None else "graph"
        cache.append(ids)
        meta = cache.batch(ids)
        wall, host = [], []
        last = clock()
        for step in range(steps + warmup):
            begin = clock()
            if graph is None:
                self.launch(meta)
            else:
                graph.run(meta, self.per_layer)
            cache.append(ids)  # the next step's plan, while the device runs this one
            meta = cache.batch(ids)
            queued = clock()
            self.backend.synchronize(self.device)
            end = clock()
            if step >= warmup:
                wall.append(end - last)
                host.append(queued - begin)
            last = end
        return {f"{name}_step_ms": statistics.median(wall) / 1e6,
                f"{name}_host_us": statistics.median(host) / 1e3}


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, device: int,
            backend: Backend) -> DeviceArray:
    return DeviceArray.from_numpy(rng.standard_normal(shape, np.float32).astype(dtype),
                                  device, backend)
