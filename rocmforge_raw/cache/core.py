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
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from ..common import checks
from ..errors import BufferClosedError, CacheFullError
from ..kernels import ops
from ..memory.array import DeviceArray
from ..memory.stream import Stream, stream_handle
from .blocks._rows import COW
from .blocks.block_pool import BlockPool
from .blocks.chains import TokenChains
from .blocks.rows import SequenceRows
from .config import CacheConfig
from .events import DEVICE, EventQueue
from .tiers.host_tier import HostTier
from .tiers.order import StreamOrder

F = TypeVar("F", bound=Callable[..., Any])


def operation(method: F) -> F:
    """``method`` run under the cache's lock (one lock around the whole operation: no other
    thread sees it half done), on an open cache only. The events it emitted join the
    cache's queue when it ends (operations do not nest)."""

    @functools.wraps(method)
    def run(self: CacheCore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._check_open()
            try:
                return method(self, *args, **kwargs)
            finally:
                if self._events.pending:
                    self._events.commit()
                if self._reached[0] or self._reached[1]:
                    self._reached = ([], [])

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
    num_window_dropped: int = 0  # table entries given up as they left every window
    peak_used_blocks: int
    num_prefix_hits: int
    num_prefix_misses: int
    _events: EventQueue
    _chains: TokenChains
    _host: HostTier | None
    _order: StreamOrder | None
    # (device, host) blocks this operation's copies wrote: a restore forgets the cached ones
    _reached: tuple[list[int], list[int]]
    _allocation_mark: int = 0  # the pending events before the last ``_allocate``

    @property
    def _tier(self) -> HostTier:
        """The host tier, where the caller knows that the cache has one."""
        assert self._host is not None, "this cache has no host tier"
        return self._host

    @property
    def _ordering(self) -> StreamOrder:
        """The order of copies between the tiers (a cache with a host tier has one)."""
        assert self._order is not None, "this cache has no host tier"
        return self._order

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
        now = self.clock()
        if type(now) is float and -math.inf < now < math.inf:  # the usual clock, at once
            return now
        return checks.real(now, "clock()")

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

    def _append_need(self, rows: np.ndarray) -> tuple[int, np.ndarray, int]:
        return self._rows.append_need(rows, self.pool.ref_cnt, self.config.block_size)

    def _extend(self, rows: np.ndarray, need: tuple[int, np.ndarray, int],
                stream: Stream | None, now: float) -> np.ndarray:
        """One more slot for each of ``rows`` as ``need`` (``_append_need``) says: new
        blocks for the GROW kinds, private copies of shared last blocks for the COW ones
        (``total`` blocks in all, known to be free). Returns the new slots."""
        total, kinds, copies = need
        saved = None  # a demoting allocation is undone by a restore
        if copies and self._host is not None and total > self.pool.num_plain_free:
            saved = self._save()
        new = self._allocate(total, stream) if total else None
        if copies:  # the only step that can fail (the copy): before any change
            assert new is not None  # total counts the copies
            cow_rows = rows[kinds == COW]
            self._copy_on_write(self._rows.last_block[cow_rows],
                                new[total - cow_rows.size :], new, saved, stream)
        slots = self._rows.extend(rows, kinds, new, self.config.block_size, now)
        self._changed()
        return slots

    def _copy_on_write(self, src: np.ndarray, dst: np.ndarray, new: np.ndarray,
                       saved: tuple[Any, ...] | None, stream: Stream | None) -> None:
        """Queue the copies of shared last blocks ``src`` into private blocks ``dst`` (of
        the allocation ``new``), then let go of ``src``. The copy is the only step of a
        reservation that can fail, and comes before any other change: if it fails, the
        state ``saved`` is restored (or else the allocation undone) and the error raised,
        but for the cached-free blocks among ``dst``: a copy that may have run counts as
        written, so they forget their prefixes (announced)."""
        try:
            if self._order is not None:
                self._order.used(stream)
            ops.copy_blocks(self.slab, np.stack([src, dst], 1).astype(np.int64, copy=False),
                            stream=stream)
        except BaseException:
            if saved is not None:
                self._reached[0].extend(dst.tolist())
                self._restore(saved)
            else:  # the reused cached-free blocks hold their prefixes again: unannounced,
                self.pool.undo_allocate(new)  # but for those the copy may have written
                self._events.truncate(self._allocation_mark)
                for digest in self.pool.forget(dst):
                    self._events.removed(digest, DEVICE)
            raise
        self.pool.free(src)
        self.num_cow_copies += int(src.size)

    def _append_plain(self, rows: np.ndarray, now: float) -> np.ndarray | None:
        """``_extend`` of an append's common case in one C call (no copy-on-write, full
        tables or demotion, blocks enough on the free stack): the new slots, or None with
        nothing changed (then the general path)."""
        if self._host is not None:  # allocations may demote to the host tier: general path
            return None
        slots = np.empty(rows.size, np.int64)
        block_size, extend = self.config.block_size, self._rows.append_plain
        popped = self.pool.pop_plain(
            lambda free, top, ref_cnt: extend(rows, free, top, ref_cnt, block_size, now, slots))
        if popped < 0:
            return None
        self._changed()
        return slots

    def _need_of(self, live: list[Hashable], ref_cnt: np.ndarray) -> int:
        """Blocks that appending a token to each of ``live`` needs, given ``ref_cnt``."""
        return self._rows.append_need(self._rows.rows(live), ref_cnt,
                                      self.config.block_size)[0]

    def _make_room(self, need: Callable[[list[Hashable], np.ndarray], int],
                   batch: list[Hashable], stream: Stream | None, now: float
                   ) -> tuple[list[Hashable], list[Hashable]]:
        """Preempt LRU sequences (others first, then members of ``batch``) until
        ``need(live, ref_cnt)`` blocks are free; returns them, and those of them swapped
        out to the host tier (``_preempt``). Planned before anything changes:
        ``CacheFullError`` in strict mode, or when preempting every sequence would not
        free enough, leaves every sequence in place."""
        free, ref_cnt = self.pool.num_free, self.pool.ref_cnt
        if need(batch, ref_cnt) <= free:
            return [], []
        if self.strict:
            raise CacheFullError(need(batch, ref_cnt), free, "strict mode")
        victims = self._rows.plan_preemption(need, batch, ref_cnt, free)
        if victims is None:
            raise CacheFullError(need(batch, ref_cnt), free, "nothing left to preempt")
        swapped = self._preempt(victims, stream, now)
        self.num_preemptions += len(victims)
        return victims, swapped

    def _preempt(self, victims: list[Hashable], stream: Stream | None, now: float
                 ) -> list[Hashable]:
        """Release ``victims``' blocks; returns those kept elsewhere (here: none)."""
        for victim in victims:
            self._release(victim)
        return []

    def _allocate(self, count: int, stream: Stream | None, taking: Sequence[int] = (),
                  fill: list[int] | None = None) -> np.ndarray:
        """``pool.take(taking)``, then ``count`` fresh blocks (see ``PrefixTiers``); the
        prefixes of the cached-free blocks reused leave the device tier (announced)."""
        if taking:
            self.pool.take(list(taking))
        self._allocation_mark = self._events.mark()  # an undone allocation's events end here
        ids = self.pool.allocate(count)
        assert ids is not None  # the caller counted them free
        for _, digest in self.pool.evicted:
            self._events.removed(digest, DEVICE)
        return ids

    def _save(self) -> tuple[Any, ...]:
        """The bookkeeping as it is now, for ``_restore`` (rare paths only: it copies)."""
        return (self._rows.snapshot(), self.pool.snapshot(), self._epoch,
                self.num_preemptions, self.peak_used_blocks, self.num_cow_copies,
                self.num_prefix_hits, self.num_prefix_misses, self._chains.snapshot(),
                None if self._host is None else self._host.snapshot(), self._events.mark())

    def _restore(self, saved: tuple[Any, ...]) -> None:
        """Put back what ``_save`` saw; cached blocks that this operation's copies wrote
        since forget their prefixes (their contents changed whatever the bookkeeping says:
        a copy that succeeded before the failure wrote as surely as one that failed)."""
        (rows, pool, self._epoch, self.num_preemptions, self.peak_used_blocks,
         self.num_cow_copies, self.num_prefix_hits, self.num_prefix_misses, chains, host,
         mark) = saved
        self._rows.restore(rows)
        self.pool.restore(pool)
        self._chains.restore(chains)
        if host is not None:
            self._tier.restore(host)
        self._events.truncate(mark)
        if self._reached[0] or self._reached[1]:
            self._forget_reached(*self._reached)

    def _forget_reached(self, device: list[int], host: list[int]) -> None:
        """Cached blocks among those copies wrote forget their prefixes (``PrefixTiers``)."""

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

    def _window_firsts(self, rows: np.ndarray, query_lens: np.ndarray | None, window: int
                       ) -> np.ndarray:
        """The first token this step's first query of each of ``rows`` sees through the
        widest ``window`` (every layer has one): what ``_leave_windows`` keeps from. Raises,
        changing nothing, where a query row reaches back into blocks an earlier step freed."""
        rows_of, block_size = self._rows, self.config.block_size
        asked = 1 if query_lens is None else query_lens
        first: np.ndarray = rows_of.lens[rows] - asked - window + 1
        dropped = rows_of.dropped[rows]
        lost = np.flatnonzero((dropped > 0) & (first < dropped * block_size))
        if lost.size:  # query rows older than an earlier step's: their keys are gone
            i = int(lost[0])
            raise ValueError(
                f"query_lens[{i}] = {int(np.broadcast_to(asked, rows.shape)[i])} reaches back "
                f"to token {int(first[i])} of a sequence whose blocks before token "
                f"{int(dropped[i]) * block_size} left every window (freed): a step's query "
                "rows start no earlier than the last's")
        return first

    def _leave_windows(self, rows: np.ndarray, first: np.ndarray) -> bool:
        """Free the blocks of ``rows`` wholly before token ``first`` of each
        (``_window_firsts``): they are never read again, as lengths only grow. The null
        block takes their table entries; blocks shared with others (forks, prefixes) lose a
        holder; freed prefix blocks stay cached, as a finished sequence's. Whether any
        was freed (the cache changed)."""
        given = self._rows.drop_before(rows, first, self.config.block_size)
        if not given.size:
            return False
        self.pool.free(given)
        self.num_window_dropped += int(given.size)
        self._changed()
        return True

    def _release(self, seq_id: Hashable) -> int:
        self._chains.stop(self._rows.index[seq_id])
        released = self.pool.free(self._rows.release(seq_id))
        self._changed()
        return released

