"""DLPack 1.1's float8 type codes for fp8 arrays: what the capsule says (read back through the
C structs, on the host), that nothing is lost when a consumer refuses it, and a torch round
trip on a GPU (where torch and a GPU are present)."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.memory import dlpack

#: DLDataTypeCode values of dlpack.h (DLPack 1.1), by ml_dtypes' name
DLPACK_1_1 = {"float8_e3m4": 7, "float8_e4m3": 8, "float8_e4m3b11fnuz": 9, "float8_e4m3fn": 10,
              "float8_e4m3fnuz": 11, "float8_e5m2": 12, "float8_e5m2fnuz": 13,
              "float8_e8m0fnu": 14}
FLOAT8 = [name for name in DLPACK_1_1 if hasattr(ml_dtypes, name)]

_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def managed(capsule, versioned):
    """The capsule's DLManagedTensor(Versioned), read through dlpack.h's layout."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    kind = dlpack._ManagedTensorVersioned if versioned else dlpack._ManagedTensor
    return ctypes.cast(_get_pointer(capsule, name), ctypes.POINTER(kind)).contents


def fp8_array(name, rng, shape=(3, 5)):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    return rf.DeviceArray.from_numpy(codes.view(getattr(ml_dtypes, name)), backend="host"), codes


@pytest.mark.parametrize("name", FLOAT8)
@pytest.mark.parametrize("max_version, version", [((1, 1), (1, 1)), ((1, 0), (1, 0)),
                                                  ((2, 3), (1, 1)), (None, None)],
                         ids=["1.1", "1.0", "2.3", "legacy"])
def test_an_fp8_capsule_carries_dlpack_1_1s_code_and_the_bytes_in_place(
        name, max_version, version, rng):
    array, codes = fp8_array(name, rng)
    capsule = array.__dlpack__(max_version=max_version)
    tensor = managed(capsule, version is not None)
    if version is not None:
        assert (tensor.version.major, tensor.version.minor) == version
        tensor = tensor.dl_tensor
    else:
        tensor = tensor.dl_tensor
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (DLPACK_1_1[name], 8, 1)
    assert tensor.data == array.ptr and tensor.ndim == 2
    assert [tensor.shape[i] for i in range(2)] == [3, 5]
    assert [tensor.strides[i] for i in range(2)] == [5, 1]
    seen = np.ctypeslib.as_array((ctypes.c_uint8 * codes.size).from_address(tensor.data))
    np.testing.assert_array_equal(seen.reshape(codes.shape), codes)
    del capsule  # never consumed: the buffer's export ends, so it frees at close
    array.buffer.root.close()
    assert array.buffer.closed


def refused_by_numpy(array):
    """NumPy's own error for a capsule it cannot read (2.4 has no float8: a SystemError)."""
    try:
        np.from_dlpack(array)
    except Exception as exc:  # whatever NumPy raises; the capsule it dropped is released
        return type(exc)
    return None


def test_a_consumer_that_does_not_know_the_codes_refuses_and_nothing_leaks(rng):
    before = rf.memory_stats()["live_buffers"]
    array, _ = fp8_array("float8_e4m3fn", rng)
    assert refused_by_numpy(array) is not None
    array.buffer.root.close()  # the refused capsule's export ended: freed now
    assert array.buffer.closed and rf.memory_stats()["live_buffers"] == before


def test_complex_arrays_go_to_numpy_as_dlpacks_complex(rng):
    data = (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64)
    array = rf.DeviceArray.from_numpy(data, backend="host")
    try:
        seen = np.from_dlpack(array)  # kDLComplex, 64 bits
        np.testing.assert_array_equal(seen, data)
        del seen
    finally:
        array.buffer.root.close()


@pytest.mark.parametrize("name", ["float4_e2m1fn", "float6_e2m3fn", "int4"])
def test_a_dtype_dlpack_cannot_describe_is_refused_before_any_export(name, rng):
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    dtype = np.dtype(getattr(ml_dtypes, name))
    with rf.HipBuffer(16, backend="host") as buf:
        array = rf.DeviceArray(buf, dtype, 16)
        with pytest.raises(BufferError, match=f"dtype {name} has no DLPack type code"):
            array.__dlpack__(max_version=(1, 1))
    assert buf.closed  # no export was left open to defer the free


# --- torch on a GPU ------------------------------------------------------------------------------
TORCH_FLOAT8 = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]


@pytest.mark.parametrize("name", TORCH_FLOAT8)
def test_fp8_round_trip_through_torch_on_the_gpu(gpu, name, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no GPU")
    codes = rng.integers(0, 256, (64, 33), dtype=np.uint8)
    array = rf.DeviceArray.from_numpy(codes.view(getattr(ml_dtypes, name)), backend=gpu)
    try:
        try:
            tensor = torch.from_dlpack(array)
        except (BufferError, RuntimeError) as exc:
            if "Unsupported code" in str(exc) or "not supported" in str(exc):
                pytest.skip(f"torch {torch.__version__} does not read DLPack float8: {exc}")
            raise
        assert tensor.dtype == getattr(torch, name) and tensor.shape == (64, 33)
        assert tensor.data_ptr() == array.ptr  # the same memory, no copy
        np.testing.assert_array_equal(tensor.view(torch.uint8).cpu().numpy(), codes)
        tensor.view(torch.uint8).bitwise_xor_(0x5A)  # written by torch, read back here
        torch.cuda.synchronize()
        np.testing.assert_array_equal(array.to_numpy().view(np.uint8), codes ^ 0x5A)
        del tensor
    finally:
        array.buffer.root.close()
