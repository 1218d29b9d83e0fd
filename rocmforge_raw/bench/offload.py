"""``bench --offload``: a sequence's KV swapped between the slab and the host tier, against
the pinned host<->device copy bandwidth measured in the same run.

The cache is a 32-layer bf16 model's (8 kv heads of 128, block 16: 2 MiB a block) on a GPU,
an 8-layer one on the host, with a host tier as large as the sequence: 4096 tokens on a GPU
(512 MiB), 2048 on the host. Two rows: the sequence's device blocks consecutive (one 2-D
copy for the whole sequence) and scattered (every other block: one 2-D copy a block). Each
iteration swaps the sequence out (``swap_out``) and back in (``swap_in``) on the cache's
stream, each timed on the host clock from the call to the end of a wait for the stream:
bookkeeping, queuing and the copies themselves. Against them, in the same run: one copy of
the same number of bytes between the slab and the host tier's pinned memory in each
direction (``download``/``upload``, waited for), which is what the copy engine gives these
bytes. GB/s count bytes moved; medians, the first iteration left out. The target is 85 % of
the pinned copy bandwidth each way. After the last swap-in the sequence's bytes are checked
against what was swapped out (not timed). On the host backend every copy is a memcpy between
two host buffers: the rows measure memcpy and the bookkeeping, not a device's copy engine.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ..cache import CacheConfig, KvCache
from ..memory.stream import Stream
from ..runtime import Backend
from .timing import fill_random

#: Swap bandwidth over the pinned copy bandwidth the issue asks for, each way (percent).
TARGET_PCT = 85.0


def offload_config(backend: Backend) -> CacheConfig:
    """Room for the sequence twice over (scattered or not) and a host tier of its size."""
    layers, tokens = (8, 2048) if backend.name == "host" else (32, 4096)
    blocks = tokens // 16
    return CacheConfig(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16,
                       num_blocks=2 * blocks + 2, dtype="bfloat16", host_blocks=blocks)


def bench_offload(backend: Backend, device: int, iters: int = 10) -> list[dict[str, Any]]:
    """One row per block layout (see the module docstring)."""
    return [_row(backend, device, scattered, iters) for scattered in (False, True)]


def _row(backend: Backend, device: int, scattered: bool, iters: int) -> dict[str, Any]:
    config = offload_config(backend)
    tokens = config.host_blocks * config.block_size
    with Stream(device, backend) as stream, KvCache(config, device, backend, strict=True,
                                                    stream=stream) as cache:
        fill_random(cache.slab.buffer, np.random.default_rng(0), config.dtype)
        if scattered:  # one-block fillers, every other one removed: the free blocks alternate
            for i in range(config.num_blocks - 1):
                cache.add_sequence(i, num_tokens=config.block_size)
            for i in range(0, config.num_blocks - 1, 2):
                cache.remove(i)
        cache.add_sequence("seq", num_tokens=tokens)
        table = cache.block_ids("seq")
        before = cache.slab.to_numpy()[:, :, table].copy()
        outs, ins, host_us = [], [], []
        for _ in range(iters + 1):
            start = time.perf_counter()
            cache.swap_out(["seq"])
            queued = time.perf_counter()
            stream.synchronize()
            outs.append(time.perf_counter() - start)
            host_us.append(1e6 * (queued - start))
            start = time.perf_counter()
            cache.swap_in(["seq"])
            stream.synchronize()
            ins.append(time.perf_counter() - start)
        after = cache.slab.to_numpy()[:, :, cache.block_ids("seq")]
        verified = bool(np.array_equal(before.view(np.uint16), after.view(np.uint16)))
        nbytes = len(table) * config.block_bytes
        down, up = _pinned_copies(cache, stream, nbytes, iters)
        copies = 1 + int(np.count_nonzero(np.diff(np.sort(table)) != 1))
    out_gbs, in_gbs = (nbytes / statistics.median(t[1:]) / 1e9 for t in (outs, ins))
    down_gbs, up_gbs = nbytes / down / 1e9, nbytes / up / 1e9
    return {"layout": "scattered" if scattered else "consecutive", "bytes": nbytes,
            "blocks": len(table), "copies": copies,
            "swap_out_gb_per_s": out_gbs, "swap_in_gb_per_s": in_gbs,
            "d2h_gb_per_s": down_gbs, "h2d_gb_per_s": up_gbs,
            "swap_out_pct": 100 * out_gbs / down_gbs, "swap_in_pct": 100 * in_gbs / up_gbs,
            "target_pct": TARGET_PCT, "swap_out_host_us": statistics.median(host_us[1:]),
            "met_target": min(out_gbs / down_gbs, in_gbs / up_gbs) * 100 >= TARGET_PCT,
            "verified": verified, "memcpy_only": backend.name == "host"}


def _pinned_copies(cache: KvCache, stream: Stream, nbytes: int, iters: int
                   ) -> tuple[float, float]:
    """Median seconds of one device-to-host and one host-to-device copy of ``nbytes``
    between the slab and the host tier's pinned memory, each waited for."""
    backend, slab, pinned = cache.slab.backend, cache.slab.ptr, cache._tier.memory.ptr
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(iters + 1):
        for down in (True, False):
            start = time.perf_counter()
            if down:
                backend.download(pinned, slab, nbytes, stream.handle)
            else:
                backend.upload(slab, pinned, nbytes, stream.handle)
            stream.synchronize()
            times[down].append(time.perf_counter() - start)
    return statistics.median(times[True][1:]), statistics.median(times[False][1:])
