"""SequenceRows: the per-sequence bookkeeping of a KvCache, in persistent NumPy arrays.

Each sequence owns one row: its block table (int32, padded with the null block 0), length in
tokens, block count, last block, the slot it last reserved (-1: none), creation and
last-access times (clock seconds) and a recency tick ordering LRU preemption (larger: used
more recently). Arrays grow by doubling; freed rows are reused. Not locked: the cache's lock
covers every call. Nothing here loops over blocks in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .. import checks
from .block_pool import NULL_BLOCK, BlockPool

_ARRAYS = ("tables", "lens", "nblocks", "last_slot", "last_block", "created", "accessed",
           "recency")


class SequenceRows:
    """Rows of sequences: ``index`` maps a sequence id to its row."""

    def __init__(self, rows: int = 16, width: int = 8) -> None:
        self.tables = np.zeros((rows, width), np.int32)
        self.lens = np.zeros(rows, np.int64)
        self.nblocks = np.zeros(rows, np.int64)
        self.last_slot = np.full(rows, -1, np.int64)
        self.last_block = np.zeros(rows, np.int64)  # == tables[row, nblocks - 1]
        self.created = np.zeros(rows)
        self.accessed = np.zeros(rows)
        self.recency = np.zeros(rows, np.int64)
        self.tick = 0
        self.free = list(range(rows - 1, -1, -1))
        self.index: dict[Hashable, int] = {}
        self.version = 0  # bumped whenever a sequence gets or gives up its row
        self._memo: tuple[int, list[Hashable], np.ndarray, bool] | None = None

    def row(self, seq_id: Hashable) -> int:
        try:
            row = self.index.get(seq_id)
        except TypeError:
            checks.hashable(seq_id, "sequence id")  # says which
            raise
        if row is None:
            raise KeyError(f"no sequence {seq_id!r} in the cache")
        return row

    def rows(self, ids: list[Hashable]) -> np.ndarray:
        """Rows of ``ids``. A decode loop asks for the same list again and again, so the last
        answer is kept until a sequence is added or released."""
        memo = self._memo
        if memo is not None and memo[0] == self.version and memo[1] == ids:
            return memo[2]
        try:
            rows = np.fromiter(map(self.index.__getitem__, ids), np.int64, len(ids))
        except KeyError as exc:
            raise KeyError(f"no sequence {exc.args[0]!r} in the cache") from None
        except TypeError:
            bad = next(s for s in ids if not isinstance(s, Hashable))
            raise TypeError(f"sequence id {bad!r} is not hashable") from None
        self._memo = (self.version, list(ids), rows, len(set(ids)) == len(ids))
        return rows

    def distinct(self) -> bool:
        """Whether the ids of the last ``rows`` call list no sequence twice."""
        return self._memo is not None and self._memo[3]

    def add(self, seq_id: Hashable, blocks: int) -> int:
        """A fresh row for ``seq_id`` wide enough for ``blocks`` blocks."""
        if not self.free:
            old = self.lens.size
            for name in _ARRAYS:
                array = getattr(self, name)
                setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
            self.last_slot[old:] = -1
            self.free = list(range(2 * old - 1, old - 1, -1))
        self.widen(blocks)
        row = self.free.pop()
        self.index[seq_id] = row
        self.version += 1
        return row

    def release(self, seq_id: Hashable) -> np.ndarray:
        """Drop ``seq_id``'s row; returns the blocks it held (a copy), in order."""
        row = self.index.pop(seq_id)
        self.version += 1
        blocks: np.ndarray = self.tables[row, : self.nblocks[row]].copy()
        self.tables[row] = NULL_BLOCK
        self.lens[row] = self.nblocks[row] = self.last_block[row] = 0
        self.last_slot[row] = -1
        self.free.append(row)
        return blocks

    def widen(self, blocks: int) -> None:
        """Make every block table at least ``blocks`` wide (doubling)."""
        width = self.tables.shape[1]
        if blocks > width:
            wider = np.zeros((self.tables.shape[0], max(blocks, 2 * width)), np.int32)
            wider[:, :width] = self.tables
            self.tables = wider

    def touch(self, rows: np.ndarray, now: float) -> None:
        """Mark ``rows`` used at ``now``, later ones in the list as more recent."""
        self.accessed[rows] = now
        self.recency[rows] = np.arange(self.tick + 1, self.tick + 1 + rows.size)
        self.tick += rows.size

    def plan_preemption(self, need: Callable[[list[Hashable], np.ndarray], int],
                        batch: list[Hashable], ref_cnt: np.ndarray, num_free: int
                        ) -> list[Hashable] | None:
        """The sequences to preempt, in order, until ``need(live, ref_cnt)`` blocks are free
        (``live``: the members of ``batch`` not preempted): least recently used first,
        sequences outside ``batch`` before its members, and then none that the others make
        unnecessary (a victim whose blocks the need takes back, such as a prefix the new
        prompt shares, frees nothing: it is spared, the most recently used first).
        Computed on a copy of the ref counts, changing nothing; None if preempting every
        sequence would not free enough."""
        members = set(batch)
        recency = self.recency
        order = sorted(self.index, key=lambda s: (s in members, recency[self.index[s]]))
        ref, live = ref_cnt.copy(), list(batch)
        victims: list[Hashable] = []
        for victim in order:
            if need(live, ref) <= num_free:
                break
            held = self._held(victim)
            ref[held] -= 1
            num_free += int(np.count_nonzero(ref[held] == 0))
            victims.append(victim)
            if victim in members:
                live.remove(victim)
        if need(live, ref) > num_free:
            return None
        for victim in victims[-2::-1]:  # the last one was needed: the others may not be
            held = self._held(victim)
            freed = int(np.count_nonzero(ref[held] == 0))
            ref[held] += 1
            back = [*live, victim] if victim in members else live
            if need(back, ref) <= num_free - freed:
                victims.remove(victim)
                live, num_free = back, num_free - freed
            else:
                ref[held] -= 1
        return victims

    def _held(self, seq_id: Hashable) -> np.ndarray:
        """The blocks ``seq_id`` holds (distinct ids)."""
        row = self.index[seq_id]
        return self.tables[row, : self.nblocks[row]]

    def snapshot(self) -> dict[str, Any]:
        """Everything ``restore`` needs to put the rows back exactly as they are now."""
        state: dict[str, Any] = {name: getattr(self, name).copy() for name in _ARRAYS}
        state.update(free=list(self.free), index=dict(self.index), tick=self.tick)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.version += 1  # never back: rows remembered since must not match again

    def extend(self, rows: np.ndarray, grow: np.ndarray, cow: np.ndarray,
               new: np.ndarray | None, block_size: int, now: float) -> None:
        """One more token for each of ``rows`` (see ``append_need``): ``new`` holds the new
        blocks of the ``grow`` rows, then the private copies replacing the last block of the
        ``cow`` rows."""
        lens = self.lens[rows]
        n_grow = int(np.count_nonzero(grow))
        if n_grow:
            assert new is not None  # a new block for each growing row
            grow_rows = rows[grow]
            count = self.nblocks[grow_rows]
            self.widen(int(count.max()) + 1)
            self.tables[grow_rows, count] = new[:n_grow]
            self.nblocks[grow_rows] = count + 1
            self.last_block[grow_rows] = new[:n_grow]
        cow_rows = rows[cow]
        if cow_rows.size:
            assert new is not None  # a private copy for each shared last block
            self.tables[cow_rows, self.nblocks[cow_rows] - 1] = new[n_grow:]
            self.last_block[cow_rows] = new[n_grow:]
        self.last_slot[rows] = self.last_block[rows] * block_size + (lens & (block_size - 1))
        self.lens[rows] = lens + 1
        self.touch(rows, now)

    def tokens_and_slots(self, block_size: int) -> tuple[int, int]:
        """(tokens held, token slots their blocks provide), over every sequence."""
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        return int(self.lens[rows].sum()), int(self.nblocks[rows].sum()) * block_size

    def append_need(self, rows: np.ndarray, ref_cnt: np.ndarray, block_size: int
                    ) -> tuple[int, np.ndarray, np.ndarray]:
        """(blocks needed, rows needing a new block, rows whose shared last block needs a
        private copy) for appending one token to each of ``rows``."""
        last = self.last_block[rows]
        grow = (self.lens[rows] & (block_size - 1)) == 0
        cow = ~grow & (ref_cnt[last] > 1)
        if cow.any():  # when every holder of a block appends now, one keeps the original
            where = np.flatnonzero(cow)
            blocks, first, counts = np.unique(last[where], return_index=True,
                                              return_counts=True)
            cow[where[first[counts == ref_cnt[blocks]]]] = False
        return int(np.count_nonzero(grow) + np.count_nonzero(cow)), grow, cow

    def check(self, pool: BlockPool, block_size: int) -> None:
        """Raise ``AssertionError`` naming the first invariant the rows and ``pool`` break:
        free + used == total, each ref count == the rows holding the block, tables padded, the
        prefix index consistent (``BlockPool.check``)."""
        pool.check()
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        held = np.concatenate([self.tables[r, : self.nblocks[r]] for r in rows]
                              or [np.zeros(0, np.int32)])
        counts = np.bincount(held, minlength=pool.num_blocks)
        counts[NULL_BLOCK] = 1
        assert (counts == pool.ref_cnt).all(), "ref counts differ from holders"
        assert pool.num_used == int((counts[1:] > 0).sum()), "used blocks differ"
        assert (self.nblocks[rows] == -(-self.lens[rows] // block_size)).all(), (
            "block count does not match length")
        for r in rows:
            assert (self.tables[r, self.nblocks[r] :] == NULL_BLOCK).all(), "stale table"
            assert self.last_block[r] == self.tables[r, self.nblocks[r] - 1], "last block"
            assert not self.lens[r] % block_size or int(self.last_block[r]) not in pool.hashes, (
                "a partial block has a prefix hash")
