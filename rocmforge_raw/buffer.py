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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._memory import BufferCore, get_allocator, registry, set_allocator
from ._memory import index as _index
from .runtime import Backend

if TYPE_CHECKING:
    from .array import DeviceArray
    from .pool import MemoryPool
    from .stream import Stream

__all__ = ["Allocation", "HipBuffer", "get_allocator", "live_allocations", "memory_stats",
           "reset_peak", "set_allocator", "track_stacks"]


@dataclass
class Allocation:
    """One live root allocation as the registry reports it."""

    nbytes: int
    device: int
    backend: str
    stack: list[str] | None = field(default=None, repr=False)


def memory_stats() -> dict[str, int]:
    """Counters of root buffers: live count and bytes, peak bytes, allocations and frees."""
    return registry.stats()


def live_allocations() -> list[Allocation]:
    """Records of every live root buffer (with creation stacks when ``RF_TRACK_STACKS=1``)."""
    return [Allocation(*record) for record in registry.records()]


def reset_peak() -> None:
    """Set ``peak_bytes`` to the bytes live now."""
    registry.reset_peak()


def track_stacks(enabled: bool) -> None:
    """Record (or stop recording) creation stacks of new buffers, as ``RF_TRACK_STACKS=1``."""
    registry.track_stacks = enabled


class HipBuffer(BufferCore):
    """``nbytes`` of device memory, owned (root) or borrowed from a parent (view).

    ``HipBuffer(nbytes, device=None, backend=None, *, pool=None)`` allocates through ``pool``,
    the pool ``set_allocator`` installed for that backend and device, or the backend's raw
    malloc. ``ptr`` is the device address as an ``int``; ``nbytes`` is fixed; ``device`` and
    ``backend`` say where the memory lives; ``closed``, ``root``, ``close()`` and ``with`` come
    from the compiled core. Using a closed buffer, or a view of one, raises
    ``BufferClosedError``.
    """

    __slots__ = ()

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
        return self._make_view(self._span(offset, nbytes, "view"), nbytes)

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
