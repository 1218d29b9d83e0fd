# cython: language_level=3, binding=True, annotation_typing=False
"""HipBuffer: owned device memory and views of it, compiled.

A root buffer owns ``nbytes`` on one device of one backend, got from an ``Allocator`` (the
backend's raw malloc or a ``MemoryPool``), and frees it exactly once: through
``close()``/``with``, or through the registry's weakref finalizer (``_registry``), which holds
no reference to the buffer, frees on the owning device, never frees in a forked child and
never raises during interpreter shutdown. A view (``buf.view(offset, nbytes)``) keeps its
parent alive and frees nothing. Every copy is bounds-checked here, before any binding call.
Sizes and offsets are in bytes.

Compiled (Cython) because it is the path every allocation takes: ``bench --alloc`` holds a
raw buffer to 1.10 x the bare binding calls and a pooled one to under a microsecond. It is
Python code apart from the typed fields and the allocation path; annotations are for
readers (``annotation_typing=False``), so NumPy integers work wherever ints do.
"""

from __future__ import annotations

import operator

import numpy as np

from libc.limits cimport INT_MAX
from libc.stdint cimport uintptr_t

from rocmforge_raw._registry cimport Registry
from rocmforge_raw.runtime._alloc cimport Allocator

from . import _registry as _registry_module
from ._registry import Allocation, live_allocations, memory_stats, reset_peak, track_stacks
from .errors import BackendUnavailableError, BufferClosedError, OutOfMemoryError
from .runtime import get_backend

__all__ = ["Allocation", "HipBuffer", "get_allocator", "live_allocations", "memory_stats",
           "reset_peak", "set_allocator", "track_stacks"]

#: Requests above this many bytes are checked against the device's total memory first.
cdef object _LARGE = 1 << 30
cdef Registry _registry = _registry_module.registry
cdef object _default_pool = None


def set_allocator(pool):
    """Route new buffers on ``pool``'s backend and device through ``pool`` (None: raw malloc)."""
    global _default_pool
    if pool is not None and not isinstance(pool, Allocator):
        raise TypeError(f"set_allocator takes a MemoryPool or None, not {type(pool).__name__}")
    _default_pool = pool


def get_allocator():
    """The pool ``set_allocator`` installed, or None."""
    return _default_pool


def _index(value, what):
    """``value`` as a non-negative ``int``; a clear ``TypeError``/``ValueError`` otherwise."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    return number


def _device_index(value):
    """``value`` as a device ordinal: a non-negative ``int`` that fits a C ``int``."""
    number = _index(value, "device")
    if number > INT_MAX:
        raise BackendUnavailableError(f"device {number} does not exist")
    return number


cdef class HipBuffer:
    """``nbytes`` of device memory, owned (root) or borrowed from a parent (view).

    ``HipBuffer(nbytes, device=None, backend=None, *, pool=None)`` allocates through ``pool``,
    the pool ``set_allocator`` installed for that backend and device, or the backend's raw
    malloc. ``ptr`` is the device address as an ``int``; ``nbytes`` is fixed; ``device`` and
    ``backend`` say where the memory lives. Using a closed buffer, or a view of one, raises
    ``BufferClosedError``.
    """
    cdef readonly object backend
    cdef readonly int device
    cdef readonly size_t nbytes
    cdef uintptr_t addr
    cdef readonly object _parent
    cdef bint view_closed
    cdef object ref  # the registry's key while a root is open; None for views and once closed
    cdef object __weakref__

    def __init__(self, nbytes, device=None, backend=None, *, pool=None):
        if type(nbytes) is not int or nbytes < 0:
            nbytes = _index(nbytes, "nbytes")
        if device is not None and (type(device) is not int or not 0 <= device <= INT_MAX):
            device = _device_index(device)
        if pool is None:
            if _default_pool is not None and _default_pool.serves(backend, device):
                pool = _default_pool
        elif (backend is not None or device is not None) and not pool.serves(backend, device):
            raise ValueError(f"{pool!r} cannot allocate on backend {backend} device {device}")
        cdef Allocator allocator
        if pool is not None:
            allocator = <Allocator?>pool
            self.backend, self.device = allocator.backend, allocator.device
        else:
            self.backend = get_backend(backend)
            self.device = self.backend.get_device() if device is None else device
            allocator = self.backend.allocator
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
        return self.view_closed or self.owner().ref is None

    @property
    def ptr(self):
        """The device address as an ``int``; raises ``BufferClosedError`` once closed."""
        if self.ref is None and self.closed:  # an open root has its ref: no walk needed
            raise BufferClosedError(f"{self!r} was closed; its memory is no longer valid")
        return self.addr

    @property
    def _ptr(self):
        """The address, closed or not (for messages)."""
        return self.addr

    def close(self):
        """Free the memory now (root) or stop using it (view). Idempotent."""
        if self._parent is None:
            ref, self.ref = self.ref, None  # the dropped ref's callback never runs
            if ref is not None:
                _registry.release(ref)
        else:
            self.view_closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise TypeError("a HipBuffer owns its device memory and cannot be copied or pickled: "
                        "copy its bytes instead (to_numpy, from_numpy, copy_from)")

    @classmethod
    def from_numpy(cls, array: Any, device: int | None = None,
                   backend: str | Backend | None = None, *, pool: MemoryPool | None = None,
                   ) -> HipBuffer:
        """A new buffer holding a copy of ``array``'s bytes (made C-contiguous first)."""
        array = np.ascontiguousarray(array)
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
        offset, nbytes = _index(offset, "offset"), _index(nbytes, "nbytes")
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"{what} of {nbytes} bytes at offset {offset} overruns a {self.nbytes}-byte buffer"
            )
        return self.ptr + offset

    def view(self, offset: int = 0, nbytes: int | None = None) -> HipBuffer:
        """A view of ``nbytes`` (default: the rest) starting ``offset`` bytes in."""
        offset = _index(offset, "offset")
        if nbytes is None:
            if offset > self.nbytes:
                raise ValueError(f"view at offset {offset} lies past a {self.nbytes}-byte buffer")
            nbytes = self.nbytes - offset
        return self._view(self._span(offset, nbytes, "view"), nbytes)

    def typed(self, dtype: Any, shape: int | tuple[int, ...] | None = None,
              offset: int = 0) -> DeviceArray:
        """A typed, C-contiguous view (DLPack and ``__cuda_array_interface__`` capable)."""
        from .array import DeviceArray

        return DeviceArray(self, dtype, shape, offset)

    # --- copies ----------------------------------------------------------------------------
    def copy_from_host(self, array: Any, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy ``array``'s bytes in at ``offset``. With a stream, keep ``array`` alive and
        unmodified until the stream has passed the copy."""
        array = np.ascontiguousarray(array)
        dst = self._span(offset, array.nbytes)
        if array.nbytes:
            self.backend.memcpy_htod(dst, array.ctypes.data, array.nbytes, _handle(stream))

    def to_numpy(self, dtype: Any = np.uint8, shape: int | tuple[int, ...] | None = None,
                 offset: int = 0, stream: Stream | None = None) -> np.ndarray:
        """A new host array of ``dtype``/``shape`` read from ``offset`` (default: all of it)."""
        shape = _shape_for(np.dtype(dtype), shape, self.nbytes - min(offset, self.nbytes))
        out = np.empty(shape, dtype)
        src = self._span(offset, out.nbytes, "read")
        if out.nbytes:
            self.backend.memcpy_dtoh(out.ctypes.data, src, out.nbytes, _handle(stream))
            if stream is not None:
                stream.synchronize()
        return out

    def copy_from(self, src: HipBuffer, nbytes: int | None = None, dst_offset: int = 0,
                  src_offset: int = 0, stream: Stream | None = None) -> None:
        """Device-to-device copy of ``nbytes`` (default: all of ``src``) from ``src``."""
        if src.backend is not self.backend:
            raise ValueError(f"cannot copy from a {src.backend.name} buffer to a "
                             f"{self.backend.name} buffer")
        nbytes = src.nbytes - min(src_offset, src.nbytes) if nbytes is None else nbytes
        from_addr = src._span(src_offset, nbytes, "read")
        to_addr = self._span(dst_offset, nbytes)
        if nbytes:
            self.backend.memcpy_dtod(to_addr, from_addr, nbytes, _handle(stream))

    def fill(self, byte: int, offset: int = 0, nbytes: int | None = None,
             stream: Stream | None = None) -> None:
        """Set ``nbytes`` (default: the rest) from ``offset`` to the byte value ``byte``."""
        if not 0 <= operator.index(byte) <= 255:
            raise ValueError(f"fill value must be a byte (0..255), got {byte}")
        nbytes = self.nbytes - min(offset, self.nbytes) if nbytes is None else nbytes
        dst = self._span(offset, nbytes, "fill")
        if nbytes:
            self.backend.memset(dst, byte, nbytes, _handle(stream))


def _handle(stream: Stream | None) -> Any:
    return None if stream is None else stream.handle


def _shape_for(dtype: np.dtype, shape: int | tuple[int, ...] | None,
               available: int) -> tuple[int, ...]:
    """The shape to read: ``shape`` checked against ``available`` bytes, or all of them."""
    if shape is None:
        if available % dtype.itemsize:
            raise ValueError(f"{available} bytes are not a whole number of {dtype} elements "
                             f"({dtype.itemsize} bytes each)")
        return (available // dtype.itemsize,)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dims = [_index(d, "shape dimension") for d in shape]
    nbytes = dtype.itemsize * int(np.prod(dims, dtype=object))
    if nbytes > available:
        raise ValueError(f"shape {tuple(dims)} of {dtype} needs {nbytes} bytes but only "
                         f"{available} are available")
    return tuple(dims)
