"""Time the host work of the mixed step's ``batch(query_lens=)`` planning, function by
function, with ``time.perf_counter_ns`` (no GPU needed): ``bench --prefill``'s mixed step,
P5 = 56 decodes at 2048 tokens and 8 chunks of 256 at 1024, 32/8 heads of 128, block 16.

The host backend plans no kernels, so the GPU path's planning functions are called here
directly with the arrays ``batch`` hands them (a host cache's own ``gather``): ``query_slots``
(``StepLaunches.batch``), ``leading_decodes``, ``prefill_wm``, ``plan_prefill`` and
``plan_work`` (``multi.plan_multi``), and ``prefill_launches`` over a stub module (the real
``Kernel.prepare`` and ``Launch``; nothing is launched), fresh and reused from a staging
slot's launches as ``plan_multi`` does. ``host_share`` is all of them in
``plan_multi``'s order: the part of ``batch`` they cost, without its uploads and the decode
launch. With a GPU, ``--batch`` also times the cache's whole ``batch`` on it.

Usage: PYTHONPATH=. python3 tools/profile_plan.py [--slots N] [--reps N] [--batch] (from
the checkout's root: without PYTHONPATH a script imports the installed package; the first
line says which it timed)
(slots: the multi-token instance's resident CTAs, ``PrefillKernel.slots``; default an H200's
132 multiprocessors x 2).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np

import rocmforge_raw
from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.cache.step.multi import prefill_launches, query_slots
from rocmforge_raw.kernels.module import Kernel
from rocmforge_raw.kernels.planning import plan_work
from rocmforge_raw.kernels.planning.prefill import (
    WARPS,
    PrefillKernel,
    leading_decodes,
    plan_prefill,
    prefill_shape,
    prefill_wm,
)
from rocmforge_raw.runtime import get_backend

BF16 = np.dtype(ml_dtypes.bfloat16)
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
Q_LENS = np.array([1] * 56 + [256] * 8, np.int32)
KV_LENS = np.array([2048] * 56 + [1024] * 8)
#: The decode instance's split inputs (``AttentionKernel``: groups, slots, sms, rule) as an
#: H200 has them for bf16 32/8 heads of 128; what ``plan_work`` costs hardly depends on them.
DECODE = SimpleNamespace(groups=1, slots=264, sms=132, rule=(2.0, 0.9, 132, 2048))


def median_us(fn: Callable[[], Any], reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn``, in microseconds (after 20 warm-ups)."""
    for _ in range(20):
        fn()
    times = np.empty(reps, np.int64)
    for i in range(reps):
        start = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - start
    return float(np.median(times)) / 1e3


def step_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tables, lens, query_lens, ref_cnt) as ``batch`` gathers them for P5 (host cache)."""
    blocks = int((-(-KV_LENS // BLOCK)).sum()) + 2
    config = CacheConfig(1, KV_HEADS, HEAD_DIM, BLOCK, blocks, BF16, num_q_heads=Q_HEADS)
    with KvCache(config, backend=get_backend("host"), strict=True) as cache:
        ids = list(range(len(KV_LENS)))
        for seq_id, n in zip(ids, KV_LENS):
            cache.add_sequence(seq_id, int(n))
        meta = cache.batch(ids, query_lens=Q_LENS)
        return (np.array(meta.block_tables), np.array(meta.seq_lens), np.array(meta.query_lens),
                cache.pool.ref_cnt.copy())


def stub_kernels(slots: int, wm: int) -> PrefillKernel:
    """A ``PrefillKernel`` whose kernels prepare real ``Launch``es on the host backend."""
    backend = get_backend("host")
    module = SimpleNamespace(backend=backend, device=0, _check_open=lambda: None,
                             stream_of=lambda stream: None)
    kernels = []
    for name in ("prefill", "combine"):
        kernel = Kernel.__new__(Kernel)
        kernel.module, kernel.name, kernel.handle = module, name, 1  # type: ignore[assignment]
        kernels.append(kernel)
    shape = prefill_shape("cuda", BF16, BF16, HEAD_DIM, wm)
    return PrefillKernel(kernels[0], kernels[1], wm, shape, slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=264)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--batch", action="store_true", help="time batch() on the GPU too")
    args = parser.parse_args()
    tables, lens, q_lens, ref_cnt = step_arrays()
    ratio, width = Q_HEADS // KV_HEADS, tables.shape[1]
    decodes = leading_decodes(q_lens)
    rest_q, rest_lens = q_lens[decodes:], lens[decodes:]
    wm = prefill_wm("cuda", BF16, HEAD_DIM, int(rest_q.max()) * ratio)
    found = stub_kernels(args.slots, wm)
    bm, bn = found.shape.bm, found.shape.bn
    work = plan_prefill(rest_q, rest_lens, KV_HEADS, ratio, bm, bn, args.slots)

    reused: dict = {}  # a staging slot's launches (plan_multi passes staging.launches)

    def launches(cache: dict | None = None) -> None:
        prefill_launches(found, work, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24, 1 << 25,
                         0.088, Q_HEADS, KV_HEADS, width, BLOCK, None, cache)

    def host_share() -> None:
        d = leading_decodes(q_lens)
        pf_q, pf_lens = q_lens[d:], lens[d:]
        prefill_wm("cuda", BF16, HEAD_DIM, int(np.max(pf_q)) * ratio)
        planned = plan_prefill(pf_q, pf_lens, KV_HEADS, ratio, bm, bn, args.slots)
        plan_work(KV_HEADS * DECODE.groups, DECODE.slots, d, lens[:d], sms=DECODE.sms,
                  rule=DECODE.rule)
        prefill_launches(found, planned, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24,
                         1 << 25, 0.088, Q_HEADS, KV_HEADS, width, BLOCK, None, reused)

    timed = {
        "query_slots": lambda: query_slots(tables, lens, q_lens, ref_cnt, BLOCK),
        "leading_decodes": lambda: leading_decodes(q_lens),
        "plan_prefill": lambda: plan_prefill(rest_q, rest_lens, KV_HEADS, ratio, bm, bn,
                                             args.slots),
        "plan_work (decodes)": lambda: plan_work(
            KV_HEADS * DECODE.groups, DECODE.slots, decodes, lens[:decodes], sms=DECODE.sms,
            rule=DECODE.rule),
        "prefill_launches": launches,
        "prefill_launches (reused)": lambda: launches(reused),
        "host_share": host_share,
    }
    print(rocmforge_raw.__file__)
    print(f"P5: {decodes} decodes + {len(rest_q)} chunks; {len(work.items)} items "
          f"({work.num_pieces} pieces, {len(work.combines)} combines), bm {bm}, bn {bn}, "
          f"slots {args.slots}, {WARPS} warps")
    for name, fn in timed.items():
        print(f"{name:26s} {median_us(fn, args.reps):8.1f} us")
    if args.batch:
        gpu_batch(args.reps // 10)


def gpu_batch(reps: int) -> None:
    """The median of the cache's whole ``batch(ids, query_lens=)`` for P5 on the GPU."""
    backend = get_backend()
    blocks = int((-(-KV_LENS // BLOCK)).sum()) + 2
    config = CacheConfig(32, KV_HEADS, HEAD_DIM, BLOCK, blocks, BF16, num_q_heads=Q_HEADS)
    with KvCache(config, backend=backend, strict=True) as cache:
        ids = list(range(len(KV_LENS)))
        for seq_id, n in zip(ids, KV_LENS):
            cache.add_sequence(seq_id, int(n))
        us = median_us(lambda: cache.batch(ids, query_lens=Q_LENS), reps)
        backend.synchronize(0)
    print(f"{'batch (' + backend.name + ')':26s} {us:8.1f} us")


if __name__ == "__main__":
    main()
