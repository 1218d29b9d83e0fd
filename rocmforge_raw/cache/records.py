"""Records of finished work, bounded by count and by age, so nothing grows without limit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class FinishedRecords:
    """At most ``max_count`` records, none older than ``ttl_s`` seconds of ``clock``; the
    oldest go first. Not locked: its owner's lock covers it."""

    def __init__(self, max_count: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.max_count, self.ttl_s, self.clock = max_count, ttl_s, clock
        self._records: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def add(self, key: Hashable, value: Any, now: float | None = None) -> None:
        """Record ``value`` for ``key`` at ``now`` (default: the clock's time)."""
        now = self.clock() if now is None else now
        self._records[key] = (now, value)
        self._records.move_to_end(key)
        self.prune(now)

    def prune(self, now: float | None = None) -> None:
        horizon = (self.clock() if now is None else now) - self.ttl_s
        records = self._records
        while records and (len(records) > self.max_count
                           or next(iter(records.values()))[0] < horizon):
            records.popitem(last=False)

    def snapshot(self) -> dict[Hashable, Any]:
        """The records still kept, oldest first: key -> value."""
        self.prune()
        return {key: value for key, (_, value) in self._records.items()}

    def __len__(self) -> int:
        return len(self._records)
