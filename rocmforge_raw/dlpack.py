"""A DLPack producer: wraps device memory in a ``dltensor`` PyCapsule (DLPack 0.8 ABI).

The capsule owns a ``DLManagedTensor`` whose ``manager_ctx`` keeps the producing object (and
so the memory) alive until the consumer calls the deleter, or until the capsule is destroyed
unconsumed. Nothing here copies data.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

KDL_CPU, KDL_CUDA, KDL_ROCM = 1, 2, 10
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
_NAME = b"dltensor"


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
        ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _ManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = [
    ("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

#: Managed tensors handed out and not yet deleted, by address: keeps their owners alive.
_alive: dict[int, tuple[_ManagedTensor, Any]] = {}


@_Deleter
def _delete(managed: Any) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


@_CapsuleDestructor
def _destroy_capsule(capsule: int) -> None:
    if _api.PyCapsule_IsValid(capsule, _NAME):  # never consumed: we still own it
        address = _api.PyCapsule_GetPointer(capsule, _NAME)
        _alive.pop(address, None)


def dtype_code(dtype: np.dtype) -> tuple[int, int]:
    """DLPack (type code, bits) of a NumPy or ml_dtypes dtype."""
    if dtype.name == "bfloat16":
        return _KDL_BFLOAT, 16
    kinds = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "b": _KDL_BOOL}
    if dtype.kind not in kinds:
        raise TypeError(f"dtype {dtype} has no DLPack equivalent")
    return kinds[dtype.kind], dtype.itemsize * 8


def to_capsule(owner: Any, ptr: int, dtype: np.dtype, shape: tuple[int, ...],
               device_type: int, device_id: int) -> Any:
    """A ``dltensor`` capsule over C-contiguous memory at ``ptr`` that keeps ``owner`` alive."""
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))()
    step = 1
    for axis in reversed(range(ndim)):
        strides[axis] = step
        step *= shape[axis]
    code, bits = dtype_code(dtype)
    managed = _ManagedTensor()
    managed.dl_tensor = _Tensor(
        ptr or None, _Device(device_type, device_id), ndim, _DataType(code, bits, 1),
        ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0,
    )
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    _alive[address] = (managed, (owner, dims, strides))
    return _api.PyCapsule_New(address, _NAME, _destroy_capsule)
