# cython: language_level=3, boundscheck=False, wraparound=False
"""Allocators: how HipBuffer gets and returns device memory, callable from C.

``Allocator`` is the interface (``alloc_ptr``/``free_ptr``, both C methods). A backend's
``BackendAllocator`` first tries its C fast path (the binding's C entry point, no Python
objects); where that path cannot serve a call (wrong device current in this thread, a failed
status) it falls back to the backend's Python ``malloc``/``free``, which make the device current
and raise ``OutOfMemoryError``/``DeviceError`` with the numbers. So errors are reported in one
place, the backend file, and the fast path only ever adds speed.
"""

from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free


cdef extern from "stdlib.h" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)


cdef class Allocator:
    """Hands out device pointers of at least ``nbytes`` > 0 bytes and takes them back.

    ``free_ptr`` is called once per pointer, with the ``nbytes`` and ``device`` it was
    allocated with (HipBuffer's registry guarantees the once)."""

    def __cinit__(self, *args, **kwargs):
        self.device = -1

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate")

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        raise NotImplementedError(f"{type(self).__name__} cannot free")

    def round_trip(self, size_t nbytes, int device):
        """Allocate ``nbytes`` > 0 on ``device`` and free them again (what benchmarks time)."""
        if nbytes == 0:
            raise ValueError("a round trip needs nbytes > 0")
        self.free_ptr(self.alloc_ptr(nbytes, device), nbytes, device)


cdef class BackendAllocator(Allocator):
    """A backend's own malloc/free: the C fast path of a subclass, else the Python methods."""

    def __init__(self, backend):
        self.backend = backend

    cdef bint fast_alloc(self, size_t nbytes, int device, uintptr_t* ptr) noexcept:
        return False

    cdef bint fast_free(self, uintptr_t ptr, int device) noexcept:
        return False

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        cdef uintptr_t ptr = 0
        if self.fast_alloc(nbytes, device, &ptr):
            return ptr
        self.fallbacks += 1
        self.backend.forget_active()  # the binding may not be where the backend last left it
        return self.backend.malloc(nbytes, device)

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        if not self.fast_free(ptr, device):
            self.fallbacks += 1
            self.backend.free(ptr, device)  # restores the active device: often a finalizer
        return 0

    def __repr__(self):
        return f"<{type(self).__name__} of {self.backend!r}>"


cdef class HookAllocator(Allocator):
    """Memory whose bookkeeping lives in Python (``rocmforge_raw.memory.ipc``): ``alloc(nbytes,
    device) -> ptr`` and ``free(ptr, nbytes, device)``; ``alloc`` None for memory this
    process only maps (another process's, imported), which it can release but never make."""

    def __init__(self, backend, alloc, free):
        self.backend = backend
        self.alloc_fn, self.free_fn = alloc, free

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        if self.alloc_fn is None:
            raise TypeError(f"{self!r} maps memory and cannot allocate")
        return self.alloc_fn(nbytes, device)

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        self.free_fn(ptr, nbytes, device)
        return 0

    def release(self, ptr, nbytes, device):
        """``free`` called from Python (a caller whose buffer never came to own the memory)."""
        self.free_fn(ptr, nbytes, device)

    def __repr__(self):
        return f"<HookAllocator of {self.backend!r}: {self.free_fn!r}>"


cdef class HostAllocator(BackendAllocator):
    """libc ``posix_memalign``/``free`` with the host backend's alignment, for its ``count``
    logical devices (one memory)."""

    cdef size_t alignment
    cdef int count

    def __init__(self, backend, size_t alignment, int count=1):
        self.backend = backend
        self.alignment = alignment
        self.count = count

    cdef bint fast_alloc(self, size_t nbytes, int device, uintptr_t* ptr) noexcept:
        cdef void* p = NULL
        if not 0 <= device < self.count or posix_memalign(&p, self.alignment, nbytes) != 0:
            return False
        ptr[0] = <uintptr_t>p
        return True

    cdef bint fast_free(self, uintptr_t ptr, int device) noexcept:
        free(<void*>ptr)
        return True


# --- GPU fast paths: the bindings' own C entry points -------------------------------------
# cuda-python (``cuda.bindings.cydriver``) and hip-python (``rocm.bindings.cyhip``) export
# every driver call as a C function through their modules' ``__pyx_capi__`` capsules, which is
# what a Cython ``cimport`` of them links to. Taking the pointers from there, with the same
# signature check a cimport makes, needs neither cuda.h nor ROCm headers at build time. Those
# functions may set a Python error when they fail to load the driver library: any failure is
# cleared here and the call falls back to the backend's Python method, which reports it.

ctypedef int (*get_pointer_fn)(void** out) noexcept
ctypedef int (*get_device_fn)(int* out) noexcept


cdef void* binding_function(dict capi, str name, str signature) except NULL:
    """The C function ``name`` exported by a binding module, checked against ``signature``
    (older bindings spell ``size_t`` as ``unsigned long``, the same type on LP64 systems,
    and may leave out ``enum`` before the status type)."""
    capsule = capi.get(name)
    spellings = [signature]
    if "size_t" in signature and sizeof(unsigned long) == sizeof(size_t):
        spellings.append(signature.replace("size_t", "unsigned long"))
    if signature.startswith("enum "):
        spellings += [spelling[len("enum "):] for spelling in spellings]
    for spelling in spellings:
        if capsule is not None and PyCapsule_IsValid(capsule, spelling.encode()):
            return PyCapsule_GetPointer(capsule, spelling.encode())
    found = None if capsule is None else (<bytes>PyCapsule_GetName(capsule)).decode()
    raise ImportError(f"the binding's {name} is {found!r}, not {signature!r}")


cdef bint binding_ok(int status) noexcept:
    if status == 0:
        return True
    if PyErr_Occurred():
        PyErr_Clear()
    return False


cdef class BindingAllocator(BackendAllocator):
    """A GPU binding's C malloc/free, served only when ``is_current(device)``."""

    cdef bint is_current(self, int device) noexcept:
        return False

    cdef bint fast_alloc(self, size_t nbytes, int device, uintptr_t* ptr) noexcept:
        cdef void* out = NULL
        if not self.is_current(device) or not binding_ok(self.mem_alloc(&out, nbytes)):
            return False
        ptr[0] = <uintptr_t>out
        return True

    cdef bint fast_free(self, uintptr_t ptr, int device) noexcept:
        return self.is_current(device) and binding_ok(self.mem_free(<void*>ptr))


cdef class CudaAllocator(BindingAllocator):
    """cuMemAlloc/cuMemFree, served only when the device's primary context is current in
    the calling thread (one cuCtxGetCurrent); the fast path never changes the context."""

    cdef get_pointer_fn current_context
    cdef list contexts  # per device: the retained primary context as an int, or 0

    def __init__(self, backend, int count, dict capi):
        self.backend = backend
        self.contexts = [0] * count
        self.current_context = <get_pointer_fn>binding_function(capi, "cuCtxGetCurrent",
                                                         "CUresult (CUcontext *)")
        self.mem_alloc = <alloc_fn>binding_function(capi, "cuMemAlloc",
                                             "CUresult (CUdeviceptr *, size_t)")
        self.mem_free = <free_fn>binding_function(capi, "cuMemFree", "CUresult (CUdeviceptr)")

    def set_context(self, int device, uintptr_t context):
        """Record ``device``'s retained primary context (a ``CUcontext`` as an int)."""
        self.contexts[device] = context

    cdef bint is_current(self, int device) noexcept:
        cdef void* now = NULL
        if not 0 <= device < len(self.contexts) or not binding_ok(self.current_context(&now)):
            return False
        return now != NULL and <uintptr_t>now == <uintptr_t>self.contexts[device]


cdef class HipAllocator(BindingAllocator):
    """hipMalloc/hipFree, served only when ``device`` is current in the calling thread (one
    hipGetDevice); the fast path never changes the device. Mirrors ``CudaAllocator``."""

    cdef get_device_fn current_device
    cdef int count

    def __init__(self, backend, int count, dict capi):
        self.backend = backend
        self.count = count
        self.current_device = <get_device_fn>binding_function(capi, "hipGetDevice",
                                                       "enum hipError_t (int *)")
        self.mem_alloc = <alloc_fn>binding_function(capi, "hipMalloc",
                                             "enum hipError_t (void **, size_t)")
        self.mem_free = <free_fn>binding_function(capi, "hipFree", "enum hipError_t (void *)")

    cdef bint is_current(self, int device) noexcept:
        cdef int now = -1
        if not 0 <= device < self.count or not binding_ok(self.current_device(&now)):
            return False
        return now == device
