# cython: language_level=3, binding=True
"""MemoryPool: an opt-in caching allocator for HipBuffer (CuPy's ``set_allocator`` model).

Freed blocks stay cached per size class and are handed out again without a binding call.
Size classes: 512 bytes and up, each power of two split in four steps, so at most 25% of a
block is rounding. ``limit`` caps the bytes the pool holds from the device (in use + cached);
past it, cached blocks are released first, then ``OutOfMemoryError`` is raised. Raw
malloc/free stays the default: use ``HipBuffer(n, pool=p)`` or ``set_allocator(p)``.

Compiled, like HipBuffer's core, so that a pooled allocation and free stay under a
microsecond; the pool is an ``Allocator`` whose C methods HipBuffer calls directly.
"""

import os
import sys
import weakref

from cpython.dict cimport PyDict_Items
from libc.stdint cimport SIZE_MAX, uintptr_t

from rocmforge_raw.runtime._alloc cimport Allocator

from .errors import OutOfMemoryError
from .runtime import get_backend

MIN_BLOCK = 512


cpdef size_t size_class(size_t nbytes) except 0:
    """The block size that serves a request of ``nbytes`` > 0."""
    if nbytes <= 512:
        return 512
    if nbytes > (<size_t>1) << 62:
        raise OverflowError(f"a pool block of {nbytes} bytes is larger than any device")
    cdef size_t top = 1
    while top < nbytes:  # next power of two
        top <<= 1
    cdef size_t step = top >> 3  # quarters of the lower half: top/2 + k * top/8
    return (nbytes + step - 1) // step * step


def _release_cached(backend, int device, dict cache, pid):
    if os.getpid() != pid or sys.is_finalizing():
        return
    for blocks in cache.values():
        while blocks:
            try:
                backend.free(blocks.pop(), device)
            except Exception as exc:
                sys.stderr.write(f"rocmforge_raw: pool free failed: {exc}\n")
    cache.clear()


cdef class MemoryPool(Allocator):
    """Caches freed device blocks of one device for reuse. Thread-safe.

    Invariant: ``reserved`` bytes = bytes of blocks lent out + ``cached`` bytes; a block is
    either lent or in ``cache[size]``, never both. Blocks lent to HipBuffers are counted
    (the registry frees each once); blocks lent through the Python ``allocate`` are also
    kept in ``loose`` (pointer -> size), so that ``free`` can refuse a pointer it never lent.

    Like the registry, the pool is made thread-safe by the GIL: each step that reads and
    writes its state runs no Python code and allocates no GC-tracked object, so it is
    atomic. Only the device allocator may run Python code (its fallback path), and it is
    called between steps: a block is reserved before it is asked for, un-reserved if that
    fails.
    """
    cdef readonly object limit
    cdef readonly size_t hits, misses
    cdef Allocator upstream
    cdef dict cache   # size class -> [pointer, ...]
    cdef dict loose   # pointer -> size class, for blocks lent through ``allocate``
    cdef size_t reserved, cached, lent
    cdef size_t cap   # limit in bytes (SIZE_MAX: none)
    cdef object _finalizer
    cdef object __weakref__

    def __init__(self, device=None, backend=None, limit=None):
        self.backend = get_backend(backend)
        self.device = self.backend.get_device() if device is None else device
        if limit is not None and not 0 <= limit < SIZE_MAX:
            raise ValueError(f"a pool limit must be between 0 and {SIZE_MAX - 1} bytes, got "
                             f"{limit}")
        self.limit = limit
        self.cap = SIZE_MAX if limit is None else limit
        self.upstream = self.backend.allocator
        self.cache, self.loose = {}, {}
        self._finalizer = weakref.finalize(
            self, _release_cached, self.backend, self.device, self.cache, os.getpid())
        self._finalizer.atexit = False

    def serves(self, backend, device):
        """Whether this pool allocates for a request naming ``backend`` and ``device``."""
        named = backend is None or backend is self.backend or backend == self.backend.name
        return named and device in (None, self.device)

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        cdef size_t size = size_class(nbytes)
        blocks = self.cache.get(size)
        if blocks:  # a hit: one atomic step
            self.cached -= size
            self.hits += 1
            self.lent += 1
            return (<list>blocks).pop()
        cdef uintptr_t ptr = self.grow(size)
        self.misses += 1
        self.lent += 1
        return ptr

    cdef uintptr_t grow(self, size_t size) except 0:
        """A new block from the device, within the limit."""
        if self.reserved + size > self.cap:
            self.free_cached()
            if self.reserved + size > self.cap:
                raise OutOfMemoryError("MemoryPool", size, self.cap - self.reserved,
                                       self.cap, 2, "pool limit reached")
        self.reserved += size
        try:
            try:
                return self.upstream.alloc_ptr(size, self.device)
            except OutOfMemoryError:
                self.free_cached()
                return self.upstream.alloc_ptr(size, self.device)
        except BaseException:
            self.reserved -= size
            raise

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        cdef size_t size = size_class(nbytes)
        blocks = self.cache.get(size)  # atomic from here on
        if blocks is None:
            self.cache[size] = [ptr]
        else:
            (<list>blocks).append(ptr)
        self.cached += size
        self.lent -= 1
        return 0

    cdef int free_cached(self) except -1:
        """Give every cached block back to the device, one atomic take at a time."""
        cdef size_t size
        for key, blocks in PyDict_Items(self.cache):  # a consistent snapshot
            size = key
            while blocks:
                ptr = (<list>blocks).pop()
                self.cached -= size
                self.reserved -= size
                self.upstream.free_ptr(ptr, size, self.device)
        return 0

    def allocate(self, nbytes):
        """A device pointer to at least ``nbytes`` > 0 bytes, for ``free`` to take back."""
        if nbytes <= 0:
            raise ValueError(f"a pool allocation needs nbytes > 0, got {nbytes}")
        ptr = self.alloc_ptr(nbytes, self.device)
        self.loose[ptr] = nbytes
        return ptr

    def free(self, ptr, device=None):
        """Return a block from ``allocate`` to the cache."""
        nbytes = self.loose.pop(ptr, None)
        if nbytes is None:
            raise ValueError(f"pointer {ptr:#x} was not allocated by this pool's allocate(), "
                             "or was freed already")
        self.free_ptr(ptr, nbytes, self.device)

    def free_all(self):
        """Give every cached (not in-use) block back to the device."""
        self.free_cached()

    def stats(self):
        """Bytes reserved from the device, in use, cached; cache hits and misses; the limit."""
        cdef size_t reserved = self.reserved, cached = self.cached, blocks = self.lent
        cdef size_t hits = self.hits, misses = self.misses
        return {"reserved_bytes": reserved, "in_use_bytes": reserved - cached,
                "cached_bytes": cached, "in_use_blocks": blocks, "hits": hits,
                "misses": misses, "limit": self.limit}

    def __repr__(self):
        return f"<MemoryPool {self.backend.name}:{self.device} {self.stats()}>"
