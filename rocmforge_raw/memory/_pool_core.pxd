# The stream-ordered core of ``MemoryPool``, for ``pool`` to extend: see _pool_core.pyx.
from libc.stdint cimport uintptr_t

from rocmforge_raw.memory._freelist cimport NUM_CLASSES, FreeList
from rocmforge_raw.runtime._alloc cimport Allocator


cdef bint stream_is_open(object stream)


cdef class _Lane:
    cdef FreeList lists[NUM_CLASSES]
    cdef readonly object stream
    cdef object fences
    cdef unsigned long long freed, fenced, passed  # frees so far; newest fence's; passed
    cdef size_t blocks  # cached blocks in this lane


cdef class PoolCore(Allocator):
    cdef readonly object limit
    cdef readonly size_t hits, misses, handoffs
    cdef Allocator upstream
    cdef _Lane default
    cdef dict lanes   # Stream -> _Lane, the streams other than the default one
    cdef dict loose   # pointer -> nbytes, for blocks lent through ``allocate``
    cdef dict loose_lanes  # pointer -> _Lane, those of them lent on a stream
    cdef list spare_events
    cdef object lock
    cdef size_t reserved, cached, lent
    cdef size_t cap   # limit in bytes (SIZE_MAX: none)
    cdef unsigned long generation
    cdef bint is_closed
    cdef object __weakref__

    cdef int check_open(self) except -1
    cdef _Lane lane(self, object stream)
    cdef _Lane register(self, _Lane lane)
    cdef _Lane current(self, _Lane lane)
    cdef uintptr_t take(self, _Lane lane, size_t nbytes) except 0
    cdef uintptr_t take_passed(self, _Lane taker, int index, size_t size) except? 0
    cdef int give(self, _Lane lane, uintptr_t ptr, size_t nbytes) except -1
    cdef record(self, event, handle)
    cdef int fence(self, _Lane lane) except -1
    cdef int poll(self, _Lane lane) except -1
    cdef uintptr_t grow(self, size_t size) except 0
    cdef int free_cached(self) except -1
    cdef int release(self, _Lane lane) except -1
    cdef int drop_events(self) except -1
