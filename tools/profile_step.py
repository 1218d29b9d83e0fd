"""Profile the host side of a step with cProfile: where do ``append`` and ``batch`` spend
their time? Usage: python3 tools/profile_step.py [batch ctx] (a decode step, ``bench
--step``'s loop), or python3 tools/profile_step.py mixed (``bench --prefill``'s mixed step:
56 decodes at 2048 tokens and 8 chunks of 256 at 1024, ``batch(ids, query_lens=)``)."""

from __future__ import annotations

import cProfile
import pstats
import sys

import ml_dtypes
import numpy as np

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.runtime import get_backend


def main(batch: int = 64, context: int = 2048, steps: int = 200) -> None:
    backend = get_backend()
    bs, layers = 16, 2
    blocks = batch * -(-(context + steps + 6) // bs) + 1
    config = CacheConfig(layers, 8, 128, bs, blocks, ml_dtypes.bfloat16, num_q_heads=32)
    with KvCache(config, backend=backend, strict=True) as cache:
        ids = list(range(batch))
        for seq_id in ids:
            cache.add_sequence(seq_id, context)
        for _ in range(5):
            cache.append(ids)
            cache.batch(ids)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            cache.append(ids)
            cache.batch(ids)
        profile.disable()
        backend.synchronize(0)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def mixed(steps: int = 200) -> None:
    """The mixed step's ``batch`` alone (its lengths fixed, as the bench plans it)."""
    backend = get_backend()
    q_lens = np.array([1] * 56 + [256] * 8, np.int32)
    kv_lens = np.array([2048] * 56 + [1024] * 8)
    blocks = int((-(-kv_lens // 16)).sum()) + 2
    config = CacheConfig(32, 8, 128, 16, blocks, ml_dtypes.bfloat16, num_q_heads=32)
    with KvCache(config, backend=backend, strict=True) as cache:
        ids = list(range(len(kv_lens)))
        for seq_id, n in zip(ids, kv_lens):
            cache.add_sequence(seq_id, int(n))
        for _ in range(5):
            cache.batch(ids, query_lens=q_lens)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            cache.batch(ids, query_lens=q_lens)
        profile.disable()
        backend.synchronize(0)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    if sys.argv[1:2] == ["mixed"]:
        mixed()
    else:
        main(*map(int, sys.argv[1:]))
