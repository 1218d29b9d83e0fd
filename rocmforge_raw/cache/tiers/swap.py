"""TierOps: sequences moving between a cache's two tiers, the slab and the host tier.

- **Swap out** (``swap_out``, and preemption when the cache has a host tier): a sequence's
  blocks are copied to host blocks and its device blocks freed; it stays in the cache,
  swapped out, until ``swap_in`` (or ``finish``/``remove``). A block whose prefix hash the
  host tier holds already, or that another sequence of the same swap shares, is not copied
  again. Preemption swaps out the victims the host tier has room for and drops the rest.
- **Swap in** (``swap_in``): each block comes back into a free device block, or is shared
  with a device block holding its prefix hash; the host blocks it leaves are freed. It
  never preempts: the caller makes room (``can_swap_in`` says whether there is).

A swapped-out sequence is not runnable: ``append`` and ``batch`` refuse it with an error
that says to ``swap_in`` it first (nothing brings it back behind the caller's back: a plan's
membership is the caller's). It can be forked (the child shares its host blocks), finished
or removed (its prefix blocks stay cached on the host tier).

Atomicity as in ``tiered``: copies first, then the bookkeeping; preemption, which changes
the bookkeeping before the copies that follow it, runs inside a saved state. Copies run on
the operation's stream (the cache's by default), ordered with the cache's other streams by
``StreamOrder``. Methods with a leading underscore run with the lock held.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from ...common import checks
from ...errors import CacheFullError
from ...memory.stream import Stream
from ..core import operation, repeated
from ..events import DEVICE
from .host_tier import Swapped
from .tiered import PrefixTiers, paired


class TierOps(PrefixTiers):
    """Swaps between the tiers (see the module docstring)."""

    # --- where sequences are ----------------------------------------------------------------
    @operation
    def __contains__(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._rows.index or self._swapped(seq_id) is not None
        except TypeError:
            checks.hashable(seq_id, "seq_id")  # says so
            raise

    @operation
    def __len__(self) -> int:
        return len(self._rows.index) + (0 if self._host is None else len(self._host.sequences))

    @operation
    def seq_ids(self) -> list[Hashable]:
        """The ids of the sequences the cache holds: those on the device (in the order they
        got their rows), then those swapped out to the host tier."""
        return [*self._rows.index, *(() if self._host is None else self._host.sequences)]

    @operation
    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds (prompt plus appended), including reserved slots."""
        swapped = self._swapped(seq_id)
        if swapped is not None:
            return swapped.num_tokens
        return int(self._rows.lens[self._rows.row(seq_id)])

    @operation
    def block_ids(self, seq_id: Hashable) -> np.ndarray:
        """The device blocks of ``seq_id`` in order (a copy; the null block 0 where a
        block left every layer's window); a swapped-out sequence has none
        (``ValueError``)."""
        rows, row = self._rows, self._resident_rows([seq_id])[0]
        blocks: np.ndarray = rows.tables[row, : rows.nblocks[row]].copy()
        return blocks

    @operation
    def times(self, seq_id: Hashable) -> tuple[float, float]:
        """(created, last accessed) of ``seq_id``, in ``clock`` seconds."""
        swapped = self._swapped(seq_id)
        if swapped is not None:
            return swapped.created, swapped.accessed
        rows, row = self._rows, self._rows.row(seq_id)
        return float(rows.created[row]), float(rows.accessed[row])

    # --- public operations -------------------------------------------------------------------
    @operation
    def swapped_ids(self) -> list[Hashable]:
        """The sequences swapped out to the host tier, in the order they went."""
        return [] if self._host is None else list(self._host.sequences)

    @operation
    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is swapped out to the host tier (``KeyError`` if unknown)."""
        if self._swapped(seq_id) is not None:
            return True
        self._rows.row(seq_id)
        return False

    @operation
    def swap_out(self, seq_ids: Iterable[Hashable], stream: Stream | None = None) -> int:
        """Move ``seq_ids`` (resident) to the host tier, copies queued on ``stream``; all or
        none: ``CacheFullError`` if the host tier cannot take them all. Returns the blocks
        copied (blocks the host tier holds by prefix hash are not copied again)."""
        ids = self._listed(seq_ids, "swap_out")
        stream = self._stream(stream)
        self._resident_rows(ids)
        if self._host is None:
            raise ValueError("this cache has no host tier: give CacheConfig(host_blocks=N)")
        now = self._now()
        before = self._tier.counts["swapped_out_blocks"]
        self._swap_out(ids, stream, now, partial=False)
        return self._tier.counts["swapped_out_blocks"] - before

    @operation
    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether ``seq_ids`` (swapped out) fit in the free device blocks now, without
        preempting (False for an id that is not swapped out, or one listed twice)."""
        ids = checks.id_list(seq_ids, "seq_ids")
        host = self._host
        if _distinct(ids) != len(ids) or host is None or any(s not in host.sequences
                                                             for s in ids):
            return False
        hits, fills, _ = self._swap_in_plan(ids)
        return self._needed(len(fills), hits, self.pool.ref_cnt) <= self.pool.num_free

    @operation
    def swap_in(self, seq_ids: Iterable[Hashable], stream: Stream | None = None) -> None:
        """Bring ``seq_ids`` back from the host tier into free device blocks, copies queued
        on ``stream``; a block whose prefix the device holds is shared instead. Never
        preempts (``CacheFullError`` when the free blocks are too few: ``can_swap_in``
        says so beforehand), so that no copy ever lands where a sequence of this very
        operation was. Each sequence comes back as it was (a slot it had reserved is
        reserved again) and counts as used now."""
        ids = self._listed(seq_ids, "swap_in")
        stream = self._stream(stream)
        for seq_id in ids:
            if self._host is None or seq_id not in self._host.sequences:
                if seq_id in self._rows.index:
                    raise ValueError(f"sequence {seq_id!r} is not swapped out")
                raise KeyError(f"no sequence {seq_id!r} in the cache")
        now = self._now()
        hits, fills, plan = self._swap_in_plan(ids)
        needed = self._needed(len(fills), hits, self.pool.ref_cnt)
        if needed > self.pool.num_free:
            raise CacheFullError(needed, self.pool.num_free, "swap_in never preempts: finish, "
                                 "remove or swap out other sequences first")
        new = self._allocate(len(fills), stream, hits, list(fills))
        self._swapped_in(ids, hits, dict(zip(fills, new.tolist())), plan, now)

    # --- internals (lock held) ---------------------------------------------------------------
    def _swapped(self, seq_id: Hashable) -> Swapped | None:
        """``seq_id``'s record on the host tier, or None (``TypeError`` naming an id that
        cannot be one: unhashable)."""
        try:
            return None if self._host is None else self._host.sequences.get(seq_id)
        except TypeError:
            checks.hashable(seq_id, "sequence id")  # says which
            raise

    def _preempt(self, victims: list[Hashable], stream: Stream | None, now: float
                 ) -> list[Hashable]:
        if self._host is None:
            return super()._preempt(victims, stream, now)
        return self._swap_out(victims, stream, now, partial=True)

    def _release_any(self, seq_id: Hashable) -> int:
        """Release a resident sequence's device blocks (returns how many went back) or a
        swapped-out one's host blocks (their prefixes stay cached there; returns 0)."""
        swapped = self._swapped(seq_id)
        if swapped is None:
            return self._release(seq_id)
        del self._tier.sequences[seq_id]
        self._tier.release(swapped.blocks, keep=True)
        return 0

    def _fork_swapped(self, parent_id: Hashable, child_id: Hashable, now: float) -> None:
        host = self._tier
        parent = host.sequences[parent_id]
        for block in parent.blocks.tolist():
            host.hold(block)
        host.sequences[parent_id] = replace(parent, accessed=now)
        host.sequences[child_id] = replace(parent, created=now, accessed=now, reserved=False)

    def _resident_rows(self, ids: list[Hashable]) -> np.ndarray:
        """The rows of ``ids``; a swapped-out one is refused with what to do instead."""
        try:
            return self._rows.rows(ids)
        except KeyError:
            host = self._host
            swapped = next((s for s in ids if host is not None and s in host.sequences), None)
            if swapped is not None:
                raise ValueError(f"sequence {swapped!r} is swapped out to the host tier: "
                                 "swap_in it first") from None
            raise

    def _listed(self, seq_ids: Any, what: str) -> list[Hashable]:
        ids = checks.id_list(seq_ids, "seq_ids")
        if _distinct(ids) != len(ids):
            raise ValueError(f"{what} lists sequence {repeated(ids)!r} twice")
        return ids

    def _swap_out(self, victims: list[Hashable], stream: Stream | None, now: float,
                  partial: bool) -> list[Hashable]:
        """Copy ``victims`` (resident) to the host tier and release their device blocks.
        ``partial``: those that do not fit are released (dropped) instead, else nothing
        changes and ``CacheFullError`` says so. Returns the ids swapped out."""
        host, pool, rows = self._tier, self.pool, self._rows
        shared: set[int] = set()  # host blocks already holding a victim's prefix
        copied: dict[int, None] = {}  # device blocks to copy, distinct
        room, tables = host.room, {}
        for victim in victims:
            row = rows.index[victim]
            if rows.dropped[row]:  # blocks that left its windows: not swapped, for now
                if not partial:
                    raise NotImplementedError(
                        f"swap_out of sequence {victim!r}, whose first {int(rows.dropped[row])}"
                        " blocks left every window (freed): only whole sequences swap for now")
                continue  # (a preemption releases it: it is recomputed)
            table = rows.tables[row, : rows.nblocks[row]].tolist()
            named = [pool.hashes.get(b) for b in table]
            found = {host.index[h] for h in named if h is not None and h in host.index}
            new = [b for b, h in zip(table, named)
                   if b not in copied and (h is None or h not in host.index)]
            pinned = found - shared  # cached ones among them stop being reusable
            cost = len(new) + int(np.count_nonzero(host.ref_cnt[list(pinned)] == 0))
            if cost > room:
                if not partial:
                    raise CacheFullError(cost, room, "the host tier is full")
                continue
            room -= cost
            shared |= found
            copied.update(dict.fromkeys(new))
            tables[victim] = table
        dests = paired(list(copied), host.peek(len(copied), shared))
        self._copies(list(copied), dests, [], [], stream)
        host.take(len(copied), shared)
        where = dict(zip(copied, dests))  # device block -> its new host block
        for block, dest in where.items():
            if block in pool.hashes:
                host.name(dest, pool.hashes[block])
        for victim in victims:
            row = rows.index[victim]
            if victim in tables:
                blocks = np.array([where[b] if b in where else host.index[pool.hashes[b]]
                                   for b in tables[victim]], np.int64)
                for block in blocks.tolist():
                    host.hold(block)
                host.sequences[victim] = Swapped(
                    blocks, int(rows.lens[row]), float(rows.created[row]), now,
                    bool(rows.last_slot[row] >= 0),
                    self._chains.get(row, int(rows.lens[row])))
            self._release(victim)
        host.counts["swapped_out_blocks"] += len(copied)
        return list(tables)

    def _swap_in_plan(self, ids: list[Hashable]
                      ) -> tuple[list[int], dict[int, None], list[list[tuple[bool, int]]]]:
        """(device blocks to take, host blocks to copy in (ordered, distinct), per sequence
        where each block comes from: (on the host tier, block), as ``_lookup`` says)."""
        host, index = self._tier, self.pool.index
        plan = []
        for seq_id in ids:
            where = []
            for block in host.sequences[seq_id].blocks.tolist():
                digest = host.hashes.get(block)  # None: a partial block, never shared
                device = None if digest is None else index.get(digest)
                where.append((True, block) if device is None else (False, device))
            plan.append(where)
        hits = dict.fromkeys(b for where in plan for on_host, b in where if not on_host)
        fills = dict.fromkeys(b for where in plan for on_host, b in where if on_host)
        return list(hits), fills, plan

    def _swapped_in(self, ids: list[Hashable], hits: list[int], placed: dict[int, int],
                    plan: list[list[tuple[bool, int]]], now: float) -> None:
        """The bookkeeping of a swap-in whose blocks are taken and copied."""
        host, pool = self._tier, self.pool
        names = [(d, host.hashes[h]) for h, d in placed.items() if h in host.hashes]
        for i in pool.register(np.array([d for d, _ in names], np.int64),
                               [h for _, h in names]):
            self._events.stored(names[i][1], DEVICE)
        extra: list[int] = []  # holders beyond the first of each block (taken once)
        seen: set[int] = set()
        for seq_id, where in zip(ids, plan):
            record = host.sequences.pop(seq_id)
            table = np.array([placed[block] if on_host else block
                              for on_host, block in where], np.int32)
            for block in table.tolist():
                if block in seen:
                    extra.append(block)
                seen.add(block)
            self._add_row(seq_id, table, record.num_tokens, not record.reserved, now)
            row = self._rows.index[seq_id]
            self._rows.created[row] = record.created
            self._chains.start(row, record.chain)
            host.release(record.blocks, keep=False)
        if extra:
            pool.share(np.array(extra, np.int64))
        host.counts["swapped_in_blocks"] += len(placed)


def _distinct(ids: list[Hashable]) -> int:
    """How many distinct ids ``ids`` holds; ``TypeError`` naming the first that cannot be
    an id (unhashable)."""
    try:
        return len(set(ids))
    except TypeError:
        for i, seq_id in enumerate(ids):
            checks.hashable(seq_id, f"seq_ids[{i}]")  # says which
        raise
