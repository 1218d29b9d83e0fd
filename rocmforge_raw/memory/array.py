"""DeviceArray: a typed, C-contiguous view of a HipBuffer, for kernels and zero-copy interop.

It exposes ``__dlpack__``/``__dlpack_device__`` on every backend (kDLROCM on hip, kDLCUDA on
cuda, kDLCPU on host) and ``__cuda_array_interface__`` on GPU backends, so NumPy, CuPy or
PyTorch can use the memory in place. The view keeps the buffer alive; it never frees it.
Its fields are fixed at construction (ops trust them), its dtype is a plain number type and
its elements are aligned to that type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..common import checks
from . import dlpack
from .buffer import HipBuffer, _shape_for, register_array_type
from .stream import Stream


class DeviceArray:
    """``shape`` elements of ``dtype`` starting ``offset`` bytes into ``buffer``.
    ``buffer`` (the view), ``dtype`` and ``shape`` are read-only."""

    __slots__ = ("buffer", "dtype", "shape")
    buffer: HipBuffer  # the view of exactly this array's bytes
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    def __init__(self, buffer: HipBuffer, dtype: Any,
                 shape: int | tuple[int, ...] | None = None, offset: int = 0) -> None:
        if not isinstance(buffer, HipBuffer):
            raise TypeError(f"buffer must be a HipBuffer, got {checks.show(buffer)}")
        dtype = checks.plain_dtype(dtype)
        offset = checks.size(offset, "offset")
        if offset > buffer.nbytes:
            raise ValueError(f"offset {offset} lies outside a {buffer.nbytes}-byte buffer")
        if (buffer._ptr + offset) % dtype.alignment:
            raise ValueError(f"offset {offset} puts {dtype} elements at address "
                             f"{buffer._ptr + offset:#x}, not {dtype.alignment}-byte aligned")
        shape = _shape_for(dtype, shape, buffer.nbytes - offset)
        view = buffer.view(offset, dtype.itemsize * math.prod(shape))
        for name, value in (("dtype", dtype), ("shape", shape), ("buffer", view)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DeviceArray.{name} is read-only: make a new DeviceArray")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"DeviceArray.{name} is read-only")

    def __copy__(self) -> DeviceArray:
        return self  # immutable: a copy would be the same view

    def __reduce__(self) -> Any:
        raise TypeError("a DeviceArray views device memory and cannot be pickled or "
                        "deep-copied: copy its data instead (to_numpy, from_numpy)")

    @classmethod
    def empty(cls, shape: int | tuple[int, ...], dtype: Any, device: int | None = None,
              backend: Any = None) -> DeviceArray:
        """A new buffer just large enough for ``shape`` of ``dtype``, uninitialised."""
        dtype = checks.plain_dtype(dtype)
        shape = checks.dims(shape)
        return cls(HipBuffer(checks.nbytes_of(dtype, shape), device, backend), dtype, shape)

    @classmethod
    def from_numpy(cls, array: Any, device: int | None = None, backend: Any = None
                   ) -> DeviceArray:
        """A new device array holding a copy of ``array``."""
        array = checks.host_array(array, "array")
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
        array = checks.host_array(array, "array")
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(f"cannot copy a {array.dtype}{list(array.shape)} array into a "
                             f"{self.dtype}{list(self.shape)} device array")
        self.buffer.copy_from_host(array, stream=stream)

    def __repr__(self) -> str:
        return (f"<DeviceArray {self.dtype}{list(self.shape)} at {self.buffer._ptr:#x} on "
                f"{self.backend.name}:{self.device}>")

    # --- interop -----------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        where: tuple[int, int] = self.backend.dlpack_device(self.device)
        return where

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        """A DLPack capsule over this memory. Pending work on the device is finished first
        (unless the consumer passes ``stream=-1``), so the consumer sees every write. The
        buffer counts the capsule as a consumer: closing it defers the free until the
        consumer lets go."""
        version = dlpack.check_request(stream, max_version, dl_device, copy,
                                       self.__dlpack_device__(), self.dtype)
        if stream != -1:
            self.backend.synchronize(self.device)
        release = self.buffer._export()
        try:
            return dlpack.to_capsule(self, self.ptr, self.dtype, self.shape,
                                     *self.__dlpack_device__(), version, release)
        except BaseException:
            release()
            raise

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.backend.name == "host":
            raise AttributeError("__cuda_array_interface__ describes GPU memory only")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}


register_array_type(DeviceArray)
