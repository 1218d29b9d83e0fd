"""Code objects: argument packing, loading, launching the tiny kernel, packaged objects."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from code_objects import KERNELS, check_code_object
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.errors import DeviceError, KernelNotAvailableError
from rocmforge_raw.kernels import module

TARGETS = {"sm_80": "cubin", "sm_90": "cubin", "gfx90a": "hsaco", "gfx942": "hsaco",
           "gfx1100": "hsaco"}


def _slot(params, index, ctype):
    return ctypes.cast(params.array[index], ctypes.POINTER(ctype))[0]


def test_args_pack_as_addresses_of_typed_values():
    params = module.pack_args((7, -3, 1.5, np.int32(-2), np.float64(0.25), np.uint16(9)))
    assert _slot(params, 0, ctypes.c_uint64) == 7 and _slot(params, 1, ctypes.c_int64) == -3
    assert _slot(params, 2, ctypes.c_float) == 1.5 and _slot(params, 3, ctypes.c_int32) == -2
    assert _slot(params, 4, ctypes.c_double) == 0.25 and _slot(params, 5, ctypes.c_uint16) == 9
    assert all(params.array[i] % 8 == 0 for i in range(6)), "each argument 8-byte aligned"
    again = module.pack_args((8, -4, 2.5, np.int32(5), np.float64(1.0), np.uint16(1)))
    assert again is params and _slot(params, 3, ctypes.c_int32) == 5  # reused per signature


@pytest.mark.parametrize("arg, error", [
    (True, "booleans"), (object(), "cannot pass object"), (1 << 64, "does not fit"),
    (np.complex64(1), "unsupported scalar type complex64"),
])
def test_bad_kernel_arguments_name_the_argument(arg, error):
    with pytest.raises((TypeError, OverflowError), match=error):
        module.pack_args((1, arg))


def test_buffers_pass_as_their_device_address():
    with rf.HipBuffer(64, backend="host") as buf:
        params = module.pack_args((buf.view(16),))
        assert _slot(params, 0, ctypes.c_uint64) == buf.ptr + 16


def test_launch_config_rejects_bad_dimensions():
    with pytest.raises(ValueError, match="grid must be one to three sizes"):
        module.LaunchConfig((0, 1, 1), (1, 1, 1))


def test_host_backend_runs_no_code_objects():
    with pytest.raises(DeviceError, match="runs no code objects"):
        rf.Module(b"\x7fELF", backend="host")


def test_missing_objects_name_the_arch_and_make_command(monkeypatch, tmp_path):
    monkeypatch.setattr(module, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(module, "SOURCE_DIR", tmp_path)
    with pytest.raises(KernelNotAvailableError, match=r"arch host.*make kernels"):
        module.load_kernels("paged_attention", backend="host")


def test_packaged_object_choice_prefers_exact_then_older_minor():
    names = [p.name for p in module.kernel_candidates("basic", "sm_89")]
    assert names[:3] == ["basic.sm_89.cubin", "basic.sm_88.cubin", "basic.sm_87.cubin"]
    assert "basic.sm_80.cubin" in names
    assert [p.name for p in module.kernel_candidates("basic", "gfx942")] == ["basic.gfx942.hsaco"]


def test_tiny_kernels_run_on_gpu(gpu, rng):
    x = rng.standard_normal(100_003).astype(np.float32)
    kernels = rf.load_kernels("basic", backend=gpu)
    with rf.HipBuffer.from_numpy(x, backend=gpu) as src, \
            rf.HipBuffer(x.nbytes, backend=gpu) as dst:
        blocks = (x.size + 255) // 256
        kernels.function("rf_scale_f32")(blocks, 256, dst, src, -2.5, x.size)
        np.testing.assert_array_equal(dst.to_numpy(np.float32), np.float32(-2.5) * x)
        kernels.function("rf_fill_f32")(blocks, 256, dst, 3.25, x.size - 3)
        out = dst.to_numpy(np.float32)
        assert (out[:-3] == 3.25).all()
        np.testing.assert_array_equal(out[-3:], np.float32(-2.5) * x[-3:])


def test_module_load_unload_from_bytes_and_runtime_compile(gpu, tmp_path, monkeypatch, rng):
    arch = gpu.properties(DEVICE).arch
    monkeypatch.setenv("RF_CACHE_DIR", str(tmp_path))
    image = module._compile(gpu, "basic", arch).image
    assert list(tmp_path.rglob("basic.*.bin"))
    with rf.Module(image, backend=gpu) as mod, rf.HipBuffer(4096, backend=gpu) as buf:
        mod.function("rf_fill_f32")(4, 256, buf, 1.5, 1024)
        assert (buf.to_numpy(np.float32) == 1.5).all()
    with pytest.raises(KernelNotAvailableError, match="unloaded"):
        mod.function("rf_fill_f32")


def test_unloading_a_module_forgets_its_shared_memory_opt_ins_on_gpu(gpu):
    """A function of a module loaded after another's unload may get the same address at the
    default limit: its opt-in must be made again, not skipped as already done."""
    if gpu.name != "cuda":
        pytest.skip("an opt-in of the cuda backend")
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    image = module._compile(gpu, "basic", gpu.properties(DEVICE).arch).image
    for _ in range(2):  # the second load's function often takes the first one's address
        with rf.Module(image, backend=gpu) as mod:
            handle = mod.function("rf_fill_f32").handle
            gpu.allow_shared(handle, 64 << 10)
            err, limit = cu.cuFuncGetAttribute(attr, handle)
            assert err == cu.CUresult.CUDA_SUCCESS and limit == 64 << 10
        assert int(handle) not in gpu._shared_raised


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("stem", list(KERNELS))
def test_built_object_holds_every_kernel_symbol(stem, target):
    path = module.KERNEL_DIR / f"{stem}.{target}.{TARGETS[target]}"
    if not path.exists():
        compiler = "nvcc" if target.startswith("sm_") else "clang-19 or hipcc"
        if shutil.which("nvcc" if target.startswith("sm_") else "clang-19") is None:
            pytest.skip(f"{compiler} is not installed here")
        if not any(module.KERNEL_DIR.glob(f"*.{TARGETS[target]}")):  # e.g. a GPU machine
            pytest.skip(f"no {TARGETS[target]} was built here (`make kernels` builds them)")
        pytest.fail(f"{path} was not built: run `make kernels`")
    check_code_object(path.read_bytes(), stem, target)
