"""Planning attention over many query tokens per sequence (``native/prefill.cu``): the
instance of a launch, its shared memory, and its work items.

A sequence ``s`` with ``q_len`` query rows has ``q_len * ratio`` *packed rows* per kv head
(row ``r`` is token ``r // ratio``, query head ``x * ratio + r % ratio``). A work item is
``BM`` packed rows of one sequence and kv head over a piece of their KV range: the range
ends where the item's last row stops seeing (causal: ``kv_len - q_len + token + 1``), so
tiles above the diagonal are never read; long ranges of few items are cut into pieces of
whole KV tiles (``n`` pieces, merged by the combine kernel). Items are ordered longest
first, pieces ahead (so a piece's record slot is its item index), which keeps the
hardware's CTA scheduler from leaving one long item for the end.

The shapes mirror ``native/pf_tile.h`` (``rf_pf_shape``); a test compares them with the
compiled instances' shared memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..module import Kernel, load_kernels
from ._prefill import prefill_items
from .arguments import DTYPES, FP8_DTYPES

#: Threads of a CTA per warp size: four warps (rf_pf_shape, RF_PF_WARPS).
WARPS = 4
#: The dynamic buffer's alignment on NVIDIA (RF_PF_ALIGN): launches pass this much more.
ALIGN = 128
#: A work item's fixed cost in KV positions (its queries' load, its output), for ordering
#: and for how far pieces are cut.
ITEM_COST = 64
#: Pieces are no shorter than this many KV tiles.
MIN_PIECE_TILES = 4
#: Pieces are cut until the launch holds this many CTAs per resident slot.
PIECE_WAVES = 2


@dataclass(frozen=True)
class PrefillShape:
    """One instance's tile shape (``rf_pf_shape``): ``bm`` query rows, ``bn`` KV tokens a
    tile, ``stages``, and the dynamic shared memory a launch passes (bytes; 0 on hip, whose
    buffer is static)."""

    bm: int
    bn: int
    stages: int
    shared_bytes: int


def _round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def prefill_shape(backend: str, dtype: np.dtype, cache_dtype: np.dtype, head_dim: int,
                  wm: int) -> PrefillShape:
    """The tile shape of the instance for ``dtype`` activations over a ``cache_dtype`` cache
    with ``wm`` warps along the rows (``rf_pf_shape``, per backend)."""
    fp8, f32 = cache_dtype in FP8_DTYPES, dtype.itemsize == 4
    amd = backend == "hip"
    if amd:
        mt = 1
        bn = (32 if head_dim == 64 else 16) if f32 else (64 if head_dim <= 128 else 16)
        stages, widen_in_copy = 1, fp8
    else:  # two m-tiles a warp for 16-bit WM = 4 up to head_dim 128 (rf_pf_shape::MT)
        mt = 2 if wm == 4 and not f32 and not fp8 and head_dim <= 128 else 1
        bn = {64: 64, 128: 32}.get(head_dim, 16) if f32 else (64 if head_dim <= 128 else 32)
        stage_bytes = 2 * bn * head_dim * cache_dtype.itemsize  # rf_pf_shape::STAGES
        big = 2 if mt == 2 else 3  # stages of more than 16 KiB
        stages = (4 if stage_bytes <= 16384 else big) if head_dim <= 128 and not f32 else 2
        widen_in_copy = False
    bm = 16 * wm * mt
    e_row = head_dim * dtype.itemsize
    s_row = e_row if widen_in_copy else head_dim * cache_dtype.itemsize
    code_stage = fp8 and not widen_in_copy
    at_stages = _round(bm * e_row)
    at_wide = at_stages + _round(stages * 2 * bn * s_row)
    total = at_wide + _round(2 * bn * e_row if code_stage else 0)
    return PrefillShape(bm, bn, stages, 0 if amd else total + ALIGN)


def prefill_wm(backend: str, dtype: np.dtype, head_dim: int, rows: int) -> int:
    """Warps along the rows for a launch whose longest packed-row run is ``rows``: 1 (16-row
    tiles, the warps splitting the tokens) where every run fits 16 rows, or for f32; else 4.
    AMD's head_dim 256 instances are WM = 4 only."""
    if dtype.itemsize == 4:
        return 1
    if backend == "hip" and head_dim > 128:
        return 4
    return 1 if rows <= 16 else 4


def prefill_instance(dtype: np.dtype, head_dim: int, cache_dtype: np.dtype, wm: int,
                     capped: bool = False) -> tuple[str, str]:
    """The (attention, combine) kernel names of an instance; ``capped``: the one that
    applies a logit cap (the others ignore it, and do not pay its registers)."""
    codes = "_e4m3" if cache_dtype in FP8_DTYPES else ""
    suffix = f"_d{head_dim}_m{wm}"
    return (f"rf_prefill_{DTYPES[dtype]}{codes}{'_cap' if capped else ''}{suffix}",
            f"rf_prefill_combine_{DTYPES[dtype]}{suffix}")


@dataclass(frozen=True)
class PrefillKernel:
    """An instance loaded on one device: its two kernels, shape and ``slots``, the CTAs the
    device runs at once."""

    kernel: Kernel
    combine: Kernel
    wm: int
    shape: PrefillShape
    slots: int

    @property
    def threads(self) -> int:
        return WARPS * self.kernel.module.backend.cached_properties(
            self.kernel.module.device).warp_size


@functools.lru_cache(maxsize=256)
def prefill_kernel(backend: object, device: int, dtype: np.dtype, head_dim: int,
                   cache_dtype: np.dtype, wm: int, capped: bool = False) -> PrefillKernel:
    """The instance for these shapes (``capped``: ``prefill_instance``), looked up once per
    process."""
    name, combine = prefill_instance(dtype, head_dim, cache_dtype, wm, capped)
    module = load_kernels("prefill", device, backend)
    kernel = module.function(name)
    shape = prefill_shape(backend.name, dtype, cache_dtype, head_dim, wm)  # type: ignore[attr-defined]
    props = backend.cached_properties(device)  # type: ignore[attr-defined]
    threads = WARPS * props.warp_size
    slots = max(kernel.max_active_blocks(threads, shape.shared_bytes), 1) * props.multiprocessors
    return PrefillKernel(kernel, module.function(combine), wm, shape, slots)


@dataclass(frozen=True)
class PrefillWork:
    """A launch's work: ``items`` int32 ``[n, 4]`` (s, row0, x | k << 16, pieces), the first
    ``num_pieces`` of them pieces of split items (record slot = item index), ``combines``
    int32 ``[m, 2]`` (first piece, pieces) per split item, and ``q_starts`` int32
    ``[num_seqs + 1]`` (each sequence's first query row)."""

    items: np.ndarray
    combines: np.ndarray
    q_starts: np.ndarray
    num_pieces: int

    @property
    def arrays(self) -> list[np.ndarray]:
        """What a launch uploads, in order: q_starts, items, and combines where any."""
        return [self.q_starts, self.items] + ([self.combines] if len(self.combines) else [])

    def partial_bytes(self, bm: int, head_dim: int) -> int:
        """Workspace for the pieces' records: ``bm`` rows of ``head_dim + 4`` floats each."""
        return self.num_pieces * bm * (head_dim + 4) * 4

    def padded(self, items: int, combines: int) -> tuple[np.ndarray, np.ndarray]:
        """``items`` and ``combines`` padded with zero rows to ``items`` and ``combines``
        rows (a graph's fixed grids: a row of 0 pieces is padding, which the kernels skip)."""
        if len(self.items) > items or len(self.combines) > combines:
            raise ValueError(f"{len(self.items)} items and {len(self.combines)} combines do "
                             f"not fit {items} and {combines}")
        padded_items = np.zeros((items, 4), np.int32)
        padded_items[:len(self.items)] = self.items
        padded_combines = np.zeros((combines, 2), np.int32)
        padded_combines[:len(self.combines)] = self.combines
        return padded_items, padded_combines


def item_capacity(tokens: int, seqs: int, num_kv_heads: int, ratio: int, bm: int) -> int:
    """The most unsplit items any step of up to ``tokens`` query rows over up to ``seqs``
    sequences has: per kv head, sum over sequences of ceil(q_len * ratio / bm), at most
    ``tokens * ratio / bm`` plus one a sequence."""
    return num_kv_heads * (-(-tokens * ratio // bm) + min(seqs, tokens))


def plan_prefill(query_lens: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int, ratio: int,
                 bm: int, bn: int, slots: int, max_pieces: int | None = None) -> PrefillWork:
    """The work items of one launch over checked host lengths (``query_lens[s] >= 1``,
    ``query_lens[s] <= seq_lens[s]``; ValueError where a length is less than its query's):
    every ``bm`` packed rows of every sequence and kv head, their KV ranges cut into pieces
    where the items are too few for PIECE_WAVES waves of ``slots`` CTAs, unless that takes
    more than ``max_pieces`` pieces (records). In C (``_prefill.prefill_items``), by this
    rule: an item of ``tiles = ceil(hi / bn)`` KV tiles is cut into ``max(1, tiles //
    target)`` pieces, ``target = max(MIN_PIECE_TILES, ceil(all items' tiles / (PIECE_WAVES
    * slots)))``, then evened out (``per = ceil(tiles / pieces)`` tiles a piece, ``pieces =
    ceil(tiles / per)``); no item is cut past ``max_pieces``. Items are ordered split first,
    each group by descending cost (``min(per * bn, hi) + ITEM_COST``), ties in (sequence, kv
    head, row tile) order, each item's pieces consecutive."""
    items, combines, q_starts, num_pieces = prefill_items(
        np.ascontiguousarray(query_lens, np.int64), np.ascontiguousarray(seq_lens, np.int64),
        num_kv_heads, ratio, bm, bn, slots, -1 if max_pieces is None else max_pieces,
        PIECE_WAVES, MIN_PIECE_TILES, ITEM_COST)
    return PrefillWork(items, combines, q_starts, num_pieces)


def leading_decodes(query_lens: np.ndarray) -> int:
    """How many of a step's sequences lead it with one query row each: the decodes, which
    the decode kernel takes; the multi-token kernel takes the rest."""
    ones = np.asarray(query_lens) == 1
    first = int(ones.argmin()) if len(ones) else 0  # the first longer one (0: none, or all)
    return len(ones) if not len(ones) or ones[first] else first


def prefill_launch(backend: object, device: int, dtype: np.dtype, head_dim: int,
                   cache_dtype: np.dtype, query_lens: np.ndarray, seq_lens: np.ndarray,
                   num_kv_heads: int, ratio: int, capped: bool = False
                   ) -> tuple[PrefillKernel, PrefillWork]:
    """The instance for a multi-token launch over these lengths (``prefill_wm`` by its
    longest packed-row run; ``capped``: with a logit cap), loaded, and the launch's work
    (``plan_prefill``)."""
    wm = prefill_wm(backend.name, dtype, head_dim,  # type: ignore[attr-defined]
                    int(np.max(query_lens)) * ratio)
    found = prefill_kernel(backend, device, dtype, head_dim, cache_dtype, wm, capped)
    work = plan_prefill(query_lens, seq_lens, num_kv_heads, ratio, found.shape.bm,
                        found.shape.bn, found.slots)
    return found, work
