"""Profile the host side of a decode step (``bench --step``'s loop) with cProfile: where do
``append`` and ``batch`` spend their time? Usage: python3 tools/profile_step.py [batch ctx]"""

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
    stats = pstats.Stats(profile).sort_stats("tottime")
    stats.print_stats(25)
    np.random.default_rng(0)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
