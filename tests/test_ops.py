"""Kernels against the float64 NumPy reference, and the ops' input validation."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.kernels import ops, planning, reference
from rocmforge_raw.memory.array import DeviceArray

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
TOLERANCE = {np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 2e-2,
             np.dtype(np.float32): 1e-5}
POISON = 0xFF  # NaN in every float format: unwritten outputs cannot pass


def random_cache(rng, backend, dtype, num_blocks, num_kv_heads, block_size, head_dim):
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = rng.standard_normal(shape, np.float32).astype(dtype)
    v = rng.standard_normal(shape, np.float32).astype(dtype)
    return (k, v, DeviceArray.from_numpy(k, backend=backend),
            DeviceArray.from_numpy(v, backend=backend))


def random_kv(rng, dtype, seq_lens, num_kv_heads, block_size, head_dim, cache_dtype=None):
    """Host K and V caches with room for ``seq_lens`` (and 3 spare blocks): (k, v, k_scale,
    v_scale). With an fp8 ``cache_dtype`` they hold codes, quantized with per-tensor scales
    (the largest magnitude at the format's limit); else values of ``dtype``, scales 1."""
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = rng.standard_normal(shape, np.float32).astype(dtype)
    v = rng.standard_normal(shape, np.float32).astype(dtype)
    if cache_dtype is None:
        return k, v, 1.0, 1.0
    limit = reference.FP8_LIMITS[np.dtype(cache_dtype)]
    k_scale = float(np.abs(k.astype(np.float32)).max()) / limit
    v_scale = float(np.abs(v.astype(np.float32)).max()) / limit
    return (reference.quantize(k, k_scale, cache_dtype),
            reference.quantize(v, v_scale, cache_dtype), k_scale, v_scale)


def random_tables(rng, seq_lens, block_size, num_blocks):
    """Block tables in random, non-contiguous order; block 0 (null) pads."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    ids = rng.permutation(np.arange(1, num_blocks))[: sum(need)]
    tables = np.zeros((len(seq_lens), max(max(need), 1)), np.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[start : start + n]
        start += n
    return tables


def run_attention(backend, rng, dtype, head_dim, block_size, ratio, seq_lens, num_kv_heads=2,
                  num_partitions=None, workspace=None, device_lens=False):
    num_q_heads = num_kv_heads * ratio
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    k, v, dk, dv = random_cache(rng, backend, dtype, num_blocks, num_kv_heads, block_size,
                                head_dim)
    tables = random_tables(rng, seq_lens, block_size, num_blocks)
    lens = np.asarray(seq_lens, np.int32)
    q = rng.standard_normal((len(seq_lens), num_q_heads, head_dim), np.float32).astype(dtype)
    dq = DeviceArray.from_numpy(q, backend=backend)
    out = DeviceArray.empty(q.shape, dtype, backend=backend)
    out.buffer.fill(POISON)
    scale = 1.0 / math.sqrt(head_dim)
    d_lens = DeviceArray.from_numpy(lens, backend=backend) if device_lens else lens
    ops.paged_attention(out, dq, dk, dv, tables, d_lens, num_partitions=num_partitions,
                        workspace=workspace)
    if device_lens:
        d_lens.buffer.close()
    got = out.to_numpy().astype(np.float64)
    want = reference.paged_attention(q, k, v, tables, lens, scale, accum=np.float64)
    for array in (out, dq, dk, dv):
        array.buffer.root.close()
    return got, want


def relative_error(got, want):
    assert not np.isnan(got).any(), "output has NaN (unwritten or invalid)"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# --- GPU correctness over the whole matrix --------------------------------------------------
MATRIX = list(itertools.product(DTYPES, ops.HEAD_DIMS, ops.BLOCK_SIZES, (1, 4, 8)))


@pytest.mark.parametrize("dtype, head_dim, block_size, ratio", MATRIX,
                         ids=lambda p: getattr(p, "__name__", str(p)))
def test_paged_attention_matches_reference_on_gpu(gpu, rng, dtype, head_dim, block_size, ratio):
    lens = [1, block_size - 1, block_size, block_size + 1, 1000, 17_000]
    got, want = run_attention(gpu, rng, dtype, head_dim, block_size, ratio, lens)
    assert relative_error(got, want) < TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("parts", [1, 3, 64])
def test_split_k_agrees_with_one_partition_on_gpu(gpu, rng, parts):
    got, want = run_attention(gpu, rng, np.float32, 128, 16, 4, [5, 700, 3000],
                              num_partitions=parts)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("parts, lens", [
    (None, [0, 3, 700, 2500]),  # a padded split: each sequence's work up to whole pieces
    (5, [0, 3, 700, 2500]),
    (None, [64] + [1, 33, 50] * 341),  # 2048 units: one CTA a unit
])
def test_lengths_on_the_device_split_every_sequence_as_the_longest_on_gpu(gpu, rng, parts,
                                                                          lens):
    got, want = run_attention(gpu, rng, np.float16, 128, 16, 4, lens, num_partitions=parts,
                              device_lens=True)
    assert relative_error(got, want) < 1e-2


def test_a_reused_workspace_grows_keeps_its_counters_zero_and_is_freed_by_close(gpu, rng):
    workspace = ops.Workspace()
    # (partitions, seq_lens, kv heads): the counters in use change shape from call to call
    calls = ((2, [900, 2000], 2), (40, [900, 2000, 50, 3000], 1), (3, [900], 4),
             (40, [2000, 700], 2))
    for parts, lens, kv_heads in calls:
        got, want = run_attention(gpu, rng, np.float16, 64, 16, 8, lens, num_kv_heads=kv_heads,
                                  num_partitions=parts, workspace=workspace)
        assert relative_error(got, want) < 1e-2
        counters = workspace._counters.to_numpy(np.int32)
        assert not counters.any(), f"counters left set after {parts} partitions: {counters}"
    split = ops.plan_work(1, 1, 4, np.array([900, 2000, 50, 3000], np.int32),
                          num_partitions=40)
    # records of 64 + 4 floats (16-byte aligned), two slots per CTA, 8 query heads a group
    assert workspace._partials.nbytes >= 2 * split.num_ctas * 8 * (64 + 4) * 4
    workspace.close()
    assert workspace._partials is None and workspace._counters is None


def test_mixed_group_sizes_beyond_eight_on_gpu(gpu, rng):
    got, want = run_attention(gpu, rng, np.float16, 64, 16, 12, [33, 400], num_kv_heads=1)
    assert relative_error(got, want) < 1e-2


# --- narrow instances (cuda: head_dim 64 of a 16-bit cache, fewer than 8 heads) -------------
@pytest.mark.parametrize("ratio", [2, 3])
def test_narrow_groups_of_two_and_three_heads_match_reference_on_gpu(gpu, rng, ratio):
    # ratios 1, 4 and 8 are in MATRIX; 3 leaves one of a group's four heads unused
    got, want = run_attention(gpu, rng, ml_dtypes.bfloat16, 64, 16, ratio,
                              [0, 1, 63, 64, 65, 3000])
    assert relative_error(got, want) < TOLERANCE[np.dtype(ml_dtypes.bfloat16)]


def test_narrow_instances_plan_half_stages():
    def shared(row_bytes, group, fp8=False):
        return ops.attention_shared_bytes("cuda", row_bytes, group, fp8, itemsize=2) - (
            planning.STAGE_ALIGN)
    narrow = planning.NARROW_ROW_BYTES
    for group in (1, 2, 4):
        assert 2 * shared(narrow, group) == shared(narrow, 8)
        assert shared(2 * narrow, group) == shared(2 * narrow, 8)
        assert shared(narrow, group, True) == shared(narrow, 8, True)


def test_fp8_instances_plan_two_stages_of_codes_at_most_128_tokens_each():
    # rf_pa_stage: an fp8 cache's stages hold its codes (rows of head_dim bytes, unpadded up
    # to 128 dims, else padded by 16: rf_pa_tile)
    pad = planning.ATTENTION_STAGES["cuda"][2]
    for head_dim, tokens, row in ((64, 128, 64), (128, 128, 128), (256, 64, 256 + pad)):
        want = 2 * tokens * 2 * row
        for group in ops.GROUP_SIZES:
            got = ops.attention_shared_bytes("cuda", 2 * head_dim, group, True, itemsize=2)
            assert got == want + planning.STAGE_ALIGN
    assert ops.attention_shared_bytes("hip", 256, 4, True, itemsize=2) == 0  # static LDS


def test_16_bit_rows_are_unpadded_in_the_stages_and_f32_rows_padded():
    # rf_pa_tile: 16-bit rows are swizzled, unpadded; f32 rows (CUDA cores) padded by 16
    # bytes; every cuda launch passes STAGE_ALIGN bytes more, to align its stages
    stages, stage_bytes, pad = planning.ATTENTION_STAGES["cuda"]
    for head_dim in ops.HEAD_DIMS:
        got = ops.attention_shared_bytes("cuda", 2 * head_dim, 8, itemsize=2)
        assert got == stages * stage_bytes + planning.STAGE_ALIGN
        rows = stage_bytes // 2 // (4 * head_dim)
        got = ops.attention_shared_bytes("cuda", 4 * head_dim, 8, itemsize=4)
        assert got == stages * (stage_bytes + 2 * rows * pad) + planning.STAGE_ALIGN


def test_each_cuda_attention_instance_fits_the_ctas_its_registers_are_fitted_to(gpu):
    if gpu.name != "cuda" or gpu.cached_properties(DEVICE).arch != "sm_90":
        pytest.skip("the CTAs per SM rf_pa_stage fits on sm_90's 228 KiB of shared memory")
    sms = gpu.cached_properties(DEVICE).multiprocessors
    fp8 = ml_dtypes.float8_e4m3fn
    for dtype, head_dim, group, cache in itertools.product(
            DTYPES, ops.HEAD_DIMS, ops.GROUP_SIZES, (None, fp8)):
        if cache is not None and dtype is np.float32:
            continue  # fp8 caches serve 16-bit activations only
        found = planning.attention_kernel(gpu, DEVICE, np.dtype(dtype), head_dim, group,
                                          None if cache is None else np.dtype(cache))
        narrow = (cache is None and head_dim * np.dtype(dtype).itemsize ==
                  planning.NARROW_ROW_BYTES and group < ops.GROUP_SIZES[-1])
        ctas = found.slots // sms
        assert ctas >= (4 if narrow else 3), (dtype, head_dim, group, cache, ctas)


def test_paged_attention_on_host_matches_float64_reference(rng):
    got, want = run_attention(rf.get_backend("host"), rng, np.float32, 64, 8, 4, [1, 7, 8, 9, 300])
    assert relative_error(got, want) < 1e-5


def test_zero_length_sequence_gives_zeros(backend, rng):
    got, _ = run_attention(backend, rng, np.float32, 64, 16, 1, [0, 20])
    assert (got[0] == 0).all()


# --- writes and copies ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reshape_and_cache_writes_slots_and_skips_minus_one(backend, rng, dtype):
    num_blocks, heads, block_size, dim = 6, 2, 16, 64
    k, v, dk, dv = random_cache(rng, backend, dtype, num_blocks, heads, block_size, dim)
    key = rng.standard_normal((5, heads, dim), np.float32).astype(dtype)
    value = rng.standard_normal((5, heads, dim), np.float32).astype(dtype)
    slots = np.array([17, -1, 3, 95, -1], np.int64)
    ops.reshape_and_cache(DeviceArray.from_numpy(key, backend=backend),
                          DeviceArray.from_numpy(value, backend=backend), dk, dv, slots)
    want_k, want_v = k.copy(), v.copy()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    np.testing.assert_array_equal(dk.to_numpy(), want_k)
    np.testing.assert_array_equal(dv.to_numpy(), want_v)
    assert (want_k[1, :, 1] == key[0]).all() and (want_v[5, :, 15] == value[3]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_copy_blocks_copies_exactly_the_listed_blocks(backend, rng, dtype):
    shape = (3, 2, 8, 2, 16, 64)
    slab = rng.standard_normal(shape, np.float32).astype(dtype)
    device = DeviceArray.from_numpy(slab, backend=backend)
    pairs = np.array([[1, 4], [2, 7], [1, 5]], np.int64)
    ops.copy_blocks(device, pairs)
    want = slab.copy()
    want[:, :, [4, 7, 5]] = slab[:, :, [1, 2, 1]]
    np.testing.assert_array_equal(device.to_numpy(), want)


def test_write_then_attend_round_trip(backend, rng):
    dtype, heads, dim, block_size, num_blocks = np.float16, 2, 128, 16, 10
    _, _, dk, dv = random_cache(rng, backend, dtype, num_blocks, heads, block_size, dim)
    tokens = 40
    key = rng.standard_normal((tokens, heads, dim), np.float32).astype(dtype)
    value = rng.standard_normal((tokens, heads, dim), np.float32).astype(dtype)
    blocks = np.array([7, 2, 9], np.int32)
    slots = (blocks[np.arange(tokens) // block_size].astype(np.int64) * block_size
             + np.arange(tokens) % block_size)
    ops.reshape_and_cache(DeviceArray.from_numpy(key, backend=backend),
                          DeviceArray.from_numpy(value, backend=backend), dk, dv, slots)
    q = rng.standard_normal((1, heads * 4, dim), np.float32).astype(dtype)
    out = DeviceArray.empty(q.shape, dtype, backend=backend)
    ops.paged_attention(out, DeviceArray.from_numpy(q, backend=backend), dk, dv,
                        blocks[None, :], np.array([tokens], np.int32))
    # direct attention over the written K/V, no paging involved
    qf = q[0].astype(np.float64).reshape(heads, 4, dim)
    scores = np.einsum("hgd,thd->hgt", qf, key.astype(np.float64)) / math.sqrt(dim)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("hgt,thd->hgd", weights, value.astype(np.float64)).reshape(1, -1, dim)
    assert relative_error(out.to_numpy().astype(np.float64), want) < 1e-2


# --- validation -----------------------------------------------------------------------------
def _attention_inputs(backend, dtype=np.float32, head_dim=64, block_size=16, q_heads=4):
    q = DeviceArray.empty((2, q_heads, head_dim), dtype, backend=backend)
    out = DeviceArray.empty((2, q_heads, head_dim), dtype, backend=backend)
    k = DeviceArray.empty((5, 2, block_size, head_dim), dtype, backend=backend)
    v = DeviceArray.empty((5, 2, block_size, head_dim), dtype, backend=backend)
    return out, q, k, v


@pytest.mark.parametrize("change, words", [
    (dict(dtype=np.float64), "dtype float64 is not supported"),
    (dict(head_dim=96), "head_dim 96 is not supported"),
    (dict(block_size=24), "block_size 24 is not supported"),
    (dict(q_heads=3), "num_q_heads 3 is not a multiple of num_kv_heads 2"),
])
def test_unsupported_shapes_raise_before_launch(backend, change, words):
    out, q, k, v = _attention_inputs(backend, **change)
    with pytest.raises(ValueError, match=words):
        ops.paged_attention(out, q, k, v, np.ones((2, 1), np.int32), np.ones(2, np.int32))


@pytest.mark.parametrize("tables, lens, words", [
    (np.ones((2, 2), np.int32), np.array([5, 33], np.int32),
     r"seq_lens\[1\] = 33 tokens exceeds the block table's 2 blocks x 16 = 32 tokens"),
    (np.array([[1, 5], [2, 3]], np.int32), np.array([20, 3], np.int32),
     r"block id 5 in block_tables is outside \[0, 5\)"),
    (np.ones((2, 2), np.int64), np.array([1, 1], np.int32), "block_tables must be int32"),
    (np.ones((2, 2), np.int32), np.array([1, 1, 1], np.int32), r"seq_lens must have shape \(2,\)"),
    (np.ones((2, 2), np.int32), np.array([-1, 1], np.int32), "seq_lens must be >= 0"),
    (np.ones((2, 1), np.int32), np.array([1, (1 << 30) + 1], np.int32),
     r"seq_lens\[1\] = 1073741825 tokens exceeds the kernel's 1073741824 a sequence"),
])
def test_bad_metadata_raises_before_launch(backend, tables, lens, words):
    out, q, k, v = _attention_inputs(backend)
    with pytest.raises(ValueError, match=words):
        ops.paged_attention(out, q, k, v, tables, lens)


def test_mismatched_dtypes_raise(backend):
    out, q, k, v = _attention_inputs(backend)
    k16 = DeviceArray.empty(k.shape, np.float16, backend=backend)
    with pytest.raises(ValueError, match="k_cache must be float32, got float16"):
        ops.paged_attention(out, q, k16, v, np.ones((2, 1), np.int32), np.ones(2, np.int32))
    with pytest.raises(TypeError, match="query must be a DeviceArray"):
        ops.paged_attention(out, np.zeros(q.shape, np.float32), k, v, np.ones((2, 1), np.int32),
                            np.ones(2, np.int32))


def test_bad_slots_and_pairs_raise(backend):
    _, _, k, v = _attention_inputs(backend)
    key = DeviceArray.empty((2, 2, 64), np.float32, backend=backend)
    with pytest.raises(ValueError, match=r"slot 80 is outside \[-1, 80\)"):
        ops.reshape_and_cache(key, key, k, v, np.array([0, 80], np.int64))
    with pytest.raises(ValueError, match="slot_mapping writes slot 3 twice"):
        ops.reshape_and_cache(key, key, k, v, np.array([3, 3], np.int64))
    slab = DeviceArray.empty((1, 2, 4, 2, 16, 64), np.float32, backend=backend)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        ops.copy_blocks(slab, np.array([[1, 4]], np.int64))
    with pytest.raises(ValueError, match="distinct and not sources"):
        ops.copy_blocks(slab, np.array([[1, 2], [2, 3]], np.int64))


def walk(split, lens):
    """What each CTA of ``split`` computes, as the kernel's walker does (the spec in Python):
    {cta: [(seq, group, start, end), ...]} with token ranges clipped to the real lengths."""
    groups, pieces = split.groups, {}
    len16 = (np.full(len(lens), split.uniform16) if split.cum16 is None
             else np.diff(split.cum16))
    unit_starts = np.concatenate([[0], np.cumsum(np.repeat(len16, groups))])
    for cta in range(split.num_ctas):
        p0 = cta * split.per_cta
        p1 = min(p0 + split.per_cta, split.total)
        for u in range(len(unit_starts) - 1):
            u0, u1 = unit_starts[u], unit_starts[u + 1]
            if u1 <= p0 or u0 >= p1:
                continue
            s = u // groups
            end = min(int(min(u1, p1) - u0), int(lens[s]))
            start = min(int(max(p0, u0) - u0), end)
            pieces.setdefault(cta, []).append((s, u % groups, start, end))
    return pieces


@pytest.mark.parametrize("lens, groups, slots", [
    ([4096] * 64, 8, 396), ([32768], 8, 396), ([512] * 256, 8, 396), ([0, 5, 17, 0], 3, 100),
    ([1, 8000, 3, 900, 2047], 2, 7), ([0], 1, 396)])
def test_the_work_split_covers_every_token_once_in_one_balanced_wave(lens, groups, slots):
    lens = np.asarray(lens, np.int32)
    split = ops.plan_work(groups, slots, len(lens), lens)
    assert split.num_ctas <= slots and split.per_cta % 16 == 0
    assert split.per_cta >= planning.MIN_TOKENS_PER_CTA
    assert split.total == sum(max(16, -(-n // 16) * 16) for n in lens) * groups
    pieces = walk(split, lens)
    covered = {}
    for _cta, items in pieces.items():
        for s, x, start, end in items:
            covered.setdefault((s, x), []).append((start, end))
    for s, n in enumerate(lens):  # every unit, empty ones too, in order and exactly once
        for x in range(groups):
            ranges = covered[s, x]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # the kernel finds each CTA's first sequence in first_seq
    assert [items[0][0] for _, items in sorted(pieces.items())] == split.first_seq.tolist()


def test_a_balanced_split_gives_every_cta_but_the_last_the_same_work():
    lens = np.random.default_rng(3).integers(1, 8193, 64).astype(np.int32)
    split = ops.plan_work(8, 396, 64, lens)
    assert split.num_ctas in (395, 396)  # one wave
    assert split.total - (split.num_ctas - 1) * split.per_cta <= split.per_cta


def test_without_lengths_every_sequence_counts_the_tables_width():
    split = ops.plan_work(4, 396, 10, None, max_len=1000)
    assert split.cum16 is None and split.first_seq is None and split.arrays == []
    assert split.uniform16 == 1008 and split.total == 10 * 4 * 1008


def test_num_partitions_cuts_the_longest_sequence_into_that_many_pieces():
    lens = np.array([3000, 700, 5], np.int32)
    split = ops.plan_work(2, 396, 3, lens, num_partitions=3)
    assert split.per_cta == 1008  # ceil(3008 / 3) rounded up to 16
    pieces = walk(split, lens)
    longest = [p for items in pieces.values() for p in items if p[:2] == (0, 0)]
    assert 3 <= len(longest) <= 4  # 3 pieces, one more where a boundary falls inside


@pytest.mark.parametrize("lens, groups, per_cta", [
    ([32768], 8, 1024), ([4096] * 8, 8, 1024), ([8192], 8, 256), ([16400], 8, 400),
    ([512] * 64, 8, 1024), ([16384] * 2, 8, 1024)])
def test_a_short_launch_of_equal_units_cuts_only_at_unit_boundaries(lens, groups, per_cta):
    lens = np.asarray(lens, np.int32)
    unit = _ceil16(int(lens[0]))
    balanced = _ceil16(-(-unit * len(lens) * groups // 396))
    assert planning.MIN_TOKENS_PER_CTA < balanced < planning.ALIGNED_SHARE_TOKENS
    for split in (ops.plan_work(groups, 396, len(lens), lens),
                  ops.plan_work(groups, 396, len(lens), None, max_len=int(lens[0]))):
        assert split.per_cta == per_cta
        assert balanced <= per_cta <= planning.ALIGNED_STRETCH * balanced
        assert unit % per_cta == 0 or per_cta % unit == 0
    pieces = walk(split := ops.plan_work(groups, 396, len(lens), lens), lens)
    assert len(pieces) == split.num_ctas <= 396
    for items in pieces.values():  # a piece of one unit, or whole units
        assert len(items) == 1 or all(end - start == lens[s] for s, _, start, end in items)


@pytest.mark.parametrize("lens, groups", [
    ([8192, 4096, 5000], 8),  # lengths differ
    ([16336], 8),             # 1021 granules (a prime): no divisor near the balanced share
    ([4096] * 14, 8),         # a share of 1168 tokens: not short
    ([160] * 20, 8),          # a share of 80 tokens, which divides the units' 160
    ([512] * 29, 8),          # a share of 304: one unit (512) is 1.68 times it
    ([1200], 8)])             # a share of MIN_TOKENS_PER_CTA (80 would divide 1200)
def test_other_launches_keep_the_balanced_share(lens, groups):
    lens = np.asarray(lens, np.int32)
    split = ops.plan_work(groups, 396, len(lens), lens)
    balanced = max(planning.MIN_TOKENS_PER_CTA, -(-split.total // 396))
    assert split.per_cta == _ceil16(balanced)


def _ceil16(tokens: int) -> int:
    return -(-tokens // 16) * 16


@pytest.mark.parametrize("lens, groups, per_cta, num_ctas", [
    ([976] * 8, 8, 256, 256),         # the balanced 160 cut each unit 7 times, the last short
    ([1104] * 8, 8, 192, 384),        # 1104 = 6 x 192 - 48: six pieces, the last shorter
    ([12000], 8, 384, 256),           # 368 would take as many tiles in 33 pieces, not 32
    ([5000] * 4, 8, 640, 256),
    ([100, 3000, 777], 8, 128, 256),  # lengths that differ are padded each to the share
    ([1024] * 8, 8, 256, 256)])       # a share that divides the units: no padding
def test_a_short_launch_pads_each_sequence_to_whole_pieces(lens, groups, per_cta, num_ctas):
    """With the device's multiprocessors known (132, three CTAs each), a short launch pads
    each sequence's work up to whole shares (chosen as docs/kernels.md v27 says): every CTA holds
    one piece of one unit, the padding past a sequence's length is empty, and every token is
    covered once."""
    lens = np.asarray(lens, np.int32)
    split = ops.plan_work(groups, 396, len(lens), lens, sms=132)
    assert (split.per_cta, split.num_ctas) == (per_cta, num_ctas)
    work16 = np.diff(split.cum16)
    assert (work16 % per_cta == 0).all()
    assert (work16 - per_cta < np.maximum(lens, 1)).all()  # no piece of padding alone
    assert split.total == int(work16.sum()) * groups
    pieces = walk(split, lens)
    assert len(pieces) == split.num_ctas
    assert all(len(items) == 1 for items in pieces.values())  # one piece of one unit
    covered = sorted(item for items in pieces.values() for item in items)
    for s, n in enumerate(lens):
        for x in range(groups):
            ranges = [(a, b) for t, y, a, b in covered if (t, y) == (s, x)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_a_launch_of_more_units_than_one_wave_is_not_padded():
    rng = np.random.default_rng(5)
    for lens, groups in (([512] * 256, 8), ([4096] * 64, 8)):
        lens = np.asarray(lens, np.int32)
        assert ops.plan_work(groups, 396, len(lens), lens, sms=132).per_cta == \
            ops.plan_work(groups, 396, len(lens), lens).per_cta
    lens = rng.integers(1, 8193, 64).astype(np.int32)  # 512 units > 396 CTAs
    padded = ops.plan_work(8, 396, 64, lens, sms=132)
    np.testing.assert_array_equal(padded.cum16, ops.plan_work(8, 396, 64, lens).cum16)


def test_lengths_far_apart_keep_the_balanced_split():
    """Whole pieces would leave the long sequence to one CTA a unit (every other unit takes
    a CTA of the one wave): the padded split's load is far past the balanced one's, so the
    balanced split stays, the long sequence cut across many CTAs."""
    for lens in ([131072] + [200] * 48, [32768] + [512] * 48):
        lens = np.asarray(lens, np.int32)
        split = ops.plan_work(8, 396, len(lens), lens, sms=132)
        unpadded = ops.plan_work(8, 396, len(lens), lens)
        assert split.per_cta == unpadded.per_cta < lens[0] // 8
        np.testing.assert_array_equal(split.cum16, unpadded.cum16)


def test_a_long_launch_of_one_wave_of_units_is_padded_too():
    """16 sequences of 8192 tokens with 64 query heads over 8 (128 units): two pieces of
    4096 a unit on 256 CTAs rather than 395 CTAs of 2656 that cut units anywhere (H200:
    148.7 -> 144.7 us)."""
    lens = np.full(16, 8192, np.int32)
    assert ops.plan_work(8, 396, 16, lens).per_cta == 2656
    split = ops.plan_work(8, 396, 16, lens, sms=132)
    assert (split.per_cta, split.num_ctas) == (4096, 256)
    assert all(len(items) == 1 for items in walk(split, lens).values())


@pytest.mark.parametrize("lens", [[512] * 256, list(np.random.default_rng(3).integers(
    1, 2049, 512))], ids=["256x512", "512xU2048"])
def test_many_units_take_one_cta_each(lens):
    """With at least WHOLE_UNIT_WAVES waves of units (and no unit longer than half a slot's
    work), each unit is one CTA's one piece, its sequence padded to the longest work; with
    lengths only as the tables' width, the same in uniform mode. Fewer waves (64 x 4096 at
    1.3), a unit too long or no such rule keep one balanced wave."""
    lens = np.asarray(lens, np.int32)
    rule = (planning.WHOLE_UNIT_WAVES, 0.0, 0, 0)
    split = ops.plan_work(8, 396, len(lens), lens, sms=132, rule=rule)
    longest = _ceil16(int(lens.max()))
    assert (split.per_cta, split.num_ctas) == (longest, 8 * len(lens))
    pieces = walk(split, lens)
    assert [pieces[c] for c in range(split.num_ctas)] == [
        [(s, x, 0, int(n))] for s, n in enumerate(lens) for x in range(8)]
    uniform = ops.plan_work(8, 396, len(lens), None, max_len=longest, sms=132, rule=rule)
    assert (uniform.per_cta, uniform.num_ctas, uniform.cum16) == (longest, 8 * len(lens), None)
    assert split.whole and uniform.whole  # no unit cut: no partial records
    assert planning.split_workspace(split.num_ctas, 4, 128, 8 * len(lens), split.whole) == (
        0, 8 * len(lens))
    assert not ops.plan_work(8, 396, 64, np.full(64, 4096, np.int32), sms=132).whole
    assert ops.plan_work(8, 396, len(lens), lens, sms=132).num_ctas <= 396
    assert ops.plan_work(8, 396, len(lens), lens, rule=rule).num_ctas <= 396  # sms unknown
    for few in ([4096] * 64, [16384] + [512] * 255):  # 1.3 waves; one unit too long
        few = np.asarray(few, np.int32)
        assert ops.plan_work(8, 396, len(few), few, sms=132, rule=rule).num_ctas <= 396


def test_a_lone_cta_a_multiprocessor_only_where_the_rule_allows_it():
    """16 x 8192 with 64/8 heads (128 units on 132 SMs): whole units under a lone_fill of
    0.9 (the 16-bit head_dim 128 instances'), two pieces a unit without one; 12 x 8192 (96
    units, under 0.9 of the SMs) keeps two pieces either way."""
    lens = np.full(16, 8192, np.int32)
    lone = (2.0, planning.LONE_CTA_FILL, 0, 0)
    split = ops.plan_work(8, 396, 16, lens, sms=132, rule=lone)
    assert (split.per_cta, split.num_ctas, split.lean) == (8192, 128, False)
    assert all(len(items) == 1 for items in walk(split, lens).values())
    assert ops.plan_work(8, 396, 16, None, max_len=8192, sms=132, rule=lone).num_ctas == 128
    assert ops.plan_work(8, 396, 16, lens, sms=132, rule=(2.0, 0.0, 0, 0)).num_ctas == 256
    few = np.full(12, 8192, np.int32)
    for fill in (0.0, planning.LONE_CTA_FILL):
        assert ops.plan_work(8, 396, 12, few, sms=132, rule=(2.0, fill, 0, 0)).num_ctas > 132


@pytest.mark.parametrize("rule", [
    (0.0, 0.0, 0, 0), (2.0, 0.0, 0, 0), (2.0, 0.9, 0, 0), (2.0, 0.9, 264, 2048),
    (4.0, 0.5, 132, 512)])
def test_uniform_mode_splits_as_the_same_lengths_on_the_host(rule):
    """Without lengths on the host, every sequence counting ``max_len`` gives the very split
    that lengths of ``max_len`` give: the one compiled rule decides both (the uniform mode
    once restated the lone-CTA rule in Python, and its margins differed): the same shares,
    and each sequence's work padded alike, so the kernel walks the same pieces."""
    for (num_seqs, groups), max_len in itertools.product(
            [(n, g) for n in (1, 2, 3, 7, 12, 15, 16, 17, 33, 64, 99, 148, 300)
             for g in (1, 2, 8, 16)], (1, 16, 500, 2048, 4096, 8192, 20000)):
        lens = np.full(num_seqs, max_len, np.int32)
        by_lens = ops.plan_work(groups, 396, num_seqs, lens, sms=132, rule=rule)
        uniform = ops.plan_work(groups, 396, num_seqs, None, max_len=max_len, sms=132,
                                rule=rule)
        case = (num_seqs, groups, max_len)
        assert (uniform.num_ctas, uniform.per_cta, uniform.total, uniform.whole,
                uniform.lean) == (by_lens.num_ctas, by_lens.per_cta, by_lens.total,
                                  by_lens.whole, by_lens.lean), case
        assert uniform.cum16 is None and (np.diff(by_lens.cum16) == uniform.uniform16).all()


@pytest.mark.parametrize("max_len", [-1, (1 << 30) + 1, 1 << 40, 2.5, "x"])
def test_a_width_past_the_kernels_positions_is_refused_by_name(max_len):
    with pytest.raises(ValueError, match=f"max_len .*got {max_len!r}"):
        ops.plan_work(8, 396, 4, None, max_len=max_len, sms=132)


@pytest.mark.parametrize("batch, context, lean", [
    (64, 4096, True),    # 512 units: 1.29 waves of 396, 1.94 of 264
    (128, 2048, True),   # 1024 units: 2.59 / 3.88 waves
    (256, 512, False),   # units shorter than LEAN_UNIT_TOKENS
    (148, 2048, False),  # 1184 units: 2.99 waves of 396 beat 4.48 of 264
    (99, 2048, False),   # 792 units: 2.0 and 3.0 waves, a tie keeps the natural occupancy
])
def test_long_even_units_run_lean_where_its_waves_are_fuller(batch, context, lean):
    """With a lean occupancy of 264 CTAs (two a SM instead of three), long units of one
    length run one CTA a unit at it where its waves are at least 0.9 full and fuller than
    the natural 396's: by lengths and in uniform mode alike; ragged lengths never do."""
    rule = (planning.WHOLE_UNIT_WAVES, planning.LONE_CTA_FILL, 264, planning.LEAN_UNIT_TOKENS)
    lens = np.full(batch, context, np.int32)
    for split in (ops.plan_work(8, 396, batch, lens, sms=132, rule=rule),
                  ops.plan_work(8, 396, batch, None, max_len=context, sms=132, rule=rule)):
        assert split.lean == lean
        if lean:
            assert (split.num_ctas, split.per_cta) == (8 * batch, context)
            assert all(len(items) == 1 for items in walk(split, lens).values())
    ragged = lens.copy()
    ragged[::2] //= 2
    assert not ops.plan_work(8, 396, batch, ragged, sms=132, rule=rule).lean
    assert not ops.plan_work(8, 396, batch, lens, sms=132,
                             rule=(*rule[:2], 0, planning.LEAN_UNIT_TOKENS)).lean


@pytest.mark.parametrize("rule", [(2.0,), "2,0.9,0,0", None, (2.0, 0.9, 264.5, 2048),
                                  (-1.0, 0.0, 0, 0), (2.0, 1.5, 0, 0), (2.0, 0.9, 264, None),
                                  (2.0, 0.9, [264], 2048)])
def test_a_malformed_split_rule_is_refused_by_name(rule):
    lens = np.full(4, 100, np.int32)
    for case in (dict(lens=lens), dict(max_len=100)):
        with pytest.raises(ValueError, match="rule must be"):
            ops.plan_work(8, 396, 4, sms=132, rule=rule, **case)


@pytest.mark.parametrize("backend_name, dtype, head_dim, fp8, rule", [
    ("cuda", np.float16, 128, False, (2.0, 0.9, True)),
    ("cuda", ml_dtypes.bfloat16, 128, False, (2.0, 0.9, True)),
    ("cuda", ml_dtypes.bfloat16, 128, True, (2.0, 0.0, False)),
    ("cuda", np.float16, 64, False, (2.0, 0.0, False)),
    ("cuda", np.float16, 256, False, (4.0, 0.0, True)),
    ("cuda", np.float32, 128, False, (2.0, 0.0, False)),
    ("hip", np.float16, 128, False, (2.0, 0.0, False))])
def test_each_instance_has_its_split_rule(backend_name, dtype, head_dim, fp8, rule):
    assert planning.split_rule_of(backend_name, np.dtype(dtype), head_dim, fp8) == rule


def test_lean_launches_fit_one_cta_fewer_and_match_reference_on_gpu(gpu, rng):
    """The 16-bit head_dim 128 instance's lean shared memory fits two CTAs a SM where the
    natural fits three, and a lean launch (256 sequences of 2048 tokens, 2 kv heads: 512
    units) matches the reference."""
    found = planning.attention_kernel(gpu, DEVICE, np.dtype(np.float16), 128, 4)
    sms = found.sms
    assert found.slots == 3 * sms and found.rule[2] == 2 * sms
    assert found.kernel.max_active_blocks(planning.THREADS, found.lean_shared_bytes) == 2
    assert found.kernel.max_active_blocks(planning.THREADS,
                                          found.lean_shared_bytes - 1024) == 3
    lens = np.full(256, 2048, np.int32)
    plan = planning.plan_attention(gpu, DEVICE, np.dtype(np.float16), 256, 8, 2, 128, 16,
                                   128, lens)
    if not plan.work.lean:
        pytest.skip(f"512 units on {sms} SMs do not fill two CTAs' waves better")
    assert plan.shared_bytes == found.lean_shared_bytes
    got, want = run_attention(gpu, rng, np.float16, 128, 16, 4, list(lens))
    assert relative_error(got, want) < 1e-2


def test_a_smaller_shared_memory_opt_in_keeps_the_larger_limit_on_gpu(gpu):
    """Opting a kernel in to less dynamic shared memory after more leaves the larger limit:
    a launch prepared for the lean occupancy's size stays valid (it was lowered before)."""
    if gpu.name != "cuda":
        pytest.skip("an opt-in of the cuda backend")
    from cuda.bindings import driver as cu

    found = planning.attention_kernel(gpu, DEVICE, np.dtype(np.float16), 128, 4)
    handle = found.kernel.handle
    gpu.allow_shared(handle, found.lean_shared_bytes)
    gpu.allow_shared(handle, found.shared_bytes + 512)  # a size not asked for before
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    err, limit = cu.cuFuncGetAttribute(attr, handle)
    assert err == cu.CUresult.CUDA_SUCCESS and limit == found.lean_shared_bytes > 0


def test_many_ragged_units_one_cta_each_match_reference_on_gpu(gpu, rng):
    """A launch of at least two waves of units (1024 sequences x 2 kv heads, 33-64 tokens
    each) runs one CTA a unit, and its outputs match the reference."""
    lens = rng.integers(33, 65, 1024)
    found = planning.attention_kernel(gpu, DEVICE, np.dtype(np.float16), 128, 4)
    plan = planning.plan_attention(gpu, DEVICE, np.dtype(np.float16), 1024, 8, 2, 128, 16, 4,
                                   lens.astype(np.int32))
    if found.slots * found.rule[0] > 2048:
        pytest.skip(f"{found.slots} CTAs at once: 2048 units are fewer than two waves")
    assert plan.work.num_ctas == 2048
    got, want = run_attention(gpu, rng, np.float16, 128, 16, 4, list(lens))
    assert relative_error(got, want) < 1e-2


def test_few_tokens_get_few_ctas():
    split = ops.plan_work(1, 396, 2, np.array([10, 20], np.int32))
    assert split.per_cta == planning.MIN_TOKENS_PER_CTA and split.num_ctas == 1


def test_work_sizes_beyond_int32_are_planned_in_int64():
    lens = np.full(4096, 2**20, np.int32)
    split = ops.plan_work(32, 396, 4096, lens)
    assert split.total == 4096 * 2**20 * 32 > 2**31 and split.cum16.dtype == np.int64
    unit = 2**20 * 32  # work tokens per sequence
    assert split.first_seq[-1] == (split.num_ctas - 1) * split.per_cta // unit


def test_a_prepared_launch_updated_to_another_split_equals_one_prepared_for_it():
    # a decode step reuses the launch an earlier step prepared (same shapes and addresses)
    # and rewrites only the grid and planning.WORK_ARGS: nothing else may depend on the split
    def plan(lens):
        work = ops.plan_work(2, 396, 3, np.asarray(lens, np.int32))
        return planning.AttentionPlan(None, 4, work, 0, 3, 8, 2, 128, 16, 64)

    before, after = plan([100, 7, 3000]), plan([101, 8, 3100])
    assert before.work.num_ctas != after.work.num_ctas
    pointers = [i << 40 for i in range(1, 11)]
    args = list(before.arguments(*pointers[:6], 0.125, *pointers[6:]))
    for index, value in zip(planning.WORK_ARGS, (after.work.uniform16, after.work.per_cta,
                                                  after.work.total)):
        args[index] = type(args[index])(value)
    want = after.arguments(*pointers[:6], 0.125, *pointers[6:])
    assert [type(a) for a in args] == [type(a) for a in want]
    assert [int(a) if not isinstance(a, np.floating) else float(a) for a in args] == [
        int(a) if not isinstance(a, np.floating) else float(a) for a in want]
