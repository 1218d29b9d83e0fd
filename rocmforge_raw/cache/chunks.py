"""ChunkOps: sequences that grow by many tokens at once: a prefill chunk, a multi-turn
follow-up, drafted tokens to verify.

``extend(seq_ids, counts)`` reserves ``counts[i]`` more slots for each sequence (the slots of
its next tokens, in order), as ``append`` reserves one: new blocks as the sequences need
them, a private copy of a shared, partly filled last block first (copy-on-write), the
least-recently-used other sequences preempted when blocks run out (never those of the call:
``CacheFullError`` then, as in strict mode), and with ``tokens`` each block that fills named
by its prefix hash, so a later prompt finds it. A step then plans those tokens as its query
rows: ``batch(seq_ids, query_lens=counts)``.

``cached_tokens(tokens)`` says how many leading tokens of a prompt the cache would find
(``add_sequence``'s ``num_cached_tokens``), changing nothing: the Scheduler sizes a first
chunk past a prefix hit with it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np

from ..common import checks
from ..kernels.planning.work import MAX_TOKENS
from ..memory.stream import Stream
from .blocks import prefix
from .core import operation, repeated
from .events import DEVICE
from .reservation import Reservation
from .tiers.swap import TierOps

#: A need no preemption can meet: the sequences of an ``extend`` are never its victims.
_NEVER = 1 << 62


class ChunkOps(TierOps):
    """``KvCache``'s operations that add many tokens to a sequence at once (module
    docstring)."""

    @operation
    def cached_tokens(self, tokens: Any) -> int:
        """How many leading tokens of the prompt ``tokens`` (ids) ``add_sequence`` would
        find cached now, on the device or the host tier (at most all but the last)."""
        ids = prefix.token_ids(tokens)
        found = len(self._lookup(prefix.block_hashes(ids, self.config.block_size)))
        return min(found * self.config.block_size, int(ids.size) - 1)

    @operation
    def room(self, seq_id: Hashable) -> int:
        """How many tokens ``seq_id`` can grow by now (``extend``) without preempting: the
        rest of its last block (after a private copy where another holder shares it) and
        every free block."""
        row = self._resident_rows([checks.hashable(seq_id, "seq_id")])[0]
        bs, length = self.config.block_size, int(self._rows.lens[row])
        free, partial = self.pool.num_free, length % bs
        if partial and self.pool.ref_cnt[self._rows.last_block[row]] > 1:
            free -= 1  # its private copy
            if free < 0:
                return 0
        return min((bs - partial if partial else 0) + free * bs, MAX_TOKENS - length)

    @operation
    def extend(self, seq_ids: Iterable[Hashable], counts: Any, stream: Stream | None = None,
               *, tokens: Any = None) -> Reservation:
        """Reserve ``counts[i]`` (>= 1) more token slots for sequence ``seq_ids[i]``; the
        reservation's slots are every new token's, sequence by sequence, in order.
        ``tokens``: the new tokens' ids (``sum(counts)`` of them, -1 for an unknown one,
        which ends that sequence's chain), so each block that fills is named by its prefix
        hash. Copy-on-write copies are queued on ``stream``. Preempts only other sequences
        (``CacheFullError`` if even that would not make room; nothing changes then)."""
        ids = checks.id_list(seq_ids, "seq_ids")
        stream = self._stream(stream)
        rows = self._resident_rows(ids)
        if not self._rows.distinct():
            raise ValueError(f"extend lists sequence {repeated(ids)!r} twice")
        grow = self._counts(counts, len(ids))
        ids_of = None
        if tokens is not None:
            ids_of = prefix.token_ids(tokens, least=-1)
            if ids_of.size != int(grow.sum()):
                raise ValueError(f"tokens holds {ids_of.size} ids for {int(grow.sum())} new "
                                 f"tokens (counts sum)")
        lens = self._rows.lens[rows].copy()
        if int((lens + grow).max()) > MAX_TOKENS:
            i = int(np.argmax(lens + grow))
            raise ValueError(f"sequence {ids[i]!r} would hold {int(lens[i] + grow[i])} tokens, "
                             f"past the kernels' {MAX_TOKENS}")
        now = self._now()
        members = set(ids)

        def need(live: list[Hashable], ref_cnt: np.ndarray) -> int:
            if len(live) < len(ids):  # a member preempted: never
                return _NEVER
            return self._grow_need(rows, grow, ref_cnt)[0]

        saved = None
        preempted: list[Hashable] = []
        swapped: list[Hashable] = []
        if need(ids, self.pool.ref_cnt) > self.pool.num_free:
            saved = self._save()  # the copies below may fail after preempting: undo all
            preempted, swapped = self._make_room(need, ids, stream, now)
            assert not members & set(preempted)
        total, copies = self._grow_need(rows, grow, self.pool.ref_cnt)
        if copies.any() and saved is None and self._host is not None and \
                total > self.pool.num_plain_free:
            saved = self._save()  # a demoting allocation is undone by a restore
        new = self._allocate(total, stream) if total else np.zeros(0, np.int32)
        blocks = self._rows.nblocks[rows]
        last = self._rows.last_block[rows]
        added = -(-(lens + grow) // self.config.block_size) - blocks
        fresh, cow = new[: int(added.sum())], new[int(added.sum()):]
        if copies.any():  # the only step that can fail (the copy): before any change
            self._copy_on_write(last[copies], cow, new, saved, stream)
        slots = self._grown(rows, lens, grow, blocks, added, fresh, cow, copies, now)
        if self._chains.count:
            self._name_chunks(rows, lens, grow, ids_of)
        self._changed()
        return Reservation(slots, preempted, 0, swapped)

    @staticmethod
    def _counts(counts: Any, n: int) -> np.ndarray:
        """``counts`` checked: ``n`` integers, each at least 1 (int64)."""
        array = np.asarray(counts)
        if array.dtype.kind not in "iu" or array.shape != (n,):
            raise ValueError(f"counts must be {n} integers (one per sequence), got "
                             f"{checks.show(counts)}")
        if n and int(array.min()) < 1:
            i = int(np.argmin(array))
            raise ValueError(f"counts[{i}] = {int(array[i])}: each sequence grows by at least "
                             f"one token")
        return array.astype(np.int64)

    def _grow_need(self, rows: np.ndarray, grow: np.ndarray, ref_cnt: np.ndarray
                   ) -> tuple[int, np.ndarray]:
        """(blocks needed, which rows copy their last block first) to add ``grow`` tokens to
        each of ``rows``: new blocks past the last, and a private copy of a partly filled
        last block another holder shares (when every holder grows now, one keeps it)."""
        bs = self.config.block_size
        lens, blocks = self._rows.lens[rows], self._rows.nblocks[rows]
        last = self._rows.last_block[rows]
        added = -(-(lens + grow) // bs) - blocks
        copies = (lens % bs != 0) & (ref_cnt[last] > 1)
        if copies.any():  # the rule append_need keeps: a block every holder grows stays one's
            where = np.flatnonzero(copies)
            shared, first, count = np.unique(last[where], return_index=True,
                                             return_counts=True)
            copies[where[first[count == ref_cnt[shared]]]] = False
        return int(added.sum()) + int(copies.sum()), copies

    def _grown(self, rows: np.ndarray, lens: np.ndarray, grow: np.ndarray, blocks: np.ndarray,
               added: np.ndarray, fresh: np.ndarray, cow: np.ndarray, copies: np.ndarray,
               now: float) -> np.ndarray:
        """The rows' bookkeeping for their new tokens (blocks taken already); their slots."""
        bs, store = self.config.block_size, self._rows
        store.widen(int((blocks + added).max()))
        tables = store.tables
        taken, copied, slots = 0, 0, []
        for i, row in enumerate(rows.tolist()):
            count, have = int(added[i]), int(blocks[i])
            if copies[i]:
                tables[row, have - 1] = cow[copied]
                copied += 1
            tables[row, have: have + count] = fresh[taken: taken + count]
            taken += count
            positions = np.arange(int(lens[i]), int(lens[i] + grow[i]))
            slots.append(tables[row, positions // bs].astype(np.int64) * bs + positions % bs)
            store.nblocks[row] = have + count
            store.lens[row] = lens[i] + grow[i]
            store.last_block[row] = tables[row, have + count - 1]
            store.last_slot[row] = slots[-1][-1]
        store.touch(rows, now)
        return np.concatenate(slots)

    def _name_chunks(self, rows: np.ndarray, lens: np.ndarray, grow: np.ndarray,
                     ids_of: np.ndarray | None) -> None:
        """The chains of ``rows`` pushed the new tokens' ids (None: the chains end), each
        block that filled named by its hash."""
        at = 0
        for i, row in enumerate(rows.tolist()):
            count = int(grow[i])
            chunk = None if ids_of is None else ids_of[at: at + count]
            at += count
            for block_index, digest, parent, block in self._chains.push_many(
                    row, int(lens[i]), chunk):
                block_id = self._rows.tables[row, block_index: block_index + 1]
                if self.pool.register(block_id, [digest]):
                    self._events.stored(digest, DEVICE, parent or None, block)
