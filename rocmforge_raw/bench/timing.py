"""Timing on the device and the host, and the bandwidths attention is measured against.

GPU timings use device events around each run, after warm-up, and report medians; each run is
queued behind a hold kernel so the events time device work, and the host's enqueue time is
reported beside it. ``bench_alloc`` times allocation round trips against the bare runtime (and
CuPy's pool where it is installed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common import progress
from ..kernels.module import load_kernels
from ..memory.buffer import HipBuffer
from ..memory.pool import MemoryPool
from ..memory.stream import Event
from ..runtime import Backend, bare_alloc_free

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def medians_us(fns: dict[str, Callable[[], Any]], iters: int, batch: int | None = None,
               warmup: int = 10) -> dict[str, float]:
    """Median wall time of one call of each of ``fns`` in microseconds, over ``iters`` calls.

    A sample is the mean of ``batch`` back-to-back calls (default: enough for 20 samples, at
    most 100), so that the clock's own cost (a system call on some virtual machines) and the
    caches the other functions cooled stay out of sub-microsecond results; the
    functions take turns sample by sample, so that drift in the machine (clocks, the
    driver's state, other load) falls on all of them alike. Each call includes one Python
    call of the function itself."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    batch = batch or max(1, min(100, iters // 20))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter_ns
    for _ in range(-(-iters // batch)):
        for name, fn in fns.items():
            start = clock()
            for _ in range(batch):
                fn()
            samples[name].append((clock() - start) / batch)
    return {name: statistics.median(values) / 1e3 for name, values in samples.items()}


def bench_alloc(backend: Backend, device: int, iters: int = 2000) -> list[dict[str, Any]]:
    """Alloc+free round trips for 256 B, 1 MiB and 64 MiB: the bare binding calls from Python
    (``bare_us``), the same calls from C through the allocator HipBuffer uses (``c_us``: what
    HipBuffer cannot go below), raw and pooled HipBuffer, and the pool's own allocate/free;
    CuPy's pool alongside, as a reference, where CuPy is installed for this GPU
    (``cupy_pooled_us``, else None)."""
    backend.activate(device)  # the bare calls' device; the caller's choice stays
    pool = MemoryPool(device, backend)
    cupy_pool = _cupy_pool(backend, device)
    cupy_malloc = None if cupy_pool is None else cupy_pool.malloc
    rows = []
    for size in progress.track((256, MiB, 64 * MiB), "bench --alloc", unit="size"):
        n = iters if size < 64 * MiB else max(iters // 10, 50)
        fns = {
            "bare_us": lambda s=size: bare_alloc_free(backend, s),
            "c_us": lambda s=size: backend.allocator.round_trip(s, device),
            "raw_us": lambda s=size: HipBuffer(s, device, backend).close(),
            "pooled_us": lambda s=size: HipBuffer(s, pool=pool).close(),
            "pool_allocate_free_us": lambda s=size: pool.free(pool.allocate(s)),
        }
        if cupy_malloc is not None:  # its MemoryPointer goes back to its pool when it dies
            fns["cupy_pooled_us"] = lambda s=size: cupy_malloc(s)
        row: dict[str, Any] = {"bytes": size, "cupy_pooled_us": None, **medians_us(fns, n)}
        row["raw_over_bare"] = row["raw_us"] / row["bare_us"]
        rows.append(row)
    pool.free_all()
    if cupy_pool is not None:  # CuPy keeps its cached blocks until told (a sanitizer's leak)
        cupy_pool.free_all_blocks()
    return rows


def _cupy_pool(backend: Backend, device: int) -> Any:
    """A fresh CuPy memory pool on ``device``, if CuPy drives this backend, else None."""
    if backend.name not in ("cuda", "hip"):
        return None
    try:
        import cupy
    except Exception:  # not installed, or built for another GPU stack
        return None
    if (backend.name == "hip") != bool(cupy.cuda.runtime.is_hip):
        return None
    cupy.cuda.Device(device).use()
    return cupy.cuda.MemoryPool()


@dataclass(frozen=True)
class Timing:
    """Medians of one timed region: device time (ms) and the host's time to enqueue it (µs)."""

    ms: float
    host_us: float


def time_ms(backend: Backend, device: int, fn: Callable[[], Any], iters: int, warmup: int = 5
            ) -> Timing:
    """Median device time of ``fn`` between two events, and its median host enqueue time.

    Each run is queued behind ``rf_hold_ns``, which keeps the device busy for twice the host
    enqueue time, so the device reaches the first event only once the whole region is queued:
    the events time device work, not the host's launch overhead (reported as ``host_us``)."""
    clock = time.perf_counter_ns
    enqueue = []
    for _ in range(max(warmup, 1)):  # one at least: the hold is sized from these
        begin = clock()
        fn()
        enqueue.append(clock() - begin)
        backend.synchronize(device)
    hold = load_kernels("basic", device, backend).function("rf_hold_ns")
    start, end = Event(device, backend), Event(device, backend)
    samples, enqueue = [], enqueue[len(enqueue) // 2:]
    for _ in range(iters):
        hold.launch(1, 32, np.uint64(2 * statistics.median(enqueue) + 20_000))
        start.record()
        begin = clock()
        fn()
        enqueue.append(clock() - begin)
        end.record()
        end.synchronize()
        samples.append(end.elapsed_ms_since(start))
    start.close()
    end.close()
    return Timing(statistics.median(samples), statistics.median(enqueue) / 1e3)


def fill_random(buf: HipBuffer, rng: np.random.Generator, dtype: Any) -> None:
    """Fill ``buf`` with random values of ``dtype``: one random chunk (up to 64 MiB) uploaded,
    then repeated by device copies (a chunk is larger than any L2, so repeats are not cached)."""
    itemsize = np.dtype(dtype).itemsize
    chunk = min(buf.nbytes, 64 * MiB) // itemsize
    data = rng.standard_normal(chunk, np.float32).astype(dtype)
    buf.copy_from_host(data)
    done = data.nbytes
    while done < buf.nbytes:
        step = min(done, buf.nbytes - done)
        buf.copy_from(buf, step, dst_offset=done, src_offset=0)
        done += step


def copy_bandwidth(backend: Backend, device: int, nbytes: int = GiB, iters: int = 50
                   ) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    rng = np.random.default_rng(0)
    with HipBuffer(nbytes, device, backend) as src, HipBuffer(nbytes, device, backend) as dst:
        fill_random(src, rng, np.float32)
        ms = time_ms(backend, device, lambda: dst.copy_from(src), iters).ms
    return 2 * nbytes / (ms * 1e-3) / 1e9


def read_bandwidth(backend: Backend, device: int, nbytes: int = GiB, iters: int = 50) -> float:
    """Device read-only bandwidth in GB/s: ``rf_read_bytes`` over ``nbytes`` of random data
    (attention only reads its cache, so this is its other natural ceiling)."""
    kernel = load_kernels("basic", device, backend).function("rf_read_bytes")
    blocks = 8 * backend.cached_properties(device).multiprocessors
    rng = np.random.default_rng(1)
    with HipBuffer(nbytes, device, backend) as src, HipBuffer(4, device, backend) as sink:
        fill_random(src, rng, np.float32)
        args = (src, nbytes // 16, blocks * 256, np.uint32(0x9E3779B9), sink)
        ms = time_ms(backend, device, lambda: kernel.launch(blocks, 256, *args), iters).ms
    return nbytes / (ms * 1e-3) / 1e9
