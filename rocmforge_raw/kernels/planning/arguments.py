"""The kernels' shapes and dtypes, and the checks of a launch's arrays and metadata.

Every check runs on the host before anything changes and names the first bad argument.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ...common import checks
from ...memory.array import DeviceArray
from ...memory.stream import stream_handle
from ..staging import Workspace
from .work import MAX_TOKENS

DTYPES = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16",
          np.dtype(np.float32): "f32"}
#: fp8 cache formats -> the activation dtypes (queries, outputs, K/V written) they serve.
FP8_DTYPES = {np.dtype(t): (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
              for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz)}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
#: Rows ([num_blocks * num_kv_heads * block_size]) of a K or V cache the attention kernel
#: indexes (int32).
MAX_CACHE_ROWS = (1 << 31) - 1
GROUP_SIZES = (1, 2, 4, 8)  # query heads one CTA serves (template G)


def expect(array: Any, name: str, ndim: int, dtype: Any | None = None) -> None:
    if not isinstance(array, DeviceArray):
        raise TypeError(f"{name} must be a DeviceArray, got {checks.show(array)}")
    if len(array.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {array.dtype}")


def host_ints(values: Any, name: str, dtype: Any, shape: tuple[int, ...] | None = None
              ) -> np.ndarray:
    """Integer metadata given on the host, as a C-contiguous array of exactly ``dtype``."""
    array = np.asarray(values)
    if array.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {array.dtype}")
    if shape is not None and array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    return np.ascontiguousarray(array)


def device_ints(values: DeviceArray, name: str, dtype: Any, ndim: int,
                shape: tuple[int, ...] | None, like: DeviceArray, like_name: str) -> None:
    """Device-resident metadata: shape, dtype and place (on ``like``'s backend and device,
    which the kernel runs on); its contents are never read back to check."""
    expect(values, name, ndim, dtype)
    if shape is not None and values.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {values.shape}")
    checks.colocated(name, values.backend, values.device, like_name, like.backend,
                     like.device)


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, or ``1/sqrt(head_dim)``; it must fit float32 (the kernels' type)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return checks.float32(scale, "scale")


def check_options(like: Any, stream: Any, check: Any, num_partitions: Any = None,
                  workspace: Any = None) -> None:
    """The keyword arguments of an op on ``like``'s device: an open ``Stream`` of that
    device or None, a bool ``check``, a split-K factor >= 1 or None, a ``Workspace`` (of
    that device, once bound to one) or None."""
    if isinstance(like, DeviceArray):
        stream_handle(stream, "stream", like.backend, like.device)
    else:
        stream_handle(stream)
    checks.flag(check, "check")
    if num_partitions is not None:
        checks.integer(num_partitions, "num_partitions", 1)
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace or None, got {checks.show(workspace)}")
    if workspace is not None and isinstance(like, DeviceArray):
        workspace.check_device(like, "the op's arrays")


def check_attention_arrays(out: Any, query: Any, k_cache: Any, v_cache: Any
                           ) -> tuple[int, int, int, int, int, int]:
    """(num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size) of a valid
    attention call; raises naming the first bad argument."""
    expect(query, "query", 3)
    num_seqs, num_q_heads, head_dim = query.shape
    expect(out, "out", 3, query.dtype)
    expect(k_cache, "k_cache", 4)
    check_cache_dtype("k_cache", k_cache.dtype, query.dtype, "query")
    expect(v_cache, "v_cache", 4, k_cache.dtype)
    num_blocks, num_kv_heads, block_size, cache_dim = k_cache.shape
    if query.dtype not in DTYPES:
        raise ValueError(f"dtype {query.dtype} is not supported: use one of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported: use one of {HEAD_DIMS}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} is not supported: use one of {BLOCK_SIZES}")
    if out.shape != query.shape:
        raise ValueError(f"out shape {out.shape} differs from query shape {query.shape}")
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be "
                         f"[num_blocks, num_kv_heads, block_size, {head_dim}]")
    if num_blocks * num_kv_heads * block_size > MAX_CACHE_ROWS:
        raise ValueError(f"k_cache {k_cache.shape} has {num_blocks * num_kv_heads * block_size} "
                         f"rows of head_dim; the kernel indexes at most {MAX_CACHE_ROWS}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    for name, array in (("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.colocated(name, array.backend, array.device, "query", query.backend,
                         query.device)
    return num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size


#: The logit caps the kernels take: normal float32 values (a GPU that flushes subnormals
#: would read a smaller one as 0, no cap) whose product with log2(e), the scores' unit in
#: the kernels, stays finite.
MIN_SOFTCAP = float(np.finfo(np.float32).tiny)
MAX_SOFTCAP = float(np.float32(np.finfo(np.float32).max / np.float32(math.log2(math.e)) * 0.99))


def check_softcap(value: Any, name: str) -> float:
    """A logit cap (``name``) as a float in ``MIN_SOFTCAP .. MAX_SOFTCAP``."""
    cap = checks.real(value, name)
    if not MIN_SOFTCAP <= cap <= MAX_SOFTCAP:
        raise ValueError(f"{name} must lie in [{MIN_SOFTCAP:.8g}, {MAX_SOFTCAP:.8g}] (> 0: a "
                         f"normal float32, and times log2(e) too), got {checks.show(value)}")
    return cap


def check_window(value: Any, name: str) -> int:
    """A sliding window (``name``): an int of tokens in ``1 .. MAX_TOKENS``."""
    return checks.integer(value, name, 1, MAX_TOKENS)


def check_variants(query: DeviceArray, logit_softcap: Any, sinks: Any, window: Any = None
                   ) -> tuple[float, DeviceArray | None, int]:
    """A call's attention variants, checked against ``query``: ``logit_softcap`` (None, or
    in ``MIN_SOFTCAP .. MAX_SOFTCAP``: scores become ``cap * tanh(s / cap)``, Gemma 2) as the
    kernels' float (0.0: none), ``sinks`` (None, or a float32 DeviceArray ``[num_q_heads]``
    beside ``query``: one finite logit a query head in its softmax's denominator only,
    gpt-oss; its values stay on the device, unread: a +inf or NaN there gives what the
    backend's arithmetic gives) and ``window`` (None, or tokens >= 1: each query sees its
    last ``window`` positions, itself included, Mistral) as the kernels' int (0: all)."""
    if window is not None:
        window = check_window(window, "window")
    cap = 0.0 if logit_softcap is None else check_softcap(logit_softcap, "logit_softcap")
    if sinks is not None:
        expect(sinks, "sinks", 1, np.float32)
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must have shape ({query.shape[1]},) (one logit a query "
                             f"head), got {sinks.shape}")
        checks.colocated("sinks", sinks.backend, sinks.device, "query", query.backend,
                         query.device)
    return cap, sinks, window or 0


def check_disjoint(written: DeviceArray, name: str, **read: DeviceArray) -> None:
    """``written`` (named ``name``) shares no byte with any of ``read`` (by name): a kernel
    would overwrite what it, or another of its CTAs, still reads."""
    start, end = written.ptr, written.ptr + written.nbytes
    for other_name, other in read.items():
        if other.ptr < end and start < other.ptr + other.nbytes and other.backend is \
                written.backend and other.device == written.device:
            raise ValueError(f"{name} overlaps {other_name} (bytes {start:#x}..{end:#x} and "
                             f"{other.ptr:#x}..{other.ptr + other.nbytes:#x}): the kernel "
                             f"would overwrite what it reads; give {name} memory of its own")


def check_cache_dtype(cache_name: str, cache: np.dtype, act: np.dtype, act_name: str
                      ) -> None:
    """A cache of ``cache`` serves activations of ``act``: the same dtype, or an fp8 cache
    with float16/bfloat16 activations."""
    if act in FP8_DTYPES.get(cache, ()) or (cache == act and cache not in FP8_DTYPES):
        return
    if cache in FP8_DTYPES:
        raise ValueError(f"{act_name} must be float16 or bfloat16 with a {cache} {cache_name}, "
                         f"got {act}")
    raise ValueError(f"{cache_name} must be {act}, got {cache}")


def fp8_scale_range(cache: np.dtype) -> tuple[float, float]:
    """The K or V scales an fp8 cache of ``cache`` takes: positive float32 numbers whose
    inverse (the write's factor) and the largest value the cache then holds (the format's
    largest code times the scale) fit float32 too."""
    return checks.FLOAT32_TINY, checks.FLOAT32_MAX / float(ml_dtypes.finfo(cache).max)


def check_kv_scales(cache: np.dtype, k_scale: Any, v_scale: Any, where: str = ""
                    ) -> tuple[float, float]:
    """The K and V scales of a call on a cache of ``cache`` (``where`` prefixes their names
    in messages): within ``fp8_scale_range``, and exactly 1.0 unless the cache is fp8 (a
    scale elsewhere would be silently ignored)."""
    scales = []
    for name, x in ((f"{where}k_scale", k_scale), (f"{where}v_scale", v_scale)):
        if cache not in FP8_DTYPES:
            if checks.real(x, name) != 1.0:
                raise ValueError(f"{name} {x} applies to fp8 caches only, not {cache}")
            scales.append(1.0)
            continue
        low, high = fp8_scale_range(cache)
        number = checks.real(x, name)
        if not low <= number <= high:
            raise ValueError(f"{name} must lie in [{low:.8g}, {high:.8g}] for a {cache} cache "
                             f"(positive, and it, its inverse and {cache} values times it fit "
                             f"float32), got {checks.show(x)}")
        scales.append(number)
    return scales[0], scales[1]


def check_tables(tables: np.ndarray, lens: np.ndarray, num_seqs: int, num_blocks: int,
                 block_size: int) -> None:
    """Block tables and lengths agree and every block a length reaches is in range."""
    if tables.ndim != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got "
                         f"{tables.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got {int(lens.min())}")
    if lens.size and lens.max() > MAX_TOKENS:
        s = int(lens.argmax())
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} tokens exceeds the kernel's "
                         f"{MAX_TOKENS} a sequence (its int32 positions)")
    capacity = tables.shape[1] * block_size
    if lens.size and lens.max() > capacity:
        s = int(lens.argmax())
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} tokens exceeds the block table's "
                         f"{tables.shape[1]} blocks x {block_size} = {capacity} tokens")
    used = np.arange(tables.shape[1])[None, :] * block_size < lens[:, None]
    ids = tables[used]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise ValueError(f"block id {bad} in block_tables is outside [0, {num_blocks})")


def check_slots(slots: np.ndarray, num_blocks: int, block_size: int) -> None:
    """Every slot is -1 or inside the cache, and no slot is written twice."""
    capacity = num_blocks * block_size
    bad = (slots < -1) | (slots >= capacity)
    if bad.any():
        raise ValueError(f"slot {int(slots[bad][0])} is outside [-1, {capacity}) for "
                         f"{num_blocks} blocks of {block_size}")
    live = np.sort(slots[slots >= 0])
    twice = live[1:][live[1:] == live[:-1]]
    if twice.size:
        raise ValueError(f"slot_mapping writes slot {int(twice[0])} twice")


def check_write_arrays(key: Any, value: Any, k_cache: Any, v_cache: Any
                       ) -> tuple[int, int, int]:
    """(num_tokens, num_blocks, block_size) of a valid K/V write."""
    expect(key, "key", 3)
    expect(value, "value", 3, key.dtype)
    expect(k_cache, "k_cache", 4)
    check_cache_dtype("k_cache", k_cache.dtype, key.dtype, "key")
    expect(v_cache, "v_cache", 4, k_cache.dtype)
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, cache_heads, block_size, cache_dim = k_cache.shape
    if value.shape != key.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {key.shape}/value {value.shape} and k_cache {k_cache.shape}/"
                         f"v_cache {v_cache.shape} must match in pairs")
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"key rows [{num_kv_heads}, {head_dim}] do not fit cache rows "
                         f"[{cache_heads}, {cache_dim}]")
    if (head_dim * k_cache.dtype.itemsize) % 16 or (head_dim * key.dtype.itemsize) % 16:
        raise ValueError(f"head_dim {head_dim} of {k_cache.dtype} is not a multiple of 16 "
                         "bytes")
    for name, array in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.colocated(name, array.backend, array.device, "key", key.backend, key.device)
    return num_tokens, num_blocks, block_size
