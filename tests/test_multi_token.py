"""Attention over many query tokens per sequence (``ops.paged_attention(query_lens=...)``):
against the float64 reference on every backend, decodes unchanged, speculative
verification equal to sequential decode steps, the work plan's invariants, and bad input
refused before anything is queued."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_ops import POISON, TOLERANCE, random_kv, random_tables, relative_error

from rocmforge_raw.kernels import ops, reference
from rocmforge_raw.kernels.planning import FP8_DTYPES
from rocmforge_raw.kernels.planning.prefill import plan_prefill
from rocmforge_raw.memory.array import DeviceArray

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def random_inputs(rng, dtype, head_dim, block_size, ratio, q_lens, kv_lens, num_kv_heads=2,
                  cache_dtype=None):
    """Host arrays of one call: q ``[sum(q_lens), H, D]``, caches (fp8 codes with their
    scales where ``cache_dtype`` is fp8), tables in random page order, lengths."""
    dtype = np.dtype(dtype)
    k, v, k_scale, v_scale = random_kv(rng, dtype, kv_lens, num_kv_heads, block_size, head_dim,
                                       cache_dtype)
    q = rng.standard_normal((sum(q_lens), num_kv_heads * ratio, head_dim),
                            np.float32).astype(dtype)
    tables = random_tables(rng, kv_lens, block_size, k.shape[0])
    return (q, k, v, tables, np.asarray(kv_lens, np.int32), np.asarray(q_lens, np.int32),
            k_scale, v_scale)


def run(backend, q, k, v, tables, lens, q_lens, k_scale=1.0, v_scale=1.0, **options):
    """The op on ``backend`` (arrays uploaded, output poisoned first), as float64."""
    dq = DeviceArray.from_numpy(q, backend=backend)
    dk = DeviceArray.from_numpy(k, backend=backend)
    dv = DeviceArray.from_numpy(v, backend=backend)
    out = DeviceArray.empty(q.shape, q.dtype, backend=backend)
    out.buffer.fill(POISON)
    try:
        ops.paged_attention(out, dq, dk, dv, tables, lens, query_lens=q_lens, k_scale=k_scale,
                            v_scale=v_scale, **options)
        return out.to_numpy().astype(np.float64)
    finally:
        for array in (out, dq, dk, dv):
            array.buffer.root.close()


def want(q, k, v, tables, lens, q_lens, k_scale=1.0, v_scale=1.0):
    scale = 1.0 / math.sqrt(q.shape[2])
    return reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale, np.float64,
                                           k_scale, v_scale)


def tolerance(dtype, cache_dtype=None):
    return 3e-2 if np.dtype(cache_dtype or dtype) in FP8_DTYPES else TOLERANCE[np.dtype(dtype)]


# --- results -------------------------------------------------------------------------------
#: (q_lens, kv_lens) shapes: a prefix hit's tail, a chunk, a whole prompt, decodes first and
#: decodes among prefills (the decode kernel takes a leading run), speculative rows.
SHAPES = {
    "mixed": ([1, 1, 37, 5, 1, 64], [9, 200, 37, 300, 1, 190]),
    "chunks": ([48, 48, 17], [48, 400, 130]),
    "verify": ([4, 3, 8, 2], [500, 33, 129, 17]),
    "long": ([300], [1700]),
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("head_dim, block_size, ratio", [(64, 8, 1), (128, 16, 4),
                                                         (256, 32, 2), (128, 128, 8)])
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_matches_the_float64_reference(backend, rng, dtype, head_dim, block_size, ratio, case):
    q_lens, kv_lens = SHAPES[case]
    inputs = random_inputs(rng, dtype, head_dim, block_size, ratio, q_lens, kv_lens)
    assert relative_error(run(backend, *inputs), want(*inputs)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cache", ["float8_e4m3fn", "float8_e4m3fnuz"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_caches_match_the_reference(backend, rng, dtype, cache, head_dim):
    inputs = random_inputs(rng, dtype, head_dim, 16, 4, [1, 33, 6], [40, 33, 250],
                           cache_dtype=np.dtype(getattr(ml_dtypes, cache)))
    assert relative_error(run(backend, *inputs), want(*inputs)) < tolerance(dtype, FP8)


def test_one_query_row_each_is_the_decode_op(backend, rng):
    """query_lens of ones: the decode op's result, bit for bit (the same kernel)."""
    q, k, v, tables, lens, q_lens, _, _ = random_inputs(rng, np.float16, 128, 16, 4,
                                                        [1] * 5, [3, 100, 1, 17, 999])
    dq, dk, dv = (DeviceArray.from_numpy(a, backend=backend) for a in (q, k, v))
    outs = []
    for options in ({}, {"query_lens": q_lens}):
        out = DeviceArray.empty(q.shape, q.dtype, backend=backend)
        ops.paged_attention(out, dq, dk, dv, tables, lens, **options)
        outs.append(out.to_numpy())
        out.buffer.close()
    for array in (dq, dk, dv):
        array.buffer.close()
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("drafted", [2, 5, 8])
def test_verifying_drafted_tokens_equals_sequential_decode_steps(backend, rng, drafted):
    """k drafted tokens verified in one call: each row equals the decode step of that
    token alone, with the cache holding the tokens up to it."""
    dtype = np.dtype(np.float32)
    base = [40, 130]
    q, k, v, tables, lens, q_lens, _, _ = random_inputs(
        rng, dtype, 64, 16, 4, [drafted] * 2, [n + drafted for n in base])
    together = run(backend, q, k, v, tables, lens, q_lens)
    for step in range(drafted):
        rows = [s * drafted + step for s in range(2)]
        alone = run(backend, q[rows], k, v, tables, np.asarray([n + step + 1 for n in base],
                                                               np.int32),
                    np.ones(2, np.int32))
        np.testing.assert_allclose(together[rows], alone, rtol=2e-5, atol=2e-6)


def test_rows_past_a_long_prefix_see_the_whole_prefix(backend, rng):
    """A prefix hit: 3 new rows over 1000 cached tokens, in one piece or cut into many
    (the host plans pieces for a launch of few items), match the reference."""
    inputs = random_inputs(rng, np.float16, 128, 16, 8, [3], [1003], num_kv_heads=1)
    assert relative_error(run(backend, *inputs), want(*inputs)) < tolerance(np.float16)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_scores_rising_along_the_positions_move_the_running_max_and_still_match(
        backend, rng, dtype, head_dim):
    """Keys with a ramp along one direction: half the query heads of each group score it
    rising (their running max passes its slack, 2^8, over and over, with output already
    summed: the rescale after a settled start), the other half falling (their max never
    moves), in the same tiles; a few spikes jump a row's max far at once. Long rows (the
    two-m-tile instance), short ones and few items (pieces and their combine)."""
    q_lens, kv_lens = [1, 180, 3, 40], [300, 1500, 1003, 700]
    q, k, v, tables, lens, q_lens, _, _ = random_inputs(rng, np.float32, head_dim, 16, 4,
                                                        q_lens, kv_lens)
    u = rng.standard_normal(head_dim)
    u /= np.linalg.norm(u)
    for s, length in enumerate(kv_lens):
        p = np.arange(length)
        ramp = 0.5 * p * np.sqrt(head_dim / 128)  # ~8 log2 units a 64-token tile
        ramp[rng.choice(length, 3, replace=False)] += 60  # spikes
        k[tables[s, p // 16], :, p % 16, :] += ramp[:, None, None] * u
    sign = np.where(np.arange(q.shape[1]) % 2 == 0, 2.0, -2.0)[None, :, None]
    q = (q + sign * u).astype(dtype)
    k, v = k.astype(dtype), v.astype(dtype)
    inputs = (q, k, v, tables, lens, q_lens)
    assert relative_error(run(backend, *inputs), want(*inputs)) < tolerance(dtype)


# --- the work plan ------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 8, 10_000])
def test_the_plan_covers_every_row_and_position_once(rng, slots):
    q_lens = np.asarray([1, 70, 3, 200], np.int32)
    kv_lens = np.asarray([5, 70, 900, 2000], np.int32)
    ratio, kv_heads, bm, bn = 4, 2, 64, 32
    work = plan_prefill(q_lens, kv_lens, kv_heads, ratio, bm, bn, slots)
    assert work.q_starts.tolist() == [0, 1, 71, 74, 274]
    seen = {}
    for index, (s, row0, xk, n) in enumerate(work.items.tolist()):
        x, k = xk & 0xFFFF, xk >> 16
        assert 0 <= k < n and (n > 1) == (index < work.num_pieces)
        seen.setdefault((s, row0, x), []).append(k)
    for s, q in enumerate(q_lens):
        for x in range(kv_heads):
            for row0 in range(0, int(q) * ratio, bm):
                pieces = seen.pop((s, row0, x))
                assert sorted(pieces) == list(range(len(pieces)))
    assert not seen, f"items outside the rows: {seen}"
    for first, n in work.combines.tolist():  # a split item's pieces, consecutive
        group = work.items[first: first + n]
        assert (group[:, :2] == group[0, :2]).all() and (group[:, 3] == n).all()
    if slots == 10_000:  # items far fewer than the slots: long ones cut
        assert work.num_pieces > 0 and len(work.combines) > 0
    if slots == 1:
        assert work.num_pieces == 0


# --- bad input ----------------------------------------------------------------------------
def _call(backend, rng, **change):
    q, k, v, tables, lens, q_lens, _, _ = random_inputs(rng, np.float16, 64, 16, 2, [3, 1],
                                                        [10, 4])
    args = {"tables": tables, "lens": lens, "q_lens": q_lens, "q": q}
    args.update(change)
    dq = DeviceArray.from_numpy(args["q"], backend=backend)
    dk, dv = (DeviceArray.from_numpy(a, backend=backend) for a in (k, v))
    out = DeviceArray.empty(args["q"].shape, q.dtype, backend=backend)
    out.buffer.fill(POISON)
    try:
        ops.paged_attention(out, dq, dk, dv, args["tables"], args["lens"],
                            query_lens=args["q_lens"], **args.get("options", {}))
    finally:
        untouched = (out.to_numpy().view(np.uint8) == POISON).all()
        for array in (out, dq, dk, dv):
            array.buffer.root.close()
        assert untouched, "a refused call wrote its output"


@pytest.mark.parametrize("change, error, words", [
    ({"q_lens": np.asarray([0, 4], np.int32)}, ValueError, "query_lens[0] = 0"),
    ({"q_lens": np.asarray([11, 1], np.int32)}, ValueError, "query_lens[0] = 11 exceeds"),
    ({"q_lens": np.asarray([2, 1], np.int32)}, ValueError, "sum to 3 rows, but query has 4"),
    ({"q_lens": np.asarray([3, 1], np.int64)}, ValueError, "query_lens must be int32"),
    ({"q_lens": np.asarray([3, 1, 0], np.int32)}, ValueError, "query_lens must have shape"),
    ({"lens": np.asarray([10, 4], np.int64)}, ValueError, "seq_lens must be int32"),
    ({"lens": np.asarray([10, 400], np.int32)}, ValueError, "seq_lens[1] = 400"),
    ({"options": {"num_partitions": 2}}, ValueError, "num_partitions=2"),
])
def test_bad_lengths_are_refused_naming_the_value(backend, rng, change, error, words):
    with pytest.raises(error) as info:
        _call(backend, rng, **change)
    assert words in str(info.value)


def test_lengths_on_the_device_are_refused(backend, rng):
    q_lens = DeviceArray.from_numpy(np.asarray([3, 1], np.int32), backend=backend)
    try:
        with pytest.raises(TypeError, match="query_lens must be host integers"):
            _call(backend, rng, q_lens=q_lens)
        with pytest.raises(TypeError, match="seq_lens must be host integers"):
            _call(backend, rng, lens=q_lens)
    finally:
        q_lens.buffer.close()


def test_the_leading_decodes_are_the_runs_of_one_row_before_the_first_longer_one():
    from rocmforge_raw.kernels.planning.prefill import leading_decodes

    for q_lens, want in (([1, 1, 5, 1], 2), ([4, 1], 0), ([1, 1, 1], 3), ([], 0), ([7], 0)):
        assert leading_decodes(np.array(q_lens, np.int32)) == want
