"""A StepGraph for a token budget (``KvCache.step_graph(token_budget=...)``): one capture
replays every step of up to ``tokens`` query tokens over up to ``seqs`` sequences,
whatever its composition: which sequences, how many decodes, how long each chunk.

A graph fixes every grid and address, so each replay lays its step out in fixed regions of
the uploaded metadata:

- rows ``0 .. seqs - 1`` of the tables and lengths are the decode launch's: the step's
  decodes, then padding rows of one token in the null block (their outputs land in rows the
  multi-token launch writes after them, or past the step's rows); its split is captured for
  room that the step's sequences may grow into (``padded_work`` spreads each replay's work
  over it, the kernel skipping what lies past each length);
- rows ``seqs .. 2 seqs - 1`` are the multi-token launch's sequences, their query rows found
  by absolute starts (a step's first chunk starts at its decode count); its grid holds
  ITEM_SLACK times the capture's own items (at most ``item_capacity``, the most any step
  has), a step's items first and no-op padding after them, and its pieces are cut only up
  to a fixed number of records;
- the K/V write runs over ``tokens`` rows, the slots past the step's rows -1.

A step re-captures where it has more sequences than a region, a wider table, more decode
work than the room or more items than the grid. Every layer's activations have ``tokens``
rows; a step uses the first ``sum(query_lens)`` of them, and output rows past those hold no
result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels.planning import WORK_GRANULE, AttentionPlan, attention_kernel, plan_work
from ...kernels.planning._worksplit import prefix_sums
from ...kernels.planning.prefill import (
    PrefillWork,
    item_capacity,
    leading_decodes,
    plan_prefill,
    prefill_kernel,
    prefill_wm,
)
from .graph_layout import Activations, CapturePlan, padded_work
from .metadata import BatchMetadata

#: The sequences a budget graph holds in each region unless ``max_seqs`` says otherwise.
DEFAULT_MAX_SEQS = 256
#: A budget capture's multi-token grid holds this many times its step's items.
ITEM_SLACK = 1.25


@dataclass(frozen=True)
class BudgetShape:
    """What a budget capture fixed: the activations (``tokens`` rows each), ``seqs`` rows of
    each region, the tables' ``width``, the decode split (``groups`` units a sequence,
    ``total`` work tokens in ``num_ctas`` CTAs of ``per_cta``, at most ``bound`` a group),
    and the multi-token grids: ``items`` items, ``pieces`` records, ``combines`` combines,
    planned with ``prefill`` = (num_kv_heads, ratio, bm, bn, slots)."""

    activations: Activations
    tokens: int
    seqs: int
    width: int
    groups: int
    total: int
    per_cta: int
    num_ctas: int
    bound: int
    items: int
    pieces: int
    combines: int
    prefill: tuple[int, int, int, int, int]

    def arrays(self, activations: Activations, meta: BatchMetadata) -> list[np.ndarray] | None:
        """What a replay of ``meta``'s step uploads (tables, lengths, slots, the decode
        split's ``cum16`` and ``first_seq``, query starts, items, combines), or None where
        the step does not fit this capture."""
        lens, tables = meta.seq_lens, meta.block_tables
        n = len(lens)
        q_lens = (np.ones(n, np.int32) if meta.query_lens is None else meta.query_lens)
        decodes = leading_decodes(q_lens)
        if (activations != self.activations or int(q_lens.sum()) > self.tokens
                or decodes > self.seqs or n - decodes > self.seqs
                or tables.shape[1] > self.width):
            return None
        seqs = self.seqs
        all_tables = np.zeros((2 * seqs, self.width), np.int32)
        all_tables[:decodes, :tables.shape[1]] = tables[:decodes]
        all_tables[seqs:seqs + n - decodes, :tables.shape[1]] = tables[decodes:]
        all_lens = np.zeros(2 * seqs, np.int32)
        all_lens[:seqs] = 1  # padding decodes: one token of the null block
        all_lens[:decodes] = lens[:decodes]
        all_lens[seqs:seqs + n - decodes] = lens[decodes:]
        work = padded_work(all_lens[:seqs], self.groups, self.total, self.per_cta,
                           self.num_ctas, self.bound)
        multi = self.multi_work(q_lens[decodes:], lens[decodes:], decodes)
        if work is None or multi is None:
            return None
        slots = np.full(self.tokens, -1, np.int64)
        slots[:len(meta.slot_mapping)] = meta.slot_mapping
        return [all_tables, all_lens, slots, *work, *multi]

    def multi_work(self, q_lens: np.ndarray, lens: np.ndarray, first_row: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The multi-token launch's query starts (absolute: from ``first_row``; the rows
        past its sequences start where they end), items and combines, padded to this
        capture's grids; None where its items do not fit."""
        ends = first_row + np.cumsum(q_lens, dtype=np.int64)
        starts = np.full(self.seqs + 1, ends[-1] if len(ends) else first_row, np.int32)
        starts[0] = first_row
        starts[1:len(ends) + 1] = ends
        if not len(q_lens):
            return (starts, np.zeros((self.items, 4), np.int32),
                    np.zeros((self.combines, 2), np.int32))
        for max_pieces in (self.pieces, 0):  # cut into pieces where they fit, else whole
            work = plan_prefill(q_lens, lens, *self.prefill, max_pieces=max_pieces)
            if len(work.items) <= self.items and len(work.combines) <= self.combines:
                return (starts, *work.padded(self.items, self.combines))
        return None


def plan_budget(graph: Any, meta: BatchMetadata, activations: Activations, tokens: int,
                max_seqs: int, q_heads: int) -> CapturePlan:
    """The capture of a budget graph for ``tokens`` query rows, sized from ``meta``'s step:
    ``max_seqs`` sequences a region (more where the step has more decodes or more other
    sequences; never more than ``tokens``), the tables' width and the decodes' split room
    for every sequence of the step to grow by ``graph.headroom`` tokens (and as many for
    each row it leaves free)."""
    cache, backend, device = graph.cache, graph.backend, graph.device
    c, act = cache.config, cache._steps.act
    lens = meta.seq_lens.astype(np.int64)
    n = len(lens)
    decodes = n if meta.query_lens is None else leading_decodes(meta.query_lens)
    seqs = min(max(max_seqs, decodes, n - decodes), tokens)
    room = decode_room(lens, seqs, graph.headroom)
    width = max(meta.block_tables.shape[1], -(-int(room.max()) // c.block_size))
    found = attention_kernel(backend, device, act, c.head_dim, q_heads // c.num_kv_heads,
                             c.dtype)
    room32 = room.astype(np.int32)
    split = plan_work(c.num_kv_heads * found.groups, found.slots, seqs, room32,
                      sms=found.sms, rule=found.rule)
    bound = prefix_sums(room32, WORK_GRANULE, np.empty(seqs + 1, np.int64))
    decode = AttentionPlan(found.kernel, found.group, split, found.shared_for(split), seqs,
                           q_heads, c.num_kv_heads, c.head_dim, c.block_size, width)
    ratio = q_heads // c.num_kv_heads
    wm = prefill_wm(backend.name, act, c.head_dim, tokens * ratio)
    kernel = prefill_kernel(backend, device, act, c.head_dim, c.dtype, wm)
    bm, bn = kernel.shape.bm, kernel.shape.bn
    items = _item_grid(graph.shape, meta, c.num_kv_heads, ratio, (bm, bn, kernel.slots),
                       item_capacity(tokens, seqs, c.num_kv_heads, ratio, bm))
    pieces = min(items, kernel.slots)
    shape = BudgetShape(activations, tokens, seqs, width, c.num_kv_heads * found.groups,
                        split.total, split.per_cta, split.num_ctas, bound, items, pieces,
                        max(pieces // 2, 1), (c.num_kv_heads, ratio, bm, bn, kernel.slots))
    arrays = shape.arrays(activations, meta)
    if arrays is None:
        raise ValueError(f"a step of {n} sequences and {len(meta.slot_mapping)} query tokens "
                         f"does not fit a graph of {tokens} tokens over {seqs} sequences")
    *_, starts, items_array, combines = arrays
    work = PrefillWork(items_array, combines, starts, pieces)  # (the grids' sizes)
    return CapturePlan(shape, arrays, decode, (kernel, work), prefill_row=seqs, q_offset=0,
                       fixed=False)


def decode_room(lens: np.ndarray, seqs: int, headroom: int) -> np.ndarray:
    """Tokens each of the ``seqs`` decode rows of a budget capture may hold (int64): the
    step's longest ``seqs`` sequences (any may decode later), each grown by ``headroom``,
    and ``headroom`` for each row left over."""
    room = np.full(seqs, headroom, np.int64)
    longest = np.sort(np.asarray(lens, np.int64))[::-1][:seqs]
    room[:len(longest)] += longest
    return room


def _item_grid(old: Any, meta: BatchMetadata, num_kv_heads: int, ratio: int,
               tile: tuple[int, int, int], bound: int) -> int:
    """The multi-token grid of a budget capture: ITEM_SLACK times the items of ``meta``'s
    step, at least the last budget capture's (``old``) and 2 a kv head, at most ``bound``
    (the most any step of the budget has): each padding item costs a CTA that does nothing,
    and a later step of more items than the grid re-captures."""
    q_lens = meta.query_lens
    decodes = len(meta.seq_lens) if q_lens is None else leading_decodes(q_lens)
    step = 0
    if q_lens is not None and decodes < len(q_lens):
        step = len(plan_prefill(q_lens[decodes:], meta.seq_lens[decodes:], num_kv_heads,
                                ratio, *tile).items)
    least = old.items if isinstance(old, BudgetShape) else 0
    return min(bound, max(least, math.ceil(ITEM_SLACK * step), 2 * num_kv_heads))
