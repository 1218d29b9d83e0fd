"""Paged-attention decode, K/V writes by slot mapping, and block copies on device memory.

Each op validates shapes, dtypes and index ranges before any launch, then runs the packaged
kernel on a GPU backend or the NumPy implementation (``reference``) on the host backend.
Caches and activations are ``DeviceArray``s; integer metadata may be NumPy arrays (uploaded
for the launch) or ``DeviceArray``s (read back once for validation when ``check=True``).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from typing import Any

import ml_dtypes
import numpy as np

from . import reference
from .array import DeviceArray
from .buffer import HipBuffer
from .module import load_kernels
from .stream import Stream

DTYPES = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16",
          np.dtype(np.float32): "f32"}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
THREADS = 128  # RF_PA_THREADS
#: Partitions are a multiple of this many tokens (the kernel takes a partition at any token,
#: so the plan can split a sequence into as many nearly equal pieces as fill the device).
PARTITION_GRANULE = 16
MAX_PARTITIONS = 512  # most partitions a split uses (bounds the workspace)
GROUP_SIZES = (1, 2, 4, 8)  # query heads one CTA serves (template G)
#: The attention kernel's pipeline per backend: (RF_PA_STAGES, RF_PA_STAGE_BYTES).
ATTENTION_STAGES = {"cuda": (2, 32768), "hip": (2, 16384)}


def attention_shared_bytes(backend: str, row_bytes: int) -> int:
    """Dynamic shared memory of the attention kernel whose K/V rows are ``row_bytes`` long:
    its stages, each holding the K and V rows of a tile padded by 16 bytes per row."""
    stages, stage_bytes = ATTENTION_STAGES[backend]
    rows = stage_bytes // 2 // row_bytes
    return stages * (stage_bytes + 2 * rows * 16)


def _expect(array: Any, name: str, ndim: int, dtype: Any | None = None) -> None:
    if not isinstance(array, DeviceArray):
        raise TypeError(f"{name} must be a DeviceArray, not {type(array).__name__}")
    if len(array.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {array.dtype}")


def _host_ints(values: Any, name: str, dtype: Any, shape: tuple[int, ...] | None = None
               ) -> np.ndarray:
    """Integer metadata as a host array (read back from the device if need be)."""
    array = values.to_numpy() if isinstance(values, DeviceArray) else np.asarray(values)
    if array.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {array.dtype}")
    if shape is not None and array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    return np.ascontiguousarray(array)


def host_view(array: DeviceArray) -> np.ndarray:
    """A NumPy array over a host-backend DeviceArray's memory (no copy)."""
    if array.backend.name != "host":
        raise ValueError(f"host_view needs host memory, not {array.backend.name}")
    raw = (ctypes.c_char * array.nbytes).from_address(array.ptr) if array.nbytes else b""
    return np.frombuffer(raw, array.dtype).reshape(array.shape)


class _Uploads:
    """Device copies of host metadata for one launch; freed once the stream has passed it."""

    def __init__(self, like: DeviceArray, stream: Stream | None) -> None:
        self.like, self.stream = like, stream
        self.buffers: list[HipBuffer | Workspace] = []

    def __call__(self, values: Any, host: np.ndarray) -> DeviceArray:
        if isinstance(values, DeviceArray):
            return values
        array = DeviceArray(HipBuffer.from_numpy(host, self.like.device, self.like.backend),
                            host.dtype, host.shape)
        self.buffers.append(array.buffer.root)
        return array

    def workspace(self) -> Workspace:
        """Split-K scratch for this launch only."""
        work = Workspace()
        self.buffers.append(work)
        return work

    def __enter__(self) -> _Uploads:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.buffers:
            if self.stream is None:
                self.like.backend.synchronize(self.like.device)
            else:
                self.stream.synchronize()
            for buf in self.buffers:
                buf.close()


# --- paged attention ---------------------------------------------------------------------
def plan_partitions(num_ctas: int, max_len: int, slots: int, mean_len: float | None = None
                    ) -> tuple[int, int]:
    """(tokens per partition, number of partitions) for ``num_ctas`` CTAs before splitting on
    a device that runs ``slots`` CTAs at once.

    A launch costs whole waves, so the split is the smallest one whose last wave is (within
    2 %) as full as any split can make it. Partitions stay at least 1024 tokens when the
    device is already full without splitting (short partitions cost more than they save)
    and 256 tokens otherwise. In a ragged batch (longest > 1.5 x mean) the longest sequences
    are cut into pieces of about half the mean length so they do not set the pace.
    """
    if max_len <= 0:
        return PARTITION_GRANULE, 1
    num_ctas = max(num_ctas, 1)
    shortest = 256 if num_ctas < slots else 1024
    most = max(1, min(MAX_PARTITIONS, max_len // shortest))
    parts = _fullest_split(num_ctas, max(slots, 1), most)
    if mean_len and max_len > 1.5 * mean_len:
        parts = min(max(parts, math.ceil(2 * max_len / mean_len)), most)
    tokens = PARTITION_GRANULE * math.ceil(math.ceil(max_len / parts) / PARTITION_GRANULE)
    return tokens, math.ceil(max_len / tokens)


@functools.lru_cache(maxsize=4096)
def _fullest_split(num_ctas: int, slots: int, most: int) -> int:
    """The smallest split in [1, most] whose last wave is within 2 % of the fullest (cached:
    a decode loop asks the same few questions every step)."""

    def fullness(parts: int) -> float:
        waves = num_ctas * parts / slots
        return waves / math.ceil(waves)

    best = max(fullness(p) for p in range(1, most + 1))
    return next(p for p in range(1, most + 1) if fullness(p) >= best - 0.02)


class Workspace:
    """Split-K scratch that lives across calls: pass one to ``paged_attention`` to avoid
    allocations per launch. Holds the partial outputs and the per-group counters through
    which the last CTA of a group finds out it is last (zero between launches: each launch
    resets the counters it uses). Grows on demand, after the device finishes with the old
    buffers; ``close()`` frees them. Use one per stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partials: HipBuffer | None = None
        self._counters: HipBuffer | None = None

    def get(self, nbytes: int, counters: int, like: DeviceArray) -> tuple[HipBuffer, HipBuffer]:
        """(``nbytes`` of partials, ``counters`` zeroed int32 counters) on ``like``'s device."""
        with self._lock:
            self._partials = self._fit(self._partials, nbytes, like)
            if self._counters is None or self._counters.nbytes < 4 * counters:
                self._counters = self._fit(self._counters, 4 * counters, like)
                self._counters.fill(0)
            return self._partials, self._counters

    @staticmethod
    def _fit(buf: HipBuffer | None, nbytes: int, like: DeviceArray) -> HipBuffer:
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        if buf is not None:
            like.backend.synchronize(like.device)
            buf.close()
        return HipBuffer(nbytes, like.device, like.backend)

    def close(self) -> None:
        with self._lock:
            for buf in (self._partials, self._counters):
                if buf is not None:
                    buf.close()
            self._partials = self._counters = None


def paged_attention(out: DeviceArray, query: DeviceArray, k_cache: DeviceArray,
                    v_cache: DeviceArray, block_tables: Any, seq_lens: Any,
                    scale: float | None = None, *, num_partitions: int | None = None,
                    stream: Stream | None = None, workspace: Workspace | None = None,
                    check: bool = True) -> None:
    """``out[s, h] = softmax(scale * q[s, h] . K[s]) V[s]`` over the first ``seq_lens[s]``
    tokens of sequence ``s``'s blocks. ``num_partitions`` forces the split-K factor; split-K
    scratch comes from ``workspace``, or is allocated for this call and freed after it."""
    _expect(query, "query", 3)
    num_seqs, num_q_heads, head_dim = query.shape
    _expect(out, "out", 3, query.dtype)
    _expect(k_cache, "k_cache", 4, query.dtype)
    _expect(v_cache, "v_cache", 4, query.dtype)
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
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if not (out.backend is query.backend is k_cache.backend is v_cache.backend):
        raise ValueError("out, query, k_cache and v_cache must be on one backend")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    read = check or query.backend.name == "host"
    tables = _host_ints(block_tables, "block_tables", np.int32) if read or not isinstance(
        block_tables, DeviceArray) else None
    lens = _host_ints(seq_lens, "seq_lens", np.int32, (num_seqs,)) if read or not isinstance(
        seq_lens, DeviceArray) else None
    if check:
        _check_tables(tables, lens, num_seqs, num_blocks, block_size)
    if query.backend.name == "host":
        result = reference.paged_attention(
            host_view(query), host_view(k_cache), host_view(v_cache), tables, lens, scale)
        host_view(out)[...] = result.astype(out.dtype)
        return
    max_blocks = tables.shape[1] if tables is not None else block_tables.shape[1]
    ratio = num_q_heads // num_kv_heads
    group = next(g for g in GROUP_SIZES if g >= min(ratio, GROUP_SIZES[-1]))
    grid_x = num_kv_heads * math.ceil(ratio / group)
    max_len = int(lens.max(initial=0)) if lens is not None else max_blocks * block_size
    module = load_kernels("paged_attention", query.device, query.backend)
    name = DTYPES[query.dtype]
    kernel = module.function(f"rf_paged_attention_{name}_d{head_dim}_g{group}")
    shared = attention_shared_bytes(query.backend.name, head_dim * query.dtype.itemsize)
    if num_partitions is None:
        multiprocessors = query.backend.cached_properties(query.device).multiprocessors
        slots = kernel.max_active_blocks(THREADS, shared) * multiprocessors
        mean_len = float(lens.mean()) if lens is not None and lens.size else None
        tokens, parts = plan_partitions(grid_x * num_seqs, max_len, slots, mean_len)
    else:
        parts = max(1, min(int(num_partitions), MAX_PARTITIONS))
        tokens = PARTITION_GRANULE * math.ceil(max(max_len, 1) / (parts * PARTITION_GRANULE))
    with _Uploads(query, stream) as upload:
        d_tables = upload(block_tables, tables)
        d_lens = upload(seq_lens, lens)
        part_out = part_ml = counters = 0
        if parts > 1:
            heads = num_seqs * num_q_heads * parts
            partials, counts = (workspace or upload.workspace()).get(
                heads * (head_dim + 2) * 4, grid_x * num_seqs, query)
            part_out, part_ml = partials.ptr, partials.ptr + heads * head_dim * 4
            counters = counts.ptr
        i32 = np.int32
        kernel.launch(
            (grid_x, num_seqs, parts), THREADS, out, part_out, part_ml, counters, query,
            k_cache, v_cache, d_tables, d_lens, np.float32(scale), i32(num_q_heads),
            i32(num_kv_heads), i32(max_blocks), i32(block_size.bit_length() - 1), i32(tokens),
            i32(parts), shared_bytes=shared, stream=stream)


def _check_tables(tables: np.ndarray, lens: np.ndarray, num_seqs: int, num_blocks: int,
                  block_size: int) -> None:
    if tables.ndim != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got "
                         f"{tables.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got {int(lens.min())}")
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


# --- cache writes and copies -------------------------------------------------------------
def reshape_and_cache(key: DeviceArray, value: DeviceArray, k_cache: DeviceArray,
                      v_cache: DeviceArray, slot_mapping: Any, *, stream: Stream | None = None
                      ) -> None:
    """Write token ``i``'s K/V (``[num_tokens, num_kv_heads, head_dim]``) at cache slot
    ``slot_mapping[i]`` (int64; ``block * block_size + offset``; -1 skips the token)."""
    _expect(key, "key", 3)
    _expect(value, "value", 3, key.dtype)
    _expect(k_cache, "k_cache", 4, key.dtype)
    _expect(v_cache, "v_cache", 4, key.dtype)
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, cache_heads, block_size, cache_dim = k_cache.shape
    if value.shape != key.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {key.shape}/value {value.shape} and k_cache {k_cache.shape}/"
                         f"v_cache {v_cache.shape} must match in pairs")
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"key rows [{num_kv_heads}, {head_dim}] do not fit cache rows "
                         f"[{cache_heads}, {cache_dim}]")
    if (head_dim * key.dtype.itemsize) % 16:
        raise ValueError(f"head_dim {head_dim} of {key.dtype} is not a multiple of 16 bytes")
    slots = _host_ints(slot_mapping, "slot_mapping", np.int64, (num_tokens,))
    capacity = num_blocks * block_size
    bad = (slots < -1) | (slots >= capacity)
    if bad.any():
        raise ValueError(f"slot {int(slots[bad][0])} is outside [-1, {capacity}) for "
                         f"{num_blocks} blocks of {block_size}")
    live = slots[slots >= 0]
    if len(np.unique(live)) != len(live):
        raise ValueError("slot_mapping writes one slot twice")
    if key.backend.name == "host":
        reference.reshape_and_cache(host_view(key), host_view(value), host_view(k_cache),
                                    host_view(v_cache), slots)
        return
    if num_tokens == 0:
        return
    module = load_kernels("cache_ops", key.device, key.backend)
    with _Uploads(key, stream) as upload:
        module.function("rf_reshape_and_cache").launch(
            num_tokens, 256, k_cache, v_cache, key, value, upload(slot_mapping, slots),
            np.int32(num_kv_heads), np.int32(block_size),
            np.int32(head_dim * key.dtype.itemsize // 16), stream=stream)


def copy_blocks(slab: DeviceArray, pairs: Any, *, stream: Stream | None = None) -> None:
    """Copy block ``src`` to ``dst`` for every ``(src, dst)`` row of ``pairs`` (int64
    ``[n, 2]``) in every layer, K and V, of ``slab`` ``[layers, 2, blocks, heads, bs, dim]``.
    Destinations must be distinct and never also a source."""
    _expect(slab, "slab", 6)
    num_layers, _, num_blocks = slab.shape[:3]
    block_bytes = math.prod(slab.shape[3:]) * slab.dtype.itemsize
    pairs = _host_ints(pairs, "pairs", np.int64).reshape(-1, 2)
    if pairs.size and (pairs.min() < 0 or pairs.max() >= num_blocks):
        raise ValueError(f"block pair {pairs[(pairs < 0).any(1) | (pairs >= num_blocks).any(1)][0]}"
                         f" is outside [0, {num_blocks})")
    if len(np.unique(pairs[:, 1])) != len(pairs) or np.isin(pairs[:, 1], pairs[:, 0]).any():
        raise ValueError("copy_blocks destinations must be distinct and not sources")
    if slab.backend.name == "host":
        reference.copy_blocks(host_view(slab), pairs)
        return
    if len(pairs) == 0:
        return
    if block_bytes % 16:
        raise ValueError(f"a block of {block_bytes} bytes is not a multiple of 16 bytes")
    module = load_kernels("cache_ops", slab.device, slab.backend)
    with _Uploads(slab, stream) as upload:
        module.function("rf_copy_blocks").launch(
            (len(pairs), num_layers * 2), 256, slab, upload(pairs, pairs), np.int32(num_blocks),
            np.int64(block_bytes // 16), stream=stream)
