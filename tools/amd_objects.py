#!/usr/bin/env python3
"""The AMD code objects in rocmforge_raw/kernels/ (`make kernels-amd`), kernel by kernel:
registers, spills, scratch and LDS from each object's AMDGPU metadata note, the dynamic LDS
each launch adds, and the occupancy those allow; and a kernel's innermost loop from its
disassembly.

    python tools/amd_objects.py --markdown   # the table docs/kernels.md carries
    python tools/amd_objects.py --json

The metadata note (NT_AMDGPU_METADATA, msgpack) is decoded here, with no tool and no new
dependency; only the disassembly needs llvm-objdump-19 (``RF_OBJDUMP`` names another).
Sizes are bytes; register counts are per lane (VGPRs, AGPRs) or per wave (SGPRs).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rocmforge_raw.kernels import planning
from rocmforge_raw.kernels.codeobject import EM_AMDGPU, ElfImage
from rocmforge_raw.kernels.module import KERNEL_DIR

TARGETS = ("gfx90a", "gfx942", "gfx1100")
STEMS = ("paged_attention", "cache_ops", "basic", "prefill")
NT_AMDGPU_METADATA = 32
OBJDUMP = os.environ.get("RF_OBJDUMP", "llvm-objdump-19")


# --- msgpack (the subset AMDGPU metadata uses: maps, arrays, strings, ints, bools, floats) ---
_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i",
          0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
_SIZED = {0xD9: (">B", str), 0xDA: (">H", str), 0xDB: (">I", str), 0xC4: (">B", bytes),
          0xC5: (">H", bytes), 0xC6: (">I", bytes), 0xDC: (">H", list), 0xDD: (">I", list),
          0xDE: (">H", dict), 0xDF: (">I", dict)}


def unpack_msgpack(data: bytes, at: int = 0) -> tuple[Any, int]:
    """The value encoded at ``data[at:]`` and the offset after it."""
    head = data[at]
    at += 1
    if head <= 0x7F or head >= 0xE0:  # positive and negative fixint
        return head - (0x100 if head >= 0xE0 else 0), at
    if head in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[head], at
    if head in _FIXED:
        return struct.unpack_from(_FIXED[head], data, at)[0], at + struct.calcsize(_FIXED[head])
    if 0x80 <= head <= 0x9F:
        kind, count = (dict if head < 0x90 else list), head & 0x0F
    elif 0xA0 <= head <= 0xBF:
        kind, count = str, head & 0x1F
    elif head in _SIZED:
        fmt, kind = _SIZED[head]
        count = struct.unpack_from(fmt, data, at)[0]
        at += struct.calcsize(fmt)
    else:
        raise ValueError(f"msgpack type byte {head:#x} at {at - 1} is not one AMDGPU uses")
    if kind in (str, bytes):
        raw = data[at:at + count]
        return (raw.decode() if kind is str else bytes(raw)), at + count
    items = []
    for _ in range(count * (2 if kind is dict else 1)):
        item, at = unpack_msgpack(data, at)
        items.append(item)
    return (dict(zip(items[::2], items[1::2])) if kind is dict else items), at


def metadata(image: bytes) -> dict[str, Any]:
    """The AMDGPU metadata map of a code object (``amdhsa.kernels``, ``amdhsa.target``)."""
    elf = ElfImage(image)
    if elf.machine != EM_AMDGPU:
        raise ValueError(f"not an AMD code object (ELF machine {elf.machine})")
    for owner, kind, desc in elf.notes():
        if owner == "AMDGPU" and kind == NT_AMDGPU_METADATA:
            return unpack_msgpack(desc)[0]
    raise ValueError(f"the {elf.arch} code object has no AMDGPU metadata note")


# --- occupancy rules --------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What one CU offers waves of one size. ``sgprs_per_simd`` None: SGPRs never limit."""

    simds: int               # SIMDs of a CU (a workgroup's waves share them)
    max_waves: int           # wave slots per SIMD
    vgprs: int               # VGPRs (+ AGPRs) per SIMD lane
    vgpr_granule: int        # allocation granule of the per-lane count
    sgprs_per_simd: int | None
    lds: int                 # bytes of LDS per CU
    lds_granule: int         # bytes a workgroup's LDS is rounded up to
    max_workgroups: int      # workgroups of 2+ waves per CU (barrier resources)


# Sources (the numbers agree unless said):
# [L] LLVM, llvm/lib/Target/AMDGPU/Utils/AMDGPUBaseInfo.cpp (IsaInfo): getMaxWavesPerEU (8 for
#     the gfx90a family, gfx942 included; 16 for GFX10.3+), getTotalNumVGPRs (512 for the
#     gfx90a family: VGPRs and AGPRs unified; GFX11 with 1.5x VGPRs: 1536 wave32, 768 wave64),
#     getVGPRAllocGranule (8; 1.5x VGPRs: 24 wave32, 12 wave64), getTotalNumSGPRs 800 and
#     getSGPRAllocGranule 16 (GFX8-9), getOccupancyWithNumSGPRs (GFX10+: SGPRs never limit),
#     getEUsPerCU (4; GFX10+ in CU mode 2), getLocalMemorySize (64 KiB, doubled in WGP mode),
#     getMaxWorkGroupsPerCU (16 barriers per CU, 32 per WGP; one-wave workgroups need none).
#     gfx1100 has the 1.5x VGPRs: AMDGPU.td FeatureISAVersion11_0_0 (FeatureGFX11FullVGPRs,
#     D134522, since renamed Feature1_5xVGPRs); gfx1102/gfx1103 do not.
# [H] HIP, ROCm/clr hipamd/src/hip_platform.cpp ihipOccupancyMaxActiveBlocksPerMultiprocessor
#     (what hipModuleOccupancyMaxActiveBlocksPerMultiprocessor answers, and planning's slots):
#     8 waves per SIMD (gfx9) or 16 (gfx10+); VGPR total and granule from comgr's ISA metadata,
#     i.e. [L]'s (rocclr/device/rocm/rocdevice.cpp), halved for wave64 on gfx10+; 800 SGPRs per
#     SIMD in granules of 16 (gfx8-9), none on gfx10+; 4 SIMDs (gfx9), 2 per CU or 4 per WGP
#     (gfx10+). It DISAGREES with [L] and the hardware on LDS: localMemSize / (static +
#     dynamic), no granule, 64 KiB even for a WGP-mode kernel (a WGP has 128 KiB), and it has
#     no barrier cap.
# [D] ROCm docs, ROCm/rocm-docs docs/reference/gpu-specs.rst: MI210/MI250X (gfx90a) and MI300X
#     (gfx942): 64 KiB LDS and a 512 KiB VGPR file per CU (4 SIMDs x 512 x 64 lanes x 4 B);
#     RX 7900 XTX (gfx1100): 128 KiB LDS and a 768 KiB VGPR file, figures per WGP although the
#     table counts CUs (768 KiB = 4 SIMD32 x 1536 x 32 lanes x 4 B).
# [U] LLVM docs, AMDGPUUsage (kernel descriptor, GRANULATED_LDS_SIZE): LDS in 128-dword blocks
#     (512 B) on GFX7 and later; the CDNA3 ISA guide (3.6.5) says the same. DISAGREES: an LLVM
#     change (PR 224852, "GFX10.3, GFX11 and GFX12.0 encode in 512-byte units while allocating
#     1024-byte blocks") gives gfx1100 a 1024 B allocation; 512 B is used here.
# gfx1100 rows are per CU (2 SIMD32, 64 KiB: half a WGP). Its objects are built in WGP mode
# (metadata .workgroup_processor_mode 1), where a WGP holds at least twice a CU's count.
_CDNA = Limits(simds=4, max_waves=8, vgprs=512, vgpr_granule=8, sgprs_per_simd=800,
               lds=65536, lds_granule=512, max_workgroups=16)
LIMITS = {
    ("gfx90a", 64): _CDNA,
    ("gfx942", 64): _CDNA,
    ("gfx1100", 32): Limits(simds=2, max_waves=16, vgprs=1536, vgpr_granule=24,
                            sgprs_per_simd=None, lds=65536, lds_granule=512, max_workgroups=16),
    ("gfx1100", 64): Limits(simds=2, max_waves=16, vgprs=768, vgpr_granule=12,
                            sgprs_per_simd=None, lds=65536, lds_granule=512, max_workgroups=16),
}
_SGPR_GRANULE = 16  # [L] getSGPRAllocGranule, [H]


def _align(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def occupancy(limits: Limits, wave: int, threads: int, vgprs: int, sgprs: int,
              lds: int) -> tuple[int, int, str]:
    """(waves per SIMD the registers allow, workgroups of ``threads`` per CU, what binds the
    latter: ``lds``, ``vgpr``, ``sgpr``, ``waves`` (wave slots) or ``barriers``, joined by
    ``+`` when several do). ``vgprs`` is the allocated per-lane count (VGPRs and AGPRs
    together on gfx90a/gfx942), ``lds`` a workgroup's bytes."""
    by_vgpr = limits.vgprs // _align(max(vgprs, 1), limits.vgpr_granule)
    by_sgpr = (limits.sgprs_per_simd // _align(max(sgprs, 1), _SGPR_GRANULE)
               if limits.sgprs_per_simd else sys.maxsize)
    waves = min(limits.max_waves, by_vgpr, by_sgpr)
    per_group = -(-threads // wave)
    by_waves = limits.simds * waves // per_group
    bounds = {"lds": limits.lds // _align(lds, limits.lds_granule) if lds else sys.maxsize,
              "vgpr": by_waves if by_vgpr == waves else sys.maxsize,
              "sgpr": by_waves if by_sgpr == waves else sys.maxsize,
              "waves": by_waves if limits.max_waves == waves else sys.maxsize,
              "barriers": limits.max_workgroups if per_group > 1 else sys.maxsize}
    groups = min(bounds.values())
    return waves, groups, "+".join(name for name, n in bounds.items() if n == groups)


# --- kernel instances ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """One kernel of one code object, what it uses and the occupancy that allows."""

    object: str
    target: str
    kernel: str
    wave: int
    threads: int            # the block a launch uses: the kernel's max flat workgroup size
    vgprs: int              # architectural VGPRs (rounded up to 4 when AGPRs follow them)
    agprs: int
    vgprs_allocated: int    # the per-lane count allocated: VGPRs + AGPRs on gfx90a/gfx942
    sgprs: int
    vgpr_spills: int        # VGPR (and AGPR) spill stores: to AGPRs or to scratch
    sgpr_spills: int        # SGPR spills (to VGPR lanes, or scratch)
    scratch: int            # private segment bytes per lane
    lds_static: int
    lds_dynamic: int        # what each launch adds (planning.attention_shared_bytes)
    workgroup_processor_mode: bool
    waves_per_simd: int
    workgroups_per_cu: int
    limit: str


def dynamic_lds(kernel: str) -> int:
    """Dynamic LDS a launch of ``kernel`` passes: the attention kernel's pipeline stages for
    its row size (``rf_paged_attention_{f16,bf16,f32}[_e4m3]_d{D}_g{G}``), else 0."""
    match = re.fullmatch(r"rf_paged_attention_(f16|bf16|f32)(_e4m3)?_d(\d+)_g(\d+)", kernel)
    if match is None:
        return 0
    itemsize = 4 if match[1] == "f32" else 2
    return planning.attention_shared_bytes("hip", int(match[3]) * itemsize, int(match[4]),
                                           bool(match[2]), itemsize=itemsize)


def instances(path: Path) -> list[Instance]:
    """Every kernel of the AMD code object at ``path``, in the object's order."""
    image = path.read_bytes()
    target = ElfImage(image).arch
    found = []
    for k in metadata(image)["amdhsa.kernels"]:
        wave, agprs = k[".wavefront_size"], k.get(".agpr_count", 0)
        limits = LIMITS.get((target, wave))
        if limits is None:
            raise ValueError(f"{path.name}: no occupancy rules for {target} wave{wave}")
        lds = k[".group_segment_fixed_size"] + dynamic_lds(k[".name"])
        waves, groups, limit = occupancy(limits, wave, k[".max_flat_workgroup_size"],
                                         k[".vgpr_count"], k[".sgpr_count"], lds)
        found.append(Instance(
            path.name, target, k[".name"], wave, k[".max_flat_workgroup_size"],
            k[".vgpr_count"] - agprs, agprs, k[".vgpr_count"], k[".sgpr_count"],
            k[".vgpr_spill_count"], k[".sgpr_spill_count"], k[".private_segment_fixed_size"],
            k[".group_segment_fixed_size"], dynamic_lds(k[".name"]),
            bool(k.get(".workgroup_processor_mode", 0)), waves, groups, limit))
    return found


def object_paths(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    """The AMD objects of every stem and target that exist in ``kernel_dir``."""
    paths = [kernel_dir / f"{stem}.{target}.hsaco" for stem in STEMS for target in TARGETS]
    return [path for path in paths if path.exists()]


def all_instances(kernel_dir: Path = KERNEL_DIR) -> list[Instance]:
    return [i for path in object_paths(kernel_dir) for i in instances(path)]


def markdown(rows: list[Instance]) -> str:
    """One table row per kernel instance and target."""
    lines = ["| object | kernel | wave | threads | VGPR | AGPR | SGPR | spills v/s | scratch B "
             "| LDS static+dyn B | waves/SIMD | WG/CU | limit |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    lines += [f"| {r.object} | {r.kernel} | {r.wave} | {r.threads} | {r.vgprs} | {r.agprs} "
              f"| {r.sgprs} | {r.vgpr_spills}/{r.sgpr_spills} | {r.scratch} "
              f"| {r.lds_static}+{r.lds_dynamic} | {r.waves_per_simd} | {r.workgroups_per_cu} "
              f"| {r.limit} |" for r in rows]
    return "\n".join(lines)


# --- disassembly ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    """One instruction: its address, mnemonic and operands; ``target`` the address a branch
    goes to (None for others)."""

    address: int
    mnemonic: str
    operands: str
    target: int | None = None

    @property
    def text(self) -> str:
        return f"{self.mnemonic} {self.operands}".rstrip()


_SYMBOL = re.compile(r"^([0-9a-fA-F]+) <([^>]+)>:$")
_LINE = re.compile(r"^\s+(?P<mnemonic>[a-z][a-z0-9_.]*)(?P<operands>[^/]*?)\s*//\s*"
                   r"(?P<address>[0-9A-Fa-f]+):(?P<rest>.*)$")
_BRANCH_TARGET = re.compile(r"<(?P<symbol>[^+>]+)(?:\+0x(?P<offset>[0-9a-fA-F]+))?>")


def disassemble(path: Path, *kernels: str) -> dict[str, list[Instruction]]:
    """Each kernel's instructions, by ``llvm-objdump-19 -d --disassemble-symbols=...`` (one
    run for all). ``FileNotFoundError`` without the tool; ``KeyError`` for a kernel the
    object lacks."""
    command = [OBJDUMP, "-d", "--no-show-raw-insn", f"--disassemble-symbols={','.join(kernels)}",
               str(path)]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found: dict[str, list[Instruction]] = {}
    bases: dict[str, int] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        symbol = _SYMBOL.match(line)
        if symbol:
            bases[symbol[2]] = int(symbol[1], 16)
            current = found.setdefault(symbol[2], [])
            continue
        match = _LINE.match(line)
        if match is None or current is None:
            continue
        target = None
        if match["mnemonic"].startswith(("s_branch", "s_cbranch_")):
            to = _BRANCH_TARGET.search(match["rest"])
            if to is not None and to["symbol"] in bases:
                target = bases[to["symbol"]] + int(to["offset"] or "0", 16)
        current.append(Instruction(int(match["address"], 16), match["mnemonic"],
                                   match["operands"].strip(), target))
    missing = [k for k in kernels if k not in found]
    if missing:
        raise KeyError(f"{path.name} has no kernel {', '.join(missing)}")
    return found


def innermost_loop(code: list[Instruction], patterns: tuple[str, ...]) -> list[Instruction]:
    """The shortest loop (a backward ``s_branch``/``s_cbranch_*`` and the instructions from its
    target to it) holding an instruction matching each of ``patterns`` (regular expressions
    matched at the start of ``Instruction.text``). ``LookupError`` when none does."""
    addresses = [i.address for i in code]
    best: list[Instruction] | None = None
    for end, branch in enumerate(code):
        if branch.target is None or branch.target > branch.address:
            continue
        body = code[bisect.bisect_left(addresses, branch.target):end + 1]
        if (best is None or len(body) < len(best)) and all(
                any(re.match(p, i.text) for i in body) for p in patterns):
            best = body
    if best is None:
        raise LookupError(f"no loop holds instructions matching all of {patterns}")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="the table (default)")
    output.add_argument("--json", action="store_true", help="one JSON list of instances")
    parser.add_argument("--kernels", type=Path, default=KERNEL_DIR, help="the objects' folder")
    args = parser.parse_args(argv)
    rows = all_instances(args.kernels)
    if not rows:
        print(f"no AMD code objects in {args.kernels}: run `make kernels-amd`", file=sys.stderr)
        return 1
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
