# The live-allocation registry, shared by HipBuffer's type (buffer.pyx) in C.
from libc.stdint cimport uintptr_t

from rocmforge_raw.runtime._alloc cimport Allocator


cdef class Registry:
    cdef dict live
    cdef size_t live_bytes, peak_bytes, num_allocs, num_frees
    cdef public bint track_stacks
    cdef object add(self, object buf, size_t nbytes, int device, Allocator allocator,
                    uintptr_t ptr)
    cdef void release(self, object ref) noexcept


cdef bint owns_memory_of(unsigned long generation) noexcept
cdef unsigned long current_generation() noexcept
