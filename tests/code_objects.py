"""What a code object holds, read from its ELF bytes (64-bit little-endian, as cubins and AMD
code objects are): the target and the symbol table, no tool needed; and the kernels each
packaged source must define."""

from __future__ import annotations

import struct

#: source stem -> the kernels its code objects must define
KERNELS = {
    "basic": ["rf_fill_f32", "rf_scale_f32", "rf_hold_ns", "rf_read_bytes"],
    "cache_ops": ["rf_reshape_and_cache", "rf_copy_blocks"],
    "paged_attention": [
        f"rf_paged_attention_{dt}_d{d}_g{g}"
        for dt in ("f16", "bf16", "f32") for d in (64, 128, 256) for g in (1, 2, 4, 8)
    ],
}
EM_CUDA, EM_AMDGPU = 190, 224
STT_OBJECT, STT_FUNC = 1, 2
_SHT_SYMTAB = 2
#: EF_AMDGPU_MACH_* (the low byte of an AMD code object's e_flags)
_AMDGPU_MACH = {0x3F: "gfx90a", 0x4C: "gfx942", 0x41: "gfx1100"}


def elf_machine(image: bytes) -> int:
    """``e_machine`` of a 64-bit little-endian ELF image; ``ValueError`` for anything else."""
    if image[:4] != b"\x7fELF" or image[4:6] != b"\x02\x01":
        raise ValueError(f"not a 64-bit little-endian ELF image: starts {image[:6]!r}")
    return struct.unpack_from("<H", image, 0x12)[0]


def elf_arch(image: bytes) -> str:
    """The target an image was built for: ``sm_90`` (a cubin's e_flags carry the SM number in
    bits 8-15) or ``gfx90a`` (an AMD code object's EF_AMDGPU_MACH)."""
    machine = elf_machine(image)
    flags, = struct.unpack_from("<I", image, 0x30)
    if machine == EM_CUDA:
        return f"sm_{(flags >> 8) & 0xFF}"
    if machine == EM_AMDGPU:
        return _AMDGPU_MACH.get(flags & 0xFF, f"amdgpu mach {flags & 0xFF:#x}")
    raise ValueError(f"ELF machine {machine} is neither EM_CUDA nor EM_AMDGPU")


def elf_symbols(image: bytes) -> dict[str, int]:
    """Symbol name → type (``STT_FUNC``, ``STT_OBJECT``, ...) from every symbol table."""
    elf_machine(image)
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize)
                for i in range(shnum)]
    symbols = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_SYMTAB:
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name_at, info = struct.unpack_from("<IB", image, at)
            end = image.index(b"\0", strings + name_at)
            symbols[image[strings + name_at:end].decode()] = info & 0xF
    return symbols


def check_code_object(image: bytes, stem: str, arch: str) -> None:
    """Assert ``image`` is a code object for ``arch`` defining every kernel of ``stem`` (and,
    for AMD, each kernel's descriptor ``<name>.kd``)."""
    assert elf_arch(image) == arch
    symbols = elf_symbols(image)
    missing = {k for k in KERNELS[stem] if symbols.get(k) != STT_FUNC}
    assert not missing, f"{stem} for {arch} lacks {sorted(missing)}"
    if elf_machine(image) == EM_AMDGPU:
        descriptors = {f"{k}.kd" for k in KERNELS[stem]}
        assert all(symbols.get(d) == STT_OBJECT for d in descriptors), "kernel descriptors"
