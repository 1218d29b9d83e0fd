"""SequenceRows: the per-sequence bookkeeping of a KvCache, in persistent NumPy arrays.

Each sequence owns one row: its block table (int32, padded with the null block 0), length in
tokens, block count, last block, the slot it last reserved (-1: none), creation and
last-access times (clock seconds) and a recency tick ordering LRU preemption (larger: used
more recently). Arrays grow by doubling; freed rows are reused. Not locked: the cache's lock
covers every call. A decode step's work (``append_need``, ``extend``, ``touch``, ``gather``)
runs in the compiled core (``_tables``, ``_rows``) over the arrays' memory; nothing here loops over
blocks or sequences in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from ...common import checks
from ...kernels.planning import check_tables
from ._rows import COW, PLAIN, RowArrays
from .block_pool import NULL_BLOCK, BlockPool

_NO_BLOCKS = np.zeros(0, np.int32)
_ARRAYS = ("tables", "lens", "nblocks", "last_slot", "last_block", "created", "accessed",
           "recency", "dropped")


class SequenceRows(RowArrays):
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
        # blocks at the table's start given up as they left every layer's window
        # (``drop_before``): the null block stands in their entries
        self.dropped = np.zeros(rows, np.int64)
        self.tick = 0
        self.free = list(range(rows - 1, -1, -1))
        self.index: dict[Hashable, int] = {}
        self.version = 0  # bumped whenever a sequence gets or gives up its row
        # (version, ids, their rows, distinct, ids as a tuple): the last ``rows`` call
        self._memo: tuple[int, list[Hashable], np.ndarray, bool,
                          tuple[Hashable, ...]] | None = None

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
        self._memo = (self.version, list(ids), rows, len(set(ids)) == len(ids), tuple(ids))
        return rows

    def distinct(self) -> bool:
        """Whether the ids of the last ``rows`` call list no sequence twice."""
        return self._memo is not None and self._memo[3]

    def last_ids(self) -> tuple[Hashable, ...]:
        """The ids of the last ``rows`` call, as a tuple (made once per list)."""
        assert self._memo is not None, "no rows call yet"
        return self._memo[4]

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
        blocks: np.ndarray = self.tables[row, self.dropped[row] : self.nblocks[row]].copy()
        self.tables[row] = NULL_BLOCK
        self.lens[row] = self.nblocks[row] = self.last_block[row] = self.dropped[row] = 0
        self.last_slot[row] = -1
        self.free.append(row)
        return blocks

    def drop_before(self, rows: np.ndarray, first: np.ndarray, block_size: int
                    ) -> np.ndarray:
        """Give up the blocks of ``rows`` that lie wholly before token ``first`` of each
        (the first any layer's window still sees): their entries become the null block.
        Returns the blocks given up (for the pool to free), in row order."""
        cut = np.maximum(first, 0) // block_size
        moved = np.flatnonzero(cut > self.dropped[rows])
        if not moved.size:
            return _NO_BLOCKS
        given = []
        for row, end in zip(rows[moved].tolist(), cut[moved].tolist()):
            start = int(self.dropped[row])
            given.append(self.tables[row, start:end].copy())
            self.tables[row, start:end] = NULL_BLOCK
            self.dropped[row] = end
        return np.concatenate(given)

    def widen(self, blocks: int) -> None:
        """Make every block table at least ``blocks`` wide (doubling)."""
        width = self.tables.shape[1]
        if blocks > width:
            wider = np.zeros((self.tables.shape[0], max(blocks, 2 * width)), np.int32)
            wider[:, :width] = self.tables
            self.tables = wider

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
        return self.tables[row, self.dropped[row] : self.nblocks[row]]

    def snapshot(self) -> dict[str, Any]:
        """Everything ``restore`` needs to put the rows back exactly as they are now."""
        state: dict[str, Any] = {name: getattr(self, name).copy() for name in _ARRAYS}
        state.update(free=list(self.free), index=dict(self.index), tick=self.tick)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.version += 1  # never back: rows remembered since must not match again

    def extend(self, rows: np.ndarray, kinds: np.ndarray, new: np.ndarray | None,
               block_size: int, now: float) -> np.ndarray:
        """One more token for each of ``rows`` as ``kinds`` says (``append_need``): ``new``
        holds the new blocks of the GROW rows, then the private copies replacing the last
        block of the COW rows. Returns each row's new slot (int64)."""
        slots = np.empty(rows.size, np.int64)
        new = _NO_BLOCKS if new is None else new
        width = self.extend_rows(rows, kinds, new, block_size, now, slots)
        if width:  # a table is full: widen, then extend (nothing changed before)
            self.widen(width)
            self.extend_rows(rows, kinds, new, block_size, now, slots)
        return slots

    def tokens_and_slots(self, block_size: int) -> tuple[int, int]:
        """(tokens held, token slots their blocks provide), over every sequence: tokens
        whose blocks were dropped (``drop_before``) are held no more."""
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        kept = self.nblocks[rows] - self.dropped[rows]
        return int((self.lens[rows] - self.dropped[rows] * block_size).sum()), int(
            kept.sum()) * block_size

    def append_need(self, rows: np.ndarray, ref_cnt: np.ndarray, block_size: int
                    ) -> tuple[int, np.ndarray, int]:
        """(blocks needed, kinds, copies) for appending one token to each of ``rows``: GROW
        for a row needing a new block, COW for one whose shared last block needs a private
        copy (``copies`` of them), PLAIN otherwise. When every holder of a block appends
        now, one keeps the original."""
        total, kinds, copies = self.need(rows, ref_cnt, block_size)
        if copies:  # rare: the C loop leaves this rule to NumPy
            where = np.flatnonzero(kinds == COW)
            blocks, first, counts = np.unique(self.last_block[rows[where]],
                                              return_index=True, return_counts=True)
            keep = where[first[counts == ref_cnt[blocks]]]
            kinds[keep] = PLAIN
            total, copies = total - keep.size, copies - keep.size
        return total, kinds, copies

    def gather(self, rows: np.ndarray, num_blocks: int, block_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's host metadata of ``rows`` (in order): block tables int32 ``[n, width]``
        (width: the most blocks any holds, at least 1; padded with the null block), lengths
        int32 and last reserved slots int64. The tables are a snapshot that nothing changes
        while it is held (a free one is brought up to date: ``RowArrays.gather_rows``). Raises
        ``ValueError`` saying how if the bookkeeping is broken (a block id out of range, a
        length past its blocks)."""
        tables, lens, slots, sound = self.gather_rows(rows, num_blocks, block_size)
        if not sound:
            check_tables(tables, lens, rows.size, num_blocks, block_size)  # says how
            lengths, counts = self.lens[rows], self.nblocks[rows]
            bad = int(np.flatnonzero(lengths > counts * block_size)[0])
            raise ValueError(f"row {int(rows[bad])} holds {int(lengths[bad])} tokens in "
                             f"{int(counts[bad])} blocks of {block_size}")
        return tables, lens, slots

    def check(self, pool: BlockPool, block_size: int) -> None:
        """Raise ``AssertionError`` naming the first invariant the rows and ``pool`` break:
        free + used == total, each ref count == the rows holding the block, tables padded, the
        prefix index consistent (``BlockPool.check``)."""
        pool.check()
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        held = np.concatenate([self.tables[r, self.dropped[r] : self.nblocks[r]] for r in rows]
                              or [np.zeros(0, np.int32)])
        counts = np.bincount(held, minlength=pool.num_blocks)
        counts[NULL_BLOCK] = 1
        assert (counts == pool.ref_cnt).all(), "ref counts differ from holders"
        assert pool.num_used == int((counts[1:] > 0).sum()), "used blocks differ"
        assert (self.nblocks[rows] == -(-self.lens[rows] // block_size)).all(), (
            "block count does not match length")
        for r in rows:
            assert (self.tables[r, self.nblocks[r] :] == NULL_BLOCK).all(), "stale table"
            assert self.dropped[r] < self.nblocks[r], "the last block dropped"
            assert (self.tables[r, : self.dropped[r]] == NULL_BLOCK).all(), "a dropped block"
            assert (self.tables[r, self.dropped[r] : self.nblocks[r]] != NULL_BLOCK).all(), (
                "the null block in a table")
            assert self.last_block[r] == self.tables[r, self.nblocks[r] - 1], "last block"
            assert not self.lens[r] % block_size or int(self.last_block[r]) not in pool.hashes, (
                "a partial block has a prefix hash")
