"""A DLPack producer: wraps device memory in a PyCapsule, zero-copy and writable.

Consumers that ask for DLPack >= 1.0 (``max_version``) get a ``dltensor_versioned`` capsule
(``DLManagedTensorVersioned``, writable: NumPy honours its flags); older ones get the legacy
``dltensor`` capsule. Our registry keeps the producing object (and so the memory) alive until
the consumer calls the deleter, or until the capsule is destroyed unconsumed; then it calls
the producer's ``release`` once (the buffer's count of consumers, see ``HipBuffer.close``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import checks

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

#: Managed tensors handed out and not yet deleted, by address: (the struct, what it keeps
#: alive, the producer's release function or None).
_alive: dict[int, tuple[Any, Any, Any]] = {}


def _forget(address: int) -> None:
    """The consumer (or the unconsumed capsule) let go of ``address``: release it once."""
    entry = _alive.pop(address, None)
    if entry is not None and entry[2] is not None:
        entry[2]()


def _consumed(managed: Any) -> None:
    """The deleter: the consumer let go of the managed tensor ``managed`` points to."""
    _forget(ctypes.addressof(managed.contents))


def _unconsumed(capsule: int) -> None:
    """The capsule's destructor: if no consumer took the tensor, we still own it."""
    for name in (_NAME, _NAME_VERSIONED):
        if _api.PyCapsule_IsValid(capsule, name):
            _forget(_api.PyCapsule_GetPointer(capsule, name))


# C callbacks, kept alive here as long as the module: (un)versioned deleters, destructor
_delete, _delete_versioned = _Deleter(_consumed), _DeleterVersioned(_consumed)
_destroy_capsule = _CapsuleDestructor(_unconsumed)


def check_request(stream: Any, max_version: Any, dl_device: Any, copy: Any,
                  device: tuple[int, int]) -> bool:
    """Check the keyword arguments of a ``__dlpack__`` call for memory on ``device``;
    returns whether the consumer takes a versioned (DLPack >= 1.0) capsule."""
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise TypeError(f"stream must be None or an integer, got {checks.show(stream)}")
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be None or a bool, got {checks.show(copy)}")
    if copy:
        raise BufferError("DeviceArray exports its memory in place only (copy=True asked)")
    if dl_device is not None:
        if not isinstance(dl_device, tuple) or len(dl_device) != 2:
            raise TypeError(f"dl_device must be a (device_type, device_id) tuple, got "
                            f"{checks.show(dl_device)}")
        if tuple(dl_device) != device:
            raise BufferError(f"cannot export to device {dl_device}: memory is on {device}")
    if max_version is None:
        return False
    if not isinstance(max_version, tuple) or len(max_version) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in max_version):
        raise TypeError(f"max_version must be a (major, minor) tuple of integers, got "
                        f"{checks.show(max_version)}")
    major: int = max_version[0]
    return major >= 1


def dtype_code(dtype: np.dtype) -> tuple[int, int]:
    """DLPack (type code, bits) of a NumPy or ml_dtypes dtype."""
    if dtype.name == "bfloat16":
        return _KDL_BFLOAT, 16
    kinds = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "b": _KDL_BOOL}
    if dtype.kind not in kinds:
        raise TypeError(f"dtype {dtype} has no DLPack equivalent")
    return kinds[dtype.kind], dtype.itemsize * 8


def to_capsule(owner: Any, ptr: int, dtype: np.dtype, shape: tuple[int, ...],
               device_type: int, device_id: int, versioned: bool = False,
               release: Any = None) -> Any:
    """A capsule over C-contiguous memory at ``ptr`` that keeps ``owner`` alive: DLPack 1.0
    ``dltensor_versioned`` (writable) if ``versioned``, else legacy ``dltensor``. When the
    consumer (or the unconsumed capsule) lets go, ``release()`` is called once."""
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
    _alive[address] = (managed, (owner, dims, strides), release)
    return _api.PyCapsule_New(address, _NAME_VERSIONED if versioned else _NAME, _destroy_capsule)
