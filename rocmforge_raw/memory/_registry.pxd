# The live-allocation registry, shared by HipBuffer's type (buffer.pyx) in C.
from libc.stdint cimport uintptr_t

from rocmforge_raw.runtime._alloc cimport Allocator


cdef class Registry:
    cdef dict live, waiting
    cdef size_t live_bytes, peak_bytes, num_allocs, num_frees
    cdef size_t waiting_bytes, num_waiting, other_bytes, num_other
    cdef public bint track_stacks
    cdef object add(self, object buf, size_t nbytes, int device, Allocator allocator,
                    uintptr_t ptr)
    cdef void release(self, object ref) noexcept
    cdef object retire(self, object ref, object event)
    cdef object defer(self, object free, size_t nbytes, object event)
    cdef size_t free(self, object entry) noexcept  # a Waiting entry (_registry.pyx)


cdef bint owns_memory_of(unsigned long generation) noexcept
cdef unsigned long current_generation() noexcept
