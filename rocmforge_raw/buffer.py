"""HipBuffer: owned device memory, views of it, and the process-wide live-allocation registry.

A root buffer owns ``nbytes`` on one device of one backend and frees it exactly once: through
``close()``/``with``, or through a weakref finalizer (the registry's) that holds no reference
to the buffer, frees on the owning device, never frees in a forked child and never raises
during interpreter shutdown. A view (``buf.view(offset, nbytes)``) keeps its parent alive
and frees nothing. Every copy is bounds-checked here, before any binding call. Sizes and
offsets are in bytes.
"""

from __future__ import annotations

import operator
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BufferClosedError, OutOfMemoryError
from .runtime import Backend, get_backend

if TYPE_CHECKING:
    from .array import DeviceArray
    from .pool import MemoryPool
    from .stream import Stream

_LARGE = 1 << 30  # requests above this are checked against the device's total memory


@dataclass
class Allocation:
    """One live root allocation as the registry reports it."""

    nbytes: int
    device: int
    backend: str
    stack: list[str] | None = field(default=None, repr=False)


class _Registry:
    """Every live root buffer, its finalizer, and the allocation counters.

    A root buffer registers a ``weakref.ref`` whose callback frees the memory: the record
    (free function, pointer, device, owning pid) never references the buffer. ``release``
    runs at most once per record, from ``close()`` or the callback, whichever comes first.
    Thread-safe; the lock is re-created in a forked child.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: dict[weakref.ref, tuple] = {}
        self.live_bytes = self.peak_bytes = self.num_allocs = self.num_frees = 0
        self.track_stacks = os.environ.get("RF_TRACK_STACKS", "") not in ("", "0")
        self._callback = self.release  # bound once: every buffer's weakref calls it

    def add(self, buf: HipBuffer, nbytes: int, device: int, ptr: int,
            free_fn: Callable[[int, int], None] | None) -> weakref.ref:
        """Register root buffer ``buf`` (``nbytes`` at ``ptr`` on ``device``); return its ref.

        ``free_fn(ptr, device)`` runs once, when the ref is released or ``buf`` dies."""
        stack = traceback.format_stack()[:-2] if self.track_stacks else None
        ref = weakref.ref(buf, self._callback)
        record = (nbytes, device, buf.backend.name, free_fn, ptr, _pid, stack)
        with self._lock:
            self.live[ref] = record
            self.live_bytes += nbytes
            self.num_allocs += 1
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        return ref

    def release(self, ref: weakref.ref) -> None:
        """Free once, on the owning device, only in the owning process; never raise."""
        with self._lock:
            record = self.live.pop(ref, None)
            if record is None:
                return
            self.live_bytes -= record[0]
            self.num_frees += 1
        nbytes, device, _, free_fn, ptr, pid, _ = record
        if free_fn is None or _pid != pid or sys.is_finalizing():
            return
        try:
            free_fn(ptr, device)
        except Exception as exc:  # a finalizer must never raise; say what leaked instead
            sys.stderr.write(f"rocmforge_raw: freeing {nbytes} bytes at {ptr:#x} on device "
                             f"{device} failed: {exc}\n")

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


_registry = _Registry()
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    _registry.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def memory_stats() -> dict[str, int]:
    """Counters of root buffers: live count and bytes, peak bytes, allocations and frees."""
    with _registry._lock:
        return {
            "live_buffers": len(_registry.live), "live_bytes": _registry.live_bytes,
            "peak_bytes": _registry.peak_bytes, "num_allocs": _registry.num_allocs,
            "num_frees": _registry.num_frees,
        }


def live_allocations() -> list[Allocation]:
    """Records of every live root buffer (with creation stacks when ``RF_TRACK_STACKS=1``)."""
    with _registry._lock:
        records = list(_registry.live.values())
    return [Allocation(r[0], r[1], r[2], r[6]) for r in records]


def reset_peak() -> None:
    """Set ``peak_bytes`` to the bytes live now."""
    with _registry._lock:
        _registry.peak_bytes = _registry.live_bytes


def track_stacks(enabled: bool) -> None:
    """Record (or stop recording) creation stacks of new buffers, as ``RF_TRACK_STACKS=1``."""
    _registry.track_stacks = enabled


def _index(value: Any, what: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    return number


class HipBuffer:
    """``nbytes`` of device memory, owned (root) or borrowed from a parent (view).

    ``ptr`` is the device address as an ``int``; ``nbytes`` is fixed; ``device`` and
    ``backend`` say where the memory lives. Using a closed buffer, or a view of one, raises
    ``BufferClosedError``.
    """

    __slots__ = ("__weakref__", "_parent", "_ptr", "_ref", "_view_closed", "backend", "device",
                 "nbytes")

    def __init__(self, nbytes: int, device: int | None = None,
                 backend: str | Backend | None = None, *, pool: MemoryPool | None = None) -> None:
        if type(nbytes) is not int or nbytes < 0:
            nbytes = _index(nbytes, "nbytes")
        if pool is None:
            if _default_pool is not None and _default_pool.serves(backend, device):
                pool = _default_pool
        elif (backend is not None or device is not None) and not pool.serves(backend, device):
            raise ValueError(f"{pool!r} cannot allocate on backend {backend} device {device}")
        if pool is not None:
            self.backend, self.device = pool.backend, pool.device
        else:
            self.backend = get_backend(backend)
            self.device = self.backend.get_device() if device is None else _index(device, "device")
        if nbytes > _LARGE and nbytes > self.backend.capacity(self.device):
            free, total = self.backend.mem_info(self.device)
            raise OutOfMemoryError("HipBuffer", nbytes, free, total, 2,
                                   "larger than the device's memory")
        self.nbytes = nbytes
        self._parent = None
        self._view_closed = False
        free_fn: Callable[[int, int], None] | None = None
        if nbytes == 0:
            self._ptr = 0
        elif pool is not None:
            self._ptr, free_fn = pool.allocate(nbytes), pool.free
        else:
            self._ptr, free_fn = self.backend.malloc(nbytes, self.device), self.backend.free
        self._ref = _registry.add(self, nbytes, self.device, self._ptr, free_fn)

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

    # --- state -----------------------------------------------------------------------------
    @property
    def root(self) -> HipBuffer:
        """The buffer that owns the memory (``self`` for a root buffer)."""
        buf = self
        while buf._parent is not None:
            buf = buf._parent
        return buf

    @property
    def closed(self) -> bool:
        return self._view_closed or self.root._ref is None

    @property
    def ptr(self) -> int:
        if self._ref is None and self.closed:  # an open root has its ref: no walk needed
            raise BufferClosedError(f"{self!r} was closed; its memory is no longer valid")
        return self._ptr

    def close(self) -> None:
        """Free the memory now (root) or stop using it (view). Idempotent."""
        if self._parent is None:
            ref, self._ref = self._ref, None  # the dropped ref's callback never runs
            if ref is not None:
                _registry.release(ref)
        else:
            self._view_closed = True

    def __enter__(self) -> HipBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        ptr = self._span(offset, nbytes, "view")
        view = object.__new__(HipBuffer)
        view.backend, view.device, view.nbytes = self.backend, self.device, nbytes
        view._ptr, view._parent, view._view_closed, view._ref = ptr, self, False, None
        return view

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


_default_pool: MemoryPool | None = None


def set_allocator(pool: MemoryPool | None) -> None:
    """Route new buffers on ``pool``'s backend and device through ``pool`` (None: raw malloc)."""
    global _default_pool
    _default_pool = pool
