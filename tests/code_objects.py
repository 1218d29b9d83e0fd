"""The kernels each packaged source must define, and a check that a code object for a target
defines them (read with ``rocmforge_raw.kernels.codeobject``, no tool needed)."""

from __future__ import annotations

from rocmforge_raw.kernels.codeobject import (
    EM_AMDGPU,
    STT_FUNC,
    STT_OBJECT,
    elf_arch,
    elf_machine,
    elf_symbols,
)

#: source stem -> the kernels its code objects must define
KERNELS = {
    "basic": ["rf_fill_f32", "rf_scale_f32", "rf_hold_ns", "rf_read_bytes"],
    "cache_ops": ["rf_reshape_and_cache", "rf_copy_blocks", "rf_copy_pieces",
                  "rf_reshape_and_cache_e4m3_f16",
                  "rf_reshape_and_cache_e4m3_bf16"],
    "paged_attention": [
        f"rf_paged_attention_{dt}_d{d}_g{g}"
        for dt in ("f16", "bf16", "f32", "f16_e4m3", "bf16_e4m3") for d in (64, 128, 256)
        for g in (1, 2, 4, 8)
    ],
}


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
