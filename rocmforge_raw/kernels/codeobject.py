"""What a code object holds, read from its ELF bytes with no tool: the target, the sections,
the symbol table, a symbol's bytes and the notes; for AMD code objects, the wavefront size
each kernel was built for (its kernel descriptor).

Cubins and AMD code objects are 64-bit little-endian ELF files; anything else (PTX text, a
truncated file) raises ``ValueError`` naming what is wrong. Offsets and sizes are in bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

EM_CUDA, EM_AMDGPU = 190, 224
STT_OBJECT, STT_FUNC = 1, 2
SHT_SYMTAB, SHT_NOTE, SHT_NOBITS = 2, 7, 8
#: EF_AMDGPU_MACH_* (the low byte of an AMD code object's e_flags), LLVM's AMDGPUUsage
AMDGPU_MACH = {0x3F: "gfx90a", 0x4C: "gfx942", 0x41: "gfx1100"}
#: An AMD kernel descriptor (``NAME.kd``, code object v3+): 64 bytes; ``kernel_code_properties``
#: is the uint16 at byte 56 and its bit 10 ENABLE_WAVEFRONT_SIZE32 (LLVM's AMDGPUUsage,
#: "Kernel Descriptor").
KERNEL_DESCRIPTOR_BYTES = 64
_CODE_PROPERTIES_AT = 56
_WAVEFRONT_SIZE32 = 1 << 10


@dataclass(frozen=True)
class Section:
    """One section header: ``address`` is where it is mapped, ``offset`` where it lies in
    the file (``kind`` SHT_NOBITS: nowhere); ``link`` and ``entsize`` as ELF defines them
    (a symbol table's string table, and its entry size)."""

    name: str
    kind: int
    address: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Symbol:
    """One symbol: ``value`` is its address, ``section`` the index of its section."""

    name: str
    kind: int
    value: int
    size: int
    section: int


class ElfImage:
    """A 64-bit little-endian ELF image, its header, sections and symbols parsed once."""

    def __init__(self, image: bytes) -> None:
        if image[:4] != b"\x7fELF" or image[4:6] != b"\x02\x01":
            raise ValueError(f"not a 64-bit little-endian ELF image: starts {image[:6]!r}")
        if len(image) < 0x40:
            raise ValueError(f"ELF image of {len(image)} bytes is shorter than its 64-byte header")
        self.image = image
        self.machine: int = struct.unpack_from("<H", image, 0x12)[0]
        self.flags: int = struct.unpack_from("<I", image, 0x30)[0]

    def _unpack(self, fmt: str, at: int, what: str) -> tuple[Any, ...]:
        try:
            return struct.unpack_from(fmt, self.image, at)
        except struct.error:
            raise ValueError(f"{what} at byte {at} overruns the {len(self.image)}-byte "
                             f"image") from None

    @property
    def arch(self) -> str:
        """``sm_90`` (a cubin's e_flags carry the SM number in bits 8-15) or ``gfx90a`` (an
        AMD code object's EF_AMDGPU_MACH)."""
        if self.machine == EM_CUDA:
            return f"sm_{(self.flags >> 8) & 0xFF}"
        if self.machine == EM_AMDGPU:
            mach = self.flags & 0xFF
            return AMDGPU_MACH.get(mach, f"amdgpu mach {mach:#x}")
        raise ValueError(f"ELF machine {self.machine} is neither EM_CUDA nor EM_AMDGPU")

    @cached_property
    def sections(self) -> list[Section]:
        shoff, = self._unpack("<Q", 0x28, "e_shoff")
        shentsize, shnum, shstrndx = self._unpack("<HHH", 0x3A, "section counts")
        raw = [self._unpack("<IIQQQQIIQQ", shoff + i * shentsize, f"section header {i}")
               for i in range(shnum)]
        names = raw[shstrndx][4] if shstrndx < shnum else None
        return [Section(self._string(names, r[0]) if names is not None else "", r[1], r[3],
                        r[4], r[5], r[6], r[9]) for r in raw]

    def _string(self, table_offset: int, at: int) -> str:
        start = table_offset + at
        end = self.image.find(b"\0", start)
        if end < 0:
            raise ValueError(f"string at byte {start} has no terminator")
        return self.image[start:end].decode(errors="replace")

    @cached_property
    def symbols(self) -> dict[str, Symbol]:
        """Every named symbol of every symbol table, by name."""
        sections = self.sections
        found = {}
        for table in sections:
            if table.kind != SHT_SYMTAB:
                continue
            strings = sections[table.link].offset
            for at in range(table.offset, table.offset + table.size, table.entsize or 24):
                name_at, info, _, index, value, size = self._unpack("<IBBHQQ", at, "symbol")
                name = self._string(strings, name_at)
                if name:
                    found[name] = Symbol(name, info & 0xF, value, size, index)
        return found

    def symbol_bytes(self, name: str) -> bytes:
        """The ``size`` bytes of symbol ``name``: its section's contents at its address."""
        symbol = self.symbols.get(name)
        if symbol is None:
            raise KeyError(f"no symbol {name!r} in the image")
        if not 0 < symbol.section < len(self.sections):
            raise ValueError(f"symbol {name!r} is in no section (index {symbol.section})")
        section = self.sections[symbol.section]
        start = symbol.value - section.address
        if section.kind == SHT_NOBITS or start < 0 or start + symbol.size > section.size:
            raise ValueError(f"symbol {name!r} ({symbol.size} bytes at {symbol.value:#x}) lies "
                             f"outside section {section.name} ({section.size} bytes at "
                             f"{section.address:#x})")
        return self.image[section.offset + start:section.offset + start + symbol.size]

    def notes(self) -> list[tuple[str, int, bytes]]:
        """(owner, type, description) of every note in every SHT_NOTE section."""
        found = []
        for section in self.sections:
            if section.kind != SHT_NOTE:
                continue
            at, end = section.offset, section.offset + section.size
            while at + 12 <= end:
                namesz, descsz, kind = self._unpack("<III", at, "note header")
                name_at, desc_at = at + 12, at + 12 + (namesz + 3) // 4 * 4
                owner = self.image[name_at:name_at + namesz].rstrip(b"\0")
                found.append((owner.decode(errors="replace"), kind,
                              self.image[desc_at:desc_at + descsz]))
                at = desc_at + (descsz + 3) // 4 * 4
        return found

    def kernel_wave_sizes(self) -> dict[str, int]:
        """Kernel name -> the wavefront size (32 or 64) its descriptor ``NAME.kd`` states."""
        sizes = {}
        for name, symbol in self.symbols.items():
            if name.endswith(".kd") and symbol.kind == STT_OBJECT:
                descriptor = self.symbol_bytes(name)
                if len(descriptor) != KERNEL_DESCRIPTOR_BYTES:
                    raise ValueError(f"kernel descriptor {name!r} is {len(descriptor)} bytes, "
                                     f"not {KERNEL_DESCRIPTOR_BYTES}")
                properties, = struct.unpack_from("<H", descriptor, _CODE_PROPERTIES_AT)
                sizes[name[:-3]] = 32 if properties & _WAVEFRONT_SIZE32 else 64
        return sizes


def elf_machine(image: bytes) -> int:
    """``e_machine`` of a 64-bit little-endian ELF image; ``ValueError`` for anything else."""
    return ElfImage(image).machine


def elf_arch(image: bytes) -> str:
    """The target an image was built for (``ElfImage.arch``)."""
    return ElfImage(image).arch


def elf_symbols(image: bytes) -> dict[str, int]:
    """Symbol name -> type (``STT_FUNC``, ``STT_OBJECT``, ...) from every symbol table."""
    return {name: symbol.kind for name, symbol in ElfImage(image).symbols.items()}


def symbol_bytes(image: bytes, name: str) -> bytes:
    """The bytes of symbol ``name`` (``ElfImage.symbol_bytes``)."""
    return ElfImage(image).symbol_bytes(name)


def is_amdgpu(image: bytes) -> bool:
    """Whether ``image`` is an ELF image for an AMD GPU (never raises)."""
    try:
        return ElfImage(image).machine == EM_AMDGPU
    except ValueError:
        return False


def wave_size(image: bytes) -> int | None:
    """The wavefront size (32 or 64) the kernels of an AMD code object were built for, read
    from their kernel descriptors; ``None`` for a CUDA image or an AMD one without kernels.
    ``ValueError`` when the kernels disagree (naming one of each size) or the image is not
    ELF."""
    elf = ElfImage(image)
    if elf.machine != EM_AMDGPU:
        return None
    sizes = elf.kernel_wave_sizes()
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        examples = ", ".join(f"{next(k for k, s in sizes.items() if s == size)} (wave{size})"
                             for size in distinct)
        raise ValueError(f"the kernels of this {elf.arch} code object disagree on the "
                         f"wavefront size: {examples}")
    return distinct[0] if distinct else None
