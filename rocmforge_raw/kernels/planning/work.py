"""The work split of one attention launch: units of (sequence, group of query heads) laid
end to end, one wave of CTAs with equal shares, or one CTA a unit where the units make waves
enough for the hardware's scheduler to even them out (native/pa_work.h walks it on the
device)."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...common.checks import show
from ._worksplit import first_sequences, prefix_sums, split_lengths

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
#: docs/kernels.md v21: 1 x 32768 57 -> 52 us on 256 CTAs instead of 391, 1 x 8192 27 ->
#: 22; measured up to 1.52 times the balanced share, so at least 5/8 of the slots stay busy).
ALIGNED_SHARE_TOKENS = 1024
ALIGNED_STRETCH = 1.6
#: With the device's multiprocessors known, a launch of at most one wave of units pads each
#: sequence's work up to a multiple of the share instead (``_worksplit.padded_share``):
#: every CTA then holds one piece of one unit, whatever the lengths. The share is the one
#: whose busiest multiprocessor does least, each piece counted in whole PIECE_QUANTUM_TOKENS
#: (a tile of the 16-bit head_dim 128 NVIDIA instances) plus PIECE_COST_TOKENS for its fixed
#: work (H200, docs/kernels.md v27: 8 x 976 tokens 22.3 -> 17.5 us a launch, 16 x 8192 with 64/8
#: heads 148.7 -> 144.7 us).
PIECE_COST_TOKENS = 32
PIECE_QUANTUM_TOKENS = 64
#: ... taken only where its busiest multiprocessor's load is at most this many times the
#: balanced split's, which cuts units anywhere (that costs 15-25 % the model does not count;
#: lengths far apart would leave a long sequence to one CTA of a padded split).
PAD_MARGIN = 1.15
#: A launch of many units takes one CTA a unit instead of one wave of equal shares, where
#: there are at least this many waves of units (and the longest unit is at most this
#: fraction's inverse of a slot's work): the hardware starts a CTA wherever one ends, which
#: evens out the multiprocessors' uneven speeds that a wave of equal shares leaves as its
#: tail, and no unit is split (H100, docs/kernels.md v30: 256 x 512 3.6 % faster, ragged
#: 512 x U[1, 2048] 3-14 %; 64 x 4096, at 1.3 waves, 1 % slower, its fp8 14 %). The
#: instance's own (``split_rule_of``): head_dim 256 takes 4 (at 2.6 waves 0.5-2.6 % slower).
WHOLE_UNIT_WAVES = 2.0
WHOLE_UNIT_WAVES_WIDE = 4.0
#: A padded split may put one CTA on a multiprocessor where its pieces occupy at least this
#: fraction of them, for the instances whose one CTA streams at the copy's rate alone
#: (``lone_fill``: 16-bit head_dim 128 on NVIDIA; H100, v30: 16 x 8192 with 64/8 heads 2.2
#: % faster unsplit; fp8, head_dim 256 and the narrow head_dim 64 instances 17-33 % slower).
LONE_CTA_FILL = 0.9
#: Units of at least this many work tokens (their mean within a tenth of the longest) run one
#: CTA a unit at one CTA fewer a multiprocessor (``AttentionKernel.lean_shared_bytes``),
#: where their waves fill that occupancy better (``_worksplit._lean``; H100, v30:
#: 64 x 4096 3 % and 32 x 2048 with 32/32 heads 1.1 % faster; 256 x 512's short units 2.8 %
#: slower, so they keep the natural occupancy).
LEAN_UNIT_TOKENS = 2048


@dataclass(frozen=True)
class WorkSplit:
    """How one attention launch divides its work (``native/paged_attention.cu``, top): units
    (sequence, group of query heads of one kv head), ``groups`` per sequence, laid end to end,
    each ``len16`` work tokens long; CTA ``c`` of ``num_ctas`` takes work tokens
    ``[c * per_cta, min((c + 1) * per_cta, total))``.

    With the lengths known on the host, ``cum16`` (int64 ``[num_seqs + 1]``, exclusive prefix
    sums of each sequence's ``len16``, which a padded split rounds up to whole ``per_cta``:
    the kernel skips what lies past a sequence's length) and ``first_seq`` (int32
    ``[num_ctas]``, the sequence holding each CTA's first work token) go to the device;
    without them (None) every sequence counts ``uniform16`` work tokens (the tables' width,
    padded alike) and the kernel skips what its length lacks. ``whole``: no unit is cut
    across CTAs (no partial records); ``lean``: the launch runs at the kernel's lean
    occupancy (one CTA a multiprocessor fewer: ``AttentionKernel.lean_shared_bytes``).
    """

    num_ctas: int
    per_cta: int
    total: int
    groups: int
    uniform16: int
    cum16: np.ndarray | None = None
    first_seq: np.ndarray | None = None
    whole: bool = False
    lean: bool = False

    @property
    def arrays(self) -> list[np.ndarray]:
        """The arrays the kernel reads from device memory (none in uniform mode)."""
        return [] if self.cum16 is None else [self.cum16, self.first_seq]


def _round16(tokens: int) -> int:
    """Work tokens of a sequence of ``tokens``: rounded up to WORK_GRANULE, at least that."""
    return max(WORK_GRANULE, -(-tokens // WORK_GRANULE) * WORK_GRANULE)


#: The most tokens a sequence may count: padded to a multiple of its share (at most its own
#: work again), its work stays within the kernel's int32 positions.
MAX_TOKENS = 1 << 30


#: The share rule's constants, as ``_worksplit`` takes them.
_RULE = (WORK_GRANULE, MIN_TOKENS_PER_CTA, ALIGNED_SHARE_TOKENS, ALIGNED_STRETCH)


#: ``plan_work``'s rule beyond the device's multiprocessors: (whole_waves, lone_fill,
#: lean_slots, lean_tokens), an instance's (``AttentionKernel.rule``).
Rule = tuple[float, float, int, int]
NO_RULE: Rule = (0.0, 0.0, 0, 0)


_RULES_SEEN: set[Rule] = {NO_RULE}  # rules found well-formed (a few: one an instance)


def _checked(rule: Any) -> Rule:
    """``rule`` if it is a Rule: (whole_waves, lone_fill, lean_slots, lean_tokens), numbers
    at least 0, lone_fill at most 1 and the last two whole; else ValueError naming it. A
    rule seen before costs one lookup (plan_work runs per ``ops.paged_attention`` call)."""
    try:
        if type(rule) is tuple and rule in _RULES_SEEN:
            return rule
    except TypeError:  # an unhashable member: not a rule (refused below)
        pass
    if (isinstance(rule, tuple) and len(rule) == 4
            and all(isinstance(x, numbers.Real) and x >= 0 for x in rule) and rule[1] <= 1
            and all(isinstance(x, numbers.Integral) for x in rule[2:])):
        if len(_RULES_SEEN) < 64:
            _RULES_SEEN.add(rule)
        return rule
    raise ValueError("rule must be (whole_waves, lone_fill, lean_slots, lean_tokens): numbers "
                     f"at least 0, lone_fill at most 1, the last two whole; got {show(rule)}")


def split_rule(sms: int, rule: Rule = NO_RULE
               ) -> tuple[int, int, int, float, int, int, int, float, float, float, int, int]:
    """Every constant of ``plan_work``'s split of real lengths on a device of ``sms``
    multiprocessors for an instance's ``rule`` (``AttentionKernel.rule``), in
    ``_worksplit.split_lengths``' order from ``granule`` on (what ``_pack.pack_step``
    takes)."""
    return (*_RULE, sms, PIECE_COST_TOKENS, PIECE_QUANTUM_TOKENS, PAD_MARGIN, *rule)


def plan_work(groups: int, slots: int, num_seqs: int, lens: np.ndarray | None = None,
              max_len: int = 0, num_partitions: int | None = None, sms: int = 0,
              rule: Rule = NO_RULE) -> WorkSplit:
    """The split of ``num_seqs`` sequences x ``groups`` units over a device that runs
    ``slots`` CTAs at once on ``sms`` multiprocessors (0: not known): one wave of CTAs with
    equal shares (at least ``MIN_TOKENS_PER_CTA`` tokens each), aligned to the units: padded
    to whole pieces where the units fit one wave (``PIECE_COST_TOKENS``, ``PAD_MARGIN``;
    ``rule``'s lone_fill), else where the shares are short and the units of one length
    (``ALIGNED_SHARE_TOKENS``); one unit a CTA where the units make ``rule``'s whole_waves
    waves or more (``WHOLE_UNIT_WAVES``; 0: never), or fill its lean_slots' waves better
    (``lean``), and ``sms`` is known.
    ``lens`` (host, int32) gives each sequence's length; without it every sequence counts
    ``max_len``. ``num_partitions`` instead cuts the longest sequence into that many pieces
    (a test and tuning knob). Without ``num_partitions`` it is one call into the compiled
    core (``_worksplit.split_lengths``), ``max_len`` standing for every length where
    ``lens`` is not given: both modes split by the same rule."""
    rule = _checked(rule)
    if lens is None and not (isinstance(max_len, numbers.Integral)
                             and 0 <= max_len <= MAX_TOKENS):
        raise ValueError(f"max_len (the block tables' width x block_size) must be a whole "
                         f"number of tokens, 0 to {MAX_TOKENS}, got {show(max_len)}")
    if num_partitions is None and lens is None:
        return _uniform_split(groups, slots, num_seqs, int(max_len), sms, rule)
    if num_partitions is None:  # one call into the compiled core
        num_ctas, per_cta, total, cum16, first_seq, whole, lean = split_lengths(
            np.ascontiguousarray(lens, np.int32), groups, slots, *split_rule(sms, rule))
        return WorkSplit(num_ctas, per_cta, total, groups, 0, cum16, first_seq, whole, lean)
    if lens is not None:
        cum16 = np.empty(num_seqs + 1, np.int64)
        lens = np.ascontiguousarray(lens, np.int32)
        total = prefix_sums(lens, WORK_GRANULE, cum16) * groups
        longest = int(_round16(int(lens.max(initial=0))))
        uniform16 = 0
    else:
        cum16, uniform16 = None, int(_round16(max_len))
        total, longest = num_seqs * groups * uniform16, uniform16
    share = -(-longest // max(1, int(num_partitions)))
    per_cta = -(-share // WORK_GRANULE) * WORK_GRANULE
    num_ctas = -(-total // per_cta)
    first_seq = None
    if cum16 is not None:
        first_seq = np.empty(num_ctas, np.int32)
        first_sequences(cum16, groups, per_cta, first_seq)
    whole = cum16 is None and num_seqs > 0 and per_cta % uniform16 == 0  # whole units a CTA
    return WorkSplit(num_ctas, per_cta, total, groups, uniform16, cum16, first_seq, whole,
                     False)


@functools.lru_cache(maxsize=64)
def _uniform_split(groups: int, slots: int, num_seqs: int, max_len: int, sms: int,
                   rule: Rule) -> WorkSplit:
    """``plan_work``'s uniform mode: the compiled split of ``num_seqs`` lengths of
    ``max_len``, whose padded work per sequence is the kernel's ``uniform16`` (it places
    the units itself: no arrays). Cached: a decode loop asks the same few (a WorkSplit
    without arrays is immutable)."""
    num_ctas, per_cta, total, cum16, _, whole, lean = split_lengths(
        np.full(num_seqs, max_len, np.int32), groups, slots, *split_rule(sms, rule),
        with_first_seq=False)
    stride = int(cum16[1] - cum16[0]) if num_seqs else _round16(max_len)
    return WorkSplit(num_ctas, per_cta, total, groups, stride, None, None, whole, lean)


def split_workspace(num_ctas: int, group: int, head_dim: int, num_units: int,
                    whole: bool = False) -> tuple[int, int]:
    """(bytes of partials, int32 counters) of a launch of ``num_ctas`` CTAs of ``group``
    query heads over ``num_units`` units: two partial slots per CTA (its first and last piece
    may be parts of units split with its neighbours), each a record per query head of
    ``head_dim`` floats, the (max, sum) pair and two unused floats (so records are 16-byte
    aligned), none where the split is ``whole`` (no unit cut: a split of one CTA a unit may
    have many more CTAs than a wave, and writes no record); one counter per unit. Records
    sit at fixed places whatever the CTA count, so a prepared launch keeps its workspace
    address."""
    return 0 if whole else 2 * num_ctas * group * (head_dim + 4) * 4, num_units
