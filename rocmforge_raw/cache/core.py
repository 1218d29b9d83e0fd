"""CacheCore: the lock-held steps that ``KvCache``'s public operations are made of.

Each public operation runs under the cache's lock on an open cache (``operation``), checks
its arguments and reads the clock before it changes anything, then composes these steps,
each of which leaves the bookkeeping consistent: ``_make_room`` plans every preemption
before it preempts, ``_extend`` allocates before its only fallible step (the copy-on-write
copy) and puts the blocks back exactly if that fails, and ``_save``/``_restore`` undo a
whole operation on the rare paths where a later step could still fail. So an operation
either completes or raises with the cache exactly as before.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import numpy as np

from .. import checks, ops
from ..array import DeviceArray
from ..errors import BufferClosedError, CacheFullError
from ..stream import Stream, stream_handle
from .block_pool import BlockPool
from .config import CacheConfig
from .rows import SequenceRows

F = TypeVar("F", bound=Callable[..., Any])


def operation(method: F) -> F:
    """``method`` run under the cache's lock (one lock around the whole operation: no other
    thread sees it half done), on an open cache only."""

    @functools.wraps(method)
    def run(self: CacheCore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._check_open()
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def repeated(ids: list[Hashable]) -> Hashable:
    """The first id listed twice in ``ids`` (for a message)."""
    seen: set[Hashable] = set()
    return next(s for s in ids if s in seen or seen.add(s))  # type: ignore[func-returns-value]


class CacheCore:
    """The bookkeeping of a KV cache and the steps that change it (lock held)."""

    config: CacheConfig
    strict: bool
    clock: Callable[[], float]
    stream: Stream | None
    slab: DeviceArray
    pool: BlockPool
    _rows: SequenceRows
    _lock: threading.RLock
    _epoch: int
    _fixed_now: float | None = None
    num_preemptions: int
    num_cow_copies: int
    peak_used_blocks: int
    num_prefix_hits: int
    num_prefix_misses: int

    def _check_open(self) -> None:
        if self.slab.buffer.closed:
            raise BufferClosedError("this KvCache was closed")

    def _stream(self, stream: Stream | None) -> Stream | None:
        """``stream`` (None: the cache's), checked to be an open ``Stream`` of the cache's
        device, or None."""
        stream = self.stream if stream is None else stream
        stream_handle(stream, "stream", self.slab.backend, self.slab.device)
        return stream

    def _now(self) -> float:
        """The clock, read before an operation changes anything (a clock that fails or
        answers nonsense then changes nothing); inside ``_at`` the time it fixed."""
        if self._fixed_now is not None:
            return self._fixed_now
        return checks.real(self.clock(), "clock()")

    @contextlib.contextmanager
    def _at(self, now: float) -> Iterator[None]:
        """Operations in this block (lock held) read ``now`` instead of the clock: a caller
        that composes several (the Scheduler) reads the clock once, before its first change,
        so that no later read can fail between two of them."""
        self._fixed_now = now
        try:
            yield
        finally:
            self._fixed_now = None

    def _changed(self) -> None:
        self._epoch += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.config.block_size)

    def _append_need(self, rows: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        return self._rows.append_need(rows, self.pool.ref_cnt, self.config.block_size)

    def _extend(self, rows: np.ndarray, grow: np.ndarray, cow: np.ndarray, total: int,
                stream: Stream | None, now: float) -> None:
        """One more slot for each of ``rows``: new blocks where ``grow``, private copies of
        shared last blocks where ``cow`` (``total`` blocks in all, known to be free)."""
        cow_rows = rows[cow]
        new = self.pool.allocate(total) if total else None
        if cow_rows.size:  # the only step that can fail (the copy): before any change
            assert new is not None  # total counts the copies
            src = self._rows.last_block[cow_rows]
            dst = new[total - cow_rows.size :].astype(np.int64)
            try:
                ops.copy_blocks(self.slab, np.stack([src, dst], 1), stream=stream)
            except BaseException:
                self.pool.undo_allocate(new)
                raise
            self.pool.free(src)
            self.num_cow_copies += int(cow_rows.size)
        self._rows.extend(rows, grow, cow, new, self.config.block_size, now)
        self._changed()

    def _need_of(self, live: list[Hashable], ref_cnt: np.ndarray) -> int:
        """Blocks that appending a token to each of ``live`` needs, given ``ref_cnt``."""
        return self._rows.append_need(self._rows.rows(live), ref_cnt,
                                      self.config.block_size)[0]

    def _make_room(self, need: Callable[[list[Hashable], np.ndarray], int],
                   batch: list[Hashable]) -> list[Hashable]:
        """Preempt LRU sequences (others first, then members of ``batch``) until
        ``need(live, ref_cnt)`` blocks are free; returns them. Planned before anything
        changes: ``CacheFullError`` in strict mode, or when preempting every sequence would
        not free enough, leaves every sequence in place."""
        free, ref_cnt = self.pool.num_free, self.pool.ref_cnt
        if need(batch, ref_cnt) <= free:
            return []
        if self.strict:
            raise CacheFullError(need(batch, ref_cnt), free, "strict mode")
        victims = self._rows.plan_preemption(need, batch, ref_cnt, free)
        if victims is None:
            raise CacheFullError(need(batch, ref_cnt), free, "nothing left to preempt")
        for victim in victims:
            self._release(victim)
        self.num_preemptions += len(victims)
        return victims

    def _save(self) -> tuple[Any, ...]:
        """The bookkeeping as it is now, for ``_restore`` (rare paths only: it copies)."""
        return (self._rows.snapshot(), self.pool.snapshot(), self._epoch,
                self.num_preemptions, self.peak_used_blocks, self.num_cow_copies)

    def _restore(self, saved: tuple[Any, ...]) -> None:
        rows, pool, self._epoch, self.num_preemptions, self.peak_used_blocks, \
            self.num_cow_copies = saved
        self._rows.restore(rows)
        self.pool.restore(pool)

    def _add_row(self, seq_id: Hashable, ids: np.ndarray, num_tokens: int, shared_last: bool,
                 now: float) -> None:
        """Give ``seq_id`` a row holding blocks ``ids`` (already taken from the pool) and
        ``num_tokens`` tokens. A last block shared with another holder (a prefix hit) is
        skipped by the step's write, as after fork."""
        rows, bs, need = self._rows, self.config.block_size, len(ids)
        row = rows.add(seq_id, need)
        rows.tables[row, :need] = ids
        rows.lens[row], rows.nblocks[row] = num_tokens, need
        rows.last_block[row] = ids[-1]
        rows.last_slot[row] = -1 if shared_last else int(ids[-1]) * bs + (num_tokens - 1) % bs
        rows.created[row] = now
        rows.touch(np.array([row]), now)
        self._changed()

    def _release(self, seq_id: Hashable) -> int:
        released = self.pool.free(self._rows.release(seq_id))
        self._changed()
        return released

