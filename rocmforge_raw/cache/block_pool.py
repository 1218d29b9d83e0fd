"""BlockPool: the one source of truth for block ids — an O(1) free stack and ref counts.

Block 0 is the null block: never handed out, never freed. Every other id is either on the
free stack with ``ref_cnt == 0`` or held with ``ref_cnt >= 1``. ``free`` of a block that is
not held raises before anything changes: a ref count never underflows. Every operation
either completes or raises with the pool exactly as before (free stack order included).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import checks

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

    @property
    def num_free(self) -> int:
        """Blocks on the free stack (ref count 0)."""
        return self._top

    @property
    def num_used(self) -> int:
        """Blocks held (ref count >= 1), the null block not counted."""
        return self.num_blocks - 1 - self._top

    def allocate(self, count: int) -> np.ndarray | None:
        """``count`` fresh blocks with ref count 1, or ``None`` if fewer are free."""
        if type(count) is not int:
            count = checks.integer(count, "count")
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self._top:
            return None
        ids = self._free[self._top - count : self._top][::-1].copy()
        self._top -= count
        self.ref_cnt[ids] = 1
        return ids

    def undo_allocate(self, ids: np.ndarray) -> None:
        """Put back the blocks the last ``allocate`` handed out, unused, so that the stack
        is exactly as before it (an operation that failed after allocating)."""
        count = len(ids)
        above = self._free[self._top : self._top + count][::-1]
        if above.size != count or (above != ids).any() or (self.ref_cnt[ids] != 1).any():
            raise ValueError(f"blocks {checks.show(list(ids))} are not the last allocation")
        self.ref_cnt[ids] = 0
        self._top += count

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
        self._free[self._top : self._top + released.size] = released
        self._top += released.size
        return int(released.size)

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
        """The free stack, bottom first (the next ``allocate`` takes from the end)."""
        return self._free[: self._top].copy()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Everything ``restore`` needs to put the pool back exactly as it is now."""
        return self.ref_cnt.copy(), self._free.copy(), self._top

    def restore(self, state: tuple[np.ndarray, np.ndarray, int]) -> None:
        """Put the pool back as ``snapshot`` saw it."""
        self.ref_cnt, self._free, self._top = state

    def __copy__(self) -> BlockPool:
        raise TypeError("a BlockPool cannot be shallow-copied (the copy would share its ref "
                        "counts and free stack): use copy.deepcopy")
