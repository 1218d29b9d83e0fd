"""The kernels' lane logic on the CPU emulation of the AMD target (tests/amd_emu), for wave64
and wave32: paged attention (the split-K combine included) against the float64 reference,
the cache writes and block copies against theirs, and the emulator's own diagnoses."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from amd_emu import lds_banks
from amd_emu.emulator import (
    LDS_ACCESS,
    NATIVE_DIR,
    Build,
    EmulationError,
    compile_all,
    find_compiler,
    load,
)
from test_ops import POISON, TOLERANCE, random_kv, random_tables, relative_error

from rocmforge_raw.kernels import ops, planning, reference

if find_compiler() is None:
    pytest.skip("no C++ compiler (g++ or clang++) to build the AMD emulation",
                allow_module_level=True)

WAVES = (64, 32)
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
HEAD_DIMS = (64, 128, 256)
RATIOS = (1, 4, 8)
BLOCK_SIZES = (8, 16, 128)
#: An orthogonal array L9(3^4): any two of (dtype, head_dim, ratio, block_size) meet in every
#: pair of their levels exactly once in these nine rows.
L9 = [(a, b, (a + b) % 3, (a + 2 * b) % 3) for a in range(3) for b in range(3)]
CASES = [(DTYPES[a], HEAD_DIMS[b], RATIOS[c], BLOCK_SIZES[d]) for a, b, c, d in L9]
LONG = 333  # tokens: a few tiles at every tile size, not a multiple of any


def ptr(array: np.ndarray) -> int:
    return array.ctypes.data


@pytest.fixture(scope="session")
def libraries():
    """The kernel libraries for both wave sizes, compiled at most once per session, two at
    a time (their on-disk cache makes a later session load them at once)."""
    builds = [Build(NATIVE_DIR / f"{stem}.cu", wave)
              for stem in ("paged_attention", "cache_ops", "basic") for wave in WAVES]
    compile_all(builds)
    return {(build.source.stem, build.wave_size): load(build.source, build.wave_size)
            for build in builds}


@pytest.fixture(params=WAVES, ids=lambda wave: f"wave{wave}")
def wave(request):
    return request.param


# --- paged attention ---------------------------------------------------------------------
def attention(emulator, rng, dtype, head_dim, block_size, ratio, lens, num_kv_heads=2,
              num_partitions=None, seed=0, slots=7, uniform=False, cache_dtype=None, sms=0,
              softcap=0.0, sinks=None, plain=None, window=0, poison_before=0):
    """One emulated launch planned by ``rocmforge_raw.planning`` as ops.paged_attention plans
    it for the hip backend, on a device of ``slots`` resident workgroups (``uniform``: the
    lengths stay on the device; ``cache_dtype``: an fp8 cache of codes, quantized with
    per-tensor scales; ``sms``: the multiprocessors, which pad a short launch's sequences to
    whole pieces; ``softcap``, ``sinks``: the Gemma 2 / gpt-oss variants, and ``plain``
    gets the reference without them; ``window``: each sequence's last tokens only, and
    ``poison_before``: NaN in the K/V of each sequence's tokens before its last that many):
    (output as float64, float64 reference, counters after)."""
    num_q_heads, num_seqs = num_kv_heads * ratio, len(lens)
    k, v, k_scale, v_scale = random_kv(rng, dtype, lens, num_kv_heads, block_size, head_dim,
                                       cache_dtype)
    q = rng.standard_normal((num_seqs, num_q_heads, head_dim), np.float32).astype(dtype)
    tables = random_tables(rng, lens, block_size, k.shape[0])
    for s, n in enumerate(lens):  # tokens a window leaves out: a read of them gives NaN
        for t in range(max(n - poison_before, 0) if poison_before else 0):
            k[tables[s, t // block_size], :, t % block_size] = np.nan
            v[tables[s, t // block_size], :, t % block_size] = np.nan
    lens = np.asarray(lens, np.int32)
    out = np.empty_like(q)
    out.view(np.uint8)[...] = POISON

    name, group = planning.attention_instance(dtype, head_dim, ratio, cache_dtype,
                                              capped=softcap > 0)
    shared = planning.attention_shared_bytes("hip", head_dim * dtype.itemsize, group,
                                             cache_dtype is not None, itemsize=dtype.itemsize)
    most, seen = tables.shape[1] * block_size, lens  # (plan_attention's window rule)
    if window:
        most, seen = min(most, window + 15), np.where(lens > window,
                                                      lens - ((lens - window) & ~15), lens)
    work = planning.plan_work(num_kv_heads * math.ceil(ratio / group), slots, num_seqs,
                              None if uniform else seen, most, num_partitions, sms)
    if sms:  # padded: each sequence's work is whole pieces, more than its length
        assert (np.diff(work.cum16) % work.per_cta == 0).all() and work.total > sum(lens)
    plan = planning.AttentionPlan(emulator.kernel(name, seed), group, work, shared, num_seqs,
                                  num_q_heads, num_kv_heads, head_dim, block_size,
                                  tables.shape[1])
    partials = np.full(plan.partial_bytes // 4, np.nan, np.float32)
    counters = np.zeros(plan.num_counters, np.int32)
    scale = 1.0 / math.sqrt(head_dim)
    kernel_scale, out_scale = planning.kernel_scales(k.dtype, scale, k_scale, v_scale)
    arrays = [ptr(a) for a in work.arrays] or [0, 0]
    plan.kernel.launch(plan.grid, planning.THREADS, *plan.arguments(
        ptr(out), ptr(q), ptr(k), ptr(v), ptr(tables), ptr(lens), kernel_scale, ptr(partials),
        ptr(counters), *arrays, out_scale, softcap, 0 if sinks is None else ptr(sinks),
        window),
        shared_bytes=plan.shared_bytes)
    want = reference.paged_attention(q, k, v, tables, lens, scale, np.float64, k_scale,
                                     v_scale, logit_softcap=softcap or None, sinks=sinks,
                                     window=window or None)
    if plain is not None:
        plain.append(reference.paged_attention(q, k, v, tables, lens, scale, np.float64,
                                               k_scale, v_scale))
    return out.astype(np.float64), want, counters


@pytest.mark.parametrize("mode", ["balanced", "partitions", "uniform", "padded"])
@pytest.mark.parametrize("row", range(len(CASES)),
                         ids=[f"{d.name}-d{h}-r{r}-bs{b}" for d, h, r, b in CASES])
def test_paged_attention_matches_reference(libraries, wave, rng, row, mode):
    dtype, head_dim, ratio, block_size = CASES[row]
    lens = [0, 1, block_size - 1, block_size + 1, LONG]
    # balanced: one wave of 7 shares, so units split at arbitrary 16-token boundaries;
    # partitions: the longest cut into 3, 5 or 7 pieces; uniform: lengths on the device only;
    # padded: 24 workgroups on 8 multiprocessors, lengths close enough that each sequence is
    # padded to whole pieces (an empty and a short one among them).
    # The split runs with a seeded schedule (workgroups, waves and lanes shuffled), so the
    # piece that combines is not always the last.
    seed = row + 1
    options = {"balanced": {}, "partitions": {"num_partitions": 3 + 2 * (row % 3)},
               "uniform": {"uniform": True, "slots": 5}, "padded": {"slots": 24, "sms": 8}}[mode]
    if mode == "padded":
        lens = [LONG, LONG - 30, LONG - 60, 17, 0]
    emulator = libraries["paged_attention", wave]
    ops_before = emulator.matrix_ops
    got, want, counters = attention(emulator, rng, dtype, head_dim, block_size, ratio, lens,
                                    seed=seed, **options)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert not counters.any(), f"counters left set: {counters}"
    # 16-bit caches with 4+ query heads per kv head run on the matrix cores (MFMA on
    # wave64, WMMA on wave32), the rest on the vector units
    matrix = dtype.itemsize == 2 and ratio >= 4
    assert (emulator.matrix_ops > ops_before) == matrix


@pytest.mark.parametrize("mode", ["balanced", "partitions", "one piece"])
@pytest.mark.parametrize("row", range(len(CASES)),
                         ids=[f"{d.name}-d{h}-r{r}-bs{b}" for d, h, r, b in CASES])
def test_softcap_and_sinks_match_reference(libraries, wave, rng, row, mode):
    """Gemma 2's logit cap (small enough to bend the scores) and gpt-oss's sinks (one
    logit a query head, in the denominator only) on every path: scores on the vector or the
    matrix units, outputs written whole or combined from pieces."""
    dtype, head_dim, ratio, block_size = CASES[row]
    lens = [0, 1, block_size + 1, LONG]
    options = {"balanced": {}, "partitions": {"num_partitions": 3},
               "one piece": {"slots": 64}}[mode]
    sinks = rng.standard_normal(2 * ratio).astype(np.float32) * 2
    got, want, counters = attention(libraries["paged_attention", wave], rng, dtype, head_dim,
                                    block_size, ratio, lens, seed=row + 1, softcap=1.5,
                                    sinks=sinks, plain=(plain := []), **options)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert not counters.any()
    assert relative_error(got, plain[0]) > 5 * TOLERANCE[dtype]  # the variants matter here


@pytest.mark.parametrize("cap", [0.05, 1e3, 1e6, 1e12, 2e38])
@pytest.mark.parametrize("row", [0, 4], ids=lambda r: "-".join(map(str, CASES[r][1:])))
def test_small_and_large_caps_match_the_reference(libraries, wave, rng, cap, row):
    """Caps from one that flattens every score to one tanh leaves as they are (scores a
    millionth of the cap and less: the series, not 1 - 2^(-2x) / ..., where that cancels)."""
    dtype, head_dim, ratio, block_size = CASES[row]
    got, want, _ = attention(libraries["paged_attention", wave], rng, dtype, head_dim,
                             block_size, ratio, [1, 17, LONG], softcap=cap)
    assert relative_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("mode", ["balanced", "partitions", "uniform", "padded"])
@pytest.mark.parametrize("row", range(len(CASES)),
                         ids=[f"{d.name}-d{h}-r{r}-bs{b}" for d, h, r, b in CASES])
def test_a_sliding_window_reads_only_its_tokens(libraries, wave, rng, row, mode):
    """Each sequence attends to its last 37 tokens (300 padded; not a multiple of a block or
    a tile):
    sequences shorter than the window see all, longer ones their tail; the work is planned
    over the window (split, partitioned, uniform and padded), and the tokens before it are
    poisoned in the cache, so a read of them fails the comparison."""
    dtype, head_dim, ratio, block_size = CASES[row]
    window = 37
    lens = [0, 1, window - 1, window + 5, LONG]
    options = {"balanced": {}, "partitions": {"num_partitions": 3},
               "uniform": {"uniform": True, "slots": 5}, "padded": {"slots": 24, "sms": 8}}[mode]
    if mode == "padded":  # lengths close enough, in the window too, to pad to whole pieces
        lens, window = [LONG, LONG - 30, LONG - 60, 17, 0], LONG - 33
    emulator = libraries["paged_attention", wave]
    got, want, counters = attention(emulator, rng, dtype, head_dim, block_size, ratio, lens,
                                    seed=row + 3, window=window, poison_before=window,
                                    **options)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert not counters.any()


@pytest.mark.parametrize("parts", [1, 4])
def test_paged_attention_with_twelve_query_heads_per_kv_head(libraries, wave, rng, parts):
    # G = 8: the second CTA of the kv head serves the remaining four query heads
    got, want, _ = attention(libraries["paged_attention", wave], rng, np.dtype(np.float16), 64,
                             16, 12, [33, 400], num_kv_heads=1, num_partitions=parts)
    assert relative_error(got, want) < TOLERANCE[np.dtype(np.float16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_eight_head_groups_on_their_own_stage_sizes(libraries, wave, rng, dtype, head_dim):
    # wave32's eight-head instances halve the stage (f32 x 256: 4 rows a tile, one a warp,
    # each lane's chunks in two passes), so their copy and tile shapes differ from the rest
    got, want, counters = attention(libraries["paged_attention", wave], rng, dtype, head_dim,
                                    8, 8, [1, 7, 9, 40, LONG], num_kv_heads=1, seed=head_dim)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert not counters.any()


FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz))
FP8_CASES = [(FP8[0], DTYPES[0], 64, 4, 16), (FP8[1], DTYPES[1], 256, 1, 8),
             (FP8[0], DTYPES[1], 128, 8, 128), (FP8[1], DTYPES[0], 128, 2, 32)]


@pytest.mark.parametrize("parts", [None, 3])
@pytest.mark.parametrize("row", range(len(FP8_CASES)),
                         ids=[f"{c.name}-{d.name}-d{h}-r{r}-bs{b}" for c, d, h, r, b in FP8_CASES])
def test_fp8_paged_attention_matches_reference(libraries, wave, rng, row, parts):
    # the codes are widened into the activations' type on their way into the stage; the
    # math is the 16-bit kernels' (matrix cores for 4+ query heads per kv head)
    cache_dtype, dtype, head_dim, ratio, block_size = FP8_CASES[row]
    emulator = libraries["paged_attention", wave]
    ops_before = emulator.matrix_ops
    got, want, counters = attention(emulator, rng, dtype, head_dim, block_size, ratio,
                                    [0, 1, block_size + 1, LONG], seed=row + 1,
                                    num_partitions=parts, cache_dtype=cache_dtype)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert not counters.any()
    assert (emulator.matrix_ops > ops_before) == (ratio >= 4)


@pytest.mark.parametrize("cache_dtype", FP8, ids=lambda d: d.name)
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: d.name)
def test_fp8_writes_quantize_as_ml_dtypes(libraries, wave, rng, cache_dtype, dtype):
    num_blocks, heads, block_size, dim = 4, 2, 8, 64
    shape = (num_blocks, heads, block_size, dim)
    limit = reference.FP8_LIMITS[cache_dtype]
    k = np.full(shape, 0x22, np.uint8).view(cache_dtype)
    v = k.copy()
    key = (rng.standard_normal((6, heads, dim), np.float32) * 60).astype(dtype)
    value = (rng.standard_normal((6, heads, dim), np.float32) * 0.01).astype(dtype)
    key[0, 0, :6] = np.array([0.0, -0.0, limit * 3, -limit * 0.9, 2.0 ** -12, np.nan])
    slots = np.array([17, -1, 3, 30, -1, 8], np.int64)
    want_k, want_v = k.copy(), v.copy()
    reference.reshape_and_cache(key, value, want_k, want_v, slots, 0.5, 0.001)
    emulator = libraries["cache_ops", wave]
    emulator.launch(f"rf_reshape_and_cache_e4m3_{planning.DTYPES[dtype]}", len(slots),
                    planning.WRITE_THREADS, *planning.write_arguments(
                        ptr(k), ptr(v), ptr(key), ptr(value), ptr(slots), heads, block_size,
                        dim * dtype.itemsize, cache_dtype, 0.5, 0.001))
    np.testing.assert_array_equal(k.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(v.view(np.uint8), want_v.view(np.uint8))


# --- LDS bank conflicts ------------------------------------------------------------------------
#: The vector-path instances (VALU: every f32 group; 16-bit and fp8 caches at 1 or 2 query
#: heads a group) as (dtype, fp8 cache dtype or None, query heads per kv head).
VECTOR_PATH = ([(DTYPES[2], None, ratio) for ratio in (1, 2, 4, 8)]
               + [(DTYPES[1], None, ratio) for ratio in (1, 2)]
               + [(DTYPES[0], FP8[0], ratio) for ratio in (1, 2)])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", VECTOR_PATH, ids=lambda c: f"{c[0].name}"
                         f"{'-' + c[1].name if c[1] is not None else ''}-r{c[2]}")
def test_vector_path_lds_accesses_are_conflict_free(libraries, wave, rng, case, head_dim):
    """Every stage write and every K, V and query read of a vector-path instance, as the
    emulated kernel makes them: 16-byte aligned (one ds_read_b128 / ds_write_b128 each) and
    conflict-free in lds_banks' model, for the lanes AMD serves together (lanes 8i..8i+7, and
    on wave64 gfx9's ds_read_b128 sets). One CTA over 128 tokens: whole tiles at every tile
    size, so every lane of a wave makes the same accesses."""
    dtype, cache_dtype, ratio = case
    emulator = libraries["paged_attention", wave]
    with emulator.lds_trace() as trace:
        got, want, _ = attention(emulator, rng, dtype, head_dim, 16, ratio, [128],
                                 num_kv_heads=1, slots=1, cache_dtype=cache_dtype)
    assert relative_error(got, want) < TOLERANCE[dtype]
    counts, conflicts = {False: 0, True: 0}, []
    for access in lds_banks.instructions(trace.records, wave):
        assert access.bytes == 16 and all(a % 16 == 0 for a in access.addresses), access
        counts[access.write] += 1
        sets = lds_banks.CONSECUTIVE
        if wave == 64 and not access.write:
            sets += lds_banks.GFX9_READ_B128
        if (ways := lds_banks.ways(access.addresses, sets)) > 1:
            conflicts.append(f"{'write' if access.write else 'read'} {access.index} of wave "
                             f"{access.wave}: {ways}-way")
    assert counts[False] and counts[True], counts  # the stage was written and read
    assert not conflicts, f"{len(conflicts)} conflicting accesses, e.g. {conflicts[:4]}"


def test_the_bank_model_finds_conflicts():
    lanes = range(64)
    assert lds_banks.ways([16 * lane for lane in lanes], lds_banks.CONSECUTIVE) == 1
    assert lds_banks.ways([0] * 64, lds_banks.CONSECUTIVE) == 1  # one word: shared
    assert lds_banks.ways([128 * lane for lane in lanes], lds_banks.CONSECUTIVE) == 8
    assert lds_banks.ways([32 * lane for lane in lanes], lds_banks.CONSECUTIVE) == 2
    # 16 lanes a row of 16 chunks, rows 16 B apart: fine 8 at a time, but gfx9 pairs lanes
    # 0-3 (row 0, chunks 0-3) with 20-23 (row 1, chunks 4-7), one bank group over
    shifted = [(lane // 16) * 272 + 16 * (lane % 16) for lane in lanes]
    assert lds_banks.ways(shifted, lds_banks.CONSECUTIVE) == 1
    assert lds_banks.ways(shifted, lds_banks.GFX9_READ_B128) == 2
    assert sorted(sum(lds_banks.GFX9_READ_B128, ())) == list(lanes)


def test_instructions_pair_the_lanes_accesses_and_refuse_divergence():
    records = np.zeros(6, LDS_ACCESS)
    records["item"] = [0, 1, 0, 1, 2, 3]
    records["address"] = [0, 16, 32, 48, 0, 0]
    records["bytes"] = 16
    records["write"] = [0, 0, 1, 1, 0, 0]
    found = list(lds_banks.instructions(records[:4], 2))
    assert [(a.index, a.write, a.addresses) for a in found] == [(0, False, (0, 16)),
                                                                (1, True, (32, 48))]
    with pytest.raises(ValueError, match="divergent"):
        list(lds_banks.instructions(records[:5], 2))
    records["write"][5] = 1
    with pytest.raises(ValueError, match="differs in kind"):
        list(lds_banks.instructions(records[4:], 2))


# --- cache writes and copies ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reshape_and_cache_writes_slots_and_skips_minus_one(libraries, wave, rng, dtype):
    num_blocks, heads, block_size, dim = 6, 2, 16, 128
    shape = (num_blocks, heads, block_size, dim)
    k = rng.standard_normal(shape, np.float32).astype(dtype)
    v = rng.standard_normal(shape, np.float32).astype(dtype)
    key = rng.standard_normal((5, heads, dim), np.float32).astype(dtype)
    value = rng.standard_normal((5, heads, dim), np.float32).astype(dtype)
    slots = np.array([17, -1, 3, 95, -1], np.int64)
    want_k, want_v = k.copy(), v.copy()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    emulator = libraries["cache_ops", wave]
    emulator.launch("rf_reshape_and_cache", len(slots), planning.WRITE_THREADS,
                    *planning.write_arguments(ptr(k), ptr(v), ptr(key), ptr(value), ptr(slots),
                                              heads, block_size, dim * dtype.itemsize))
    np.testing.assert_array_equal(k.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(v.view(np.uint8), want_v.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_copy_blocks_copies_exactly_the_listed_blocks(libraries, wave, rng, dtype):
    slab = rng.standard_normal((3, 2, 8, 2, 16, 64), np.float32).astype(dtype)
    pairs = np.array([[1, 4], [2, 7], [1, 5]], np.int64)
    want = slab.copy()
    reference.copy_blocks(want, pairs)
    block_vecs = math.prod(slab.shape[3:]) * dtype.itemsize // 16
    # the arguments ops.copy_blocks passes
    libraries["cache_ops", wave].launch(
        "rf_copy_blocks", (len(pairs), slab.shape[0] * 2), planning.WRITE_THREADS, ptr(slab),
        ptr(pairs), np.int32(slab.shape[2]), np.int64(block_vecs))
    np.testing.assert_array_equal(slab.view(np.uint8), want.view(np.uint8))


def test_copy_pieces_moves_every_piece_ops_cuts(libraries, wave, rng):
    """The pieces ops.copy_spans cuts (long spans, odd vector counts, a single vector) land
    exactly, the rest of the destination untouched."""
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    spans = np.array([[0, 1 << 19, 3 * ops.PIECE_BYTES + 48], [1 << 18, 16, 16],
                      [5 << 16, 64, (1 << 16) - 4096 + 80]], np.int64)
    want = dst.copy()
    for s, d, n in spans.tolist():
        want[d : d + n] = src[s : s + n]
    pieces = ops.cut_pieces(ptr(dst), ptr(src), spans)  # what ops.copy_spans launches over
    assert len(pieces) == 4 + 1 + 1
    libraries["cache_ops", wave].launch("rf_copy_pieces", len(pieces), planning.WRITE_THREADS,
                                        ptr(pieces))
    np.testing.assert_array_equal(dst, want)


def test_basic_kernels_fill_scale_and_hold_by_the_clock(libraries, wave):
    emulator = libraries["basic", wave]
    x, y = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    emulator.launch("rf_fill_f32", 4, 256, ptr(x), np.float32(2.5), 1000)
    emulator.launch("rf_scale_f32", 4, 256, ptr(y), ptr(x), np.float32(3.0), 1000)
    assert (x == 2.5).all() and (y == 7.5).all()
    start = time.perf_counter()
    emulator.launch("rf_hold_ns", 1, 32, 2_000_000)  # s_memrealtime and s_sleep
    assert time.perf_counter() - start >= 0.002


# --- the emulator itself ----------------------------------------------------------------------
PROBES = textwrap.dedent("""\
    #include "compat.h"
    // every lane gets the sum of the lane ids of its wave, and lane 0 the wave size
    RF_KERNEL(128) rf_wave_sums(float* sums, int* warp) {
      sums[rf_tid()] = rf_warp_sum((float)(rf_tid() % RF_WARP));
      if (rf_tid() == 0) *warp = RF_WARP;
    }
    // each lane reads the id its neighbour wrote to shared memory, after a barrier or not
    RF_KERNEL(128) rf_neighbour(int* out, int synced) {
      RF_SHARED int ids[128];
      const int tid = (int)rf_tid();
      ids[tid] = tid;
      if (synced) rf_sync();
      out[tid] = ids[(tid + 1) % 128];
    }
    // lanes 0-15 shuffle, the rest of the wave does not
    RF_KERNEL(64) rf_divergent_shuffle(float* out) {
      float v = (float)rf_tid();
      if (rf_tid() < 16) v = rf_shfl_xor(v, 1);
      out[rf_tid()] = v;
    }
    // work-item 0 of workgroup 2 leaves; the others wait at the barrier for it
    RF_KERNEL(128) rf_early_exit(int* out) {
      if (rf_tid() == 0 && rf_bid_x() == 2) return;
      rf_sync();
      out[rf_tid()] = 1;
    }
    // lanes 0-7 wait at a wave barrier, the rest of the wave at the workgroup's barrier
    RF_KERNEL(64) rf_mixed_barriers() {
      if (rf_tid() < 8) rf_syncwarp(); else rf_sync();
    }
    // work-item 0 writes element n of its dynamic shared memory
    RF_KERNEL(64) rf_overrun(int n) {
      RF_DYNAMIC_SHARED(float, buffer);
      if (rf_tid() == 0) buffer[n] = 1.f;
    }
    // each work-item writes chunk tid and reads chunk tid + 1 through compat.h's LDS helpers
    RF_KERNEL(64) rf_lds_neighbour(unsigned* out) {
      RF_SHARED rf_vec16 chunks[64];
      const int tid = (int)rf_tid();
      rf_lds_store16(&chunks[tid], rf_vec16{(unsigned)tid, 0u, 0u, 0u});
      rf_sync();
      out[rf_bid_x() * 64 + tid] = rf_lds_load16(&chunks[(tid + 1) % 64]).x;
    }
    // waits for a flag that no one sets
    RF_KERNEL(64) rf_wait_forever(const volatile int* flag) {
      while (!*flag) rf_nap();
    }
    """)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The probe kernels for both wave sizes, by wave size."""
    source = tmp_path_factory.mktemp("amd_emu") / "probes.cu"
    source.write_text(PROBES)
    compile_all([Build(source, wave) for wave in WAVES])
    return {wave: load(source, wave) for wave in WAVES}


def test_wave32_and_wave64_builds_differ_in_the_wave_size(probes, wave):
    sums, warp = np.zeros(128, np.float32), np.zeros(1, np.int32)
    probes[wave].launch("rf_wave_sums", 1, 128, ptr(sums), ptr(warp))
    assert warp[0] == wave == probes[wave].wave_size
    np.testing.assert_array_equal(sums, np.full(128, wave * (wave - 1) / 2))


def test_an_lds_trace_records_each_helper_access_in_program_order(probes):
    emulator, out = probes[64], np.zeros(128, np.uint32)
    emulator.launch("rf_lds_neighbour", 2, 64, ptr(out))  # outside a block: not recorded
    with emulator.lds_trace() as trace:
        with pytest.raises(RuntimeError, match="already recording"), emulator.lds_trace():
            pass
        emulator.launch("rf_lds_neighbour", 2, 64, ptr(out))
    np.testing.assert_array_equal(out, np.tile((np.arange(64) + 1) % 64, 2))
    records = trace.records
    assert records.dtype == LDS_ACCESS and len(records) == 2 * 64 * 2
    base = int(records["address"].min())
    for group in (0, 1):
        for item in (0, 1, 63):
            mine = records[(records["group"] == group) & (records["item"] == item)]
            assert mine["write"].tolist() == [1, 0] and mine["bytes"].tolist() == [16, 16]
            assert (mine["address"] - base).tolist() == [16 * item, 16 * ((item + 1) % 64)]
    with emulator.lds_trace() as after:
        pass
    assert after.records.size == 0


def test_a_missing_barrier_reads_poisoned_shared_memory(probes, wave):
    out = np.zeros(128, np.int32)
    # first in a thread of its own: its shared memory is poisoned from the first launch on
    thread = threading.Thread(target=probes[wave].launch,
                              args=("rf_neighbour", 1, 128, ptr(out), np.int32(0)))
    thread.start()
    thread.join()
    assert (out == -1).sum() >= 64, f"unsynchronised reads saw written values: {out}"
    probes[wave].launch("rf_neighbour", 1, 128, ptr(out), np.int32(1))
    np.testing.assert_array_equal(out, (np.arange(128) + 1) % 128)


def test_a_divergent_shuffle_is_diagnosed(probes, wave):
    out = np.zeros(64, np.float32)
    with pytest.raises(EmulationError, match=r"divergent cross-lane operation in "
                       r"rf_divergent_shuffle: workgroup \(0, 0, 0\), wave 0 "
                       r".*lanes 0-15 at ds_bpermute #1 .*exited"):
        probes[wave].launch("rf_divergent_shuffle", 1, 64, ptr(out))


def test_a_lane_leaving_before_a_barrier_is_diagnosed(probes, wave):
    out = np.zeros(128, np.int32)
    with pytest.raises(EmulationError, match=r"deadlock at s_barrier .* in rf_early_exit: "
                       r"workgroup \(2, 0, 0\): lane 0 exited, lanes 1-127 at s_barrier"):
        probes[wave].launch("rf_early_exit", 3, 128, ptr(out))


def test_lanes_at_different_barriers_are_diagnosed(probes, wave):
    with pytest.raises(EmulationError, match=r"deadlock at wave_barrier in rf_mixed_barriers: "
                       r"workgroup \(0, 0, 0\), wave 0 .*lanes 0-7 at wave_barrier .*"
                       r"lanes 8-(31|63) at s_barrier"):
        probes[wave].launch("rf_mixed_barriers", 1, 64)


def test_a_wait_that_never_ends_stops_at_the_time_limit(probes):
    flag = np.zeros(1, np.int32)
    with pytest.raises(EmulationError, match=r"rf_wait_forever: workgroup .* time limit"):
        probes[64].launch("rf_wait_forever", 1, 64, ptr(flag), timeout_s=0.2)


def test_a_fault_names_the_kernel_workgroup_and_lane(probes):
    script = textwrap.dedent(f"""\
        import sys
        import numpy as np
        sys.path.insert(1, "tests")
        from amd_emu.emulator import load
        load({str(probes[64].build.source)!r}, 64).launch("rf_overrun", 1, 64, np.int32(16),
                                                          shared_bytes=64)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert re.search(r"rf_amd_emu: fault at 0x[0-9a-f]+ \(past the end of the launch's dynamic "
                     r"shared memory\) in rf_overrun, workgroup \(0, 0, 0\), lane 0", done.stderr)


def test_launches_are_checked_against_the_kernel(probes):
    emulator = probes[64]
    with pytest.raises(KeyError, match=r"no kernel 'rf_missing' in probes\.cu"):
        emulator.launch("rf_missing", 1, 64)
    out = np.zeros(128, np.int32)
    with pytest.raises(TypeError, match="argument 1 of rf_neighbour is int32, got uint64"):
        emulator.launch("rf_neighbour", 1, 128, ptr(out), 1)
    with pytest.raises(TypeError, match=r"rf_neighbour takes 2 arguments \(pi\), got 1"):
        emulator.launch("rf_neighbour", 1, 128, ptr(out))
    with pytest.raises(EmulationError, match="block of 256 work-items exceeds the kernel's "
                       "bound of 128"):
        emulator.launch("rf_neighbour", 1, 256, ptr(out), np.int32(1))


def test_the_ucontext_fibers_schedule_as_the_assembly_ones(tmp_path):
    source = tmp_path / "probes.cu"
    source.write_text(PROBES)
    emulator = load(source, 32, defines=["RF_EMU_UCONTEXT"])
    sums, warp = np.zeros(128, np.float32), np.zeros(1, np.int32)
    emulator.launch("rf_wave_sums", 1, 128, ptr(sums), ptr(warp))
    np.testing.assert_array_equal(sums, np.full(128, 32 * 31 / 2))
    with pytest.raises(EmulationError, match="divergent cross-lane operation"):
        emulator.launch("rf_divergent_shuffle", 1, 64, ptr(sums))
