# cython: language_level=3, boundscheck=False, wraparound=False
"""Kernel launches from C: arguments packed once, one binding call per launch.

A ``Launch`` is one kernel's launch made ready: function, grid, block, dynamic shared bytes,
stream, and its arguments in 8-byte slots with a ``void*[]`` of the slots' addresses
(``kernelParams``, the convention ``cuLaunchKernel`` and ``hipModuleLaunchKernel`` share; both
copy the arguments at launch, so the slots may change between launches). Calling it writes
up to four pointer arguments into the slots named at construction (``patch``) and launches
through the binding's C entry point (cuda-python's ``cydriver``, hip-python's ``cyhip``),
taken from its ``__pyx_capi__`` as the allocators take theirs. Where that path cannot serve
(the device is not current in this thread, the binding has no C layer, a failed status) it
activates the device (``Backend.activate``) and calls the backend's Python ``launch``, which
raises ``DeviceError`` with the status: errors are reported in one place, the backend file.

This is the per-layer path of a decode step, so it holds no Python objects on the way to the
driver. A ``Launch`` is not locked: one thread at a time (the KV cache's lock).
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from rocmforge_raw.runtime._alloc cimport BindingAllocator, binding_function, binding_ok

ctypedef int (*launch_fn)(void* function, unsigned int grid_x, unsigned int grid_y,
                          unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                          unsigned int block_z, unsigned int shared_bytes, void* stream,
                          void** params, void** extra) noexcept

cdef enum:
    MAX_ARGS = 32   # kernel arguments a Launch holds
    MAX_PATCH = 4   # pointer arguments a call may replace


cdef class LaunchApi:
    """A GPU binding's C launch function, used only while ``guard`` (the backend's allocator)
    finds the launch's device current in the calling thread."""

    cdef launch_fn launch
    cdef BindingAllocator guard

    def __init__(self, guard, dict capi, str name, str signature):
        if not isinstance(guard, BindingAllocator):
            raise TypeError(f"the C launch path needs a binding allocator, not {guard!r}")
        self.guard = <BindingAllocator>guard
        self.launch = <launch_fn>binding_function(capi, name, signature)


cdef class Launch:
    """One kernel launch with its arguments packed once (see the module docstring).

    ``function`` is a kernel of ``module`` (a ``module.Module``, kept alive and checked open
    at each call); ``packed`` holds the arguments, 8 bytes each (``Kernel.prepare`` packs
    them); ``patch`` names the argument indices that each call replaces, in call order.
    """

    cdef readonly object backend
    cdef readonly int device
    cdef object function, stream  # the binding's handles, kept alive with the launch
    cdef object module  # the loaded module the function lives in (kept alive; must be open)
    cdef LaunchApi api
    cdef void* c_function
    cdef void* c_stream
    cdef unsigned int grid[3]
    cdef unsigned int block[3]
    cdef unsigned int shared_bytes
    cdef uint64_t slots[MAX_ARGS]
    cdef void* params[MAX_ARGS]
    cdef int patch[MAX_PATCH]
    cdef int num_patch
    cdef readonly int num_args
    cdef readonly size_t fallbacks  # calls that took the backend's Python launch

    def __init__(self, module, function, grid, block, unsigned int shared_bytes, stream,
                 bytes packed, patch=()):
        cdef Py_ssize_t i
        if len(packed) % 8 or len(packed) // 8 > MAX_ARGS:
            raise ValueError(f"packed arguments must be at most {MAX_ARGS} slots of 8 bytes, "
                             f"got {len(packed)} bytes")
        if len(patch) > MAX_PATCH or any(not 0 <= p < len(packed) // 8 for p in patch):
            raise ValueError(f"patch {tuple(patch)} must name at most {MAX_PATCH} of the "
                             f"{len(packed) // 8} arguments")
        backend = module.backend
        self.module, self.backend, self.device = module, backend, module.device
        self.function, self.stream = function, stream
        self.num_args = len(packed) // 8
        memset(self.slots, 0, sizeof(self.slots))
        memcpy(self.slots, <const char*>packed, len(packed))
        for i in range(MAX_ARGS):
            self.params[i] = &self.slots[i]
        for i in range(3):
            self.grid[i], self.block[i] = grid[i], block[i]
        self.shared_bytes = shared_bytes
        self.num_patch = len(patch)
        for i in range(self.num_patch):
            self.patch[i] = patch[i]
        self.c_function = <void*><uintptr_t>int(function)
        self.c_stream = <void*><uintptr_t>(0 if stream is None else int(stream))
        self.api = backend.launch_api
        backend.allow_shared(function, shared_bytes)

    def __call__(self, uintptr_t a=0, uintptr_t b=0, uintptr_t c=0, uintptr_t d=0):
        """Write the patched arguments (pointers, in ``patch`` order), then launch."""
        cdef uintptr_t values[MAX_PATCH]
        values[0] = a
        values[1] = b
        values[2] = c
        values[3] = d
        cdef int i
        for i in range(self.num_patch):
            self.slots[self.patch[i]] = values[i]
        self.module._check_open()
        if self.api is not None and self.api.guard.is_current(self.device) and binding_ok(
                self.api.launch(self.c_function, self.grid[0], self.grid[1], self.grid[2],
                                self.block[0], self.block[1], self.block[2],
                                self.shared_bytes, self.c_stream, self.params, NULL)):
            return
        self.fallbacks += 1
        self.backend.forget_active()  # the C path found the binding elsewhere: really switch
        self.backend.activate(self.device)
        self.backend.launch(self.function, tuple(self.grid), tuple(self.block),
                            self.shared_bytes, self.stream, <uintptr_t>self.params)

    def set_float(self, int index, float value):
        """Argument ``index`` becomes the float32 ``value`` (e.g. an attention scale)."""
        if not 0 <= index < self.num_args:
            raise IndexError(f"argument {index} outside [0, {self.num_args})")
        self.slots[index] = 0
        memcpy(&self.slots[index], &value, sizeof(float))

    def set_int(self, int index, long long value):
        """Argument ``index`` becomes the integer ``value`` (an int32 argument reads the low
        four bytes of its slot, an int64 all eight)."""
        if not 0 <= index < self.num_args:
            raise IndexError(f"argument {index} outside [0, {self.num_args})")
        self.slots[index] = <uint64_t>value

    def set_ints(self, tuple indices, tuple values):
        """Arguments ``indices[i]`` become the integers ``values[i]`` (as ``set_int``; a
        pointer up to 2**64 too): a step's changed arguments in one call. Every index and
        value is checked before any slot changes."""
        cdef Py_ssize_t i, n = len(indices)
        cdef int index
        cdef int where[MAX_ARGS]
        cdef uint64_t given[MAX_ARGS]
        if len(values) != n or n > MAX_ARGS:
            raise ValueError(f"{n} indices and {len(values)} values must pair up, at most "
                             f"{MAX_ARGS}")
        for i in range(n):
            index = where[i] = indices[i]
            if not 0 <= index < self.num_args:
                raise IndexError(f"argument {index} outside [0, {self.num_args})")
            value = values[i]  # a pointer (up to 2**64) or a signed integer
            given[i] = <unsigned long long>value if value >= 0 else <uint64_t><long long>value
        for i in range(n):
            self.slots[where[i]] = given[i]

    def set_grid(self, unsigned int x, unsigned int y=1, unsigned int z=1):
        """The grid of the following launches (CTAs along x, y, z; each at least 1)."""
        if x == 0 or y == 0 or z == 0:
            raise ValueError(f"grid ({x}, {y}, {z}) must be at least 1 along each axis")
        self.grid[0], self.grid[1], self.grid[2] = x, y, z

    def slot(self, int index):
        """The 8 bytes of argument ``index`` as an unsigned integer (for tests)."""
        if not 0 <= index < self.num_args:
            raise IndexError(f"argument {index} outside [0, {self.num_args})")
        return self.slots[index]
