"""KvCache: sequences of blocks over one device slab, with sharing, copy-on-write, LRU
preemption and a per-step plan. Every public operation is atomic under one lock.

Bookkeeping lives in ``SequenceRows`` (persistent NumPy arrays indexed by a sequence's row);
``append()`` and ``batch()`` run over them in the compiled core (``blocks._rows``). A decode
step is ``append`` (one slot per sequence), ``batch`` (the step's plan: metadata uploaded
once) and, per layer, ``write`` + ``attention`` (one launch each, see ``step``), or all the
layers as one graph (``step_graph``); a serving loop plans step t + 1 while the device runs
step t (README).
Invariants, checked by ``check_invariants()``: free (cached-free included) + used blocks ==
num_blocks - 1, each block's ref count equals the number of sequences holding it, and the
prefix index names exactly the blocks that keep a hash. A prompt given by its token ids
(``add_sequence(seq_id, tokens=...)``) shares the full blocks the prefix cache already holds
(``prefix``); an ``append`` given the new tokens' ids names each block it fills
(``chains``), so the next turn of a conversation finds all of it. An fp8 cache stores codes
with per-layer scales (``CacheConfig``).

With ``CacheConfig(host_blocks=N)`` the cache has a host tier of pinned host memory
(``host_tier``): preempted sequences are swapped out there instead of dropped, and come
back with ``swap_in`` (``swap``); freed prefix blocks are demoted there before they are
reused and promoted back by a later prompt (``tiered``). The invariants then hold for both
tiers. Prefix changes are announced as events (``events()``: ``events``).

Device work is queued on the cache's ``stream`` (None: the backend's default stream) unless
a call names another; nothing here waits for the device. The slab starts zeroed (one memset
on that stream), so slots never written read as zeros and copy-on-write never copies
uninitialized memory.

Every operation checks its arguments and plans (preemption included) before it changes
anything, and reads the clock first, so it either completes or raises with the cache exactly
as before. A closed cache refuses every use; a cache cannot be copied or pickled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from ..common import checks
from ..errors import CacheFullError
from ..memory.array import DeviceArray
from ..memory.buffer import HipBuffer
from ..memory.stream import Stream, stream_handle
from ..runtime import get_backend
from .blocks import prefix
from .blocks.block_pool import BlockPool
from .blocks.chains import TokenChains
from .blocks.rows import SequenceRows
from .chunks import ChunkOps
from .config import CacheConfig
from .core import operation, repeated
from .events import EventQueue
from .records import FinishedRecords
from .reservation import Reservation
from .step.launches import StepLaunches
from .step.planner import StepPlanner
from .tiers.host_tier import HostTier
from .tiers.order import StreamOrder
from .transfer.sequences import SequenceTransfer


class KvCache(SequenceTransfer, ChunkOps, StepLaunches):
    """A paged KV cache on one device. ``strict=True`` raises ``CacheFullError`` where the
    default would preempt the least-recently-used running sequence. ``stream`` orders the
    cache's device work (copy-on-write copies, uploads, kernels) unless a call names one.
    ``shareable=True`` puts the slab in memory other processes can map (``IpcTransport``).
    With ``config.host_blocks`` the cache has a host tier (``swap``); ``max_events`` bounds
    the queue of prefix events ``events()`` drains (0: none are recorded)."""

    def __init__(self, config: CacheConfig, device: int | None = None, backend: Any = None, *,
                 strict: bool = False, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 stream: Stream | None = None, shareable: bool = False,
                 max_events: int = 10_000) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {checks.show(config)}")
        strict = checks.flag(strict, "strict")
        finished = FinishedRecords(max_finished, finished_ttl_s, clock)  # checks all three
        backend = get_backend(backend)
        device = backend.resolve_device(device)
        stream_handle(stream, "stream", backend, device)  # an open Stream of it, or None
        self.config, self.strict, self.clock, self.stream = config, strict, clock, stream
        self._lock = threading.RLock()
        shareable = checks.flag(shareable, "shareable")
        self._events = EventQueue(checks.integer(max_events, "max_events", 0))
        self._reached: tuple[list[int], list[int]] = ([], [])  # see CacheCore
        # checks the size before allocating
        buf = HipBuffer(config.total_bytes, device, backend, shareable=shareable)
        self.slab = DeviceArray(buf, config.dtype, config.slab_shape)
        self._host = self._order = None
        try:
            buf.fill(0, stream=stream)  # unwritten slots read as zeros: no copy reads garbage
            if config.host_blocks:
                self._order = StreamOrder(backend, device)
                self._host = HostTier(config, config.host_blocks, self.slab, self._events)
        except BaseException:
            if self._order is not None:
                self._order.close()
            buf.close()
            raise
        self.pool = BlockPool(config.num_blocks)
        self._rows = SequenceRows()
        self._chains = TokenChains(config.block_size)
        self._steps = StepPlanner(config, self.slab)
        self._epoch = 0  # bumped by every change of tables or lengths: plans go stale
        self._finished = finished
        self.num_preemptions = self.num_cow_copies = self.peak_used_blocks = 0
        self.num_prefix_hits = self.num_prefix_misses = 0

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the slab, the host tier and the staging memory, after the device has
        passed the plans' launches and the copies. Idempotent; the cache cannot be used
        afterwards, but for draining its last ``events()`` (an ``AllCleared`` ends them)."""
        with self._lock:
            if self.closed:
                return
            self._steps.close()
            if self._order is not None:
                self._order.close()
                self._tier.close()
            self.slab.buffer.root.close()
            self._events.cleared()
            self._events.commit()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` released the slab (the cache refuses new work then)."""
        return self.slab.buffer.closed

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a KvCache owns device memory and its bookkeeping and cannot be copied "
                        "or pickled")

    # --- check-then-act ----------------------------------------------------------------------
    @operation
    def can_allocate(self, num_tokens: int | None = None, *, tokens: Any = None) -> bool:
        """Whether a prompt of ``num_tokens``, or of the token ids ``tokens`` (the blocks
        the device holds by prefix counted as found), fits in free blocks now, without
        preempting."""
        if tokens is not None:
            hashes = prefix.block_hashes(prefix.token_ids(tokens), self.config.block_size)
            hits = [b for on_host, b in self._lookup(hashes) if not on_host]
            fresh = self._blocks_for(len(tokens)) - len(hits)
            return self._needed(fresh, hits, self.pool.ref_cnt) <= self.pool.num_free
        num_tokens = checks.integer(num_tokens, "num_tokens")
        return num_tokens > 0 and self._blocks_for(num_tokens) <= self.pool.num_free

    @operation
    def can_append(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether one more token for each of ``seq_ids`` fits now, without preempting (False
        for an id the cache does not hold, or one listed twice)."""
        ids = checks.id_list(seq_ids, "seq_ids", in_order=False)
        try:
            rows = self._rows.rows(ids)
        except KeyError:
            return False
        if not self._rows.distinct():
            return False
        return self._append_need(rows)[0] <= self.pool.num_free

    # --- operations --------------------------------------------------------------------------
    @operation
    def add_sequence(self, seq_id: Hashable, num_tokens: int | None = None, *,
                     tokens: Any = None) -> Reservation:
        """Allocate blocks for a prompt of ``num_tokens``, or of the token ids ``tokens``
        (exactly one of the two); the reservation maps every prompt token to its slot (in
        order). Given ``tokens``, each full block is looked up in the prefix cache by its
        chained hash (``prefix.block_hashes``): the leading blocks found are shared (held
        or cached-free), the rest are fresh and become findable, and the reservation says
        how many leading tokens are cached. When the whole prompt is cached, its last token
        is reported uncached so that the caller still computes it (its K/V, written again,
        equal what the block holds; a ``batch()`` write before the next ``append`` skips
        it, as it does after ``fork``). The caller writes the K/V of the uncached tokens on
        the cache's stream before any later use: a hit is only as good as that write.
        Blocks found on the host tier only are copied into fresh blocks (promoted) and
        count as hits; the sequence keeps its token chain (``append(..., tokens=)``)."""
        checks.hashable(seq_id, "seq_id")
        if (num_tokens is None) == (tokens is None):
            raise TypeError("give exactly one of num_tokens and tokens")
        hashes: list[bytes] = []
        ids_of = None
        if tokens is not None:
            ids_of = prefix.token_ids(tokens)
            num_tokens = int(ids_of.size)
            hashes = prefix.block_hashes(ids_of, self.config.block_size)
        num_tokens = checks.integer(num_tokens, "num_tokens", 1)
        if seq_id in self._rows.index or self._swapped(seq_id) is not None:
            raise ValueError(f"sequence {seq_id!r} already exists")
        need = self._blocks_for(num_tokens)
        if need > self.config.num_blocks - 1:
            raise CacheFullError(need, self.pool.num_free,
                                 f"a {num_tokens}-token prompt exceeds the whole cache")
        now = self._now()
        ids, found, preempted, swapped = self._prompt_blocks(need, hashes, ids_of, now)
        self._add_row(seq_id, ids, num_tokens, found == need, now)
        if ids_of is not None:
            self._chains.start(self._rows.index[seq_id], (
                hashes[-1] if hashes else b"", ids_of[len(hashes) * self.config.block_size :]))
        self.num_prefix_hits += found
        self.num_prefix_misses += len(hashes) - found
        positions = np.arange(num_tokens)
        bs = self.config.block_size
        slots = ids[positions // bs].astype(np.int64) * bs + positions % bs
        return Reservation(slots, preempted, min(found * bs, num_tokens - 1), swapped)

    @operation
    def append(self, seq_ids: Iterable[Hashable], stream: Stream | None = None, *,
               tokens: Any = None) -> Reservation:
        """Reserve one more token slot for each sequence, vectorised. A sequence whose last
        block is shared gets a private copy first (copy-on-write, queued on ``stream``).
        When blocks run out, the least-recently-used other sequences are preempted (then, if
        need be, those of this call, which get slot -1): swapped out to the host tier where
        it has room, else dropped; with ``strict`` it raises ``CacheFullError`` instead.
        ``tokens``: the ids of the new tokens, one per sequence (-1: unknown, which ends
        that sequence's chain): each block that fills is named by its prefix hash
        (``chains``), so a later prompt repeating the sequence hits it."""
        ids = checks.id_list(seq_ids, "seq_ids")
        stream = self._stream(stream)
        rows = self._resident_rows(ids)
        if not self._rows.distinct():
            raise ValueError(f"append lists sequence {repeated(ids)!r} twice")
        if tokens is not None:
            tokens = prefix.token_ids(tokens, least=-1)
            if tokens.size != len(ids):
                raise ValueError(f"tokens holds {tokens.size} ids for {len(ids)} sequences")
        now = self._now()
        lens = self._rows.lens[rows] if self._chains.count else None
        slots = self._append_plain(rows, now)
        if slots is not None:  # the common case, in one call
            if lens is not None:
                self._chain(rows, lens, tokens)
            return Reservation._plain(slots)
        need = self._append_need(rows)
        live, saved = ids, None
        preempted: list[Hashable] = []
        swapped: list[Hashable] = []
        if need[0] > self.pool.num_free:
            saved = self._save()  # the copy below may fail after preempting: undo all
            preempted, swapped = self._make_room(self._need_of, ids, stream, now)
            gone = set(preempted)
            live = [s for s in ids if s not in gone]
            rows = self._rows.rows(live)
            need = self._append_need(rows)
        lens = self._rows.lens[rows] if self._chains.count else None
        try:
            new_slots = self._extend(rows, need, stream, now)
        except BaseException:
            if saved is not None:
                self._restore(saved)
            raise
        if not preempted:
            if lens is not None:
                self._chain(rows, lens, tokens)
            return Reservation(new_slots, preempted)
        slots = np.full(len(ids), -1, np.int64)
        index = {s: i for i, s in enumerate(ids)}
        kept = [index[s] for s in live]
        slots[kept] = new_slots
        if lens is not None:
            self._chain(rows, lens, None if tokens is None else tokens[kept])
        return Reservation(slots, preempted, 0, swapped)

    @operation
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares every block of ``parent_id`` (ref counts, no copy); the child
        of a swapped-out parent is swapped out too, sharing its host blocks."""
        checks.hashable(child_id, "child_id")
        rows = self._rows
        swapped = self._swapped(parent_id)
        parent = None if swapped is not None else rows.row(parent_id)
        if child_id in rows.index or self._swapped(child_id) is not None:
            raise ValueError(f"sequence {child_id!r} already exists")
        now = self._now()
        if swapped is not None:
            self._fork_swapped(parent_id, child_id, now)
            return
        assert parent is not None  # a sequence on the device
        count, dropped = int(rows.nblocks[parent]), int(rows.dropped[parent])
        self.pool.share(rows.tables[parent, dropped:count])
        row = rows.add(child_id, count)
        rows.tables[row, :count] = rows.tables[parent, :count]
        rows.dropped[row] = dropped
        rows.lens[row], rows.nblocks[row] = rows.lens[parent], count
        rows.last_block[row] = rows.last_block[parent]
        rows.last_slot[row] = -1
        rows.created[row] = now
        rows.touch(np.array([parent, row]), now)
        self._chains.start(row, self._chains.get(parent, int(rows.lens[parent])))
        self._changed()

    @operation
    def finish(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now and keep a bounded record that it finished. Returns
        the number of device blocks that went back to the pool (0 for a swapped-out one,
        whose host blocks go back to the host tier)."""
        swapped = self._swapped(seq_id)
        tokens = swapped.num_tokens if swapped else int(self._rows.lens[self._rows.row(seq_id)])
        now = self._now()
        released = self._release_any(seq_id)
        self._finished.add(seq_id, (now, tokens), now)
        return released

    @operation
    def remove(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now, keeping no record. Returns the device blocks
        released (see ``finish``)."""
        if self._swapped(seq_id) is None:
            self._rows.row(seq_id)
        return self._release_any(seq_id)

    @operation
    def finished(self) -> dict[Hashable, tuple[float, int]]:
        """Recently finished ids → (finish time, tokens), bounded by count and age."""
        return self._finished.snapshot()

    # --- accounting --------------------------------------------------------------------------
    @operation
    def stats(self) -> dict[str, Any]:
        """Blocks free/used, usage, fragmentation (reserved but unwritten slots over slots in
        use), bytes per token, sequences, preemptions, copy-on-write copies, peak usage, and
        the table entries given up as they left every layer's window
        (``window_dropped_blocks``, ``KvCache.batch``), the prefix cache: full prompt blocks
        found (hits) and not found (misses), the hit
        rate over them (0.0 before any lookup), and how many free blocks still hold a
        prefix (``cached_free_blocks``, counted in ``free_blocks``). The host tier
        (``host_*`` zeros without one): its blocks held by swapped-out sequences, cached
        (prefixes) and free, sequences swapped out, blocks and bytes copied out (swaps and
        demotions) and in (swaps and promotions), and the prompt blocks it served
        (``host_hits``, also prefix hits) over those the device did not hold
        (``host_hit_rate``). Events: queued, and dropped by the bounded queue in all."""
        used, usable = self.pool.num_used, self.config.num_blocks - 1
        tokens, slots = self._rows.tokens_and_slots(self.config.block_size)
        self._finished.prune()
        lookups = self.num_prefix_hits + self.num_prefix_misses
        return {
            "num_blocks": usable, "free_blocks": self.pool.num_free, "used_blocks": used,
            "usage": used / usable, "peak_used_blocks": self.peak_used_blocks,
            "fragmentation": (slots - tokens) / max(used * self.config.block_size, 1),
            "bytes_per_token": self.config.bytes_per_token,
            "active_sequences": len(self._rows.index), "tokens": tokens,
            "preemptions": self.num_preemptions, "cow_copies": self.num_cow_copies,
            "window_dropped_blocks": self.num_window_dropped,
            "finished_records": len(self._finished),
            "prefix_hits": self.num_prefix_hits, "prefix_misses": self.num_prefix_misses,
            "prefix_hit_rate": self.num_prefix_hits / lookups if lookups else 0.0,
            "cached_free_blocks": self.pool.num_cached_free,
            **self._tier_stats(),
            "events_queued": len(self._events), "events_dropped": self._events.total_dropped,
        }

    @operation
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, of either tier."""
        self._rows.check(self.pool, self.config.block_size)
        if self._host is not None:
            self._host.check()
            assert not set(self._host.sequences) & set(self._rows.index), (
                "a sequence is both on the device and swapped out")
