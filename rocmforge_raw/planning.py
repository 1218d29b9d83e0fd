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
from ._worksplit import first_sequences, prefix_sums
from .array import DeviceArray
from .module import Kernel, load_kernels
from .runtime import Backend
from .staging import Workspace
from .stream import stream_handle

DTYPES = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16",
          np.dtype(np.float32): "f32"}
#: fp8 cache formats -> the activation dtypes (queries, outputs, K/V written) they serve.
FP8_DTYPES = {np.dtype(t): (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
              for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz)}
#: The kernels read an fp8 code as e4m3 with bias 7 into value / 256 (native/compat.h,
#: rf_e4m3): what to multiply that by to get the code's value (e4m3fnuz has bias 8).
FP8_CODE_FACTOR = {np.dtype(ml_dtypes.float8_e4m3fn): 256.0,
                   np.dtype(ml_dtypes.float8_e4m3fnuz): 128.0}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
THREADS = 128  # RF_PA_THREADS
WRITE_THREADS = 256  # RF_CO_THREADS
#: Rows ([num_blocks * num_kv_heads * block_size]) of a K or V cache the attention kernel
#: indexes (int32).
MAX_CACHE_ROWS = (1 << 31) - 1
GROUP_SIZES = (1, 2, 4, 8)  # query heads one CTA serves (template G)
#: The attention kernel's dynamic shared memory per backend: (RF_PA_STAGES,
#: RF_PA_STAGE_BYTES, bytes each K/V row is padded by). The AMD kernel's one stage is static
#: LDS, each instance sizing its own (rf_pa_stage), so hip launches pass none.
ATTENTION_STAGES = {"cuda": (2, 32768, 16), "hip": (0, 0, 0)}
WRITE_PATCH = (0, 1, 2, 3)  # k_cache, v_cache, key, value


#: Stage rows this long (head_dim 64 of a 16-bit cache) make an instance with fewer than
#: GROUP_SIZES[-1] heads narrow on cuda: half stages, five CTAs per SM (rf_pa_stage).
NARROW_ROW_BYTES = 128


#: Tokens an fp8 cache's stage holds at most (rf_pa_stage: one row a lane).
CODE_STAGE_TOKENS = 128


def attention_shared_bytes(backend: str, row_bytes: int, group: int, fp8: bool = False
                           ) -> int:
    """Dynamic shared memory a launch of the attention kernel of ``group`` heads whose rows
    of the activation dtype are ``row_bytes`` long passes: its stages, each holding the K and
    V rows of a tile, every row padded (0 on hip: the stage is static there). An fp8 cache's
    stages hold its codes (rows of ``row_bytes / 2``), at most CODE_STAGE_TOKENS of them; a
    narrow instance (rows of NARROW_ROW_BYTES, fewer than GROUP_SIZES[-1] heads, a 16-bit
    cache) keeps its two stages at half the size."""
    stages, stage_bytes, pad = ATTENTION_STAGES[backend]
    if stages == 0:
        return 0
    if fp8:  # rf_pa_stage: the codes as they are in the cache
        row_bytes //= 2
        stage_bytes = min(stage_bytes, 2 * CODE_STAGE_TOKENS * row_bytes)
    elif row_bytes == NARROW_ROW_BYTES and group < GROUP_SIZES[-1]:
        stage_bytes //= 2
    rows = stage_bytes // 2 // row_bytes
    return stages * (stage_bytes + 2 * rows * pad)


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
    if not (out.backend is query.backend is k_cache.backend is v_cache.backend):
        raise ValueError("out, query, k_cache and v_cache must be on one backend")
    return num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size


def check_cache_dtype(cache_name: str, cache: np.dtype, act: np.dtype, act_name: str
                      ) -> None:
    """A cache of ``cache`` serves activations of ``act``: the same dtype, or an fp8 cache
    with float16/bfloat16 activations."""
    if cache == act or act in FP8_DTYPES.get(cache, ()):
        return
    if cache in FP8_DTYPES:
        raise ValueError(f"{act_name} must be float16 or bfloat16 with a {cache} {cache_name}, "
                         f"got {act}")
    raise ValueError(f"{cache_name} must be {act}, got {cache}")


def check_kv_scales(cache: np.dtype, k_scale: Any, v_scale: Any) -> tuple[float, float]:
    """The K and V scales of a call on a cache of ``cache``: positive finite numbers, and
    exactly 1.0 unless the cache is fp8 (a scale elsewhere would be silently ignored)."""
    k, v = checks.real(k_scale, "k_scale"), checks.real(v_scale, "v_scale")
    for name, x in (("k_scale", k), ("v_scale", v)):
        if not 0.0 < x < math.inf:
            raise ValueError(f"{name} must be positive and finite, got {x}")
        if cache not in FP8_DTYPES and x != 1.0:
            raise ValueError(f"{name} {x} applies to fp8 caches only, not {cache}")
    return k, v


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
    return num_tokens, num_blocks, block_size


# --- the work split ------------------------------------------------------------------------
#: Work is counted in tokens rounded up to this (and every unit owns at least this many, so an
#: empty sequence still has a position): pieces start at multiples of it.
WORK_GRANULE = 16
#: The least work one CTA gets (tokens): less costs more in per-piece fixed work than it
#: gains in parallel streams.
MIN_TOKENS_PER_CTA = 64
#: A short launch (a balanced share under this many tokens) of units of one length takes the
#: least share, up to ALIGNED_STRETCH times the balanced one, that divides that length or
#: that the length divides: each CTA then holds one piece of one unit or whole units, with
#: no piece end inside a unit's share and fewer pieces for each unit's combine (H200,
#: native/NOTES.md v21: 1 x 32768 57 -> 52 us on 256 CTAs instead of 391, 1 x 8192 27 ->
#: 22; measured up to 1.52 times the balanced share, so at least 5/8 of the slots stay busy).
ALIGNED_SHARE_TOKENS = 1024
ALIGNED_STRETCH = 1.6


@dataclass(frozen=True)
class WorkSplit:
    """How one attention launch divides its work (``native/paged_attention.cu``, top): units
    (sequence, group of query heads of one kv head), ``groups`` per sequence, laid end to end,
    each ``len16`` work tokens long; CTA ``c`` of ``num_ctas`` takes work tokens
    ``[c * per_cta, min((c + 1) * per_cta, total))``.

    With the lengths known on the host, ``cum16`` (int64 ``[num_seqs + 1]``, exclusive prefix
    sums of each sequence's ``len16``) and ``first_seq`` (int32 ``[num_ctas]``, the sequence
    holding each CTA's first work token) go to the device; without them (None) every
    sequence counts ``uniform16`` work tokens and the kernel skips what its length lacks.
    """

    num_ctas: int
    per_cta: int
    total: int
    groups: int
    uniform16: int
    cum16: np.ndarray | None = None
    first_seq: np.ndarray | None = None

    @property
    def arrays(self) -> list[np.ndarray]:
        """The arrays the kernel reads from device memory (none in uniform mode)."""
        return [] if self.cum16 is None else [self.cum16, self.first_seq]


def _round16(tokens: int) -> int:
    """Work tokens of a sequence of ``tokens``: rounded up to WORK_GRANULE, at least that."""
    return max(WORK_GRANULE, -(-tokens // WORK_GRANULE) * WORK_GRANULE)


def _aligned_share(share: int, unit: int) -> int:
    """The least multiple of WORK_GRANULE from ``share`` to ``ALIGNED_STRETCH * share`` that
    divides ``unit`` or that ``unit`` divides (both multiples of WORK_GRANULE); ``share``
    when there is none."""
    whole = unit // WORK_GRANULE
    for granules in range(share // WORK_GRANULE,
                          int(ALIGNED_STRETCH * share) // WORK_GRANULE + 1):
        if whole % granules == 0 or granules % whole == 0:
            return granules * WORK_GRANULE
    return share


def plan_work(groups: int, slots: int, num_seqs: int, lens: np.ndarray | None = None,
              max_len: int = 0, num_partitions: int | None = None) -> WorkSplit:
    """The split of ``num_seqs`` sequences x ``groups`` units over a device that runs
    ``slots`` CTAs at once: one wave of CTAs with equal shares (at least
    ``MIN_TOKENS_PER_CTA`` tokens each; aligned to the units where they are short and the
    units of one length: ``ALIGNED_SHARE_TOKENS``). ``lens`` (host, int32) gives each
    sequence's length; without it every sequence counts ``max_len``. ``num_partitions``
    instead cuts the longest sequence into that many pieces (a test and tuning knob)."""
    if lens is not None:
        cum16 = np.empty(num_seqs + 1, np.int64)
        total = prefix_sums(np.ascontiguousarray(lens, np.int32), WORK_GRANULE, cum16) * groups
        longest = int(_round16(int(lens.max(initial=0)))) if num_partitions else 0
        uniform16 = 0
    else:
        cum16, uniform16 = None, int(_round16(max_len))
        total, longest = num_seqs * groups * uniform16, uniform16
    if num_partitions is not None:
        share = -(-longest // max(1, int(num_partitions)))
    else:
        share = max(MIN_TOKENS_PER_CTA, -(-total // max(slots, 1)))
        if MIN_TOKENS_PER_CTA < share < ALIGNED_SHARE_TOKENS and num_seqs:
            work16 = np.diff(cum16) if cum16 is not None else None
            if work16 is None or (work16 == work16[0]).all():  # units of one length
                unit = uniform16 or int(work16[0])
                share = _aligned_share(_round16(share), unit)
    per_cta = -(-share // WORK_GRANULE) * WORK_GRANULE
    num_ctas = -(-total // per_cta)
    first_seq = None
    if cum16 is not None:
        first_seq = np.empty(num_ctas, np.int32)
        first_sequences(cum16, groups, per_cta, first_seq)
    return WorkSplit(num_ctas, per_cta, total, groups, uniform16, cum16, first_seq)


def split_workspace(num_ctas: int, group: int, head_dim: int, num_units: int
                    ) -> tuple[int, int]:
    """(bytes of partials, int32 counters) of a launch of ``num_ctas`` CTAs of ``group``
    query heads over ``num_units`` units: two partial slots per CTA (its first and last piece
    may be parts of units split with its neighbours), each a record per query head of
    ``head_dim`` floats, the (max, sum) pair and two unused floats (so records are 16-byte
    aligned); one counter per unit. Records sit at fixed places whatever the CTA count, so
    a prepared launch keeps its workspace address."""
    return 2 * num_ctas * group * (head_dim + 4) * 4, num_units


@dataclass(frozen=True)
class AttentionPlan:
    """How one paged-attention launch runs: the kernel (``group`` query heads per CTA), its
    work split (one CTA per share), dynamic shared memory (bytes) and the shapes."""

    kernel: Kernel
    group: int
    work: WorkSplit
    shared_bytes: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.work.num_ctas, 1, 1)

    @property
    def partial_bytes(self) -> int:
        """Workspace bytes for partial records."""
        return self.workspace_sizes[0]

    @property
    def num_counters(self) -> int:
        return self.workspace_sizes[1]

    @property
    def workspace_sizes(self) -> tuple[int, int]:
        return split_workspace(self.work.num_ctas, self.group, self.head_dim,
                               self.num_seqs * self.work.groups)

    def arguments(self, out: Any, query: Any, k_cache: Any, v_cache: Any, tables: Any,
                  lens: Any, scale: float, partials: int, counters: int, cum16: int = 0,
                  first_seq: int = 0, out_scale: float = 1.0) -> tuple:
        """The kernel's arguments in order (``partials``/``counters``: workspace addresses;
        ``cum16``/``first_seq``: device copies of the work split's arrays, 0 in uniform
        mode; ``scale``/``out_scale``: ``kernel_scales``)."""
        i32, i64 = np.int32, np.int64
        work = self.work
        if work.cum16 is None:
            cum16 = first_seq = 0
        return (out, partials, counters, query, k_cache, v_cache, tables, lens,
                cum16, first_seq, np.float32(scale), i32(self.num_q_heads),
                i32(self.num_kv_heads), i32(self.max_blocks),
                i32(self.block_size.bit_length() - 1), i32(self.num_seqs), i32(work.uniform16),
                i64(work.per_cta), i64(work.total), np.float32(out_scale))


    def update(self, launch: Any) -> None:
        """Make a launch prepared from another plan of the same shapes (``Launch``) run
        this plan's work split: its grid and its three work arguments."""
        launch.set_grid(self.work.num_ctas)
        for index, value in zip(WORK_ARGS, (self.work.uniform16, self.work.per_cta,
                                            self.work.total)):
            launch.set_int(index, value)


#: Indices in ``AttentionPlan.arguments``: the scale, the work split's numbers (uniform16,
#: per_cta, total) and the pointers a prepared launch replaces per call (``Kernel.prepare``'s
#: ``patch``).
SCALE_ARG = 10
WORK_ARGS = (16, 17, 18)
OUT_SCALE_ARG = 19
ATTENTION_PATCH = (0, 3, 4, 5)  # out, query, k_cache, v_cache


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


def kernel_scales(cache: np.dtype, scale: float, k_scale: float, v_scale: float
                  ) -> tuple[float, float]:
    """The kernel's (``scale``, ``out_scale``) for a softmax scale and a layer's K/V scales:
    an fp8 cache's factors fold into them (FP8_CODE_FACTOR); other caches pass ``scale``.
    ``scale`` multiplies last, so the answer for scale 1 times any scale is the answer for
    that scale (the step computes the layer's part once)."""
    factor = FP8_CODE_FACTOR.get(cache)
    if factor is None:
        return scale, 1.0
    return scale * (k_scale * factor), v_scale * factor


def attention_instance(dtype: np.dtype, head_dim: int, ratio: int,
                       cache_dtype: np.dtype | None = None) -> tuple[str, int]:
    """The attention kernel's name for ``ratio`` query heads per kv head of ``dtype``
    activations over a cache of ``cache_dtype`` (None: ``dtype``), and its group size G
    (the fewest heads of GROUP_SIZES that hold the ratio, at most the largest)."""
    group = next(g for g in GROUP_SIZES if g >= min(ratio, GROUP_SIZES[-1]))
    codes = "_e4m3" if cache_dtype in FP8_DTYPES else ""
    return f"rf_paged_attention_{DTYPES[dtype]}{codes}_d{head_dim}_g{group}", group


@functools.lru_cache(maxsize=256)
def attention_kernel(backend: Backend, device: int, dtype: np.dtype, head_dim: int,
                     ratio: int, cache_dtype: np.dtype | None = None) -> AttentionKernel:
    """The kernel for ``ratio`` query heads per kv head of ``dtype`` activations over a
    cache of ``cache_dtype`` (None: ``dtype``), looked up once per process."""
    name, group = attention_instance(dtype, head_dim, ratio, cache_dtype)
    kernel = load_kernels("paged_attention", device, backend).function(name)
    shared = attention_shared_bytes(backend.name, head_dim * dtype.itemsize, group,
                                    cache_dtype in FP8_DTYPES)
    multiprocessors = backend.cached_properties(device).multiprocessors
    slots = kernel.max_active_blocks(THREADS, shared) * multiprocessors
    return AttentionKernel(kernel, group, math.ceil(ratio / group), shared, slots)


def plan_attention(backend: Backend, device: int, dtype: np.dtype, num_seqs: int,
                   num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   max_blocks: int, lens: np.ndarray | None = None,
                   num_partitions: int | None = None, cache_dtype: np.dtype | None = None
                   ) -> AttentionPlan:
    """The launch plan for checked shapes. ``lens`` (host) balances the split over the
    real lengths; without it the block tables' width stands for every length.
    ``num_partitions`` cuts the longest sequence into that many pieces instead."""
    found = attention_kernel(backend, device, dtype, head_dim, num_q_heads // num_kv_heads,
                             cache_dtype)
    work = plan_work(num_kv_heads * found.groups, found.slots, num_seqs, lens,
                     max_blocks * block_size, num_partitions)
    return AttentionPlan(found.kernel, found.group, work, found.shared_bytes, num_seqs,
                         num_q_heads, num_kv_heads, head_dim, block_size, max_blocks)


# --- K/V writes ----------------------------------------------------------------------------
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
