"""``bench --cache``: the host cost of one decode step's bookkeeping (``append`` + ``batch``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

#: Target of ``bench_cache``: host microseconds of one step's ``append`` + ``batch`` at
#: B = 256 (issue 29: the device must not wait for the host's bookkeeping).
CACHE_TARGET_US = 20.0


def bench_cache(num_seqs: int = 256, context: int = 2048, block_size: int = 16,
                steps: int = 300, backend: Any = "host", runs: int = 5) -> dict[str, Any]:
    """CPU cost of one decode step of the cache: ``append`` one token to each of
    ``num_seqs`` sequences of about ``context`` tokens, then ``batch`` (the step's metadata,
    built in the compiled core), in microseconds. ``runs`` runs of ``steps`` steps each;
    ``median_us`` is the least run median (as ``timeit`` advises: slower runs measure other
    work on the CPU: on a shared 2-core machine they take up to twice as long), with each
    part's median in that run; ``median_all_us`` and ``p90_us`` are over every step."""
    from ..cache import CacheConfig, KvCache

    rng = np.random.default_rng(7)
    total = steps * max(runs, 1)  # tokens each sequence grows by: about ``context`` midway
    lens = rng.integers(context - context // 16, context + context // 16, num_seqs) - min(
        total // 2, context // 2)
    blocks = int((-(-(lens + total) // block_size)).sum()) + 2
    config = CacheConfig(1, 1, 64, block_size, blocks, "float16")
    clock = time.perf_counter_ns
    results = []
    with KvCache(config, backend=backend, strict=True) as cache:
        for seq_id, n in enumerate(lens):
            cache.add_sequence(seq_id, int(n))
        ids = list(range(num_seqs))
        for _ in range(max(runs, 1)):
            appends, batches = [], []
            for _ in range(steps):
                start = clock()
                cache.append(ids)
                middle = clock()
                cache.batch(ids)
                appends.append((middle - start) / 1e3)
                batches.append((clock() - middle) / 1e3)
            sums = [a + b for a, b in zip(appends, batches)]
            results.append((statistics.median(sums), statistics.median(appends),
                            statistics.median(batches), sums))
        cache.check_invariants()
    best = min(results, key=lambda run: run[0])
    samples = sorted(s for run in results for s in run[3])
    return {"num_seqs": num_seqs, "context": context, "block_size": block_size,
            "steps": steps, "runs": len(results), "median_us": best[0],
            "run_medians_us": [run[0] for run in results],
            "median_all_us": statistics.median(samples),
            "p90_us": samples[int(0.9 * len(samples))],
            "append_us": best[1], "batch_us": best[2], "target_us": CACHE_TARGET_US,
            "met_target": best[0] <= CACHE_TARGET_US}
