"""Cache events: what a router needs to know about the prefixes a cache holds.

A block is named by its prefix hash (``prefix``), never by a block id (ids are reused). A
hash entering a tier's index is ``BlockStored`` (with its parent's hash and its token ids),
leaving it ``BlockRemoved``; ``AllCleared`` says that no tier holds any prefix any more.
Tiers are ``"device"`` (the slab) and ``"host"`` (the pinned host tier).

``EventQueue`` collects them for one cache, under the cache's lock: an operation's events
wait in ``pending`` and join the queue, in order, when the operation ends (``commit``); an
operation that fails puts its state back and drops the events of what it undid
(``truncate`` to a ``mark``). The queue is bounded: when full, the oldest event is dropped
and counted, so nothing ever blocks or grows; ``drain()`` hands out the events and how many
were dropped since the previous drain. ``max_events=0`` records nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class BlockStored:
    """``block_hash`` entered ``tier``'s index; ``parent_hash`` is the hash of the block
    before it (None for a sequence's first block), ``token_ids`` its tokens (empty where
    the cache never saw them: a block imported from another cache)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    tier: str


@dataclass(frozen=True)
class BlockRemoved:
    """``block_hash`` left ``tier``'s index (its block was reused, moved or forgotten)."""

    block_hash: bytes
    tier: str


@dataclass(frozen=True)
class AllCleared:
    """No tier holds any prefix any more (``clear_prefix_cache``, ``close``)."""


@dataclass(frozen=True)
class EventBatch:
    """What ``KvCache.events()`` drained: the events in operation order, and how many
    older ones the bounded queue dropped since the previous drain (a router that sees
    ``dropped > 0`` has missed some and should resynchronise)."""

    events: list[Any]
    dropped: int

    def __iter__(self) -> Any:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


class EventQueue:
    """The bounded event queue of one cache (see the module docstring). Not locked: the
    cache's lock covers every call. It also remembers, while any tier holds a hash, the
    hash's parent and tokens, so that a block stored again in another tier is announced
    with them."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.enabled = max_events > 0
        self.pending: list[Any] = []
        self._queue: deque[Any] = deque()
        self.dropped = self.total_dropped = 0
        self._known: dict[bytes, list[Any]] = {}  # hash -> [parent, token ids, tiers]
        self._graves: dict[bytes, list[Any]] = {}  # forgotten since the last commit

    def stored(self, block_hash: bytes, tier: str, parent: bytes | None = None,
               tokens: np.ndarray | None = None) -> None:
        """``block_hash`` entered ``tier`` (parent and tokens as first seen, if not given)."""
        if not self.enabled:
            return
        known = self._known.get(block_hash) or self._graves.get(block_hash) or [
            parent, (), set()]
        self._known[block_hash] = known
        if not known[1] and tokens is not None:  # first seen now, or moved between tiers
            known[0], known[1] = parent, tuple(np.asarray(tokens).tolist())
        known[2].add(tier)
        self.pending.append(BlockStored(block_hash, known[0], known[1], tier))

    def removed(self, block_hash: bytes, tier: str) -> None:
        if not self.enabled:
            return
        known = self._known.get(block_hash)
        if known is not None:
            known[2].discard(tier)
            if not known[2]:
                self._graves[block_hash] = self._known.pop(block_hash)
        self.pending.append(BlockRemoved(block_hash, tier))

    def cleared(self) -> None:
        if not self.enabled:
            return
        self._graves.update(self._known)
        self._known = {}
        self.pending.append(AllCleared())

    def mark(self) -> int:
        """Where the pending events stand now (``truncate`` goes back here): O(1)."""
        return len(self.pending)

    def truncate(self, mark: int) -> None:
        """Undo the events pending since ``mark`` (their operation was undone), newest
        first, and what they changed in the remembered parents and tokens."""
        for event in reversed(self.pending[mark:]):
            if isinstance(event, BlockStored):
                known = self._known[event.block_hash]
                known[2].discard(event.tier)
                if not known[2]:
                    del self._known[event.block_hash]
            elif isinstance(event, BlockRemoved):
                kept = self._known.get(event.block_hash) or self._graves.get(event.block_hash)
                if kept is not None:
                    self._known[event.block_hash] = kept
                    kept[2].add(event.tier)
            else:  # AllCleared: every prefix it cleared is known again
                self._known.update((h, k) for h, k in self._graves.items() if k[2])
        del self.pending[mark:]

    def commit(self) -> None:
        """The pending events join the queue; the oldest go when it is full."""
        queue, room = self._queue, self.max_events
        for event in self.pending:
            if len(queue) >= room:
                queue.popleft()
                self.dropped += 1
                self.total_dropped += 1
            queue.append(event)
        self.pending = []
        self._graves = {}

    def drain(self) -> EventBatch:
        """Every queued event, oldest first, and the count dropped since the last drain."""
        batch = EventBatch(list(self._queue), self.dropped)
        self._queue.clear()
        self.dropped = 0
        return batch

    def __len__(self) -> int:
        return len(self._queue)
