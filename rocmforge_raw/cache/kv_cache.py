"""KvCache: sequences of blocks over one device slab, with sharing, copy-on-write and LRU
preemption. Every public operation is atomic under one lock.

Bookkeeping lives in persistent NumPy arrays indexed by a sequence's row: ``block tables``
(int32, padded with the null block 0), lengths, block counts, the slot each sequence last
reserved, creation and last-access times, and a recency tick that orders LRU preemption.
``append()`` and ``batch()`` work on these arrays; nothing loops over blocks in Python.
Invariants, checked by ``check_invariants()``: free + used blocks == num_blocks - 1, and each
block's ref count equals the number of sequences holding it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ops
from ..array import DeviceArray
from ..buffer import HipBuffer
from ..errors import CacheFullError
from ..stream import Stream
from .block_pool import NULL_BLOCK, BlockPool
from .config import CacheConfig
from .records import FinishedRecords


@dataclass(frozen=True)
class Reservation:
    """Slots reserved by ``add_sequence``/``append`` (int64, ``-1`` for a sequence that was
    preempted instead) and the ids preempted to make room."""

    slot_mapping: np.ndarray
    preempted: list[Hashable]


@dataclass(frozen=True)
class BatchMetadata:
    """Kernel metadata for ``seq_ids``: ``block_tables`` int32 ``[n, max_blocks]`` padded with
    0, ``seq_lens`` int32 ``[n]``, ``slot_mapping`` int64 ``[n]`` (each sequence's last
    reserved slot)."""

    seq_ids: list[Hashable]
    block_tables: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray


class KvCache:
    """A paged KV cache on one device. ``strict=True`` raises ``CacheFullError`` where the
    default would preempt the least-recently-used running sequence."""

    def __init__(self, config: CacheConfig, device: int | None = None, backend: Any = None, *,
                 strict: bool = False, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.config, self.strict, self.clock = config, strict, clock
        self._lock = threading.RLock()
        buf = HipBuffer(config.total_bytes, device, backend)  # checks size before allocating
        self.slab = DeviceArray(buf, config.dtype, config.slab_shape)
        self.workspace = ops.Workspace()  # split-K scratch of attention(), freed by close()
        self.pool = BlockPool(config.num_blocks)
        rows, width = 16, 8
        self._tables = np.zeros((rows, width), np.int32)
        self._lens = np.zeros(rows, np.int64)
        self._nblocks = np.zeros(rows, np.int64)
        self._last_slot = np.full(rows, -1, np.int64)
        self._last_block = np.zeros(rows, np.int64)  # == tables[row, nblocks - 1]
        self._created = np.zeros(rows)
        self._accessed = np.zeros(rows)
        self._recency = np.zeros(rows, np.int64)  # larger = used more recently
        self._tick = 0
        self._free_rows = list(range(rows - 1, -1, -1))
        self._seqs: dict[Hashable, int] = {}  # seq id -> row
        self._version = 0  # bumped whenever a sequence gets or gives up its row
        self._rows_memo: tuple[int, list[Hashable], np.ndarray, bool] | None = None
        self._finished = FinishedRecords(max_finished, finished_ttl_s, clock)
        self.num_preemptions = self.num_cow_copies = self.peak_used_blocks = 0

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the slab. The cache cannot be used afterwards."""
        with self._lock:
            self.workspace.close()
            self.slab.buffer.root.close()

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, seq_id: Hashable) -> bool:
        with self._lock:
            return seq_id in self._seqs

    def __len__(self) -> int:
        with self._lock:
            return len(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        with self._lock:
            return int(self._lens[self._row(seq_id)])

    def block_ids(self, seq_id: Hashable) -> np.ndarray:
        """The blocks of ``seq_id`` in order (a copy)."""
        with self._lock:
            row = self._row(seq_id)
            return self._tables[row, : self._nblocks[row]].copy()

    def times(self, seq_id: Hashable) -> tuple[float, float]:
        """(created, last accessed) of ``seq_id``, in ``clock`` seconds."""
        with self._lock:
            row = self._row(seq_id)
            return float(self._created[row]), float(self._accessed[row])

    # --- check-then-act ----------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits in free blocks now, without preempting."""
        with self._lock:
            return num_tokens > 0 and self._blocks_for(num_tokens) <= self.pool.num_free

    def can_append(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether one more token for each of ``seq_ids`` fits now, without preempting."""
        with self._lock:
            ids = list(seq_ids)
            if len(set(ids)) != len(ids) or any(s not in self._seqs for s in ids):
                return False
            return self._append_need(self._rows(ids))[0] <= self.pool.num_free

    # --- operations --------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> Reservation:
        """Allocate blocks for a prompt of ``num_tokens``; the reservation maps every prompt
        token to its slot (in order)."""
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} already exists")
            if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or num_tokens < 1:
                raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
            need = self._blocks_for(num_tokens)
            if need > self.config.num_blocks - 1:
                raise CacheFullError(need, self.pool.num_free,
                                     f"a {num_tokens}-token prompt exceeds the whole cache")
            preempted = self._make_room(lambda: need, [])
            ids = self.pool.allocate(need)
            row = self._new_row(need)
            self._tables[row, :need] = ids
            self._lens[row], self._nblocks[row] = num_tokens, need
            self._last_block[row] = ids[-1]
            self._last_slot[row] = self._slot(ids[-1], num_tokens - 1)
            self._seqs[seq_id] = row
            self._created[row] = self.clock()
            self._touch(np.array([row]))
            self._note_usage()
            positions = np.arange(num_tokens)
            slots = ids[positions // self.config.block_size].astype(np.int64)
            slots = slots * self.config.block_size + positions % self.config.block_size
            return Reservation(slots, preempted)

    def append(self, seq_ids: Iterable[Hashable]) -> Reservation:
        """Reserve one more token slot for each sequence, vectorised. A sequence whose last
        block is shared gets a private copy first (copy-on-write). When blocks run out, the
        least-recently-used other sequences are preempted (then, if need be, those of this
        call, which get slot -1); with ``strict`` it raises ``CacheFullError`` instead."""
        with self._lock:
            ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
            rows = self._rows(ids)
            if not self._rows_memo[3]:
                raise ValueError("append lists a sequence twice")
            total, grow, cow = self._append_need(rows)
            live, preempted = ids, []
            if total > self.pool.num_free:
                live = list(ids)
                preempted = self._make_room(
                    lambda: self._append_need(self._rows(live))[0], live)
                rows = self._rows(live)
                total, grow, cow = self._append_need(rows)
            new = self.pool.allocate(total)
            bs = self.config.block_size
            lens = self._lens[rows]
            n_grow = int(np.count_nonzero(grow))
            if n_grow:
                grow_rows = rows[grow]
                count = self._nblocks[grow_rows]
                self._widen(int(count.max()) + 1)
                self._tables[grow_rows, count] = new[:n_grow]
                self._nblocks[grow_rows] = count + 1
                self._last_block[grow_rows] = new[:n_grow]
            if n_grow < total:
                cow_rows = rows[cow]
                src, dst = self._last_block[cow_rows], new[n_grow:].astype(np.int64)
                ops.copy_blocks(self.slab, np.stack([src, dst], 1))
                self._tables[cow_rows, self._nblocks[cow_rows] - 1] = dst
                self._last_block[cow_rows] = dst
                self.pool.free(src)
                self.num_cow_copies += int(cow_rows.size)
            self._last_slot[rows] = self._last_block[rows] * bs + (lens & (bs - 1))
            self._lens[rows] = lens + 1
            self._touch(rows)
            self._note_usage()
            if not preempted:
                return Reservation(self._last_slot[rows], preempted)
            slots = np.full(len(ids), -1, np.int64)
            index = {s: i for i, s in enumerate(ids)}
            slots[[index[s] for s in live]] = self._last_slot[rows]
            return Reservation(slots, preempted)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares every block of ``parent_id`` (ref counts, no copy)."""
        with self._lock:
            parent = self._row(parent_id)
            if child_id in self._seqs:
                raise ValueError(f"sequence {child_id!r} already exists")
            count = int(self._nblocks[parent])
            self.pool.share(self._tables[parent, :count])
            row = self._new_row(count)
            self._tables[row, :count] = self._tables[parent, :count]
            self._lens[row], self._nblocks[row] = self._lens[parent], count
            self._last_block[row] = self._last_block[parent]
            self._last_slot[row] = -1
            self._seqs[child_id] = row
            self._created[row] = self.clock()
            self._touch(np.array([parent, row]))

    def finish(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now and keep a bounded record that it finished. Returns
        the number of blocks that went back to the pool."""
        with self._lock:
            tokens = int(self._lens[self._row(seq_id)])
            released = self._release(seq_id)
            self._finished.add(seq_id, (self.clock(), tokens))
            return released

    def remove(self, seq_id: Hashable) -> int:
        """Free ``seq_id``'s blocks now, keeping no record. Returns the blocks released."""
        with self._lock:
            self._row(seq_id)
            return self._release(seq_id)

    def batch(self, seq_ids: Iterable[Hashable]) -> BatchMetadata:
        """Kernel metadata for ``seq_ids`` (in that order)."""
        with self._lock:
            ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
            rows = self._rows(ids)
            width = max(int(self._nblocks[rows].max(initial=0)), 1)
            self._touch(rows)
            return BatchMetadata(ids, self._tables[rows, :width],
                                 self._lens[rows].astype(np.int32), self._last_slot[rows].copy())

    def finished(self) -> dict[Hashable, tuple[float, int]]:
        """Recently finished ids → (finish time, tokens), bounded by count and age."""
        with self._lock:
            return self._finished.snapshot()

    # --- device views ------------------------------------------------------------------------
    def k_cache(self, layer: int) -> DeviceArray:
        return self._plane(layer, 0)

    def v_cache(self, layer: int) -> DeviceArray:
        return self._plane(layer, 1)

    def _plane(self, layer: int, kv: int) -> DeviceArray:
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.config.num_layers})")
        c = self.config
        plane_bytes = c.num_blocks * c.block_size * c.num_kv_heads * c.head_dim * c.dtype.itemsize
        return DeviceArray(self.slab.buffer, c.dtype, c.slab_shape[2:],
                           (layer * 2 + kv) * plane_bytes)

    def write(self, layer: int, key: DeviceArray, value: DeviceArray, slot_mapping: Any,
              stream: Stream | None = None) -> None:
        """Write new tokens' K/V of ``layer`` at ``slot_mapping`` (see ops.reshape_and_cache)."""
        ops.reshape_and_cache(key, value, self.k_cache(layer), self.v_cache(layer),
                              slot_mapping, stream=stream)

    def attention(self, layer: int, out: DeviceArray, query: DeviceArray,
                  batch: BatchMetadata, scale: float | None = None,
                  stream: Stream | None = None) -> None:
        """Decode attention of ``layer`` for ``batch`` (see ops.paged_attention)."""
        ops.paged_attention(out, query, self.k_cache(layer), self.v_cache(layer),
                            batch.block_tables, batch.seq_lens, scale, stream=stream,
                            workspace=self.workspace)

    # --- accounting --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Blocks free/used, usage, fragmentation (reserved but unwritten slots over slots in
        use), bytes per token, sequences, preemptions, copy-on-write copies, peak usage."""
        with self._lock:
            used, usable = self.pool.num_used, self.config.num_blocks - 1
            rows = self._rows(list(self._seqs))
            slack = int((self._nblocks[rows] * self.config.block_size - self._lens[rows]).sum())
            self._finished.prune()
            return {
                "num_blocks": usable, "free_blocks": self.pool.num_free, "used_blocks": used,
                "usage": used / usable, "peak_used_blocks": self.peak_used_blocks,
                "fragmentation": slack / max(used * self.config.block_size, 1),
                "bytes_per_token": self.config.bytes_per_token,
                "active_sequences": len(self._seqs), "tokens": int(self._lens[rows].sum()),
                "preemptions": self.num_preemptions, "cow_copies": self.num_cow_copies,
                "finished_records": len(self._finished),
            }

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        with self._lock:
            pool, usable = self.pool, self.config.num_blocks - 1
            assert pool.num_free + pool.num_used == usable, "free + used != total"
            free = pool.free_ids()
            assert len(np.unique(free)) == free.size, "a block is on the free stack twice"
            assert (pool.ref_cnt[free] == 0).all(), "a free block has holders"
            rows = self._rows(list(self._seqs))
            held = np.concatenate([self._tables[r, : self._nblocks[r]] for r in rows]
                                  or [np.zeros(0, np.int32)])
            counts = np.bincount(held, minlength=self.config.num_blocks)
            counts[NULL_BLOCK] = 1
            assert (counts == pool.ref_cnt).all(), "ref counts differ from holders"
            assert pool.num_used == int((counts[1:] > 0).sum()), "used blocks differ"
            assert (self._nblocks[rows] == -(-self._lens[rows] // self.config.block_size)).all(
            ), "block count does not match length"
            for r in rows:
                assert (self._tables[r, self._nblocks[r] :] == NULL_BLOCK).all(), "stale table"
                assert self._last_block[r] == self._tables[r, self._nblocks[r] - 1], "last block"

    # --- internals (lock held) ---------------------------------------------------------------
    def _row(self, seq_id: Hashable) -> int:
        row = self._seqs.get(seq_id)
        if row is None:
            raise KeyError(f"no sequence {seq_id!r} in the cache")
        return row

    def _rows(self, ids: list[Hashable]) -> np.ndarray:
        """Rows of ``ids``. A decode loop asks for the same list again and again, so the last
        answer is kept until a sequence is added or released."""
        memo = self._rows_memo
        if memo is not None and memo[0] == self._version and memo[1] == ids:
            return memo[2]
        try:
            rows = np.fromiter(map(self._seqs.__getitem__, ids), np.int64, len(ids))
        except KeyError as exc:
            raise KeyError(f"no sequence {exc.args[0]!r} in the cache") from None
        self._rows_memo = (self._version, list(ids), rows, len(set(ids)) == len(ids))
        return rows

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.config.block_size)

    def _append_need(self, rows: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """(blocks needed, rows needing a new block, rows whose shared last block needs a
        private copy) for appending one token to each row."""
        last = self._last_block[rows]
        grow = (self._lens[rows] & (self.config.block_size - 1)) == 0
        cow = ~grow & (self.pool.ref_cnt[last] > 1)
        if cow.any():  # when every holder of a block appends now, one keeps the original
            where = np.flatnonzero(cow)
            blocks, first, counts = np.unique(last[where], return_index=True,
                                              return_counts=True)
            cow[where[first[counts == self.pool.ref_cnt[blocks]]]] = False
        return int(np.count_nonzero(grow) + np.count_nonzero(cow)), grow, cow

    def _make_room(self, need: Callable[[], int], batch: list[Hashable]) -> list[Hashable]:
        """Preempt LRU sequences (others first, then members of ``batch``, which shrinks)
        until ``need()`` blocks are free. Raises ``CacheFullError`` in strict mode or when
        nothing is left to preempt."""
        preempted: list[Hashable] = []
        while need() > self.pool.num_free:
            if self.strict:
                raise CacheFullError(need(), self.pool.num_free, "strict mode")
            victim = self._least_recent(exclude=batch)
            if victim is None:
                victim = self._least_recent(exclude=())
            if victim is None:
                raise CacheFullError(need(), self.pool.num_free, "nothing left to preempt")
            if victim in batch:
                batch.remove(victim)
            self._release(victim)
            self.num_preemptions += 1
            preempted.append(victim)
        return preempted

    def _least_recent(self, exclude: Iterable[Hashable]) -> Hashable | None:
        skip = set(exclude)
        candidates = [s for s in self._seqs if s not in skip]
        if not candidates:
            return None
        return min(candidates, key=lambda s: self._recency[self._seqs[s]])

    def _release(self, seq_id: Hashable) -> int:
        row = self._seqs.pop(seq_id)
        self._version += 1
        released = self.pool.free(self._tables[row, : self._nblocks[row]])
        self._tables[row] = NULL_BLOCK
        self._lens[row] = self._nblocks[row] = self._last_block[row] = 0
        self._last_slot[row] = -1
        self._free_rows.append(row)
        return released

    def _new_row(self, blocks: int) -> int:
        if not self._free_rows:
            old = self._lens.size
            for name in ("_tables", "_lens", "_nblocks", "_last_slot", "_last_block",
                         "_created", "_accessed", "_recency"):
                array = getattr(self, name)
                setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
            self._last_slot[old:] = -1
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        self._widen(blocks)
        self._version += 1
        return self._free_rows.pop()

    def _widen(self, blocks: int) -> None:
        width = self._tables.shape[1]
        if blocks > width:
            wider = np.zeros((self._tables.shape[0], max(blocks, 2 * width)), np.int32)
            wider[:, :width] = self._tables
            self._tables = wider

    def _slot(self, block: int, position: int) -> int:
        return int(block) * self.config.block_size + position % self.config.block_size

    def _touch(self, rows: np.ndarray) -> None:
        """Mark ``rows`` used now, later ones in the list as more recent."""
        self._accessed[rows] = self.clock()
        self._recency[rows] = np.arange(self._tick + 1, self._tick + 1 + rows.size)
        self._tick += rows.size

    def _note_usage(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)
