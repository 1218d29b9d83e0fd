"""Reservation: what ``KvCache.add_sequence`` and ``append`` reserved, and what they preempted
to make room."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Reservation:
    """Slots reserved by ``add_sequence``/``append`` (int64, ``-1`` for a sequence that was
    preempted instead), the ids preempted to make room and, for a prompt given by its
    tokens, how many leading tokens the prefix cache already holds (their K/V need not be
    written: prefill ``slot_mapping[num_cached_tokens:]``). Of the preempted, ``swapped``
    lists those swapped out to the host tier (``swap_in`` brings them back as they were);
    the others were dropped (their tokens must be computed again)."""

    slot_mapping: np.ndarray
    preempted: list[Hashable]
    num_cached_tokens: int = 0
    swapped: list[Hashable] = field(default_factory=list)

    @classmethod
    def _plain(cls, slot_mapping: np.ndarray) -> Reservation:
        """``Reservation(slot_mapping, [])`` without the frozen ``__init__``'s
        ``object.__setattr__`` per field (an append's common case)."""
        made = cls.__new__(cls)
        made.__dict__.update(slot_mapping=slot_mapping, preempted=[], num_cached_tokens=0,
                             swapped=[])
        return made
