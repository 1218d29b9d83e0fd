"""Planning kernel launches on the host: argument checks, metadata checks, the split-K plan.

Everything here runs before any launch and touches no device memory: ``ops`` plans and
launches a one-off call, the KV cache plans once per step (``KvCache.batch``) and launches
per layer. Kernel arguments follow the signatures in ``native/`` (pointers as 64-bit values,
``int`` as int32, the scale as float32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from . import checks
from .array import DeviceArray
from .module import Kernel, load_kernels
from .runtime import Backend
from .staging import Workspace
from .stream import stream_handle

DTYPES = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16",
          np.dtype(np.float32): "f32"}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
THREADS = 128  # RF_PA_THREADS
WRITE_THREADS = 256  # RF_CO_THREADS
#: Partitions are a multiple of this many tokens (the kernel takes a partition at any token,
#: so the plan can split a sequence into as many nearly equal pieces as fill the device).
PARTITION_GRANULE = 16
MAX_PARTITIONS = 512  # most partitions a split uses (bounds the workspace)
GROUP_SIZES = (1, 2, 4, 8)  # query heads one CTA serves (template G)
#: The attention kernel's pipeline per backend: (RF_PA_STAGES, RF_PA_STAGE_BYTES).
ATTENTION_STAGES = {"cuda": (2, 32768), "hip": (2, 16384)}
#: Arguments a prepared launch replaces per call (``Kernel.prepare``'s ``patch``).
ATTENTION_PATCH = (0, 4, 5, 6)  # out, query, k_cache, v_cache
WRITE_PATCH = (0, 1, 2, 3)  # k_cache, v_cache, key, value


def attention_shared_bytes(backend: str, row_bytes: int) -> int:
    """Dynamic shared memory of the attention kernel whose K/V rows are ``row_bytes`` long:
    its stages, each holding the K and V rows of a tile padded by 16 bytes per row."""
    stages, stage_bytes = ATTENTION_STAGES[backend]
    rows = stage_bytes // 2 // row_bytes
    return stages * (stage_bytes + 2 * rows * 16)


# --- argument checks -----------------------------------------------------------------------
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
                shape: tuple[int, ...] | None = None) -> None:
    """Device-resident metadata: shape and dtype only (it is never read back to check)."""
    expect(values, name, ndim, dtype)
    if shape is not None and values.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {values.shape}")


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, or ``1/sqrt(head_dim)``; it must be a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return checks.real(scale, "scale")


def check_options(like: Any, stream: Any, check: Any, num_partitions: Any = None,
                  workspace: Any = None) -> None:
    """The keyword arguments of an op on ``like``'s device: an open ``Stream`` of that
    device or None, a bool ``check``, a split-K factor >= 1 or None, a ``Workspace`` or
    None."""
    if isinstance(like, DeviceArray):
        stream_handle(stream, "stream", like.backend, like.device)
    else:
        stream_handle(stream)
    checks.flag(check, "check")
    if num_partitions is not None:
        checks.integer(num_partitions, "num_partitions", 1)
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace or None, got {checks.show(workspace)}")


def check_attention_arrays(out: Any, query: Any, k_cache: Any, v_cache: Any
                           ) -> tuple[int, int, int, int, int, int]:
    """(num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size) of a valid
    attention call; raises naming the first bad argument."""
    expect(query, "query", 3)
    num_seqs, num_q_heads, head_dim = query.shape
    expect(out, "out", 3, query.dtype)
    expect(k_cache, "k_cache", 4, query.dtype)
    expect(v_cache, "v_cache", 4, query.dtype)
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
    return num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size


def check_tables(tables: np.ndarray, lens: np.ndarray, num_seqs: int, num_blocks: int,
                 block_size: int) -> None:
    """Block tables and lengths agree and every block a length reaches is in range."""
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
    expect(k_cache, "k_cache", 4, key.dtype)
    expect(v_cache, "v_cache", 4, key.dtype)
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
    return num_tokens, num_blocks, block_size


# --- the split-K plan ----------------------------------------------------------------------
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


def split_workspace(grid: tuple[int, int, int], num_q_heads: int, head_dim: int
                    ) -> tuple[int, int]:
    """(bytes of partial outputs and (max, sum) pairs, int32 counters) that an attention
    launch on ``grid`` (groups, sequences, partitions) needs; (0, 0) without split-K."""
    groups, num_seqs, parts = grid
    if parts == 1:
        return 0, 0
    return num_seqs * num_q_heads * parts * (head_dim + 2) * 4, groups * num_seqs


@dataclass(frozen=True)
class AttentionPlan:
    """How one paged-attention launch runs: the kernel, its grid (kv-head groups x sequences
    x partitions), dynamic shared memory (bytes) and split-K (tokens per partition)."""

    kernel: Kernel
    grid: tuple[int, int, int]
    shared_bytes: int
    partition_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int

    @property
    def num_partitions(self) -> int:
        return self.grid[2]

    @property
    def partial_bytes(self) -> int:
        """Workspace bytes for partial outputs and (max, sum) pairs; 0 without split-K."""
        return split_workspace(self.grid, self.num_q_heads, self.head_dim)[0]

    @property
    def num_counters(self) -> int:
        return split_workspace(self.grid, self.num_q_heads, self.head_dim)[1]

    def arguments(self, out: Any, query: Any, k_cache: Any, v_cache: Any, tables: Any,
                  lens: Any, scale: float, partials: int = 0, counters: int = 0) -> tuple:
        """The kernel's arguments in order (``partials``/``counters``: workspace addresses,
        needed when split)."""
        part_out = part_ml = 0
        if self.num_partitions > 1:
            heads = self.grid[1] * self.num_q_heads * self.num_partitions
            part_out, part_ml = partials, partials + heads * self.head_dim * 4
        else:
            counters = 0
        i32 = np.int32
        return (out, part_out, part_ml, counters, query, k_cache, v_cache, tables, lens,
                np.float32(scale), i32(self.num_q_heads), i32(self.num_kv_heads),
                i32(self.max_blocks), i32(self.block_size.bit_length() - 1),
                i32(self.partition_tokens), i32(self.num_partitions))


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel for one dtype, head size and GQA ratio on one device: ``group``
    query heads per CTA, ``groups`` CTAs per kv head, dynamic shared memory (bytes) and
    ``slots``, the CTAs the device runs at once."""

    kernel: Kernel
    group: int
    groups: int
    shared_bytes: int
    slots: int


@functools.lru_cache(maxsize=256)
def attention_kernel(backend: Backend, device: int, dtype: np.dtype, head_dim: int,
                     ratio: int) -> AttentionKernel:
    """The kernel for ``ratio`` query heads per kv head (looked up once per process)."""
    group = next(g for g in GROUP_SIZES if g >= min(ratio, GROUP_SIZES[-1]))
    module = load_kernels("paged_attention", device, backend)
    kernel = module.function(f"rf_paged_attention_{DTYPES[dtype]}_d{head_dim}_g{group}")
    shared = attention_shared_bytes(backend.name, head_dim * dtype.itemsize)
    multiprocessors = backend.cached_properties(device).multiprocessors
    slots = kernel.max_active_blocks(THREADS, shared) * multiprocessors
    return AttentionKernel(kernel, group, math.ceil(ratio / group), shared, slots)


def plan_attention(backend: Backend, device: int, dtype: np.dtype, num_seqs: int,
                   num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   max_blocks: int, lens: np.ndarray | None = None,
                   num_partitions: int | None = None) -> AttentionPlan:
    """The launch plan for checked shapes. ``lens`` (host) sizes the split; without it the
    block tables' width bounds the length. ``num_partitions`` forces the split-K factor."""
    found = attention_kernel(backend, device, dtype, head_dim, num_q_heads // num_kv_heads)
    max_len = int(lens.max(initial=0)) if lens is not None else max_blocks * block_size
    mean_len = float(lens.mean()) if lens is not None and lens.size else None
    grid, tokens = attention_split(found, num_kv_heads, num_seqs, max_len, mean_len,
                                   num_partitions)
    return AttentionPlan(found.kernel, grid, found.shared_bytes, tokens, num_q_heads,
                         num_kv_heads, head_dim, block_size, max_blocks)


def attention_split(found: AttentionKernel, num_kv_heads: int, num_seqs: int, max_len: int,
                    mean_len: float | None, num_partitions: int | None = None
                    ) -> tuple[tuple[int, int, int], int]:
    """(grid: kv-head groups x sequences x partitions, tokens per partition) of ``found``
    over ``num_seqs`` sequences of at most ``max_len`` tokens (``num_partitions`` forces the
    split-K factor)."""
    grid_x = num_kv_heads * found.groups
    if num_partitions is None:
        tokens, parts = plan_partitions(grid_x * num_seqs, max_len, found.slots, mean_len)
    else:
        parts = max(1, min(int(num_partitions), MAX_PARTITIONS))
        tokens = PARTITION_GRANULE * math.ceil(max(max_len, 1) / (parts * PARTITION_GRANULE))
    return (grid_x, num_seqs, parts), tokens


# --- K/V writes ----------------------------------------------------------------------------
def write_kernel(backend: Backend, device: int) -> Kernel:
    return load_kernels("cache_ops", device, backend).function("rf_reshape_and_cache")


def write_arguments(k_cache: Any, v_cache: Any, key: Any, value: Any, slot_mapping: Any,
                    num_kv_heads: int, block_size: int, row_bytes: int) -> tuple:
    """``rf_reshape_and_cache``'s arguments in order (``row_bytes``: one head's row)."""
    i32 = np.int32
    return (k_cache, v_cache, key, value, slot_mapping, i32(num_kv_heads), i32(block_size),
            i32(row_bytes // 16))
