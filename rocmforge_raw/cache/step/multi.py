"""The launches of a step with many query tokens per sequence (``KvCache.batch(seq_ids,
query_lens=...)``): prefill chunks, prefix-hit tails and drafted tokens mixed with decodes.

A step lists its decodes first (the Scheduler's order); those leading one-row sequences run
in the decode kernel over the first rows of the step's tables and lengths, the rest in the
multi-token kernel (``native/prefill.cu``) over the rows after them: two launches a layer
(three where the multi-token items were cut into pieces: their combine). Everything is
planned and uploaded with the step's metadata, every argument packed but the per-layer
pointers, so a layer's attention is two or three launches from C.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...common import checks
from ...kernels.planning import SCALE_ARG, SINKS_ARG, plan_work, split_workspace, window_work
from ...kernels.planning.prefill import (
    PrefillKernel,
    PrefillWork,
    leading_decodes,
    prefill_launch,
)
from ...kernels.staging import Staging
from ...memory.stream import Stream
from ...runtime._launch import Launch
from ..blocks._rows import query_slots as _query_slots

#: Indices in the multi-token kernel's arguments: the pointers a layer replaces (out, q, k,
#: v), the scale and the fp8 output scale.
PREFILL_PATCH = (0, 2, 3, 4)
PREFILL_SCALE_ARG, PREFILL_OUT_SCALE_ARG, PREFILL_SOFTCAP_ARG = 9, 14, 15
#: The sinks' address in the multi-token kernel's arguments and in its combine's.
PREFILL_SINKS_ARG, COMBINE_SINKS_ARG = 16, 8
#: The arguments a step changes in a reused multi-token launch (partials, tables, lengths,
#: query starts, items, table width) and in its combine (partials, items, combines, starts).
STEP_PREFILL_ARGS, STEP_COMBINE_ARGS = (1, 5, 6, 7, 8, 12), (1, 2, 3, 4)


def query_slots(tables: np.ndarray, lens: np.ndarray, query_lens: np.ndarray,
                ref_cnt: np.ndarray, block_size: int) -> np.ndarray:
    """The slots of each sequence's last ``query_lens`` tokens (int64, sequence by sequence):
    where a step writes their K/V; -1 for a token in a block another sequence shares (a
    prefix hit, a fork) that an earlier sequence of the step writes already (the first one
    whose rows reach the block writes it: a prompt and a hit on its fresh blocks in one
    step). One loop in C (``_rows``)."""
    found: np.ndarray = _query_slots(_int32("tables", tables), _int32("lens", lens),
                                     _int32("query_lens", query_lens),
                                     _int32("ref_cnt", ref_cnt), block_size)
    return found


def _int32(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as int32, refused (naming them) where that would change one."""
    array = np.asarray(values)
    limits = np.iinfo(np.int32)
    if array.dtype != np.int32 and (array.dtype.kind not in "iu" or (array.size > 0 and (
            array.min() < limits.min or array.max() > limits.max))):
        raise ValueError(f"{name} must be int32 values, got {array.dtype} "
                         f"{checks.show(array)}")
    return array.astype(np.int32, copy=False)


@dataclass
class MultiLaunch:
    """A layer's attention for a multi-token step: the decode launch of the leading
    ``decodes`` sequences (None without), the multi-token launch of the rest, whose query
    and output rows start ``offset`` bytes in, and its combine (None without pieces)."""

    decode: Launch | None
    prefill: Launch | None
    combine: Launch | None
    offset: int

    def __call__(self, out: int, query: int, k: int, v: int) -> None:
        if self.decode is not None:
            self.decode(out, query, k, v)
        if self.prefill is not None:
            self.prefill(out + self.offset, query + self.offset, k, v)
        if self.combine is not None:
            self.combine(out + self.offset)

    def set_float(self, index: int, value: float) -> None:
        """``Launch.set_float`` of the decode launch's SCALE_ARG or OUT_SCALE_ARG, for
        every launch of the layer (the planner sets a step's scales so)."""
        if self.decode is not None:
            self.decode.set_float(index, value)
        if self.prefill is not None:
            self.prefill.set_float(PREFILL_SCALE_ARG if index == SCALE_ARG
                                   else PREFILL_OUT_SCALE_ARG, value)

    def set_sinks(self, address: int) -> None:
        """Every launch of the layer reads its sinks at ``address`` (0: none)."""
        if self.decode is not None:
            self.decode.set_ints((SINKS_ARG,), (address,))
        if self.prefill is not None:
            self.prefill.set_ints((PREFILL_SINKS_ARG,), (address,))
        if self.combine is not None:
            self.combine.set_ints((COMBINE_SINKS_ARG,), (address,))


def plan_multi(planner: Any, staging: Staging, num_q_heads: int, lens: np.ndarray,
               query_lens: np.ndarray, width: int, addresses: list[int],
               stream: Stream | None) -> tuple[MultiLaunch, dict[int, MultiLaunch]]:
    """Plan and prepare a multi-token step's attention: ``addresses`` are the step's
    uploaded slots, lengths and tables; the work arrays are appended to ``staging``'s
    upload. ``planner`` is the cache's ``StepPlanner``. Returns the launches over every
    token and, in a cache with windows, those of each window a sequence outgrows (window
    -> launches): the multi-token items are the same (the kernel finds each item's window
    itself), the leading decodes' split is the window's (``window_work``). Every launch
    shares the slot's workspace, sized for the largest of them before any is prepared."""
    c = planner.config
    _, lens_at, tables_at = addresses
    num_seqs = len(lens)
    decodes = leading_decodes(query_lens)
    longest = int(lens.max())
    windows = [0, *(w for w in planner.window_values if longest > w)]
    found_pf, plan, partial_bytes = None, None, 0
    if decodes < num_seqs:
        found_pf, plan = prefill_launch(planner.backend, planner.device, planner.act,
                                        c.head_dim, c.dtype, query_lens[decodes:],
                                        lens[decodes:], c.num_kv_heads,
                                        num_q_heads // c.num_kv_heads, bool(planner.softcap))
        partial_bytes = plan.partial_bytes(found_pf.shape.bm, c.head_dim)
    found = planner._kernel(num_q_heads) if decodes else None
    works = {}
    if found is not None:
        head = lens[:decodes]
        works = {w: plan_work(c.num_kv_heads * found.groups, found.slots, decodes,
                              window_work(head, w) if w else head, sms=found.sms,
                              rule=found.rule) for w in windows}
    sizes = [split_workspace(work.num_ctas, found.group, c.head_dim,
                             decodes * c.num_kv_heads * found.groups, work.whole)
             for work in works.values()] if found is not None else []
    partials = staging.workspace.get(max([partial_bytes, *(size[0] for size in sizes)]),
                                     max([0, *(size[1] for size in sizes)]), planner.slab,
                                     stream)[0].ptr
    prefill_at = None
    if found_pf is not None and plan is not None:
        starts_at, items_at, *combines_at = staging.put(plan.arrays, stream, append=True)
        prefill_at = (starts_at, items_at, combines_at[0] if combines_at else 0)
    launches = {}
    for window in windows:
        decode = None
        if found is not None:
            work = works[window]
            arrays = staging.put(work.arrays, stream, append=True) if work.arrays else [0, 0]
            decode = planner._attention_launch(
                staging, found, num_q_heads, decodes,
                (work.num_ctas, work.per_cta, work.total, work.whole, work.lean), width,
                [addresses[0], lens_at, tables_at, *arrays], stream, window)
        if found_pf is None or plan is None or prefill_at is None:  # decodes only
            launches[window] = MultiLaunch(decode, None, None, 0)
            continue
        prefill, combine = prefill_launches(
            found_pf, plan, partials, tables_at + 4 * decodes * width, lens_at + 4 * decodes,
            *prefill_at, planner.default_scale, num_q_heads, c.num_kv_heads, width,
            c.block_size, stream, staging.launches, planner.softcap, window)
        offset = decodes * num_q_heads * c.head_dim * planner.act.itemsize
        launches[window] = MultiLaunch(decode, prefill, combine, offset)
    return launches.pop(0), launches


def prefill_launches(found: PrefillKernel, work: PrefillWork, partials: int, tables_at: int,
                     lens_at: int, starts_at: int, items_at: int, combines_at: int,
                     scale: float, num_q_heads: int, num_kv_heads: int, width: int,
                     block_size: int, stream: Stream | None,
                     launches: dict[Any, Any] | None = None, softcap: float = 0.0,
                     window: int = 0) -> tuple[Launch, Launch | None]:
    """The multi-token launch of ``work`` and its combine (None without pieces), every
    argument packed but the per-layer pointers: the tables and lengths of its sequences
    (at ``tables_at``/``lens_at``, ``width`` blocks a row), their query starts, items and
    combines where uploaded, and ``partials`` for the pieces' records. With ``launches``
    (a staging slot's), launches prepared by an earlier step of that slot are reused, given
    this step's grids and every argument that may differ (``STEP_PREFILL_ARGS``,
    ``STEP_COMBINE_ARGS``, the scales): the bytes they pass are those a fresh ``prepare``
    packs, at a tenth of its host time. ``softcap``: the logit cap (0: none; the instance
    ``found`` must be a capped one for a cap), ``window`` the sliding window (tokens, 0:
    none; launches are kept per window); the sinks start at none."""
    i32, f32 = np.int32, np.float32
    shape = found.shape
    key = (found.kernel, num_q_heads, num_kv_heads, block_size, stream, window)
    prefill = None if launches is None else launches.get(("prefill", key))
    if prefill is None:
        prefill = found.kernel.prepare(
            len(work.items), found.threads, 0, partials, 0, 0, 0, tables_at, lens_at,
            starts_at, items_at, f32(scale), i32(num_q_heads), i32(num_kv_heads), i32(width),
            i32(block_size.bit_length() - 1), f32(1.0), f32(softcap), 0, i32(window),
            shared_bytes=shape.shared_bytes, stream=stream, patch=PREFILL_PATCH)
        if launches is not None:
            launches[("prefill", key)] = prefill
    else:
        prefill.set_grid(len(work.items))
        prefill.set_ints(STEP_PREFILL_ARGS, (partials, tables_at, lens_at, starts_at, items_at,
                                             width))
        prefill.set_float(PREFILL_SCALE_ARG, scale)
        prefill.set_float(PREFILL_OUT_SCALE_ARG, 1.0)
        prefill.set_float(PREFILL_SOFTCAP_ARG, softcap)
        prefill.set_ints((PREFILL_SINKS_ARG,), (0,))
    if not len(work.combines):
        return prefill, None
    combine = None if launches is None else launches.get(("combine", key))
    if combine is None:
        combine = found.combine.prepare(
            len(work.combines), found.threads, 0, partials, items_at, combines_at, starts_at,
            i32(num_q_heads), i32(num_kv_heads), i32(shape.bm), 0, stream=stream, patch=(0,))
        if launches is not None:
            launches[("combine", key)] = combine
    else:
        combine.set_grid(len(work.combines))
        combine.set_ints(STEP_COMBINE_ARGS, (partials, items_at, combines_at, starts_at))
        combine.set_ints((COMBINE_SINKS_ARG,), (0,))
    return prefill, combine
