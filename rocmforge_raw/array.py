"""DeviceArray: a typed, C-contiguous view of a HipBuffer, for kernels and zero-copy interop.

It exposes ``__dlpack__``/``__dlpack_device__`` on every backend (kDLROCM on hip, kDLCUDA on
cuda, kDLCPU on host) and ``__cuda_array_interface__`` on GPU backends, so NumPy, CuPy or
PyTorch can use the memory in place. The view keeps the buffer alive; it never frees it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import dlpack
from .buffer import HipBuffer, _shape_for
from .stream import Stream


class DeviceArray:
    """``shape`` elements of ``dtype`` starting ``offset`` bytes into ``buffer``."""

    __slots__ = ("buffer", "dtype", "shape")

    def __init__(self, buffer: HipBuffer, dtype: Any,
                 shape: int | tuple[int, ...] | None = None, offset: int = 0) -> None:
        self.dtype = np.dtype(dtype)
        available = buffer.nbytes - offset if 0 <= offset <= buffer.nbytes else -1
        if available < 0:
            raise ValueError(f"offset {offset} lies outside a {buffer.nbytes}-byte buffer")
        self.shape = _shape_for(self.dtype, shape, available)
        self.buffer = buffer.view(offset, self.nbytes)

    @classmethod
    def empty(cls, shape: int | tuple[int, ...], dtype: Any, device: int | None = None,
              backend: Any = None) -> DeviceArray:
        """A new buffer just large enough for ``shape`` of ``dtype``, uninitialised."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cls(HipBuffer(dtype.itemsize * math.prod(shape), device, backend), dtype, shape)

    @classmethod
    def from_numpy(cls, array: Any, device: int | None = None, backend: Any = None
                   ) -> DeviceArray:
        """A new device array holding a copy of ``array``."""
        array = np.ascontiguousarray(array)
        return cls(HipBuffer.from_numpy(array, device, backend), array.dtype, array.shape)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def backend(self) -> Any:
        return self.buffer.backend

    @property
    def device(self) -> int:
        return self.buffer.device

    def to_numpy(self, stream: Stream | None = None) -> np.ndarray:
        return self.buffer.to_numpy(self.dtype, self.shape, stream=stream)

    def copy_from_host(self, array: Any, stream: Stream | None = None) -> None:
        """Copy ``array`` in; its shape and dtype must match this array's exactly."""
        array = np.asarray(array)
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(f"cannot copy a {array.dtype}{list(array.shape)} array into a "
                             f"{self.dtype}{list(self.shape)} device array")
        self.buffer.copy_from_host(array, stream=stream)

    def __repr__(self) -> str:
        return (f"<DeviceArray {self.dtype}{list(self.shape)} at {self.buffer._ptr:#x} on "
                f"{self.backend.name}:{self.device}>")

    # --- interop -----------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return self.backend.dlpack_device_type, self.device

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        """A DLPack capsule over this memory. Pending work on the device is finished first
        (unless the consumer passes ``stream=-1``), so the consumer sees every write."""
        if copy:
            raise BufferError("DeviceArray exports its memory in place only (copy=True asked)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"cannot export to device {dl_device}: memory is on "
                              f"{self.__dlpack_device__()}")
        if stream != -1:
            self.backend.synchronize(self.device)
        versioned = max_version is not None and max_version[0] >= 1
        return dlpack.to_capsule(self, self.ptr, self.dtype, self.shape,
                                 self.backend.dlpack_device_type, self.device, versioned)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.backend.name == "host":
            raise AttributeError("__cuda_array_interface__ describes GPU memory only")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}
