"""HostTier: blocks of pinned host memory below a cache's slab, and the copies between them.

The tier is ``num_blocks`` blocks laid out as the slab is, one plane per layer and K/V:
``[2 * num_layers, num_blocks, block bytes of one plane]``, so a run of blocks consecutive
on both sides moves as one 2-D copy (a row per plane) in either direction. Host block ids
run ``0 .. num_blocks - 1`` (no null block).

Every host block is in exactly one of three places: *held* (``ref_cnt >= 1``: swapped-out
sequences hold it), *free* (no hash), or *cached* (``ref_cnt == 0``, keeps a prefix hash:
a demoted prefix block, or one a finished swapped sequence left). A block taken for a new
copy comes from the free stack first, then from the cached ones least recently used first
(their hashes leave the index: ``BlockRemoved``). ``index`` maps a hash to the host block
holding it; a hash names at most one host block (it may also name a device block).

``sequences`` holds what a swapped-out sequence needs to come back: its host blocks in
order, its token count and times, whether it had a slot reserved, and its token chain.
Not locked: the cache's lock covers every call. Sizes are bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels import ops
from ...kernels.staging import PinnedBuffer
from ...memory.array import DeviceArray
from ...memory.stream import Stream, stream_handle
from ...runtime.base import MAX_PITCH
from ..blocks.chains import Chain
from ..config import CacheConfig
from ..events import HOST, EventQueue

#: A swap moves by one kernel launch rather than 2-D copies when those would average fewer
#: bytes than this each. Measured on an H200 (bench --offload, 256 blocks of 2 MiB, every
#: other one, each way by 2-D copies or one launch, alternating in one process): out by
#: launch 86.9-88.7 % of a pinned copy's bandwidth, by 2-D copies 82.6-85.2 %; and pinned
#: memory that the other method touched last moves 5-8 points slower (2-D swap-ins after a
#: launch's swap-out 82.4-84.1 %, after 2-D ones 88.3-90.2 %): so both ways by launch.
KERNEL_BELOW_BYTES = 4 << 20


@dataclass(frozen=True)
class Swapped:
    """A sequence on the host tier: ``blocks`` (host ids, in order) hold its ``num_tokens``
    tokens; ``created``/``accessed`` are its times (clock seconds), ``reserved`` whether its
    last slot was reserved (a step may still write it), ``chain`` its token chain."""

    blocks: np.ndarray
    num_tokens: int
    created: float
    accessed: float
    reserved: bool
    chain: Chain | None


class HostTier:
    """The host tier of one cache (see the module docstring)."""

    def __init__(self, config: CacheConfig, num_blocks: int, slab: DeviceArray,
                 events: EventQueue) -> None:
        self.num_blocks, self.events = num_blocks, events
        self.planes = 2 * config.num_layers
        self.block_bytes = config.block_bytes
        self.chunk = config.block_bytes // self.planes  # one block of one plane
        self.backend, self.device = slab.backend, slab.device
        self.slab_ptr, self.slab_blocks = slab.ptr, config.num_blocks
        self.memory = PinnedBuffer(num_blocks * config.block_bytes, slab.device, slab.backend)
        #: whether ``rf_copy_pieces`` can move this tier's blocks (a GPU backend; every
        #: address and plane chunk 16-byte aligned)
        self.by_kernel = self.backend.name != "host" and not (
            (self.slab_ptr | self.memory.ptr | self.chunk) & 15)
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id
        self.hashes: dict[int, bytes] = {}
        self.index: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.sequences: dict[Hashable, Swapped] = {}
        self.counts = dict.fromkeys(("swapped_out_blocks", "swapped_in_blocks",
                                     "demoted_blocks", "promoted_blocks", "host_hits"), 0)

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by swapped-out sequences."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def room(self) -> int:
        """Blocks a copy can take now: free ones, then cached ones."""
        return len(self._free) + len(self._cached)

    def peek(self, count: int, keep: AbstractSet[int] = frozenset()) -> list[int]:
        """The blocks ``take(count, keep)`` would hand out, changing nothing (in no
        particular order: callers pair them with their sources, ``tiered.paired``)."""
        free = self._free[len(self._free) - min(count, len(self._free)) :]
        cached = (b for b in self._cached if b not in keep)
        return free + [next(cached) for _ in range(count - len(free))]

    def take(self, count: int, keep: AbstractSet[int] = frozenset()) -> list[int]:
        """``count`` blocks with no holder and no hash, for new copies: free ones first,
        then cached ones least recently used first but those in ``keep`` (their hashes
        leave the index). ``count`` is at most ``room`` less the cached blocks kept."""
        taken = self.peek(count, keep)
        del self._free[len(self._free) - min(count, len(self._free)) :]
        for block in taken:
            if block in self._cached:
                del self._cached[block]
                self._unname(block)
        return taken

    def room_besides(self, keep: AbstractSet[int]) -> int:
        """``room`` less the cached blocks in ``keep`` (which a take must not reuse)."""
        return self.room - sum(1 for b in keep if b in self._cached)

    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a cached one is held again, hash intact)."""
        if self.ref_cnt[block] == 0:
            self._cached.pop(block, None)
        self.ref_cnt[block] += 1

    def name(self, block: int, digest: bytes) -> None:
        """``block`` (just taken) holds the prefix ``digest`` (announced with the parent and
        tokens the events remember for it); unheld, it joins the cached blocks as the most
        recently used."""
        self.hashes[block], self.index[digest] = digest, block
        self.events.stored(digest, HOST)
        if self.ref_cnt[block] == 0:
            self._cached[block] = None

    def touch(self, block: int) -> None:
        """``block`` was used now: a cached one becomes the most recently used."""
        if block in self._cached:
            self._cached.move_to_end(block)

    def release(self, blocks: Any, keep: bool) -> None:
        """One holder fewer for each of ``blocks``; a block left unheld stays cached if it
        has a hash and ``keep``, else it is freed (its hash leaves the index)."""
        for block in np.asarray(blocks).tolist():
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.drop(block, keep)

    def drop(self, block: int, keep: bool = False) -> None:
        """Unheld ``block`` is cached (``keep`` and named) or freed."""
        if keep and block in self.hashes:
            self._cached[block] = None
            return
        self._cached.pop(block, None)
        if block in self.hashes:
            self._unname(block)
        self._free.append(block)

    def _unname(self, block: int) -> None:
        digest = self.hashes.pop(block)
        del self.index[digest]
        self.events.removed(digest, HOST)

    def clear(self) -> None:
        """Forget every cached block (the caller announces that all prefixes are gone)."""
        for block in self._cached:
            del self.index[self.hashes.pop(block)]
            self._free.append(block)
        self._cached.clear()

    def cached_ids(self) -> list[int]:
        """The cached blocks, least recently used first."""
        return list(self._cached)

    def snapshot(self) -> tuple[Any, ...]:
        return (self.ref_cnt.copy(), list(self._free), dict(self.hashes), dict(self.index),
                OrderedDict(self._cached), dict(self.sequences), dict(self.counts))

    def restore(self, state: tuple[Any, ...]) -> None:
        (self.ref_cnt, self._free, self.hashes, self.index, self._cached, self.sequences,
         self.counts) = state

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the tier."""
        held = [s.blocks for s in self.sequences.values()]
        counts = np.bincount(np.concatenate([np.zeros(0, np.int64), *held]),
                             minlength=self.num_blocks)
        assert (counts == self.ref_cnt).all(), "host ref counts differ from holders"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a host block is free twice"
        assert not free & cached, "a host block is free and cached"
        assert len(free) + len(cached) + int((counts > 0).sum()) == self.num_blocks, (
            "host free + cached + held != total")
        assert all(self.ref_cnt[b] == 0 for b in free | cached), "a free host block is held"
        assert not free & set(self.hashes), "a free host block keeps a hash"
        assert cached <= set(self.hashes), "a cached host block has no hash"
        assert len(self.index) == len(self.hashes) and all(
            self.index.get(h) == b for b, h in self.hashes.items()), "host index differs"

    # --- copies ------------------------------------------------------------------------------
    def copy(self, device_ids: Any, host_ids: Any, to_host: bool, stream: Stream | None
             ) -> None:
        """Queue the copies of device blocks ``device_ids[i]`` to host blocks ``host_ids[i]``
        (``to_host``) or back, on ``stream``: one 2-D copy per run of blocks consecutive on
        both sides (one per plane where a pitch exceeds ``MAX_PITCH``), or, where that would
        be many short copies, one launch that moves every run of every plane either way
        (``ops.copy_pieces``; the device reaches pinned memory directly;
        ``KERNEL_BELOW_BYTES``)."""
        dev, host = np.asarray(device_ids), np.asarray(host_ids)  # distinct integers
        if not dev.size:
            return
        order = np.argsort(dev)
        dev, host = dev[order], host[order]
        cut = np.flatnonzero((np.diff(dev) != 1) | (np.diff(host) != 1)) + 1
        starts = np.concatenate([[0], cut])
        lengths = np.diff(np.append(starts, dev.size))
        chunk = self.chunk
        dev_pitch, host_pitch = self.slab_blocks * chunk, self.num_blocks * chunk
        rows = 1 if max(dev_pitch, host_pitch) > MAX_PITCH else self.planes
        calls = len(starts) * (self.planes // rows)
        if calls > 1 and dev.size * self.block_bytes < calls * KERNEL_BELOW_BYTES \
                and self.by_kernel:
            ops.copy_pieces(self.backend, self.device,
                            self._pieces(dev[starts], host[starts], lengths, to_host), stream)
            return
        handle = stream_handle(stream, backend=self.backend, device=self.device)
        for start, length in zip(starts.tolist(), lengths.tolist()):
            dev_ptr = self.slab_ptr + int(dev[start]) * chunk
            host_ptr = self.memory.ptr + int(host[start]) * chunk
            for plane in range(0, self.planes, rows):  # once, unless the pitch is too large
                d, h = dev_ptr + plane * dev_pitch, host_ptr + plane * host_pitch
                if to_host:
                    self.backend.memcpy_2d(h, host_pitch, d, dev_pitch, length * chunk, rows,
                                           True, handle)
                else:
                    self.backend.memcpy_2d(d, dev_pitch, h, host_pitch, length * chunk, rows,
                                           False, handle)

    def _pieces(self, dev: np.ndarray, host: np.ndarray, lengths: np.ndarray,
                to_host: bool) -> np.ndarray:
        """The ``rf_copy_pieces`` table (``ops.cut_pieces``' rows: src address, dst address,
        bytes) of the runs starting at device blocks ``dev`` and host blocks ``host``,
        ``lengths`` blocks each, in every plane, out to the host (``to_host``) or in."""
        planes = np.arange(self.planes, dtype=np.int64)[:, None]
        dev_at = self.slab_ptr + (planes * self.slab_blocks + dev) * self.chunk
        host_at = self.memory.ptr + (planes * self.num_blocks + host) * self.chunk
        runs = np.empty((self.planes, dev.size, 3), np.int64)
        runs[..., 0], runs[..., 1] = (dev_at, host_at) if to_host else (host_at, dev_at)
        runs[..., 2] = lengths * self.chunk
        table = runs.reshape(-1, 3)
        if self.chunk * int(lengths.max()) <= ops.PIECE_BYTES:  # a piece a run and plane
            return table
        return ops.cut_pieces(0, 0, table)

    def close(self) -> None:
        """Free the pinned memory (the caller has waited for the last copies)."""
        self.memory.close()
