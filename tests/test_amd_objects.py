"""The AMD code objects `make kernels-amd` builds, checked from their metadata and disassembly
(tools/amd_objects.py): the stated limits on registers, spills, scratch and occupancy, the
reading itself, and the paged-attention tile loop. No GPU needed; skipped only where the
objects or llvm-objdump-19/llvm-readelf-19 are missing."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rocmforge_raw.kernels import planning
from rocmforge_raw.kernels.codeobject import ElfImage
from rocmforge_raw.kernels.module import KERNEL_DIR
from rocmforge_raw.kernels.planning.prefill import WARPS as PREFILL_WARPS


def _load_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "amd_objects.py"
    spec = importlib.util.spec_from_file_location("amd_objects", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # dataclasses look their module up
    spec.loader.exec_module(tool)
    return tool


amd = _load_tool()

# --- the stated limits --------------------------------------------------------------------
#: Scratch (private segment) bytes per lane: scratch is global memory traffic in the tile
#: loop; everything must live in registers and LDS.
MAX_SCRATCH_BYTES = 0
#: VGPR spill stores. The metadata counts spills of VGPRs and AGPRs in one field, to AGPRs
#: (gfx90a/gfx942, scratch 0) or to scratch, so this also rules out AGPR spills.
MAX_VGPR_SPILLS = 0
# SGPR spills are not limited: they go to VGPR lanes (v_writelane/v_readlane, no memory),
# and any that reached scratch would fail the scratch limit.
#: Paged-attention workgroups resident per CU (static + dynamic LDS, registers): at least two,
#: so one workgroup's loads and barriers overlap another's math.
MIN_ATTENTION_WORKGROUPS_PER_CU = {"gfx90a": 2, "gfx942": 2, "gfx1100": 2}

OBJECTS = amd.object_paths()
OBJECT_IDS = [p.name.removesuffix(".hsaco") for p in OBJECTS]
_NO_OBJECTS = pytest.mark.skip(reason=f"no AMD code objects in {KERNEL_DIR}: `make kernels-amd` "
                                      f"(make test builds them)")


def _each_object(stems=amd.STEMS):
    chosen = [(p, i) for p, i in zip(OBJECTS, OBJECT_IDS) if p.name.split(".")[0] in stems]
    return pytest.mark.parametrize(
        "path", [p for p, _ in chosen] or [pytest.param(None, marks=_NO_OBJECTS)],
        ids=[i for _, i in chosen] or ["none"])


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (make toolchain installs llvm-19)")
    return found


def _violations(path: Path, broken) -> list[str]:
    """``broken(instance)`` (a message, or None) for every kernel of ``path``."""
    return [f"{i.kernel}: {why}" for i in amd.instances(path) if (why := broken(i))]


@pytest.mark.parametrize("field, limit, what", [
    ("scratch", MAX_SCRATCH_BYTES, "B scratch per lane"),
    ("vgpr_spills", MAX_VGPR_SPILLS, "VGPR spills"),
], ids=["no_scratch", "no_vgpr_or_agpr_spills"])
@_each_object()
def test_within_the_memory_limits(path, field, limit, what):
    def over(i):
        return getattr(i, field) > limit and f"{getattr(i, field)} {what}"
    bad = _violations(path, over)
    assert not bad, f"{path.name}: " + "; ".join(bad)


@_each_object(("paged_attention",))
def test_attention_keeps_enough_workgroups_per_cu(path):
    def short(i):
        needed = MIN_ATTENTION_WORKGROUPS_PER_CU[i.target]
        limits = amd.LIMITS[i.target, i.wave]
        fits = limits.lds // needed // limits.lds_granule * limits.lds_granule
        lds = i.lds_static + i.lds_dynamic
        return i.workgroups_per_cu < needed and (
            f"{i.workgroups_per_cu} per CU, needs {needed} (bound by {i.limit}; LDS "
            f"{i.lds_static}+{i.lds_dynamic} B, {max(lds - fits, 0)} B over the {fits} B that "
            f"{needed} fit; {i.vgprs_allocated} VGPRs allow {i.waves_per_simd} waves/SIMD)")
    bad = _violations(path, short)
    assert not bad, f"{path.name}: " + "; ".join(bad)


# --- the reading ------------------------------------------------------------------------------
_YAML_FIELDS = {".name": str, ".vgpr_count": int, ".sgpr_count": int, ".wavefront_size": int,
                ".group_segment_fixed_size": int, ".private_segment_fixed_size": int,
                ".vgpr_spill_count": int, ".sgpr_spill_count": int}


def _readelf_kernels(path: Path) -> list[dict]:
    """Kernel-level fields of ``llvm-readelf-19 --notes`` (its YAML: 4-space keys, a kernel
    starting at ``  - ``)."""
    text = subprocess.run([_tool("llvm-readelf-19"), "--notes", str(path)], capture_output=True,
                          text=True, check=True).stdout
    kernels: list[dict] = []
    for line in text.splitlines():
        if line.startswith("  - ."):  # a kernel's map (amdhsa.version's items are numbers)
            kernels.append({})
        match = re.match(r"^(?:  - |    )(\.[a-z_]+):\s+(\S+)$", line)
        if match and kernels and match[1] in _YAML_FIELDS:
            kernels[-1][match[1]] = _YAML_FIELDS[match[1]](match[2])
    return kernels


@_each_object()
def test_metadata_decodes_as_llvm_readelf_prints_it(path):
    decoded = amd.metadata(path.read_bytes())["amdhsa.kernels"]
    assert [{k: d[k] for k in _YAML_FIELDS} for d in decoded] == _readelf_kernels(path)


@_each_object()
def test_metadata_vgpr_count_is_what_the_descriptor_allocates(path):
    """The descriptor's GRANULATED_WORKITEM_VGPR_COUNT (compute_pgm_rsrc1 bits 0-5, in
    blocks of 8 on gfx90a/gfx942 and wave32, 4 on wave64 gfx11) covers the metadata's count
    exactly; on gfx90a/gfx942 ACCUM_OFFSET (rsrc3 bits 0-5) puts the AGPRs after the VGPRs."""
    elf = ElfImage(path.read_bytes())
    for i in amd.instances(path):
        rsrc3, rsrc1 = struct.unpack_from("<II", elf.symbol_bytes(f"{i.kernel}.kd"), 44)
        granule = 8 if i.target != "gfx1100" or i.wave == 32 else 4
        assert rsrc1 & 0x3F == -(-max(i.vgprs_allocated, 1) // granule) - 1, i.kernel
        if i.agprs:
            assert ((rsrc3 & 0x3F) + 1) * 4 == i.vgprs, i.kernel


@_each_object()
def test_launch_sizes_are_what_planning_and_basic_cu_launch(path):
    expected = {"rf_fill_f32": 256, "rf_scale_f32": 256, "rf_hold_ns": 32, "rf_read_bytes": 256,
                "rf_reshape_and_cache": planning.WRITE_THREADS,
                "rf_reshape_and_cache_e4m3_f16": planning.WRITE_THREADS,
                "rf_reshape_and_cache_e4m3_bf16": planning.WRITE_THREADS,
                "rf_copy_blocks": planning.WRITE_THREADS, "rf_copy_pieces": planning.WRITE_THREADS}
    for i in amd.instances(path):
        if i.kernel.startswith(("rf_prefill_", "rf_matrix_rate")):  # four waves
            assert i.threads == PREFILL_WARPS * i.wave, i.kernel
            continue
        assert i.threads == expected.get(i.kernel, planning.THREADS), i.kernel


@dataclass(frozen=True)
class _Stage:
    """An attention instance's stage as native/paged_attention.cu sizes it: 16 KiB of K and V
    rows of the activations (an fp8 cache's codes are widened into it), half that on wave32
    for groups of 8 heads, each row padded (rf_pa_tile: by 8 bytes on the matrix path, 16-bit
    with 4+ heads a group; by 16 per 8 threads of a row's score, at least 16, on the vector
    path); and its register copy's chunks."""

    bytes: int          # the stage's LDS, padding included
    chunks_per_lane: int  # 16-byte chunks of K (as many of V) each lane loads per tile


def _stage(wave: int, kernel: str) -> _Stage:
    match = re.fullmatch(r"rf_paged_attention_(f16|bf16|f32)(_e4m3)?_d(\d+)_g(\d+)", kernel)
    dtype, fp8, head_dim, group = match[1], match[2], int(match[3]), int(match[4])
    stage = 8192 if wave == 32 and group >= 8 else 16384
    itemsize = 4 if dtype == "f32" else 2
    rows = stage // 2 // (head_dim * itemsize)
    matrix = dtype != "f32" and group >= 4
    pad = 8 if matrix else 16 * max(1, 128 // rows // 8)
    cache_chunks = head_dim * (1 if fp8 else itemsize) // 16  # rf_pa_reg_copy's VPR
    return _Stage(stage + 2 * rows * pad, rows // (128 // wave) * cache_chunks // wave)


@_each_object(("paged_attention",))
def test_each_attention_instance_holds_its_own_stage_in_static_lds(path):
    # launches on hip pass no dynamic LDS, so the stage must be in the kernel's own
    assert planning.attention_shared_bytes("hip", 256, 4, itemsize=2) == 0
    for i in amd.instances(path):
        stage = _stage(i.wave, i.kernel).bytes
        assert i.lds_dynamic == 0 and stage <= i.lds_static <= stage + 9 * 1024, (
            f"{i.kernel}: {i.lds_static} B static LDS for a {stage} B stage")


@pytest.mark.parametrize("key, threads, vgprs, sgprs, lds, expected", [
    (("gfx90a", 64), 128, 128, 96, 0, (4, 8, "vgpr")),          # 512 / 128 = 4 waves x 4 / 2
    (("gfx90a", 64), 128, 129, 96, 0, (3, 6, "vgpr")),          # granule 8: 136 -> 3 waves
    (("gfx90a", 64), 128, 24, 104, 0, (7, 14, "sgpr")),         # 800 / 112 SGPRs
    (("gfx90a", 64), 128, 24, 40, 0, (8, 16, "waves+barriers")),
    (("gfx942", 64), 128, 100, 90, 32769, (4, 1, "lds")),       # 33280 B: one fits 64 KiB
    (("gfx942", 64), 128, 100, 90, 65537, (4, 0, "lds")),
    (("gfx1100", 32), 128, 256, 108, 0, (5, 2, "vgpr")),        # 1536 / 264 (granule 24)
    (("gfx1100", 32), 32, 8, 108, 0, (16, 32, "waves")),        # one-wave groups: no barriers
])
def test_occupancy_rules(key, threads, vgprs, sgprs, lds, expected):
    assert amd.occupancy(amd.LIMITS[key], key[1], threads, vgprs, sgprs, lds) == expected


def test_markdown_has_a_row_per_instance_and_json_the_same_rows(capsys):
    if not OBJECTS:
        pytest.skip(f"no AMD code objects in {KERNEL_DIR}: `make kernels-amd`")
    rows = amd.all_instances()
    table = amd.markdown(rows).splitlines()
    # per target: 60 attention instances (3 dtypes + 2 fp8 x 3 head dims x 4 groups), the 5
    # cache ops (write, two fp8 writes, block and piece copies), basic.cu's 5 and the
    # multi-token kernels: 23 (4 dtypes x head dims 64 and 128 x WM 1 and 4, and 256 at WM 4;
    # f32 at WM 1), each twice (without and with the logit cap), and their 15 combines
    assert len(table) == 2 + len(rows) == 2 + 3 * (60 + 5 + 5 + 2 * 23 + 15)
    first = rows[0]
    assert table[2].startswith(f"| {first.object} | {first.kernel} | {first.wave} | 128 |")
    assert amd.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [amd.asdict(r) for r in rows]


def test_metadata_of_a_cuda_image_is_refused():
    image = bytearray((KERNEL_DIR / "basic.gfx942.hsaco").read_bytes()) if OBJECTS else None
    if image is None:
        pytest.skip(f"no AMD code objects in {KERNEL_DIR}: `make kernels-amd`")
    image[0x12:0x14] = struct.pack("<H", 190)
    with pytest.raises(ValueError, match="not an AMD code object"):
        amd.metadata(bytes(image))


# --- disassembly and loops --------------------------------------------------------------------
#: The paged-attention tile loop: it copies K/V tiles (16-byte global loads, LDS writes: 16
#: bytes on the vector path, two 8-byte halves on the matrix path's 8-byte-padded rows) and
#: reads them back from LDS.
TILE_LOOP = (r"global_load_(dwordx4|b128)", r"ds_(write|store)(2|_2addr)?_b(64|128)",
             r"ds_(read|load)(2|_2addr)?_b(64|128)")
NEXT_TILE_LOAD = r"global_load_(dwordx4|b128)\b"
MATRIX = r"\bv_(mfma|wmma)_"
MATH = r"\bv_(mfma|wmma|(dual_)?(pk_)?fma(c|mk|ak)?_f(16|32)|dual_fmac)"
WAIT_ALL_LOADS = r"s_waitcnt\b.*\bvmcnt\(0\)"


def _on_matrix_cores(kernel: str) -> bool:
    """16-bit activations in groups of 4 or 8 heads run on v_mfma/v_wmma (rf_pa_matrix)."""
    return re.search(r"_(f16|bf16)(_e4m3)?_d\d+_g(4|8)$", kernel) is not None


def _tile_loop(kernel: str, code: list) -> list:
    """The tile loop: the shortest loop holding the copy through LDS and the math, the matrix
    instructions where the instance runs on them. The math pins it down: the compiler may
    rotate the piece loop so that a shorter loop (a piece's end, its records' loads, the next
    piece's first copy) holds the copy's instructions without any tile's math."""
    return amd.innermost_loop(code, (*TILE_LOOP, MATRIX if _on_matrix_cores(kernel) else MATH))


@functools.cache
def _disassembly(path: Path) -> dict:
    _tool(amd.OBJDUMP)
    return amd.disassemble(path, *(i.kernel for i in amd.instances(path)))


def _code(name: str, address: int, target: int | None = None):
    return amd.Instruction(address, name, "", target)


def test_innermost_loop_is_the_shortest_holding_every_pattern():
    code = [_code("s_mov_b32", 0), _code("global_load_dwordx4", 4), _code("ds_write_b128", 8),
            _code("v_fma_f32", 12), _code("s_cbranch_scc1", 16, 8), _code("ds_read_b128", 20),
            _code("s_branch", 24, 4), _code("s_endpgm", 28)]
    assert [i.address for i in amd.innermost_loop(code, ("ds_write",))] == [8, 12, 16]
    assert [i.address for i in amd.innermost_loop(code, ("global_load", "ds_read"))] == \
        [4, 8, 12, 16, 20, 24]
    with pytest.raises(LookupError, match="no loop holds"):
        amd.innermost_loop(code, ("s_endpgm",))


def test_disassembly_names_a_missing_kernel():
    if not OBJECTS:
        pytest.skip(f"no AMD code objects in {KERNEL_DIR}: `make kernels-amd`")
    _tool(amd.OBJDUMP)
    with pytest.raises(KeyError, match="has no kernel rf_nothing"):
        amd.disassemble(KERNEL_DIR / "basic.gfx90a.hsaco", "rf_fill_f32", "rf_nothing")


@_each_object(("paged_attention",))
def test_tile_loop_copies_through_lds(path):
    # _tile_loop raises LookupError where no loop holds the copy together with the math
    for kernel, code in _disassembly(path).items():
        loop = _tile_loop(kernel, code)
        assert loop[-1].target == loop[0].address, kernel
        assert re.match(r"s_(c)?branch", loop[-1].mnemonic), kernel
        assert sum(bool(re.match(NEXT_TILE_LOAD, i.text)) for i in loop) >= 2, kernel


def _first(loop: list, pattern: str) -> int:
    found = [k for k, i in enumerate(loop) if re.search(pattern, i.text)]
    assert found, f"no instruction matches {pattern} in the tile loop"
    return found[0]


@_each_object(("paged_attention",))
def test_tile_loop_loads_the_next_tile_ahead_of_the_matrix_math(path):
    """Every instance's tile loop issues the next tile's 16-byte global loads (the register
    prefetch); 16-bit G >= 4 instances run on v_mfma (gfx90a/gfx942) or v_wmma (gfx1100), and
    nothing between the tile loads and the first matrix instruction waits for them (no
    s_waitcnt vmcnt(0)): the loads are in flight while the tile is multiplied."""
    failures = []
    for kernel, code in _disassembly(path).items():
        loop = _tile_loop(kernel, code)  # a missing loop is a real failure
        loads = [k for k, i in enumerate(loop) if re.match(NEXT_TILE_LOAD, i.text)]
        wave = 32 if "gfx11" in path.name else 64
        if len(loads) < 2 * _stage(wave, kernel).chunks_per_lane:
            failures.append(f"{kernel}: {len(loads)} 16-byte global loads in the tile loop")
            continue
        if not _on_matrix_cores(kernel):
            continue
        try:
            math = _first(loop, MATRIX)
            ahead = [k for k in loads if k < math]
            assert ahead, f"no tile load before the first matrix instruction at {math}"
            waits = [k for k in range(ahead[-1], math) if re.match(WAIT_ALL_LOADS, loop[k].text)]
            assert not waits, (f"s_waitcnt vmcnt(0) at {waits[0]} between the tile load at "
                               f"{ahead[-1]} and the matrix instruction at {math}")
        except AssertionError as exc:
            failures.append(f"{kernel}: {exc}")
    assert not failures, f"{path.name}: " + "; ".join(failures)


@_each_object(("prefill",))
def test_prefill_tiles_run_on_matrix_cores_from_lds(path):
    """The multi-token kernel's tile loop reads K and V from LDS into v_mfma (gfx90a/gfx942)
    or v_wmma (gfx1100) for 16-bit and fp8 caches (f32: FMAs); the combines have no loop."""
    failures = []
    for kernel, code in _disassembly(path).items():
        if "_combine_" in kernel:
            continue
        math = MATH if "_f32_" in kernel else MATRIX
        try:
            loop = amd.innermost_loop(code, (r"ds_(read|load)", math))
        except LookupError as exc:
            failures.append(f"{kernel}: {exc}")
            continue
        if not re.match(r"s_(c)?branch", loop[-1].mnemonic):
            failures.append(f"{kernel}: the loop does not end in a branch")
    assert not failures, f"{path.name}: " + "; ".join(failures)
