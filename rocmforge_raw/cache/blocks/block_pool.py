"""BlockPool: the one source of truth for block ids — an O(1) free stack, ref counts and
the prefix-cache index.

Block 0 is the null block: never handed out, never freed. Every other id is in exactly one
of three places: held (``ref_cnt >= 1``), on the free stack (``ref_cnt == 0``, no hash), or
*cached-free* (``ref_cnt == 0``, keeps its contents and its prefix hash so that a later
prompt can still hit it). Free blocks of both kinds can be allocated: the stack first, then
the cached-free ones least recently freed first, whose hashes leave the index then. ``free``
of a block that is not held raises before anything changes: a ref count never underflows.
Every operation either completes or raises with the pool exactly as before (free order and
index included).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...common import checks
from ._rows import pop_blocks

NULL_BLOCK = 0


def _ids(ids: Any, what: str) -> np.ndarray:
    """Block ids as int64; ``TypeError`` for anything but integers."""
    array = np.asarray(ids)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"block ids to {what} must be integers, got {array.dtype} "
                        f"{checks.show(ids)}")
    return array.astype(np.int64, copy=False).reshape(-1)


class BlockPool:
    """Ids ``1 .. num_blocks - 1``; operations are vectorised over arrays of ids."""

    def __init__(self, num_blocks: int) -> None:
        num_blocks = checks.integer(num_blocks, "num_blocks")
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is null), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self.ref_cnt[NULL_BLOCK] = 1  # pinned
        self._free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)  # top = lowest id
        self._top = num_blocks - 1
        self.hashes: dict[int, bytes] = {}  # block -> prefix hash (held or cached-free)
        self.index: dict[bytes, int] = {}  # prefix hash -> block: the inverse of ``hashes``
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._evicted: list[tuple[int, bytes]] = []  # what the last allocate evicted

    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` can hand out: the free stack and the cached-free ones."""
        return self._top + len(self._cached)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a prefix (reused only after the free stack)."""
        return len(self._cached)

    @property
    def num_plain_free(self) -> int:
        """Free blocks that hold no prefix (an allocation takes these before it evicts)."""
        return self._top

    @property
    def evicted(self) -> list[tuple[int, bytes]]:
        """(block, hash) of the cached-free blocks the last ``allocate`` reused."""
        return self._evicted

    @property
    def num_used(self) -> int:
        """Blocks held (ref count >= 1), the null block not counted."""
        return self.num_blocks - 1 - self.num_free

    def allocate(self, count: int) -> np.ndarray | None:
        """``count`` blocks with ref count 1 and no hash, or ``None`` if fewer are free: the
        free stack's first, then cached-free blocks least recently freed first (their
        contents are given up: their hashes leave the index)."""
        if type(count) is not int:
            count = checks.integer(count, "count")
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.num_free:
            return None
        take = min(count, self._top)
        ids: np.ndarray = pop_blocks(self._free, self._top, take, self.ref_cnt)
        self._top -= take
        self._evicted = []
        if take < count:
            for _ in range(count - take):
                block = self._cached.popitem(last=False)[0]
                self._evicted.append((block, self.hashes.pop(block)))
                del self.index[self._evicted[-1][1]]
            evicted = np.array([b for b, _ in self._evicted], np.int32)
            self.ref_cnt[evicted] = 1
            ids = np.concatenate([ids, evicted])
        return ids

    def pop_plain(self, pop: Callable[[np.ndarray, int, np.ndarray], int]) -> int:
        """Let ``pop(free, top, ref_cnt)`` take blocks off the top of the free stack
        ``free[:top]``, giving each ref count 1, and return how many (-1: none, nothing
        changed): ``allocate`` for a caller that takes them in C
        (``RowArrays.append_plain``)."""
        count = pop(self._free, self._top, self.ref_cnt)
        if count >= 0:
            self._top -= count
            self._evicted = []
        return count

    def peek(self, count: int, taking: Sequence[int] = ()
             ) -> tuple[np.ndarray, list[tuple[int, bytes]]]:
        """(ids, evicted) that ``take(taking)`` then ``allocate(count)`` would give (count
        <= ``num_free`` less the cached-free blocks of ``taking``), changing nothing."""
        take = min(count, self._top)
        ids = self._free[self._top - take : self._top][::-1]
        evicted: list[tuple[int, bytes]] = []
        if take < count:
            taken = set(taking)
            for block in self._cached:
                if block not in taken:
                    evicted.append((block, self.hashes[block]))
                    if len(evicted) == count - take:
                        break
        return np.concatenate([ids, np.array([b for b, _ in evicted], np.int32)]), evicted

    def undo_allocate(self, ids: np.ndarray) -> None:
        """Put back the blocks the last ``allocate`` handed out, unused, so that the pool is
        exactly as before it (an operation that failed after allocating)."""
        count, evicted = len(ids), len(self._evicted)
        above = self._free[self._top : self._top + count - evicted][::-1]
        last = np.concatenate([above, np.array([b for b, _ in self._evicted], np.int32)])
        if last.size != count or (last != ids).any() or (self.ref_cnt[ids] != 1).any():
            raise ValueError(f"blocks {checks.show(list(ids))} are not the last allocation")
        self.ref_cnt[ids] = 0
        self._top += count - evicted
        for block, digest in reversed(self._evicted):
            self._cached[block] = None
            self._cached.move_to_end(block, last=False)
            self.hashes[block], self.index[digest] = digest, block
        self._evicted = []

    def forget(self, ids: Any) -> list[bytes]:
        """Cached-free blocks among ``ids`` no longer hold what their hashes name (a failed
        write reached them): their hashes leave the index and they join the free stack.
        Returns the hashes forgotten."""
        forgotten = []
        for block in _ids(ids, "forget").tolist():
            if block in self._cached:
                del self._cached[block]
                forgotten.append(self.hashes.pop(block))
                del self.index[forgotten[-1]]
                self._free[self._top] = block
                self._top += 1
        return forgotten

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest leading run of ``hashes`` (held or cached-free):
        the first hash not indexed ends it."""
        found: list[int] = []
        for digest in checks.ordered(hashes, "hashes", "block hashes in order"):
            block = self.index.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, ids: list[int]) -> None:
        """One more holder for each of ``ids`` (distinct blocks from ``lookup``): a
        cached-free block is held again, contents and hash intact. Refuses, changing
        nothing, a block listed twice or one that holds no prefix."""
        bad = next((b for b in ids if b not in self.hashes), None)
        if bad is not None or len(set(ids)) != len(ids):
            raise ValueError(f"take needs distinct blocks that lookup() found, got "
                             f"{checks.show(ids)}" + (f": block {bad!r} holds no prefix"
                                                      if bad is not None else ""))
        for block in ids:
            if self.ref_cnt[block] == 0:
                del self._cached[block]
        if ids:
            self.ref_cnt[ids] += 1

    def register(self, ids: np.ndarray, hashes: list[bytes]) -> list[int]:
        """Name held blocks ``ids`` by ``hashes`` (their full, written-in-order prefix): a
        later ``lookup`` finds them. A hash already in the index keeps its block, and a
        block already named keeps its name. One hash (bytes) per id. Returns the positions
        in ``ids`` that were named."""
        ids = _ids(ids, "register")
        self._check_held(ids, "register")
        hashes = checks.ordered(hashes, "hashes", "block hashes, one per id")
        if len(hashes) != ids.size or not all(isinstance(h, bytes) for h in hashes):
            raise ValueError(f"register needs one hash (bytes) per block: {ids.size} blocks, "
                             f"got {checks.show(hashes)}")
        named = []
        for i, (block, digest) in enumerate(zip(ids.tolist(), hashes)):
            if digest not in self.index and block not in self.hashes:
                self.hashes[block], self.index[digest] = digest, block
                named.append(i)
        return named

    def share(self, ids: np.ndarray) -> None:
        """One more holder for each id (ids may repeat)."""
        ids = _ids(ids, "share")
        self._check_held(ids, "share")
        np.add.at(self.ref_cnt, ids, 1)

    def free(self, ids: np.ndarray) -> int:
        """One holder fewer for each id; blocks reaching zero return to the free stack.
        Returns how many returned. Raises ``ValueError`` (changing nothing) if any id is not
        held as often as it is listed."""
        ids = _ids(ids, "free")
        if ids.size == 0:
            return 0
        self._check_held(ids, "free")
        unique, counts = np.unique(ids, return_counts=True)
        short = counts > self.ref_cnt[unique]
        if short.any():
            bad = int(unique[short][0])
            raise ValueError(f"block {bad} freed {int(counts[short][0])} times but held "
                             f"{int(self.ref_cnt[bad])} times")
        self.ref_cnt[unique] -= counts.astype(np.int32)
        released = unique[self.ref_cnt[unique] == 0].astype(np.int32)
        total = int(released.size)
        if self.hashes and total:
            cached = [b in self.hashes for b in released.tolist()]
            if any(cached):  # kept, the tail of a chain first out (freed in reverse order)
                keep = set(released[cached].tolist())
                for block in ids[::-1].tolist():
                    if block in keep and block not in self._cached:
                        self._cached[block] = None
                released = released[~np.array(cached)]
        # pushed highest first, so the next allocation pops them lowest first: a run of
        # blocks freed comes back as the same ascending run (one copy span, not one a block)
        self._free[self._top : self._top + released.size] = released[::-1]
        self._top += released.size
        return total

    def _check_held(self, ids: np.ndarray, what: str) -> None:
        if ids.size == 0:
            return
        if ids.min() < 1 or ids.max() >= self.num_blocks:
            bad = int(ids[(ids < 1) | (ids >= self.num_blocks)][0])
            raise ValueError(f"cannot {what} block {bad}: ids run 1..{self.num_blocks - 1}")
        held = self.ref_cnt[ids] > 0
        if not held.all():
            raise ValueError(f"cannot {what} block {int(ids[~held][0])}: it is not held")

    def free_ids(self) -> np.ndarray:
        """Every free block in the reverse of the order ``allocate`` hands them out (it takes
        from the end): the cached-free ones most recently freed first, then the stack."""
        cached = np.fromiter(reversed(self._cached), np.int32, len(self._cached))
        return np.concatenate([cached, self._free[: self._top]])

    def cached_ids(self) -> np.ndarray:
        """The cached-free blocks, least recently freed (next reused) first."""
        return np.fromiter(self._cached, np.int32, len(self._cached))

    def snapshot(self) -> tuple[Any, ...]:
        """Everything ``restore`` needs to put the pool back exactly as it is now."""
        return (self.ref_cnt.copy(), self._free.copy(), self._top, dict(self.hashes),
                dict(self.index), OrderedDict(self._cached), list(self._evicted))

    def restore(self, state: tuple[Any, ...]) -> None:
        """Put the pool back as ``snapshot`` saw it."""
        (self.ref_cnt, self._free, self._top, self.hashes, self.index, self._cached,
         self._evicted) = state

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the free lists and
        the prefix index (holders are checked against the sequences by the cache)."""
        assert self.num_free + self.num_used == self.num_blocks - 1, "free + used != total"
        free = self.free_ids()
        assert len(np.unique(free)) == free.size, "a block is free twice"
        assert (self.ref_cnt[free] == 0).all(), "a free block has holders"
        assert all(int(b) not in self.hashes for b in self._free[: self._top]), (
            "a block on the free stack keeps a hash")
        assert all(b in self.hashes for b in self._cached), "a cached-free block has no hash"
        assert len(self.index) == len(self.hashes), "the index and the hashes differ"
        assert all(self.index.get(h) == b for b, h in self.hashes.items()), (
            "the index and the hashes differ")

    def __copy__(self) -> BlockPool:
        raise TypeError("a BlockPool cannot be shallow-copied (the copy would share its ref "
                        "counts and free stack): use copy.deepcopy")
