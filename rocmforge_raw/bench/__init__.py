"""The benchmarks behind ``rocmforge-raw bench``: timing and bandwidths (``timing``), decode
attention (``attention``), a step's bookkeeping on the host (``cache``), a whole decode step
through the cache (``step``), swaps to the host tier (``offload``) and sequences moved between
processes (``transfer``).

An application: imports any layer of the library; nothing in the library imports it. The
names below are the ones device scripts and tools import from ``rocmforge_raw.bench``.
"""

from .attention import (
    FP8_SHAPES,
    SHAPES,
    WINDOW_SHAPES,
    AttentionInputs,
    AttentionLaunch,
    Shape,
    attended,
    attention_bytes,
    attention_inputs,
    bench_attention,
    row_inputs,
    shape_rng,
    sweep_shapes,
)
from .cache import CACHE_TARGET_US, bench_cache
from .timing import (
    Timing,
    bench_alloc,
    copy_bandwidth,
    fill_random,
    medians_us,
    read_bandwidth,
    time_ms,
)

__all__ = ["CACHE_TARGET_US", "FP8_SHAPES", "SHAPES", "WINDOW_SHAPES", "AttentionInputs",
           "AttentionLaunch", "Shape", "Timing", "attended", "attention_bytes",
           "attention_inputs", "bench_alloc", "bench_attention", "bench_cache", "copy_bandwidth",
           "fill_random", "medians_us", "read_bandwidth", "row_inputs", "shape_rng",
           "sweep_shapes", "time_ms"]
