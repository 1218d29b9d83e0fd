"""``bench --step``: a whole decode step through the KV cache's API, as a serving loop runs it.

A step of a ``layers``-layer model: ``append`` one token to every sequence, ``batch`` (the
step's plan), then per layer ``write`` (the new token's K/V) and ``attention``, then wait for
the device. Reported: the step's wall time (median; bookkeeping, planning, launches and the
wait included), the device time of the step's kernels alone (events, the region queued
behind a hold kernel so that they time device work), their ratio (1.0: the host is fully
hidden), and the host's time per ``append``, ``batch``, ``write`` and ``attention`` call
(medians, taken while the device is busy with the step's earlier launches). Inputs are
random (the cache is filled with random K/V), never zeros.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .array import DeviceArray
from .bench import fill_random, time_ms
from .cache import CacheConfig, KvCache
from .runtime import Backend


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
#: Targets: step wall time over the kernels' device time, and host microseconds per call.
STEP_RATIO_TARGET, HOST_US_TARGET = 1.05, 10.0


def bench_step(backend: Backend, device: int, shape: StepShape, steps: int = 30,
               warmup: int = 5, dtype: Any = ml_dtypes.bfloat16) -> dict[str, Any]:
    """Time ``steps`` decode steps of ``shape`` (after ``warmup`` ones); returns one row."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(2024)
    total_steps = steps + warmup
    start_len = shape.context - total_steps // 2
    blocks = shape.batch * -(-(start_len + total_steps + 1) // shape.block_size) + 1
    config = CacheConfig(shape.layers, shape.kv_heads, shape.head_dim, shape.block_size,
                         blocks, dtype, num_q_heads=shape.q_heads)
    q_shape = (shape.batch, shape.q_heads, shape.head_dim)
    kv_shape = (shape.batch, shape.kv_heads, shape.head_dim)
    arrays = []
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
            per_layer.append((q, k, v, out))
            arrays += [q, k, v, out]
        clock = time.perf_counter_ns
        wall, host = [], {"append": [], "batch": [], "write": [], "attention": []}
        for step in range(total_steps):
            begin = clock()
            cache.append(ids)
            planned = clock()
            meta = cache.batch(ids)
            launched = clock()
            times = []
            for layer, (q, k, v, out) in enumerate(per_layer):
                t0 = clock()
                cache.write(layer, k, v, meta)
                t1 = clock()
                cache.attention(layer, out, q, meta)
                times.append((t1 - t0, clock() - t1))
            backend.synchronize(device)
            end = clock()
            if step >= warmup:
                wall.append(end - begin)
                host["append"].append(planned - begin)
                host["batch"].append(launched - planned)
                host["write"] += [w for w, _ in times]
                host["attention"] += [a for _, a in times]

        def layers() -> None:
            for layer, (q, k, v, out) in enumerate(per_layer):
                cache.write(layer, k, v, meta)
                cache.attention(layer, out, q, meta)

        kernels = time_ms(backend, device, layers, iters=max(steps // 2, 5))
    for array in arrays:
        array.buffer.root.close()
    step_ms = statistics.median(wall) / 1e6
    return {
        "batch": shape.batch, "context": shape.context, "layers": shape.layers,
        "dtype": dtype.name, "step_ms": step_ms, "kernels_ms": kernels.ms,
        "step_over_kernels": step_ms / kernels.ms, "target_ratio": STEP_RATIO_TARGET,
        **{f"{name}_host_us": statistics.median(values) / 1e3 for name, values in host.items()},
        "target_host_us": HOST_US_TARGET,
    }


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, device: int,
            backend: Backend) -> DeviceArray:
    return DeviceArray.from_numpy(rng.standard_normal(shape, np.float32).astype(dtype),
                                  device, backend)
