"""Code objects read in Python (rocmforge_raw.kernels.codeobject): descriptors, wave sizes, symbol
bytes; the loader refuses an AMD object whose wave size is not the device's, before any
driver call. Runs on the objects `make kernels-amd` builds, with no GPU."""

from __future__ import annotations

import struct

import pytest

from rocmforge_raw.errors import KernelNotAvailableError
from rocmforge_raw.kernels import codeobject, jit, module
from rocmforge_raw.runtime import DeviceProperties
from rocmforge_raw.runtime.host import HostBackend

#: target -> the wavefront size its objects are built for (the Makefile's RF_WAVE_SIZE)
WAVE = {"gfx90a": 64, "gfx942": 64, "gfx1100": 32}


def _object(stem: str, arch: str) -> bytes:
    path = module.KERNEL_DIR / f"{stem}.{arch}.hsaco"
    if not path.exists():
        pytest.skip(f"{path.name} is not built here (`make kernels-amd` builds it)")
    return path.read_bytes()


def _props(arch: str, warp_size: int) -> DeviceProperties:
    return DeviceProperties(backend="hip", index=0, name="a test device", arch=arch,
                            total_bytes=1 << 34, multiprocessors=64, warp_size=warp_size)


def _set_descriptor_bit(image: bytes, kernel: str, wave32: bool) -> bytes:
    """``image`` with kernel's descriptor rewritten to state wave32 (or wave64)."""
    elf = codeobject.ElfImage(image)
    symbol = elf.symbols[f"{kernel}.kd"]
    section = elf.sections[symbol.section]
    at = section.offset + symbol.value - section.address + 56
    properties, = struct.unpack_from("<H", image, at)
    properties = properties | 1 << 10 if wave32 else properties & ~(1 << 10)
    return image[:at] + struct.pack("<H", properties) + image[at + 2:]


@pytest.mark.parametrize("stem", ["basic", "cache_ops", "paged_attention"])
@pytest.mark.parametrize("arch", list(WAVE))
def test_wave_size_is_read_from_the_kernel_descriptors(stem, arch):
    image = _object(stem, arch)
    assert codeobject.wave_size(image) == WAVE[arch]
    assert set(codeobject.ElfImage(image).kernel_wave_sizes().values()) == {WAVE[arch]}


def test_descriptor_bytes_point_at_their_kernel():
    """A descriptor's kernel_code_entry_byte_offset (int64 at byte 16) leads from the
    descriptor's address to its kernel's: the bytes read are the descriptor's."""
    elf = codeobject.ElfImage(_object("cache_ops", "gfx942"))
    for kernel in ("rf_reshape_and_cache", "rf_copy_blocks"):
        descriptor = elf.symbol_bytes(f"{kernel}.kd")
        entry, = struct.unpack_from("<q", descriptor, 16)
        assert len(descriptor) == 64
        assert elf.symbols[f"{kernel}.kd"].value + entry == elf.symbols[kernel].value


def test_kernels_that_disagree_on_the_wave_size_are_an_error():
    image = _set_descriptor_bit(_object("cache_ops", "gfx1100"), "rf_copy_blocks", False)
    with pytest.raises(ValueError, match=r"gfx1100 code object disagree on the wavefront size: "
                                         r"rf_reshape_and_cache \(wave32\), rf_copy_blocks "
                                         r"\(wave64\)"):
        codeobject.wave_size(image)


def test_cuda_images_have_no_wave_size():
    image = bytearray(_object("basic", "gfx942"))
    image[0x12:0x14] = struct.pack("<H", codeobject.EM_CUDA)
    assert codeobject.wave_size(bytes(image)) is None
    assert not codeobject.is_amdgpu(bytes(image))


@pytest.mark.parametrize("image, words", [
    (b"// PTX text", "not a 64-bit little-endian ELF image"),
    (b"\x7fELF\x02\x01", "shorter than its 64-byte header"),
])
def test_what_is_not_an_elf_image_is_named(image, words):
    with pytest.raises(ValueError, match=words):
        codeobject.wave_size(image)
    assert not codeobject.is_amdgpu(image)


def test_truncated_object_names_what_overruns():
    image = _object("basic", "gfx90a")
    with pytest.raises(ValueError, match=r"overruns the 2000-byte image"):
        codeobject.wave_size(image[:2000])


def test_missing_symbol_is_a_key_error():
    with pytest.raises(KeyError, match=r"no symbol 'rf_nothing\.kd'"):
        codeobject.symbol_bytes(_object("basic", "gfx90a"), "rf_nothing.kd")


# --- the loader -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch, device_warp", [("gfx1100", 64), ("gfx942", 32), ("gfx90a", 32)])
def test_wave_size_mismatch_is_refused_naming_both_sizes(arch, device_warp):
    image = _object("paged_attention", arch)
    with pytest.raises(KernelNotAvailableError) as error:
        module.check_wave_size(image, _props(arch, device_warp), f"paged_attention.{arch}.hsaco")
    message = str(error.value)
    assert f"paged_attention.{arch}.hsaco holds wave{WAVE[arch]} kernels" in message
    assert f"runs wave{device_warp}: rebuild it for {arch} with wavefront size {device_warp}" \
        in message and "make kernels-amd" in message


@pytest.mark.parametrize("arch", list(WAVE))
def test_matching_wave_size_passes(arch):
    module.check_wave_size(_object("basic", arch), _props(arch, WAVE[arch]), "basic")


class _FakeHip(HostBackend):
    """A backend named hip whose device is ``arch`` with ``warp_size`` lanes and whose driver
    must not be called to load a module."""

    name = "hip"

    def __init__(self, arch: str, warp_size: int) -> None:
        super().__init__()
        self.arch, self.warp, self.loads = arch, warp_size, 0

    def properties(self, device: int) -> DeviceProperties:
        return _props(self.arch, self.warp)

    def module_load(self, image: bytes, device: int):
        self.loads += 1
        raise AssertionError("the driver was asked to load a refused object")


@pytest.mark.parametrize("arch, device_warp", [("gfx1100", 64), ("gfx942", 32)])
def test_module_refuses_before_the_driver_loads(arch, device_warp):
    backend = _FakeHip(arch, device_warp)
    path = module.KERNEL_DIR / f"basic.{arch}.hsaco"
    _object("basic", arch)
    with pytest.raises(KernelNotAvailableError, match=f"basic.{arch}.hsaco holds wave"):
        module.Module(path, backend=backend)
    with pytest.raises(KernelNotAvailableError, match=r"a [0-9]+-byte image holds wave"):
        module.Module(path.read_bytes(), backend=backend)
    assert backend.loads == 0


def test_prebuilt_load_names_the_mismatch(monkeypatch):
    _object("basic", "gfx1100")
    monkeypatch.setenv("RF_KERNELS", "prebuilt")
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_origins", {})
    backend = _FakeHip("gfx1100", 64)
    with pytest.raises(KernelNotAvailableError,
                       match=r"RF_KERNELS=prebuilt.*basic.gfx1100.hsaco holds wave32 kernels"):
        module.load_kernels("basic", backend=backend)
    assert backend.loads == 0


def test_run_time_compiled_images_are_checked_too(monkeypatch, tmp_path):
    """A compiled image whose wave size is not the device's is refused under its cache
    entry's name (here the prebuilt gfx1100 object stands in for hiprtc's output)."""
    image = _object("basic", "gfx1100")
    compiled = jit.Compiled(image, tmp_path / "basic.gfx1100.0123.bin", False, 0.1, "test")
    monkeypatch.setattr(module, "_compile", lambda backend, stem, arch: compiled)
    monkeypatch.setenv("RF_KERNELS", "jit")
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_origins", {})
    backend = _FakeHip("gfx1100", 64)
    with pytest.raises(KernelNotAvailableError, match=r"basic.gfx1100.0123.bin holds wave32"):
        module.load_kernels("basic", backend=backend)
    assert backend.loads == 0
