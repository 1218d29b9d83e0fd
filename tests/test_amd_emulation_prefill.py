"""The multi-token kernel's lane logic on the CPU emulation of the AMD target (tests/amd_emu),
wave64 (MFMA, standing for gfx942) and wave32 (WMMA, gfx1100): planned as the hip backend
plans it, against the float64 reference; pieces merged by the combine; 16-bit and fp8 caches
on the matrix units, f32 on the vector units."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from amd_emu.emulator import NATIVE_DIR, Build, compile_all, find_compiler, load
from test_multi_token import random_inputs, tolerance, want
from test_ops import POISON, relative_error

from rocmforge_raw.kernels import planning, reference
from rocmforge_raw.kernels.planning.prefill import (
    WARPS,
    plan_prefill,
    prefill_instance,
    prefill_shape,
    prefill_wm,
)

if find_compiler() is None:
    pytest.skip("no C++ compiler (g++ or clang++) to build the AMD emulation",
                allow_module_level=True)

WAVES = (64, 32)
F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


@pytest.fixture(scope="module")
def libraries():
    builds = [Build(NATIVE_DIR / "prefill.cu", wave) for wave in WAVES]
    compile_all(builds)
    return {build.wave_size: load(build.source, build.wave_size) for build in builds}


def emulate(emulator, wave, q, k, v, tables, lens, q_lens, k_scale=1.0, v_scale=1.0, slots=6,
            seed=0, padding=0, softcap=0.0, sinks=None, window=0):
    """One launch (and its combine) as the hip backend plans it on a device of ``slots``
    resident workgroups, its grids grown by ``padding`` no-op items and combines (as a
    budget graph's are), with a logit cap, sinks and a window where given; returns (output as
    float64, the plan)."""
    dtype, head_dim = q.dtype, q.shape[2]
    num_kv_heads = k.shape[1]
    ratio = q.shape[1] // num_kv_heads
    wm = prefill_wm("hip", dtype, head_dim, int(q_lens.max()) * ratio)
    shape = prefill_shape("hip", dtype, k.dtype, head_dim, wm)
    work = plan_prefill(q_lens, lens, num_kv_heads, ratio, shape.bm, shape.bn, slots)
    name, combine = prefill_instance(dtype, head_dim, k.dtype, wm, capped=softcap > 0)
    partials = np.full(max(work.partial_bytes(shape.bm, head_dim) // 4, 1), np.nan, np.float32)
    out = np.empty_like(q)
    out.view(np.uint8)[...] = POISON
    scale, out_scale = planning.kernel_scales(k.dtype, 1.0 / math.sqrt(head_dim), k_scale,
                                              v_scale)
    threads, p = WARPS * wave, (lambda a: a.ctypes.data)
    i32 = np.int32
    items, combines = work.padded(len(work.items) + padding, len(work.combines) + padding)
    emulator.kernel(name, seed).launch(
        len(items), threads, p(out), p(partials), p(q), p(k), p(v), p(tables), p(lens),
        p(work.q_starts), p(items), np.float32(scale), i32(q.shape[1]), i32(num_kv_heads),
        i32(tables.shape[1]), i32(k.shape[2].bit_length() - 1), np.float32(out_scale),
        np.float32(softcap), 0 if sinks is None else p(sinks), i32(window))
    if len(combines):
        emulator.kernel(combine, seed).launch(
            len(combines), threads, p(out), p(partials), p(items), p(combines),
            p(work.q_starts), i32(q.shape[1]), i32(num_kv_heads), i32(shape.bm),
            0 if sinks is None else p(sinks))
    return out.astype(np.float64), work


#: (dtype, head_dim, ratio, block_size, q_lens, kv_lens): rows past a prefix, chunks,
#: decodes among prefills, 12 query heads a kv head (a tile spans tokens' heads partly).
CASES = [
    (F16, 128, 4, 16, [5, 37, 1], [40, 37, 9]),
    (BF16, 64, 1, 8, [70, 2], [100, 2]),
    (F32, 64, 2, 16, [9, 3], [30, 3]),
    (F16, 256, 2, 32, [20], [50]),
    (F16, 128, 4, 16, [3, 4], [300, 200]),
    (BF16, 128, 12, 16, [2, 1, 3], [20, 5, 7]),
    (F32, 256, 1, 128, [17], [140]),
]


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{c[0].name}-d{c[1]}-r{c[2]}-bs{c[3]}" for c in CASES])
def test_matches_the_reference(libraries, rng, wave, case):
    dtype, head_dim, ratio, block_size, q_lens, kv_lens = CASES[case]
    emulator = libraries[wave]
    before = emulator.matrix_ops
    inputs = random_inputs(rng, dtype, head_dim, block_size, ratio, q_lens, kv_lens)
    got, _ = emulate(emulator, wave, *inputs)
    assert relative_error(got, want(*inputs)) < tolerance(dtype)
    on_matrix = emulator.matrix_ops > before
    assert on_matrix == (dtype != F32), f"matrix units used: {on_matrix}"


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
@pytest.mark.parametrize("seed", [1, 7])
@pytest.mark.parametrize("dtype, head_dim, ratio, q_lens, kv_lens", [
    (F16, 128, 4, [4], [2000]),
    (F32, 128, 1, [5], [700]),
    (BF16, 256, 1, [30], [1000]),
])
def test_pieces_merge_in_any_order(libraries, rng, wave, seed, dtype, head_dim, ratio, q_lens,
                                   kv_lens):
    """Few items over long ranges are cut into pieces; the combine merges them whatever
    order the workgroups ran in (a seeded schedule)."""
    inputs = random_inputs(rng, dtype, head_dim, 16, ratio, q_lens, kv_lens)
    got, work = emulate(libraries[wave], wave, *inputs, seed=seed)
    assert work.num_pieces > 1 and len(work.combines) >= 1
    assert relative_error(got, want(*inputs)) < tolerance(dtype)


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=lambda d: d.name)
def test_fp8_codes_widen_on_the_way_into_lds(libraries, rng, wave, dtype):
    inputs = random_inputs(rng, dtype, 128, 16, 4, [6, 17], [60, 90],
                           cache_dtype=np.dtype(ml_dtypes.float8_e4m3fn))
    got, _ = emulate(libraries[wave], wave, *inputs)
    assert relative_error(got, want(*inputs)) < tolerance(dtype, inputs[1].dtype)


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
def test_padding_items_and_combines_change_nothing(libraries, rng, wave):
    """A budget graph's fixed grids: items and combines of 0 pieces after the real ones
    leave every output as the unpadded launch writes it (pieces and combines included)."""
    inputs = random_inputs(rng, F16, 128, 16, 4, [4, 9], [2000, 30])
    plain, work = emulate(libraries[wave], wave, *inputs)
    assert work.num_pieces > 1, "the case must cut pieces (their combine is padded too)"
    padded, _ = emulate(libraries[wave], wave, *inputs, padding=5)
    np.testing.assert_array_equal(padded, plain)


#: CASES, and long ranges with few rows that the plan cuts into pieces (combined after)
VARIANT_CASES = [*CASES, (F16, 128, 4, 16, [4], [2000]), (F32, 128, 1, 16, [5], [700]),
                 (BF16, 256, 1, 16, [30], [1000])]


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
@pytest.mark.parametrize("case", range(len(VARIANT_CASES)),
                         ids=[f"{c[0].name}-d{c[1]}-r{c[2]}-bs{c[3]}-kv{max(c[5])}"
                              for c in VARIANT_CASES])
def test_softcap_and_sinks_match_the_reference(libraries, rng, wave, case):
    """Gemma 2's logit cap and gpt-oss's sinks on the vector and matrix paths, rows written
    whole and pieces combined (the last three cases: the sinks join in the combine)."""
    dtype, head_dim, ratio, block_size, q_lens, kv_lens = VARIANT_CASES[case]
    q, k, v, tables, lens, q_lens, *_ = random_inputs(rng, dtype, head_dim, block_size, ratio,
                                                      q_lens, kv_lens)
    sinks = rng.uniform(3, 7, q.shape[1]).astype(np.float32)  # (long rows feel them too)
    # gfx11's 16-bit head_dim 256 instance has no register room for the cap (pf_math.h's
    # CAPS; the op refuses capped calls there): sinks only
    cap = None if wave == 32 and head_dim == 256 and dtype != F32 else 1.5
    got, work = emulate(libraries[wave], wave, q, k, v, tables, lens, q_lens,
                        softcap=cap or 0.0, sinks=sinks)
    assert case < len(CASES) or len(work.combines) > 0
    scale = 1.0 / math.sqrt(head_dim)
    expect = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale, np.float64,
                                             logit_softcap=cap, sinks=sinks)
    assert relative_error(got, expect) < tolerance(dtype)
    plain = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale, np.float64)
    assert relative_error(got, plain) > 3 * tolerance(dtype)  # the variants matter here


@pytest.mark.parametrize("wave", WAVES, ids=lambda w: f"wave{w}")
@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("case", range(len(VARIANT_CASES)),
                         ids=[f"{c[0].name}-d{c[1]}-r{c[2]}-bs{c[3]}-kv{max(c[5])}"
                              for c in VARIANT_CASES])
def test_a_window_masks_and_never_reads_what_lies_before_it(libraries, rng, wave, window,
                                                            case):
    """Each row sees its last ``window`` positions: the blocks wholly before the first row's
    window hold NaN (a cache frees them), so reading one, or a weight on one, fails; with
    sinks, and the cap where the instance has one."""
    dtype, head_dim, ratio, block_size, q_lens, kv_lens = VARIANT_CASES[case]
    q, k, v, tables, lens, q_lens, *_ = random_inputs(rng, dtype, head_dim, block_size, ratio,
                                                      q_lens, kv_lens)
    for s in range(len(lens)):
        gone = max(0, int(lens[s]) - int(q_lens[s]) - window + 1) // block_size
        for block in tables[s, :gone].tolist():
            k[block] = np.nan
            v[block] = np.nan
    sinks = rng.uniform(-1, 2, q.shape[1]).astype(np.float32)
    cap = None if wave == 32 and head_dim == 256 and dtype != F32 else 2.5
    got, _ = emulate(libraries[wave], wave, q, k, v, tables, lens, q_lens, softcap=cap or 0.0,
                     sinks=sinks, window=window)
    scale = 1.0 / math.sqrt(head_dim)
    expect = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale, np.float64,
                                             logit_softcap=cap, sinks=sinks, window=window)
    assert relative_error(got, expect) < tolerance(dtype)
