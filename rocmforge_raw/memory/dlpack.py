"""A DLPack producer: wraps device memory in a PyCapsule, zero-copy and writable.

Consumers that ask for DLPack >= 1.0 (``max_version``) get a ``dltensor_versioned`` capsule
(``DLManagedTensorVersioned``, writable: NumPy honours its flags) of version 1.1 where they
take 1.1, else 1.0; older ones get the legacy ``dltensor`` capsule. ml_dtypes' 8-bit floats go
with DLPack 1.1's type codes (``kDLFloat8_e4m3fn`` and the rest, dlpack.h's ``DLDataTypeCode``)
in every kind of capsule, as torch reads them though it asks for 1.0: a consumer that does not
know them refuses the tensor with its own error (NumPy 2.4 raises a SystemError: view the array
as uint8 for NumPy) and the capsule it drops is released.

Our registry keeps the producing object (and so the memory) alive until the consumer calls
the deleter, or until the capsule is destroyed unconsumed; then it calls
the producer's ``release`` once (the buffer's count of consumers, see ``HipBuffer.close``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..common import checks
from . import _dlpack_release as _release

KDL_CPU, KDL_CUDA, KDL_ROCM = 1, 2, 10
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_COMPLEX, _KDL_BOOL = 0, 1, 2, 4, 5, 6
#: DLPack 1.1's type codes of the 8-bit floats (dlpack.h, DLDataTypeCode), by ml_dtypes' name
FLOAT8_CODES = {"float8_e3m4": 7, "float8_e4m3": 8, "float8_e4m3b11fnuz": 9,
                "float8_e4m3fn": 10, "float8_e4m3fnuz": 11, "float8_e5m2": 12,
                "float8_e5m2fnuz": 13, "float8_e8m0fnu": 14}
#: The DLPack versions this producer writes: 1.1 (the float8 codes) and 1.0
VERSION, VERSION_1_0 = (1, 1), (1, 0)
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
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

#: Managed tensors handed out and not yet deleted, by address: (the struct, what it keeps
#: alive, the producer's release function or None).
_alive: dict[int, tuple[Any, Any, Any]] = {}


def _forget(address: int) -> None:
    """The consumer (or the unconsumed capsule) let go of ``address``: release it once."""
    entry = _alive.pop(address, None)
    if entry is not None and entry[2] is not None:
        entry[2]()


# The deleter and the capsule destructor are C functions of the compiled core: they run even
# with an exception pending, which a ctypes callback cannot (_dlpack_release.pyx says why).
_release.set_release(_forget)
_DELETER, _DESTRUCTOR = _release.deleter_address(), _release.destructor_address()


def check_request(stream: Any, max_version: Any, dl_device: Any, copy: Any,
                  device: tuple[int, int], dtype: np.dtype[Any]) -> tuple[int, int] | None:
    """Check the keyword arguments of a ``__dlpack__`` call for memory of ``dtype`` on
    ``device`` (``BufferError`` for a dtype DLPack cannot describe); returns the version of
    the versioned capsule the consumer takes (the highest this producer writes that it asked
    for), or None for a legacy (pre-1.0) capsule."""
    dtype_code(dtype)
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
        return None
    if not isinstance(max_version, tuple) or len(max_version) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in max_version):
        raise TypeError(f"max_version must be a (major, minor) tuple of integers, got "
                        f"{checks.show(max_version)}")
    asked: tuple[int, int] = max_version
    if asked[0] < 1:
        return None
    return VERSION if asked >= VERSION else VERSION_1_0


def dtype_code(dtype: np.dtype[Any]) -> tuple[int, int]:
    """DLPack (type code, bits) of a NumPy or ml_dtypes dtype; ``BufferError`` for one that
    DLPack cannot describe (ml_dtypes' 4- and 6-bit floats and int4, stored a byte each,
    would need the padded sub-byte flag, which consumers do not read yet)."""
    if dtype.name == "bfloat16":
        return _KDL_BFLOAT, 16
    if dtype.name in FLOAT8_CODES:
        return FLOAT8_CODES[dtype.name], 8
    kinds = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "c": _KDL_COMPLEX, "b": _KDL_BOOL}
    if dtype.kind not in kinds:
        raise BufferError(f"dtype {dtype} has no DLPack type code (DLPack 1.1 names bool, "
                          "integers, floats, complex, bfloat16 and the 8-bit floats)")
    return kinds[dtype.kind], dtype.itemsize * 8


def to_capsule(owner: Any, ptr: int, dtype: np.dtype[Any], shape: tuple[int, ...],
               device_type: int, device_id: int, version: tuple[int, int] | None = None,
               release: Any = None) -> Any:
    """A capsule over C-contiguous memory at ``ptr`` that keeps ``owner`` alive: a writable
    ``dltensor_versioned`` of DLPack ``version`` (``check_request``), or a legacy ``dltensor``
    for None. When the consumer (or the unconsumed capsule) lets go, ``release()`` is called
    once. A dtype DLPack cannot describe raises ``BufferError`` before anything is made."""
    code, bits = dtype_code(dtype)
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))()
    step = 1
    for axis in reversed(range(ndim)):
        strides[axis] = step
        step *= shape[axis]
    tensor = _Tensor(
        ptr or None, _Device(device_type, device_id), ndim, _DataType(code, bits, 1),
        ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0,
    )
    if version is not None:
        managed: Any = _ManagedTensorVersioned(_Version(*version), None, _DELETER, 0, tensor)
    else:
        managed = _ManagedTensor(tensor, None, _DELETER)
    address = ctypes.addressof(managed)
    _alive[address] = (managed, (owner, dims, strides), release)
    name = _NAME if version is None else _NAME_VERSIONED
    return _api.PyCapsule_New(address, name, _DESTRUCTOR)
