# cython: language_level=3, binding=True
"""MemoryPool: an opt-in caching allocator for HipBuffer (CuPy's ``set_allocator`` model).

Freed blocks stay cached per size class and are handed out again without a binding call.
Size classes: 512 bytes and up, each power of two split in four steps, so at most 25% of a
block is rounding. ``limit`` caps the bytes the pool holds from the device (in use + cached);
past it, cached blocks are released first, then ``OutOfMemoryError`` is raised. Raw
malloc/free stays the default: use ``HipBuffer(n, pool=p)`` or ``set_allocator(p)``.

Compiled, like HipBuffer, so that a pooled allocation and free stay under a microsecond:
the pool is an ``Allocator`` whose C methods HipBuffer calls directly, and each size class
keeps its cached pointers in a C array (no Python objects on the hot path).
"""

from libc.stdint cimport SIZE_MAX, uintptr_t
from libc.stdlib cimport free, realloc

from rocmforge_raw._registry cimport current_generation, owns_memory_of
from rocmforge_raw.runtime._alloc cimport Allocator

from . import checks
from .errors import OutOfMemoryError
from .runtime import get_backend

MIN_BLOCK = 512

cdef enum:
    NUM_CLASSES = 1 + 4 * 53  # 512 bytes, then four classes per power of two up to 2**62


cdef struct FreeList:
    uintptr_t* ptrs
    size_t count, capacity


cdef inline int class_of(size_t nbytes, size_t* size) noexcept:
    """The size-class index of ``nbytes`` (> 0) and its block size, or -1 past 2**62."""
    if nbytes <= 512:
        size[0] = 512
        return 0
    if nbytes > (<size_t>1) << 62:
        return -1
    cdef int shift = 64 - __builtin_clzll(nbytes - 1)  # top = 2**shift >= nbytes
    cdef size_t step = (<size_t>1) << (shift - 3)  # quarters of the lower half
    cdef size_t steps = (nbytes + step - 1) // step  # 5..8
    size[0] = steps * step
    return 1 + 4 * (shift - 10) + <int>(steps - 5)


cdef inline size_t size_of_class(int index) noexcept:
    """The block size of size class ``index`` (the inverse of ``class_of``)."""
    if index == 0:
        return 512
    return ((<size_t>1) << (7 + (index - 1) // 4)) * (5 + (index - 1) % 4)


cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


def size_class(nbytes):
    """The block size that serves a request of ``nbytes`` > 0."""
    cdef size_t size = 0
    if class_of(nbytes, &size) < 0:
        raise OverflowError(f"a pool block of {nbytes} bytes is larger than any device")
    return size


cdef class MemoryPool(Allocator):
    """Caches freed device blocks of one device for reuse. Thread-safe.

    Invariant: ``reserved`` bytes = bytes of blocks lent out + ``cached`` bytes; a block is
    either lent or in its class's free list, never both. Blocks lent to HipBuffers are
    counted (the registry frees each once); blocks lent through the Python ``allocate`` are
    also kept in ``loose`` (pointer -> size), so that ``free`` can refuse a pointer it never
    lent. Cached blocks go back to the device on ``free_all()``, at the limit, and when the
    pool dies (in the process that made it, and not once the interpreter is exiting).

    Like the registry, the pool is made thread-safe by the GIL: each step that reads and
    writes its state runs no Python code, so it is atomic. Only the device allocator may run
    Python code (its fallback path), and it is called between steps: a block is reserved
    before it is asked for, un-reserved if that fails.
    """
    cdef readonly object limit
    cdef readonly size_t hits, misses
    cdef Allocator upstream
    cdef FreeList lists[NUM_CLASSES]
    cdef dict loose   # pointer -> nbytes, for blocks lent through ``allocate``
    cdef size_t reserved, cached, lent
    cdef size_t cap   # limit in bytes (SIZE_MAX: none)
    cdef unsigned long generation
    cdef object __weakref__

    def __init__(self, device=None, backend=None, limit=None):
        self.backend = get_backend(backend)
        self.device = self.backend.resolve_device(device)
        if limit is not None:
            limit = checks.integer(limit, "limit")
        if limit is not None and not 0 <= limit < SIZE_MAX:
            raise ValueError(f"a pool limit must be between 0 and {SIZE_MAX - 1} bytes, got "
                             f"{limit}")
        self.limit = limit
        self.cap = SIZE_MAX if limit is None else limit
        self.upstream = self.backend.allocator
        self.loose = {}
        self.generation = current_generation()

    def __dealloc__(self):
        cdef int index
        if self.upstream is not None and owns_memory_of(self.generation):
            try:
                self.free_cached()
            except BaseException:  # a finalizer never raises; the process keeps the blocks
                pass
        for index in range(NUM_CLASSES):
            free(self.lists[index].ptrs)

    def serves(self, backend, device):
        """Whether this pool allocates for a request naming ``backend`` and ``device``."""
        named = backend is None or backend is self.backend or backend == self.backend.name
        return named and device in (None, self.device)

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        cdef size_t size = 0
        cdef int index = class_of(nbytes, &size)
        if index < 0:
            raise OverflowError(f"a pool block of {nbytes} bytes is larger than any device")
        cdef FreeList* blocks = &self.lists[index]
        if blocks.count:  # a hit: one atomic step
            blocks.count -= 1
            self.cached -= size
            self.hits += 1
            self.lent += 1
            return blocks.ptrs[blocks.count]
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
        cdef size_t size = 0
        cdef FreeList* blocks = &self.lists[class_of(nbytes, &size)]
        cdef uintptr_t* grown
        if blocks.count == blocks.capacity:
            grown = <uintptr_t*>realloc(blocks.ptrs,
                                        (2 * blocks.capacity + 8) * sizeof(uintptr_t))
            if grown == NULL:  # no host memory for the list: give the block back instead
                self.lent -= 1
                self.reserved -= size
                self.upstream.free_ptr(ptr, size, self.device)
                return 0
            blocks.ptrs, blocks.capacity = grown, 2 * blocks.capacity + 8
        blocks.ptrs[blocks.count] = ptr
        blocks.count += 1
        self.cached += size
        self.lent -= 1
        return 0

    cdef int free_cached(self) except -1:
        """Give every cached block back to the device, one atomic take at a time."""
        cdef int index
        cdef size_t size
        cdef FreeList* blocks
        cdef uintptr_t ptr
        for index in range(NUM_CLASSES):
            blocks = &self.lists[index]
            size = size_of_class(index)
            while blocks.count:
                blocks.count -= 1
                ptr = blocks.ptrs[blocks.count]
                self.cached -= size
                self.reserved -= size
                self.upstream.free_ptr(ptr, size, self.device)
        return 0

    def allocate(self, nbytes):
        """A device pointer to at least ``nbytes`` > 0 bytes, for ``free`` to take back."""
        if type(nbytes) is not int:
            nbytes = checks.integer(nbytes, "nbytes")
        if nbytes <= 0:
            raise ValueError(f"a pool allocation needs nbytes > 0, got {nbytes}")
        if nbytes > 1 << 62:
            raise ValueError(f"a pool allocation needs nbytes <= 2**62, got {nbytes}")
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

    def __reduce__(self):
        raise TypeError("a MemoryPool owns device memory and cannot be copied or pickled")

    def __repr__(self):
        return f"<MemoryPool {self.backend.name}:{self.device} {self.stats()}>"
