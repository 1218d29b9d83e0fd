"""Records of finished work, bounded by count and by age, so nothing grows without limit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from ..common import checks


class FinishedRecords:
    """At most ``max_count`` records (>= ``least``), none older than ``ttl_s`` seconds (>= 0)
    of ``clock`` (a callable returning seconds); the oldest go first. Not locked: its
    owner's lock covers it. The arguments are checked here, for every owner."""

    def __init__(self, max_count: int, ttl_s: float, clock: Callable[[], float],
                 least: int = 0) -> None:
        self.max_count = checks.integer(max_count, "max_finished", least)
        self.ttl_s = checks.real(ttl_s, "finished_ttl_s", 0.0)
        self.clock: Callable[[], float] = checks.function(clock, "clock",
                                                          "a callable returning seconds")
        self._records: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def now(self) -> float:
        """The clock's time, checked to be a finite number."""
        return checks.real(self.clock(), "clock()")

    def add(self, key: Hashable, value: Any, now: float | None = None) -> None:
        """Record ``value`` for ``key`` at ``now`` (default: the clock's time)."""
        now = self.now() if now is None else now
        self._records[key] = (now, value)
        self._records.move_to_end(key)
        self.prune(now)

    def prune(self, now: float | None = None) -> None:
        horizon = (self.now() if now is None else now) - self.ttl_s
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
