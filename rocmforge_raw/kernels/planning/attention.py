"""The attention kernel of a launch (instance, shared memory, CTAs the device runs at once),
its scales and its arguments: planned once, launched per layer."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ...common import checks
from ...runtime import Backend
from ..module import Kernel, load_kernels
from .arguments import DTYPES, FP8_DTYPES, GROUP_SIZES
from .work import (
    LEAN_UNIT_TOKENS,
    LONE_CTA_FILL,
    NO_RULE,
    WHOLE_UNIT_WAVES,
    WHOLE_UNIT_WAVES_WIDE,
    Rule,
    WorkSplit,
    plan_work,
    split_workspace,
)

#: The kernels read an fp8 code as e4m3 with bias 7 into value / 256 (native/compat.h,
#: rf_e4m3): what to multiply that by to get the code's value (e4m3fnuz has bias 8).
FP8_CODE_FACTOR = {np.dtype(ml_dtypes.float8_e4m3fn): 256.0,
                   np.dtype(ml_dtypes.float8_e4m3fnuz): 128.0}
THREADS = 128  # RF_PA_THREADS
#: The attention kernel's dynamic shared memory per backend: (RF_PA_STAGES,
#: RF_PA_STAGE_BYTES, bytes each padded K/V row is padded by: f32 rows and fp8 codes of
#: more than SWIZZLED_CODE_BYTES; 16-bit rows and other codes are unpadded and swizzled,
#: rf_pa_tile). The AMD kernel's one stage is static LDS, each instance sizing its own
#: (rf_pa_stage), so hip launches pass none.
ATTENTION_STAGES = {"cuda": (2, 32768, 16), "hip": (0, 0, 0)}
#: The longest fp8 code rows (bytes: head_dim) a stage holds unpadded (rf_pa_tile::SWIZZLED).
SWIZZLED_CODE_BYTES = 128
#: Bytes a cuda launch passes beyond its stages: the kernel starts them at the next multiple
#: of this (RF_PA_STAGE_ALIGN), which its swizzled rows need whatever the compiler aligns.
STAGE_ALIGN = 128


#: Stage rows this long (head_dim 64 of a 16-bit cache) make an instance with fewer than
#: GROUP_SIZES[-1] heads narrow on cuda: half stages, four CTAs per SM (rf_pa_stage).
NARROW_ROW_BYTES = 128


#: Tokens an fp8 cache's stage holds at most (rf_pa_stage: one row a lane).
CODE_STAGE_TOKENS = 128


def attention_shared_bytes(backend: str, row_bytes: int, group: int, fp8: bool = False, *,
                           itemsize: int) -> int:
    """Dynamic shared memory a launch of the attention kernel of ``group`` heads whose rows
    of the activation dtype (``itemsize`` bytes an element) are ``row_bytes`` long passes:
    its stages, each holding the K and V rows of a tile, and STAGE_ALIGN bytes to align them
    (0 on hip: the stage is static there); f32 rows and codes longer than
    SWIZZLED_CODE_BYTES are padded, other rows not. An fp8 cache's stages hold its codes
    (rows of ``row_bytes / 2``), at most CODE_STAGE_TOKENS of them; a narrow instance (rows
    of NARROW_ROW_BYTES, fewer than GROUP_SIZES[-1] heads, a 16-bit cache) keeps its two
    stages at half the size."""
    stages, stage_bytes, pad = ATTENTION_STAGES[backend]
    if stages == 0:
        return 0
    if fp8:  # rf_pa_stage: the codes as they are in the cache
        row_bytes //= 2
        stage_bytes = min(stage_bytes, 2 * CODE_STAGE_TOKENS * row_bytes)
    elif row_bytes == NARROW_ROW_BYTES and group < GROUP_SIZES[-1]:
        stage_bytes //= 2
    rows = stage_bytes // 2 // row_bytes
    if itemsize != 4 and not (fp8 and row_bytes > SWIZZLED_CODE_BYTES):  # swizzled
        pad = 0
    return stages * (stage_bytes + 2 * rows * pad) + STAGE_ALIGN


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
                               self.num_seqs * self.work.groups, self.work.whole)

    def arguments(self, out: Any, query: Any, k_cache: Any, v_cache: Any, tables: Any,
                  lens: Any, scale: float, partials: int, counters: int, cum16: int = 0,
                  first_seq: int = 0, out_scale: float = 1.0, softcap: float = 0.0,
                  sinks: int = 0, window: int = 0) -> tuple:
        """The kernel's arguments in order (``partials``/``counters``: workspace addresses;
        ``cum16``/``first_seq``: device copies of the work split's arrays, 0 in uniform
        mode; ``scale``/``out_scale``: ``kernel_scales``; ``softcap``: the logit cap, 0 for
        none; ``sinks``: the address of one float32 logit a query head, 0 for none;
        ``window``: the tokens a sequence attends to, its last, 0 for all)."""
        i32, i64 = np.int32, np.int64
        work = self.work
        if work.cum16 is None:
            cum16 = first_seq = 0
        return (out, partials, counters, query, k_cache, v_cache, tables, lens,
                cum16, first_seq, np.float32(scale), i32(self.num_q_heads),
                i32(self.num_kv_heads), i32(self.max_blocks),
                i32(self.block_size.bit_length() - 1), i32(self.num_seqs), i32(work.uniform16),
                i64(work.per_cta), i64(work.total), np.float32(out_scale),
                np.float32(softcap), sinks, i32(window))


#: Indices in ``AttentionPlan.arguments``: the scale, the work split's numbers (uniform16,
#: per_cta, total) and the pointers a prepared launch replaces per call (``Kernel.prepare``'s
#: ``patch``).
SCALE_ARG = 10
WORK_ARGS = (16, 17, 18)
OUT_SCALE_ARG = 19
#: The logit cap and the sinks' address (``AttentionPlan.arguments``).
SOFTCAP_ARG, SINKS_ARG, WINDOW_ARG = 20, 21, 22
ATTENTION_PATCH = (0, 3, 4, 5)  # out, query, k_cache, v_cache
#: Indices in ``AttentionPlan.arguments`` that differ between two steps of one shape (same
#: kernel, sequences and query heads): workspace, metadata addresses, table width and the
#: work split (``step_arguments`` gives their values). With the grid, ATTENTION_PATCH and
#: the scales, they are all a launch prepared for one step needs to run another.
STEP_ARGS = (1, 2, 6, 7, 8, 9, 13, *WORK_ARGS)


def step_arguments(work: tuple[int, int, int], partials: int, counters: int, tables: int,
                   lens: int, cum16: int, first_seq: int, max_blocks: int) -> tuple[int, ...]:
    """The values of STEP_ARGS for a step whose work split ``work`` is (uniform16, per_cta,
    total) of a ``WorkSplit`` (addresses as ``AttentionPlan.arguments`` takes them; 0 for
    ``cum16``/``first_seq`` in uniform mode)."""
    return (partials, counters, tables, lens, cum16, first_seq, max_blocks, *work)


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel for one dtype, head size and GQA ratio on one device: ``group``
    query heads per CTA, ``groups`` CTAs per kv head, dynamic shared memory (bytes) and
    ``slots``, the CTAs the device runs at once on its ``sms`` multiprocessors; ``rule``
    its work split's (``plan_work``: ``split_rule_of``, and the lean occupancy's slots);
    ``lean_shared_bytes`` the dynamic shared memory at which one CTA fewer fits a
    multiprocessor (0: no lean launch), for splits planned ``lean``."""

    kernel: Kernel
    group: int
    groups: int
    shared_bytes: int
    slots: int
    sms: int
    rule: Rule = NO_RULE
    lean_shared_bytes: int = 0

    def shared_for(self, work: WorkSplit) -> int:
        """The dynamic shared memory of a launch of ``work``."""
        return self.lean_shared_bytes if work.lean else self.shared_bytes


def lean_shared_bytes(kernel: Kernel, shared: int, ctas: int) -> int:
    """The least dynamic shared memory, in 1 KiB steps past ``shared``, at which ``kernel``
    fits ``ctas - 1`` CTAs a multiprocessor, not ``ctas`` (0: none within 96 KiB more)."""
    for extra in range(1 << 10, 97 << 10, 1 << 10):
        fits = kernel.max_active_blocks(THREADS, shared + extra)
        if fits < ctas:
            return shared + extra if fits == ctas - 1 else 0
    return 0


def split_rule_of(backend: str, dtype: np.dtype, head_dim: int, fp8: bool
                  ) -> tuple[float, float, bool]:
    """An instance's (whole_waves, lone_fill, lean) for ``plan_work``: one CTA a unit from
    WHOLE_UNIT_WAVES waves of units (head_dim 256: WHOLE_UNIT_WAVES_WIDE); one CTA on
    LONE_CTA_FILL of the multiprocessors only for NVIDIA's 16-bit head_dim 128 instances,
    whose one CTA (two 32 KiB stages of 64 tokens) streams at the copy's rate alone; a lean
    occupancy (one CTA a multiprocessor fewer, LEAN_UNIT_TOKENS) only for NVIDIA's 16-bit
    head_dim 128 and 256 instances. Measured on H100s (docs/kernels.md v30): fp8 and head_dim
    64 were slower lean (S1-fp8 1.3 %, 128 x 2048 d64 G = 8 1.2 %) and alone; AMD never."""
    waves = WHOLE_UNIT_WAVES_WIDE if head_dim > 128 else WHOLE_UNIT_WAVES
    wide16 = backend == "cuda" and not fp8 and dtype.itemsize == 2 and head_dim >= 128
    return waves, LONE_CTA_FILL if wide16 and head_dim == 128 else 0.0, wide16


def kernel_scales(cache: np.dtype, scale: float, k_scale: float, v_scale: float
                  ) -> tuple[float, float]:
    """The kernel's (``scale``, ``out_scale``) for a softmax scale and a layer's K/V scales:
    an fp8 cache's factors fold into them (FP8_CODE_FACTOR); other caches pass ``scale``.
    ``scale`` multiplies last, so the answer for scale 1 times any scale is the answer for
    that scale (the step computes the layer's part once)."""
    factor = FP8_CODE_FACTOR.get(cache)
    if factor is None:
        return scale, 1.0
    folded = scale * (k_scale * factor)
    checks.float32(folded, f"scale {scale:g} x k_scale {k_scale:g} x {factor:g} (the fp8 "
                   "code factor)")
    return folded, v_scale * factor


def attention_instance(dtype: np.dtype, head_dim: int, ratio: int,
                       cache_dtype: np.dtype | None = None, capped: bool = False
                       ) -> tuple[str, int]:
    """The attention kernel's name for ``ratio`` query heads per kv head of ``dtype``
    activations over a cache of ``cache_dtype`` (None: ``dtype``), and its group size G
    (the fewest heads of GROUP_SIZES that hold the ratio, at most the largest). A call with a
    logit cap (``capped``) on 16-bit activations of head_dim 256 takes groups of at most 4:
    gfx11's groups of 8 there have no register left for the cap (their instances skip it)."""
    group = next(g for g in GROUP_SIZES if g >= min(ratio, GROUP_SIZES[-1]))
    if capped and head_dim == 256 and dtype.itemsize == 2:
        group = min(group, 4)
    codes = "_e4m3" if cache_dtype in FP8_DTYPES else ""
    return f"rf_paged_attention_{DTYPES[dtype]}{codes}_d{head_dim}_g{group}", group


@functools.lru_cache(maxsize=256)
def attention_kernel(backend: Backend, device: int, dtype: np.dtype, head_dim: int,
                     ratio: int, cache_dtype: np.dtype | None = None, capped: bool = False
                     ) -> AttentionKernel:
    """The kernel for ``ratio`` query heads per kv head of ``dtype`` activations over a
    cache of ``cache_dtype`` (None: ``dtype``), looked up once per process (``capped``: for
    calls with a logit cap, ``attention_instance``)."""
    name, group = attention_instance(dtype, head_dim, ratio, cache_dtype, capped)
    kernel = load_kernels("paged_attention", device, backend).function(name)
    shared = attention_shared_bytes(backend.name, head_dim * dtype.itemsize, group,
                                    cache_dtype in FP8_DTYPES, itemsize=dtype.itemsize)
    multiprocessors = backend.cached_properties(device).multiprocessors
    ctas = kernel.max_active_blocks(THREADS, shared)
    waves, lone_fill, may_lean = split_rule_of(backend.name, dtype, head_dim,
                                               cache_dtype in FP8_DTYPES)
    # the lean occupancy: three CTAs a multiprocessor down to two (measured, docs/kernels.md v30)
    lean = lean_shared_bytes(kernel, shared, ctas) if may_lean and ctas == 3 else 0
    lean_slots = kernel.max_active_blocks(THREADS, lean) * multiprocessors if lean else 0
    rule = (waves, lone_fill, lean_slots, LEAN_UNIT_TOKENS if lean else 0)
    return AttentionKernel(kernel, group, math.ceil(ratio / group), shared,
                           ctas * multiprocessors, multiprocessors, rule, lean)


def window_work(lens: np.ndarray, window: int) -> np.ndarray:
    """Each sequence's work under a ``window`` (tokens): its last ``window`` tokens counted
    from a multiple of 16 below them (the kernel's tiles start on 16 tokens), so
    ``len - ((len - window) & ~15)``, at most ``window + 15``; all of a shorter one."""
    worked: np.ndarray = np.where(lens > window, lens - ((lens - window) & ~15), lens)
    return worked


def plan_attention(backend: Backend, device: int, dtype: np.dtype, num_seqs: int,
                   num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   max_blocks: int, lens: np.ndarray | None = None,
                   num_partitions: int | None = None, cache_dtype: np.dtype | None = None,
                   capped: bool = False, window: int = 0) -> AttentionPlan:
    """The launch plan for checked shapes. ``lens`` (host) balances the split over the
    real lengths; without it the block tables' width stands for every length.
    ``num_partitions`` cuts the longest sequence into that many pieces instead; ``capped``:
    the call has a logit cap (``attention_instance``); ``window`` > 0: each sequence
    attends to its last ``window`` tokens, the split planned over those."""
    found = attention_kernel(backend, device, dtype, head_dim, num_q_heads // num_kv_heads,
                             cache_dtype, capped)
    most = max_blocks * block_size
    if window:
        most = min(most, window + 15)
        if lens is not None:
            lens = window_work(lens, window)
    work = plan_work(num_kv_heads * found.groups, found.slots, num_seqs, lens, most,
                     num_partitions, found.sms, found.rule)
    return AttentionPlan(found.kernel, found.group, work, found.shared_for(work), num_seqs,
                         num_q_heads, num_kv_heads, head_dim, block_size, max_blocks)
