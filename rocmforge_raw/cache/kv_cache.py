"""KvCache: sequences of blocks over one device slab, with sharing, copy-on-write, LRU
preemption and a per-step plan. Every public operation is atomic under one lock.

Bookkeeping lives in ``SequenceRows`` (persistent NumPy arrays indexed by a sequence's row);
``append()`` and ``batch()`` work on whole arrays, nothing loops over blocks in Python. A
decode step is ``append`` (one slot per sequence), ``batch`` (the step's plan: metadata
uploaded once) and, per layer, ``write`` + ``attention`` (one launch each, see ``step``).
Invariants, checked by ``check_invariants()``: free + used blocks == num_blocks - 1, and each
block's ref count equals the number of sequences holding it.

Device work is queued on the cache's ``stream`` (None: the backend's default stream) unless
a call names another; nothing here waits for the device.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ops
from ..array import DeviceArray
from ..buffer import HipBuffer
from ..errors import BufferClosedError, CacheFullError
from ..stream import Stream
from .block_pool import BlockPool
from .config import CacheConfig
from .records import FinishedRecords
from .rows import SequenceRows
from .step import BatchMetadata, StepPlanner


@dataclass(frozen=True)
class Reservation:
    """Slots reserved by ``add_sequence``/``append`` (int64, ``-1`` for a sequence that was
    preempted instead) and the ids preempted to make room."""

    slot_mapping: np.ndarray
    preempted: list[Hashable]


class KvCache:
    """A paged KV cache on one device. ``strict=True`` raises ``CacheFullError`` where the
    default would preempt the least-recently-used running sequence. ``stream`` orders the
    cache's device work (copy-on-write copies, uploads, kernels) unless a call names one."""

    def __init__(self, config: CacheConfig, device: int | None = None, backend: Any = None, *,
                 strict: bool = False, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 stream: Stream | None = None) -> None:
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be a Stream or None, not {type(stream).__name__}")
        self.config, self.strict, self.clock, self.stream = config, strict, clock, stream
        self._lock = threading.RLock()
        buf = HipBuffer(config.total_bytes, device, backend)  # checks size before allocating
        self.slab = DeviceArray(buf, config.dtype, config.slab_shape)
        self.pool = BlockPool(config.num_blocks)
        self._rows = SequenceRows()
        self._steps = StepPlanner(config, self.slab)
        self._epoch = 0  # bumped by every change of tables or lengths: plans go stale
        self._finished = FinishedRecords(max_finished, finished_ttl_s, clock)
        self.num_preemptions = self.num_cow_copies = self.peak_used_blocks = 0

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the slab and the staging memory, after the device has passed the plans'
        launches. Idempotent; the cache cannot be used afterwards."""
        with self._lock:
            self._steps.close()
            self.slab.buffer.root.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` released the slab (the cache refuses new work then)."""
        return self.slab.buffer.closed

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, seq_id: Hashable) -> bool:
        with self._lock:
            return seq_id in self._rows.index

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows.index)

    def seq_ids(self) -> list[Hashable]:
        """The ids of the sequences the cache holds (in the order they got their rows)."""
        with self._lock:
            return list(self._rows.index)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds (prompt plus appended), including reserved slots."""
        with self._lock:
            return int(self._rows.lens[self._rows.row(seq_id)])

    def block_ids(self, seq_id: Hashable) -> np.ndarray:
        """The blocks of ``seq_id`` in order (a copy)."""
        with self._lock:
            rows, row = self._rows, self._rows.row(seq_id)
            return rows.tables[row, : rows.nblocks[row]].copy()

    def times(self, seq_id: Hashable) -> tuple[float, float]:
        """(created, last accessed) of ``seq_id``, in ``clock`` seconds."""
        with self._lock:
            rows, row = self._rows, self._rows.row(seq_id)
            return float(rows.created[row]), float(rows.accessed[row])

    # --- check-then-act ----------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits in free blocks now, without preempting."""
        with self._lock:
            return num_tokens > 0 and self._blocks_for(num_tokens) <= self.pool.num_free

    def can_append(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether one more token for each of ``seq_ids`` fits now, without preempting."""
        with self._lock:
            ids = list(seq_ids)
            if len(set(ids)) != len(ids) or any(s not in self._rows.index for s in ids):
                return False
            return self._append_need(self._rows.rows(ids))[0] <= self.pool.num_free

    # --- operations --------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> Reservation:
        """Allocate blocks for a prompt of ``num_tokens``; the reservation maps every prompt
        token to its slot (in order)."""
        with self._lock:
            self._check_open()
            if isinstance(num_tokens, bool):
                raise TypeError("num_tokens must be an integer, not bool")
            try:
                num_tokens = operator.index(num_tokens)
            except TypeError:
                raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}") from None
            if num_tokens < 1:
                raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
            if seq_id in self._rows.index:
                raise ValueError(f"sequence {seq_id!r} already exists")
            need = self._blocks_for(num_tokens)
            if need > self.config.num_blocks - 1:
                raise CacheFullError(need, self.pool.num_free,
                                     f"a {num_tokens}-token prompt exceeds the whole cache")
            preempted = self._make_room(lambda: need, [])
            ids = self.pool.allocate(need)
            rows, bs = self._rows, self.config.block_size
            row = rows.add(seq_id, need)
            rows.tables[row, :need] = ids
            rows.lens[row], rows.nblocks[row] = num_tokens, need
            rows.last_block[row] = ids[-1]
            rows.last_slot[row] = int(ids[-1]) * bs + (num_tokens - 1) % bs
            rows.created[row] = self.clock()
            rows.touch(np.array([row]), rows.created[row])
            self._changed()
            positions = np.arange(num_tokens)
            slots = ids[positions // bs].astype(np.int64) * bs + positions % bs
            return Reservation(slots, preempted)

    def append(self, seq_ids: Iterable[Hashable], stream: Stream | None = None) -> Reservation:
        """Reserve one more token slot for each sequence, vectorised. A sequence whose last
        block is shared gets a private copy first (copy-on-write, queued on ``stream``).
        When blocks run out, the least-recently-used other sequences are preempted (then, if
        need be, those of this call, which get slot -1); with ``strict`` it raises
        ``CacheFullError`` instead."""
        with self._lock:
            self._check_open()
            if isinstance(seq_ids, (str, bytes)):
                raise TypeError(f"seq_ids must be a list of ids, not the string {seq_ids!r}")
            ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
            rows = self._rows.rows(ids)
            if not self._rows.distinct():
                raise ValueError("append lists a sequence twice")
            total, grow, cow = self._append_need(rows)
            live, preempted = ids, []
            if total > self.pool.num_free:
                live = list(ids)
                preempted = self._make_room(
                    lambda: self._append_need(self._rows.rows(live))[0], live)
                rows = self._rows.rows(live)
                total, grow, cow = self._append_need(rows)
            self._extend(rows, grow, cow, total, self._stream(stream))
            if not preempted:
                return Reservation(self._rows.last_slot[rows], preempted)
            slots = np.full(len(ids), -1, np.int64)
            index = {s: i for i, s in enumerate(ids)}
            slots[[index[s] for s in live]] = self._rows.last_slot[rows]
            return Reservation(slots, preempted)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares every block of ``parent_id`` (ref counts, no copy)."""
        with self._lock:
            self._check_open()
            rows = self._rows
            parent = rows.row(parent_id)
            if child_id in rows.index:
                raise ValueError(f"sequence {child_id!r} already exists")
            count = int(rows.nblocks[parent])
            self.pool.share(rows.tables[parent, :count])
            row = rows.add(child_id, count)
            rows.tables[row, :count] = rows.tables[parent, :count]
            rows.lens[row], rows.nblocks[row] = rows.lens[parent], count
            rows.last_block[row] = rows.last_block[parent]
            rows.last_slot[row] = -1
            rows.created[row] = self.clock()
            rows.touch(np.array([parent, row]), rows.created[row])
            self._changed()

    def finish(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now and keep a bounded record that it finished. Returns
        the number of blocks that went back to the pool."""
        with self._lock:
            tokens = int(self._rows.lens[self._rows.row(seq_id)])
            released = self._release(seq_id)
            self._finished.add(seq_id, (self.clock(), tokens))
            return released

    def remove(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now, keeping no record. Returns the blocks released."""
        with self._lock:
            self._rows.row(seq_id)
            return self._release(seq_id)

    def batch(self, seq_ids: Iterable[Hashable], stream: Stream | None = None
              ) -> BatchMetadata:
        """The step's plan for ``seq_ids`` (in that order): metadata uploaded to the device
        once, asynchronously on ``stream``, and the step's launches prepared. Current until
        the cache changes or plans again; the previous plan stops being current."""
        with self._lock:
            self._check_open()
            ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
            rows_of = self._rows
            rows = rows_of.rows(ids)
            if not rows_of.distinct():
                raise ValueError("batch lists a sequence twice")
            width = max(int(rows_of.nblocks[rows].max(initial=0)), 1)
            meta = self._steps.plan(
                self, self._epoch, list(ids), rows_of.tables[rows, :width],
                rows_of.lens[rows].astype(np.int32), rows_of.last_slot[rows],
                self._stream(stream))
            rows_of.touch(rows, self.clock())
            return meta

    def finished(self) -> dict[Hashable, tuple[float, int]]:
        """Recently finished ids → (finish time, tokens), bounded by count and age."""
        with self._lock:
            return self._finished.snapshot()

    # --- device work -------------------------------------------------------------------------
    def k_cache(self, layer: int) -> DeviceArray:
        """Layer ``layer``'s K cache, ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        return self._plane(layer, 0)

    def v_cache(self, layer: int) -> DeviceArray:
        """Layer ``layer``'s V cache, shaped like ``k_cache``."""
        return self._plane(layer, 1)

    def _plane(self, layer: int, kv: int) -> DeviceArray:
        with self._lock:
            ptrs = self._steps.planes(layer)
        c = self.config
        return DeviceArray(self.slab.buffer, c.dtype, c.slab_shape[2:],
                           ptrs[kv] - self.slab.ptr)

    def write(self, layer: int, key: DeviceArray, value: DeviceArray,
              slot_mapping: BatchMetadata | Any, stream: Stream | None = None) -> None:
        """Write K/V of ``layer``: with the current ``batch()`` plan, each sequence's new
        token (``[n, num_kv_heads, head_dim]``, one launch); with a slot mapping, any tokens
        at those slots (see ``ops.reshape_and_cache``; prefill)."""
        with self._lock:
            if isinstance(slot_mapping, BatchMetadata):
                self._steps.write(self._current(slot_mapping, stream), layer, key, value)
            else:
                ops.reshape_and_cache(key, value, self.k_cache(layer), self.v_cache(layer),
                                      slot_mapping, stream=self._stream(stream))

    def attention(self, layer: int, out: DeviceArray, query: DeviceArray,
                  batch: BatchMetadata, scale: float | None = None,
                  stream: Stream | None = None) -> None:
        """Decode attention of ``layer`` for the current ``batch()`` plan: one launch."""
        with self._lock:
            self._steps.attention(self._current(batch, stream), layer, out, query, scale)

    # --- accounting --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Blocks free/used, usage, fragmentation (reserved but unwritten slots over slots in
        use), bytes per token, sequences, preemptions, copy-on-write copies, peak usage."""
        with self._lock:
            used, usable = self.pool.num_used, self.config.num_blocks - 1
            tokens, slots = self._rows.tokens_and_slots(self.config.block_size)
            self._finished.prune()
            return {
                "num_blocks": usable, "free_blocks": self.pool.num_free, "used_blocks": used,
                "usage": used / usable, "peak_used_blocks": self.peak_used_blocks,
                "fragmentation": (slots - tokens) / max(used * self.config.block_size, 1),
                "bytes_per_token": self.config.bytes_per_token,
                "active_sequences": len(self._rows.index), "tokens": tokens,
                "preemptions": self.num_preemptions, "cow_copies": self.num_cow_copies,
                "finished_records": len(self._finished),
            }

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        with self._lock:
            self._rows.check(self.pool, self.config.block_size)

    # --- internals (lock held) ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self.slab.buffer.closed:
            raise BufferClosedError("this KvCache was closed")

    def _stream(self, stream: Stream | None) -> Stream | None:
        if stream is None:
            return self.stream
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be a Stream or None, not {type(stream).__name__}")
        return stream

    def _current(self, meta: Any, stream: Stream | None) -> BatchMetadata:
        """``meta`` if it is this cache's current plan (O(1)); raises otherwise."""
        if type(meta) is not BatchMetadata or meta._owner is not self:
            raise ValueError(f"batch must be metadata from this cache's batch(), not "
                             f"{type(meta).__name__}")
        if meta is not self._steps.current or meta._epoch != self._epoch:
            raise ValueError("batch metadata is stale: the cache changed or planned another "
                             "batch since; call batch() again")
        if stream is not None and stream is not meta.stream:
            raise ValueError("stream differs from the one the batch was planned on: plan the "
                             "batch on the stream that runs it")
        return meta

    def _changed(self) -> None:
        self._epoch += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.config.block_size)

    def _append_need(self, rows: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        return self._rows.append_need(rows, self.pool.ref_cnt, self.config.block_size)

    def _extend(self, rows: np.ndarray, grow: np.ndarray, cow: np.ndarray, total: int,
                stream: Stream | None) -> None:
        """One more slot for each of ``rows``: new blocks where ``grow``, private copies of
        shared last blocks where ``cow`` (``total`` blocks in all, known to be free)."""
        cow_rows = rows[cow]
        new = self.pool.allocate(total) if total else None
        if cow_rows.size:  # the only step that can fail (the copy): before any change
            src = self._rows.last_block[cow_rows]
            dst = new[total - cow_rows.size :].astype(np.int64)
            try:
                ops.copy_blocks(self.slab, np.stack([src, dst], 1), stream=stream)
            except BaseException:
                self.pool.free(new)
                raise
            self.pool.free(src)
            self.num_cow_copies += int(cow_rows.size)
        self._rows.extend(rows, grow, cow, new, self.config.block_size, self.clock())
        self._changed()

    def _make_room(self, need: Callable[[], int], batch: list[Hashable]) -> list[Hashable]:
        """Preempt LRU sequences (others first, then members of ``batch``, which shrinks)
        until ``need()`` blocks are free. Raises ``CacheFullError`` in strict mode or when
        nothing is left to preempt."""
        preempted: list[Hashable] = []
        while need() > self.pool.num_free:
            if self.strict:
                raise CacheFullError(need(), self.pool.num_free, "strict mode")
            victim = self._rows.least_recent(exclude=batch)
            if victim is None:
                victim = self._rows.least_recent(exclude=())
            if victim is None:
                raise CacheFullError(need(), self.pool.num_free, "nothing left to preempt")
            if victim in batch:
                batch.remove(victim)
            self._release(victim)
            self.num_preemptions += 1
            preempted.append(victim)
        return preempted

    def _release(self, seq_id: Hashable) -> int:
        released = self.pool.free(self._rows.release(seq_id))
        self._changed()
        return released
