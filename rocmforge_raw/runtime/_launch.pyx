# cython: language_level=3, boundscheck=False, wraparound=False
"""Kernel launches from C: arguments packed once, one binding call per launch; and the other
driver calls a step's plan makes each step (``DriverCalls``).

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

ctypedef int (*record_fn)(void* event, void* stream) noexcept
ctypedef int (*query_fn)(void* event) noexcept
ctypedef int (*upload_fn)(uintptr_t dst, const void* src, size_t nbytes, void* stream) noexcept

cdef struct MemLocation:  # CUmemLocation / hipMemLocation
    int type
    int id

cdef struct CopyAttributes:  # CUmemcpyAttributes / hipMemcpyAttributes (24 bytes)
    int src_access_order
    MemLocation src_hint
    MemLocation dst_hint
    unsigned int flags

ctypedef int (*batch_fn)(const uint64_t* dsts, const uint64_t* srcs, const size_t* sizes,
                         size_t count, CopyAttributes* attrs, size_t* attrs_idxs,
                         size_t num_attrs, void* stream) noexcept
ctypedef int (*batch_fail_fn)(const uint64_t* dsts, const uint64_t* srcs, const size_t* sizes,
                              size_t count, CopyAttributes* attrs, size_t* attrs_idxs,
                              size_t num_attrs, size_t* fail_idx, void* stream) noexcept

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


cdef class DriverCalls:
    """A GPU binding's C entries for the other driver calls of a decode step's plan: record
    an event, ask whether one completed, queue a copy from pinned host memory. Each is the
    very call the backend's Python method makes, with the same handles (as integers) and the
    same current context, without the binding's Python wrapper (2-3 us a call on a slow
    host). A call whose status is not success answers False (``query``: None), having
    changed nothing the caller sees: the backend then makes its Python call, which raises
    with the status (errors are reported in one place, the backend file)."""

    cdef record_fn c_record
    cdef query_fn c_query
    cdef upload_fn c_upload
    cdef batch_fn c_batch
    cdef batch_fail_fn c_batch_fail
    cdef int not_ready

    def __init__(self, dict capi, tuple record, tuple query, tuple upload, int not_ready,
                 tuple batch=()):
        """``record``, ``query`` and ``upload``: (name, signature) of each C function in
        ``capi`` (see ``_alloc.binding_function``); ``not_ready``: the status of an event
        not yet reached; ``batch``: the batched copy's name and its signatures without (CUDA
        13) and with (CUDA 12.8-12.9, HIP) a failure index, where the binding may have it."""
        self.c_record = <record_fn>binding_function(capi, record[0], record[1])
        self.c_query = <query_fn>binding_function(capi, query[0], query[1])
        self.c_upload = <upload_fn>binding_function(capi, upload[0], upload[1])
        self.not_ready = not_ready
        if batch:
            try:
                self.c_batch = <batch_fn>binding_function(capi, batch[0], batch[1])
            except ImportError:
                try:
                    self.c_batch_fail = <batch_fail_fn>binding_function(capi, batch[0],
                                                                        batch[2])
                except ImportError:  # a binding without it: copies go one by one
                    pass

    @property
    def batches(self):
        """Whether the binding has a batched copy (the driver may still refuse it)."""
        return self.c_batch != NULL or self.c_batch_fail != NULL

    def copy_batch(self, const uint64_t[::1] dsts, const uint64_t[::1] srcs,
                   const uint64_t[::1] sizes, int src_device, int dst_device,
                   uintptr_t stream):
        """Queue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i in one
        driver call (``cuMemcpyBatchAsync`` since CUDA 12.8, ``hipMemcpyBatchAsync``) on
        ``stream`` (not 0: the batch refuses the legacy default stream): in stream order as a
        whole, the sources read in stream order, the copies in no order among themselves;
        the devices are location hints. Addresses are any the driver resolves (this device's
        memory, a peer's, an IPC mapping). Returns the driver's status (0: queued; otherwise
        nothing was queued: the caller copies another way), -1 without ``batches``."""
        cdef CopyAttributes attrs
        cdef size_t first = 0, failed = 0
        cdef size_t count = <size_t>sizes.shape[0]
        cdef int status = -1
        if <size_t>dsts.shape[0] != count or <size_t>srcs.shape[0] != count:
            raise ValueError(f"{dsts.shape[0]} destinations, {srcs.shape[0]} sources and "
                             f"{count} sizes must pair up")
        if count == 0:
            return 0
        memset(&attrs, 0, sizeof(attrs))
        attrs.src_access_order = 1  # the sources are read in stream order
        attrs.src_hint.type = attrs.dst_hint.type = 1  # a device
        attrs.src_hint.id, attrs.dst_hint.id = src_device, dst_device
        if self.c_batch != NULL:
            status = self.c_batch(&dsts[0], &srcs[0], <const size_t*>&sizes[0], count,
                                  &attrs, &first, 1, <void*>stream)
        elif self.c_batch_fail != NULL:
            status = self.c_batch_fail(&dsts[0], &srcs[0], <const size_t*>&sizes[0], count,
                                       &attrs, &first, 1, &failed, <void*>stream)
        binding_ok(status)  # (clears an error the binding may have set)
        return status

    def record(self, uintptr_t event, uintptr_t stream):
        """Record ``event`` on ``stream`` (0: the default stream); False if that failed."""
        return binding_ok(self.c_record(<void*>event, <void*>stream))

    def query(self, uintptr_t event):
        """Whether the work before ``event`` completed; None if the query failed."""
        cdef int status = self.c_query(<void*>event)
        if status == 0:
            return True
        if status == self.not_ready:
            return False
        binding_ok(status)  # (clears an error the binding may have set)
        return None

    def upload(self, uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
        """Queue a copy of ``nbytes`` from pinned host address ``src`` to device address
        ``dst`` on ``stream``; False if that failed."""
        return binding_ok(self.c_upload(dst, <const void*>src, nbytes, <void*>stream))


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
