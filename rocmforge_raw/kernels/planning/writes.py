"""The K/V write's kernel and arguments (a copy of rows at slots, or their quantization into
an fp8 cache)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ...runtime import Backend
from ..module import Kernel, load_kernels
from .arguments import DTYPES, FP8_DTYPES

WRITE_THREADS = 256  # RF_CO_THREADS
WRITE_PATCH = (0, 1, 2, 3)  # k_cache, v_cache, key, value
WRITE_SLOTS_ARG = 4  # slot_mapping


def write_kernel(backend: Backend, device: int, dtype: np.dtype | None = None,
                 cache_dtype: np.dtype | None = None) -> Kernel:
    """The K/V write: a copy of ``dtype`` rows, or their quantization into an fp8 cache."""
    module = load_kernels("cache_ops", device, backend)
    if cache_dtype in FP8_DTYPES:
        return module.function(f"rf_reshape_and_cache_e4m3_{DTYPES[dtype]}")
    return module.function("rf_reshape_and_cache")


#: Indices of an fp8 write's inverse scales in ``write_arguments``.
WRITE_SCALE_ARGS = (8, 9)


def write_arguments(k_cache: Any, v_cache: Any, key: Any, value: Any, slot_mapping: Any,
                    num_kv_heads: int, block_size: int, row_bytes: int,
                    cache_dtype: np.dtype | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> tuple:
    """The write kernel's arguments in order (``row_bytes``: one head's row of the
    activations); an fp8 cache's kernel also takes the inverse scales and the format."""
    i32, f32 = np.int32, np.float32
    args = (k_cache, v_cache, key, value, slot_mapping, i32(num_kv_heads), i32(block_size),
            i32(row_bytes // 16))
    if cache_dtype not in FP8_DTYPES:
        return args
    fnuz = cache_dtype == np.dtype(ml_dtypes.float8_e4m3fnuz)
    return (*args, f32(1.0 / k_scale), f32(1.0 / v_scale), i32(fnuz))
