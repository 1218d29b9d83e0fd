# cython: language_level=3, binding=True, annotation_typing=False
"""HipBuffer: owned device memory and views of it, compiled.

A root buffer owns ``nbytes`` on one device of one backend, got from an ``Allocator`` (the
backend's raw malloc or a ``MemoryPool``), and frees it exactly once: through
``close()``/``with``, or through the registry's weakref finalizer (``_registry``), which holds
no reference to the buffer, frees on the owning device, never frees in a forked child and
never raises during interpreter shutdown. A view (``buf.view(offset, nbytes)``) keeps its
parent alive and frees nothing. Every copy is bounds-checked here, before any binding call.
Sizes and offsets are in bytes. A buffer exported through DLPack counts its consumers:
``close()`` while one is alive marks the buffer closed at once but frees the memory only when
the last consumer lets go (``_export``). ``release_after(after)`` closes a root at once and
hands its memory to the registry until the device has passed ``after`` (``waiting``).

Compiled (Cython) because it is the path every allocation takes: ``bench --alloc`` holds a
raw buffer to 1.10 x the bare binding calls and a pooled one to under a microsecond. It is
Python code apart from the typed fields and the allocation path; annotations are for
readers (``annotation_typing=False``), so NumPy integers work wherever ints do.
"""

from __future__ import annotations

import numpy as np

from libc.stdint cimport uintptr_t

from rocmforge_raw.memory._registry cimport Registry
from rocmforge_raw.runtime._alloc cimport Allocator

from . import _registry as _registry_module
from ..common import checks
from . import ipc
from ._registry import Allocation, live_allocations, memory_stats, reset_peak, track_stacks
from ..errors import BufferClosedError, OutOfMemoryError
from .pool import MemoryPool, StreamAllocator
from ..runtime import get_backend
from .stream import stream_handle
from .waiting import event_after, free_entry

#: The type of ``HipBuffer.typed``'s views: ``DeviceArray``, registered by ``array`` when it is
#: imported (the package ``memory`` imports it), so this module never imports the one above it.
_array_type = None


def register_array_type(array_type):
    """Make ``array_type`` (``DeviceArray``) the type ``HipBuffer.typed`` returns."""
    global _array_type
    _array_type = array_type


__all__ = ["Allocation", "HipBuffer", "get_allocator", "live_allocations", "memory_stats",
           "reset_peak", "set_allocator", "track_stacks"]

#: Requests above this many bytes are checked against the device's total memory first.
cdef object _LARGE = 1 << 30
cdef Registry _registry = _registry_module.registry
cdef object _default_pool = None


def set_allocator(pool):
    """Route new buffers on ``pool``'s backend and device through ``pool`` (None: raw malloc)."""
    global _default_pool
    if pool is not None and not isinstance(pool, (MemoryPool, StreamAllocator)):
        raise TypeError(f"set_allocator takes a MemoryPool (or its .on(stream)) or None, got "
                        f"{checks.show(pool)}")
    if pool is not None and (pool.pool if isinstance(pool, StreamAllocator) else pool).closed:
        raise BufferClosedError(f"set_allocator: {pool!r} belongs to a closed MemoryPool")
    _default_pool = pool


def get_allocator():
    """The pool ``set_allocator`` installed, or None."""
    return _default_pool


cdef class HipBuffer:
    """``nbytes`` of device memory, owned (root) or borrowed from a parent (view).

    ``HipBuffer(nbytes, device=None, backend=None, *, pool=None, shareable=False)``
    allocates through ``pool``, the pool ``set_allocator`` installed for that backend and
    device (``device=None``: the thread's device), or the backend's raw malloc;
    ``shareable=True`` allocates memory that other processes can map (``ipc_handle()``,
    ``from_ipc``; see ``rocmforge_raw.memory.ipc``), never from a pool. ``ptr`` is the
    device address as an ``int``; ``nbytes`` is fixed; ``device`` and ``backend`` say where
    the memory lives. Using a closed buffer, or a view of one, raises
    ``BufferClosedError``.
    """
    cdef readonly object backend
    cdef readonly int device
    cdef readonly size_t nbytes
    cdef uintptr_t addr
    cdef readonly object _parent
    cdef bint view_closed
    cdef bint closing  # a root closed while exported: freed when the last export ends
    cdef Py_ssize_t exports  # live DLPack consumers of a root
    cdef object ref  # the registry's key while a root is open; None for views and once closed
    cdef object waiting  # the registry's entry after release_after, until close() frees it
    cdef object after  # release_after's event while DLPack consumers hold the memory
    cdef object __weakref__

    def __init__(self, nbytes, device=None, backend=None, *, pool=None, shareable=False):
        if type(nbytes) is not int or nbytes < 0:
            nbytes = checks.size(nbytes, "nbytes")
        if device is not None and (type(device) is not int or device < 0):
            device = checks.integer(device, "device", 0)
        if pool is not None and not isinstance(pool, (MemoryPool, StreamAllocator)):
            raise TypeError(f"pool must be a MemoryPool (or its .on(stream)) or None, got "
                            f"{checks.show(pool)}")
        if shareable is not False and checks.flag(shareable, "shareable") and pool is not None:
            raise ValueError("pooled memory cannot be shared (the pool reuses it after "
                             "close()): allocate with shareable=True and no pool")
        if pool is None:
            if (not shareable and _default_pool is not None
                    and _default_pool.serves(backend, device)
                    and (device is not None  # else: the thread's device must be the pool's
                         or _default_pool.backend.get_device() == _default_pool.device)):
                pool = _default_pool
        elif (backend is not None or device is not None) and not pool.serves(backend, device):
            raise ValueError(f"{pool!r} cannot allocate on backend {backend} device {device}")
        cdef Allocator allocator
        if pool is not None:
            allocator = <Allocator?>pool
            self.backend, self.device = allocator.backend, allocator.device
        else:
            self.backend = get_backend(backend)
            if device is None:
                device = self.backend.get_device()
            elif device >= self.backend.num_devices:
                self.backend.resolve_device(device)  # raises, naming the device
            self.device = device
            allocator = ipc.shareable_allocator(self.backend) if shareable \
                else self.backend.allocator
        if nbytes > _LARGE and nbytes > self.backend.capacity(self.device):
            free, total = self.backend.mem_info(self.device)
            raise OutOfMemoryError("HipBuffer", nbytes, free, total, 2,
                                   "larger than the device's memory")
        self.nbytes = nbytes
        if self.nbytes:
            self.addr = allocator.alloc_ptr(self.nbytes, self.device)
            try:
                self.ref = _registry.add(self, self.nbytes, self.device, allocator, self.addr)
            except BaseException:
                allocator.free_ptr(self.addr, self.nbytes, self.device)
                raise
        else:
            self.ref = _registry.add(self, 0, self.device, allocator, 0)

    cdef HipBuffer _view(self, uintptr_t addr, size_t nbytes):
        """A view of ``nbytes`` at ``addr`` (already bounds-checked) of this buffer."""
        cdef HipBuffer view = type(self).__new__(type(self))
        view.backend, view.device, view.nbytes = self.backend, self.device, nbytes
        view.addr, view._parent = addr, self
        return view

    cdef HipBuffer owner(self):
        cdef HipBuffer buf = self
        while buf._parent is not None:
            buf = buf._parent
        return buf

    @property
    def root(self):
        """The buffer that owns the memory (``self`` for a root buffer)."""
        return self.owner()

    @property
    def closed(self):
        cdef HipBuffer root = self.owner()
        return self.view_closed or root.ref is None or root.closing

    @property
    def ptr(self):
        """The device address as an ``int``; raises ``BufferClosedError`` once closed."""
        if (self.ref is None or self.closing) and self.closed:  # an open root: no walk
            raise BufferClosedError(f"{self!r} was closed; its memory is no longer valid")
        return self.addr

    @property
    def _ptr(self):
        """The address, closed or not (for messages)."""
        return self.addr

    def close(self):
        """Free the memory now (root) or stop using it (view). Idempotent. A root with live
        DLPack consumers is closed at once but freed when the last of them lets go; one
        handed over with ``release_after`` is freed now, once the device has passed it."""
        if self._parent is None:
            if self.waiting is not None:
                entry, self.waiting = self.waiting, None
                free_entry(entry)
                return
            if self.exports:
                self.closing = True
                return
            ref, self.ref = self.ref, None  # the dropped ref's callback never runs
            if ref is not None:
                _registry.release(ref)
        else:
            self.view_closed = True

    def release_after(self, after=None):
        """Close this root buffer now and free its memory once the device has passed
        ``after``: an ``Event`` recorded after the memory's last use on the device, or the
        ``Stream`` (None: the default stream) where all that use was queued (an event is
        recorded on it now). Until then the memory counts as waiting in ``memory_stats()``,
        not live; ``rocmforge_raw.free_waiting()``, this buffer's ``close()`` or interpreter
        exit frees it (each waits for that event), never a call that would not wait anyway.
        Using the buffer or a view of it raises ``BufferClosedError`` from now on. Nothing
        happens to a buffer closed already."""
        if self._parent is not None:
            raise ValueError(f"{self!r} is a view, which frees nothing: release_after its "
                             "root (.root) once no view of it is used")
        if self.ref is None or self.closing:
            return
        event = event_after(after, self.backend, self.device)
        if self.exports:  # handed over when the last consumer lets go
            self.closing, self.after = True, event
            return
        ref, self.ref = self.ref, None
        self.waiting = _registry.retire(ref, event)

    def _export(self):
        """Count one more outside consumer (a DLPack capsule) of this memory; returns the
        function that ends it, to be called exactly once. Raises if already closed."""
        if self.closed:
            raise BufferClosedError(f"{self!r} was closed; its memory cannot be exported")
        cdef HipBuffer root = self.owner()
        root.exports += 1
        return root._end_export

    def _end_export(self):
        self.exports -= 1
        if self.exports == 0 and self.closing:
            self.closing = False
            ref, self.ref = self.ref, None
            after, self.after = self.after, None
            if ref is not None and after is not None:
                self.waiting = _registry.retire(ref, after)
            elif ref is not None:
                _registry.release(ref)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise TypeError("a HipBuffer owns its device memory and cannot be copied or pickled: "
                        "copy its bytes instead (to_numpy, from_numpy, copy_from)")

    # --- sharing with other processes (rocmforge_raw.memory.ipc) -------------------------
    def ipc_handle(self) -> IpcHandle:
        """A picklable handle that ``HipBuffer.from_ipc`` opens in another process of this
        host. Only a root buffer allocated with ``shareable=True`` has one; while another
        process maps it, ``close()`` here defers the free until the last mapping goes."""
        return ipc.export_handle(self)

    @classmethod
    def from_ipc(cls, handle: IpcHandle, device: int | None = None) -> HipBuffer:
        """Map another process's memory named by ``handle``: a root buffer whose ``close()``
        (or garbage collection) unmaps it and never frees it. ``device``: where this
        process maps it the first time (None: the exporter's device; another that reaches it
        by peer access lets its kernels read it directly); later imports share that mapping,
        and the buffer's ``device`` says where it is. The last importer's unmap waits for
        that device only: wait for copies another device queued from it before letting go
        (the transports wait for every read). ``IpcError`` for a handle of another
        host or of this process, or whose memory was freed or whose exporter exited."""
        backend, addr, allocator, mapped_on = ipc.import_handle(handle, device)
        cdef HipBuffer buf = cls.__new__(cls)
        buf.backend, buf.device, buf.nbytes, buf.addr = backend, mapped_on, handle.nbytes, addr
        try:
            buf.ref = _registry.add(buf, buf.nbytes, buf.device, allocator, addr)
        except BaseException:
            allocator.release(addr, buf.nbytes, buf.device)
            raise
        return buf

    @classmethod
    def from_numpy(cls, array: Any, device: int | None = None,
                   backend: str | Backend | None = None, *, pool: MemoryPool | None = None,
                   ) -> HipBuffer:
        """A new buffer holding a copy of ``array``'s bytes (made C-contiguous first)."""
        array = checks.host_array(array, "array")
        buf = cls(array.nbytes, device, backend, pool=pool)
        try:
            buf.copy_from_host(array)
        except BaseException:
            buf.close()
            raise
        return buf

    def __repr__(self) -> str:
        kind = "view" if self._parent is not None else "buffer"
        state = " closed" if self.closed else ""
        return (f"<HipBuffer {kind} {self.nbytes} bytes at {self._ptr:#x} on "
                f"{self.backend.name}:{self.device}{state}>")

    # --- views -----------------------------------------------------------------------------
    def _span(self, offset: int, nbytes: int, what: str = "copy") -> int:
        """Check that [offset, offset + nbytes) lies in this buffer; return its address."""
        offset, nbytes = checks.size(offset, "offset"), checks.size(nbytes, "nbytes")
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"{what} of {nbytes} bytes at offset {offset} overruns a {self.nbytes}-byte buffer"
            )
        return self.ptr + offset

    def view(self, offset: int = 0, nbytes: int | None = None) -> HipBuffer:
        """A view of ``nbytes`` (default: the rest) starting ``offset`` bytes in."""
        offset = checks.size(offset, "offset")
        if nbytes is None:
            if offset > self.nbytes:
                raise ValueError(f"view at offset {offset} lies past a {self.nbytes}-byte buffer")
            nbytes = self.nbytes - offset
        return self._view(self._span(offset, nbytes, "view"), nbytes)

    def typed(self, dtype: Any, shape: int | tuple[int, ...] | None = None,
              offset: int = 0) -> DeviceArray:
        """A typed, C-contiguous view (DLPack and ``__cuda_array_interface__`` capable): a
        ``DeviceArray``, the type ``array`` registers (``register_array_type``)."""
        return _array_type(self, dtype, shape, offset)

    # --- copies ----------------------------------------------------------------------------
    def copy_from_host(self, array: Any, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy ``array``'s bytes in at ``offset``. With a stream, keep ``array`` alive and
        unmodified until the stream has passed the copy."""
        array = checks.host_array(array, "array")
        dst = self._span(offset, array.nbytes)
        handle = stream_handle(stream, "stream", self.backend, self.device)
        if array.nbytes:
            self.backend.memcpy_htod(dst, array.ctypes.data, array.nbytes, handle)

    def to_numpy(self, dtype: Any = np.uint8, shape: int | tuple[int, ...] | None = None,
                 offset: int = 0, stream: Stream | None = None) -> np.ndarray:
        """A new host array of ``dtype``/``shape`` read from ``offset`` (default: all of it)."""
        dtype = checks.plain_dtype(dtype)
        offset = checks.size(offset, "offset")
        handle = stream_handle(stream, "stream", self.backend, self.device)
        shape = _shape_for(dtype, shape, self.nbytes - min(offset, self.nbytes))
        src = self._span(offset, checks.nbytes_of(dtype, shape), "read")
        out = np.empty(shape, dtype)
        if out.nbytes:
            self.backend.memcpy_dtoh(out.ctypes.data, src, out.nbytes, handle)
            if stream is not None:
                stream.synchronize()
        return out

    def copy_from(self, src: HipBuffer, nbytes: int | None = None, dst_offset: int = 0,
                  src_offset: int = 0, stream: Stream | None = None) -> None:
        """Device-to-device copy of ``nbytes`` (default: all of ``src``) from ``src``."""
        if not isinstance(src, HipBuffer):
            raise TypeError(f"src must be a HipBuffer, got {checks.show(src)}")
        if src.backend is not self.backend:
            checks.colocated("src", src.backend, src.device, "this buffer", self.backend,
                             self.device)
        src_offset = checks.size(src_offset, "src_offset")
        dst_offset = checks.size(dst_offset, "dst_offset")
        nbytes = src.nbytes - min(src_offset, src.nbytes) if nbytes is None else nbytes
        from_addr = src._span(src_offset, nbytes, "read")
        to_addr = self._span(dst_offset, nbytes)
        handle = stream_handle(stream, "stream", self.backend, self.device)
        if nbytes:
            self.backend.memcpy_dtod(to_addr, from_addr, nbytes, handle)

    def fill(self, byte: int, offset: int = 0, nbytes: int | None = None,
             stream: Stream | None = None) -> None:
        """Set ``nbytes`` (default: the rest) from ``offset`` to the byte value ``byte``."""
        byte = checks.integer(byte, "fill value (a byte)", 0, 255)
        offset = checks.size(offset, "offset")
        nbytes = self.nbytes - min(offset, self.nbytes) if nbytes is None else nbytes
        dst = self._span(offset, nbytes, "fill")
        handle = stream_handle(stream, "stream", self.backend, self.device)
        if nbytes:
            self.backend.memset(dst, byte, nbytes, handle)


def _shape_for(dtype: np.dtype, shape: int | tuple[int, ...] | None,
               available: int) -> tuple[int, ...]:
    """The shape to read: ``shape`` checked against ``available`` bytes, or all of them."""
    if shape is None:
        if available % dtype.itemsize:
            raise ValueError(f"{available} bytes are not a whole number of {dtype} elements "
                             f"({dtype.itemsize} bytes each)")
        return (available // dtype.itemsize,)
    dims = checks.dims(shape)
    nbytes = checks.nbytes_of(dtype, dims)
    if nbytes > available:
        raise ValueError(f"shape {dims} of {dtype} needs {nbytes} bytes but only "
                         f"{available} are available")
    return dims
