"""MemoryPool: an opt-in caching allocator for HipBuffer (CuPy's ``set_allocator`` model).

Freed blocks stay cached per size class and are handed out again without a binding call.
Size classes: 512 bytes and up, each power of two split in four steps, so at most 25% of a
block is rounding. ``limit`` caps the bytes the pool holds from the device (in use + cached);
past it, cached blocks are released first, then ``OutOfMemoryError`` is raised. Raw
malloc/free stays the default: use ``HipBuffer(n, pool=p)`` or ``set_allocator(p)``.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

from .errors import OutOfMemoryError
from .runtime import Backend, get_backend

MIN_BLOCK = 512


def size_class(nbytes: int) -> int:
    """The block size that serves a request of ``nbytes`` > 0."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    top = 1 << (nbytes - 1).bit_length()  # next power of two
    step = top >> 3  # quarters of the lower half: top/2 + k * top/8
    return -(-nbytes // step) * step


def _release_cached(backend: Backend, device: int, cache: dict[int, list[int]], pid: int
                    ) -> None:
    if os.getpid() != pid or sys.is_finalizing():
        return
    for blocks in cache.values():
        while blocks:
            try:
                backend.free(blocks.pop(), device)
            except Exception as exc:
                sys.stderr.write(f"rocmforge_raw: pool free failed: {exc}\n")
    cache.clear()


class MemoryPool:
    """Caches freed device blocks of one device for reuse. Thread-safe."""

    def __init__(self, device: int | None = None, backend: str | Backend | None = None,
                 limit: int | None = None) -> None:
        self.backend = get_backend(backend)
        self.device = self.backend.get_device() if device is None else device
        self.limit = limit
        self._lock = threading.Lock()
        self._cache: dict[int, list[int]] = {}
        self._in_use: dict[int, int] = {}
        self._reserved = self._cached = self.hits = self.misses = 0
        self._finalizer = weakref.finalize(
            self, _release_cached, self.backend, self.device, self._cache, os.getpid())
        self._finalizer.atexit = False

    def serves(self, backend: Any, device: int | None) -> bool:
        """Whether this pool allocates for a request naming ``backend`` and ``device``."""
        named = backend is None or backend is self.backend or backend == self.backend.name
        return named and device in (None, self.device)

    def allocate(self, nbytes: int) -> int:
        """A device pointer to at least ``nbytes`` > 0 bytes."""
        size = size_class(nbytes)
        with self._lock:
            blocks = self._cache.get(size)
            if blocks:
                ptr = blocks.pop()
                self._cached -= size
                self.hits += 1
            else:
                ptr = self._grow(size)
                self.misses += 1
            self._in_use[ptr] = size
            return ptr

    def _grow(self, size: int) -> int:
        if self.limit is not None and self._reserved + size > self.limit:
            self._free_cached()
            if self._reserved + size > self.limit:
                raise OutOfMemoryError("MemoryPool", size, self.limit - self._reserved,
                                       self.limit, 2, "pool limit reached")
        try:
            ptr = self.backend.malloc(size, self.device)
        except OutOfMemoryError:
            self._free_cached()
            ptr = self.backend.malloc(size, self.device)
        self._reserved += size
        return ptr

    def free(self, ptr: int, device: int | None = None) -> None:
        """Return a block from ``allocate`` to the cache."""
        with self._lock:
            size = self._in_use.pop(ptr, None)
            if size is None:
                raise ValueError(f"pointer {ptr:#x} was not allocated by this pool, or was "
                                 "freed already")
            blocks = self._cache.get(size)
            if blocks is None:
                self._cache[size] = [ptr]
            else:
                blocks.append(ptr)
            self._cached += size

    def _free_cached(self) -> None:
        for size, blocks in self._cache.items():
            while blocks:
                self.backend.free(blocks.pop(), self.device)
                self._reserved -= size
                self._cached -= size

    def free_all(self) -> None:
        """Give every cached (not in-use) block back to the device."""
        with self._lock:
            self._free_cached()

    def stats(self) -> dict[str, int | None]:
        """Bytes reserved from the device, in use, cached; cache hits and misses; the limit."""
        with self._lock:
            return {"reserved_bytes": self._reserved,
                    "in_use_bytes": self._reserved - self._cached,
                    "cached_bytes": self._cached, "in_use_blocks": len(self._in_use),
                    "hits": self.hits, "misses": self.misses, "limit": self.limit}

    def __repr__(self) -> str:
        return f"<MemoryPool {self.backend.name}:{self.device} {self.stats()}>"
