# The C-level allocator interface shared by HipBuffer's core, MemoryPool and the backends'
# fast paths. Pointers are uintptr_t device addresses, sizes are bytes.
from libc.stdint cimport uintptr_t


cdef class Allocator:
    cdef readonly object backend
    cdef readonly int device  # the one device it serves, or -1: any device of its backend
    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0
    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1


cdef class HookAllocator(Allocator):
    cdef object alloc_fn  # Python callables: see _alloc.pyx
    cdef object free_fn


cdef class BackendAllocator(Allocator):
    cdef readonly size_t fallbacks  # calls the C fast path left to the backend's Python method
    cdef bint fast_alloc(self, size_t nbytes, int device, uintptr_t* ptr) noexcept
    cdef bint fast_free(self, uintptr_t ptr, int device) noexcept


ctypedef int (*alloc_fn)(void** out, size_t nbytes) noexcept
ctypedef int (*free_fn)(void* ptr) noexcept


cdef class BindingAllocator(BackendAllocator):
    cdef alloc_fn mem_alloc
    cdef free_fn mem_free
    cdef bint is_current(self, int device) noexcept  # the device is current in this thread


cdef void* binding_function(dict capi, str name, str signature) except NULL
cdef bint binding_ok(int status) noexcept  # status == 0; a Python error it left is cleared
