"""A DLPack producer: wraps device memory in a PyCapsule, zero-copy and writable.

Consumers that ask for DLPack >= 1.0 (``max_version``) get a ``dltensor_versioned`` capsule
(``DLManagedTensorVersioned``, writable: NumPy honours its flags); older ones get the legacy
``dltensor`` capsule. Our registry keeps the producing object (and so the memory) alive until
the consumer calls the deleter, or until the capsule is destroyed unconsumed.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

KDL_CPU, KDL_CUDA, KDL_ROCM = 1, 2, 10
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"


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

class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedTensorVersioned(ctypes.Structure):
    pass


_DeleterVersioned = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensorVersioned))
_ManagedTensorVersioned._fields_ = [
    ("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _DeleterVersioned),
    ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor),
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
_alive: dict[int, tuple[Any, Any]] = {}


@_Deleter
def _delete(managed: Any) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


@_DeleterVersioned
def _delete_versioned(managed: Any) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


@_CapsuleDestructor
def _destroy_capsule(capsule: int) -> None:
    for name in (_NAME, _NAME_VERSIONED):
        if _api.PyCapsule_IsValid(capsule, name):  # never consumed: we still own it
            _alive.pop(_api.PyCapsule_GetPointer(capsule, name), None)


def dtype_code(dtype: np.dtype) -> tuple[int, int]:
    """DLPack (type code, bits) of a NumPy or ml_dtypes dtype."""
    if dtype.name == "bfloat16":
        return _KDL_BFLOAT, 16
    kinds = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "b": _KDL_BOOL}
    if dtype.kind not in kinds:
        raise TypeError(f"dtype {dtype} has no DLPack equivalent")
    return kinds[dtype.kind], dtype.itemsize * 8


def to_capsule(owner: Any, ptr: int, dtype: np.dtype, shape: tuple[int, ...],
               device_type: int, device_id: int, versioned: bool = False) -> Any:
    """A capsule over C-contiguous memory at ``ptr`` that keeps ``owner`` alive: DLPack 1.0
    ``dltensor_versioned`` (writable) if ``versioned``, else legacy ``dltensor``."""
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))()
    step = 1
    for axis in reversed(range(ndim)):
        strides[axis] = step
        step *= shape[axis]
    code, bits = dtype_code(dtype)
    tensor = _Tensor(
        ptr or None, _Device(device_type, device_id), ndim, _DataType(code, bits, 1),
        ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0,
    )
    if versioned:
        managed: Any = _ManagedTensorVersioned(_Version(1, 0), None, _delete_versioned, 0, tensor)
    else:
        managed = _ManagedTensor(tensor, None, _delete)
    address = ctypes.addressof(managed)
    _alive[address] = (managed, (owner, dims, strides))
    return _api.PyCapsule_New(address, _NAME_VERSIONED if versioned else _NAME, _destroy_capsule)
