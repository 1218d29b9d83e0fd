"""The mixed step's host plan (``batch(query_lens=)`` on a GPU) against a plain re-derivation
of what its arrays mean, over many random compositions: decodes and chunks, kv lengths,
block sizes, GQA ratios, head dims and the tile shapes they pick. The references below
are loops over the documented meaning (``plan_prefill``, ``query_slots``), one item or
one token at a time, sharing no code with the planner."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from rocmforge_raw.cache.step.multi import (
    PREFILL_OUT_SCALE_ARG,
    PREFILL_SCALE_ARG,
    prefill_launches,
    query_slots,
)
from rocmforge_raw.kernels.module import Kernel
from rocmforge_raw.kernels.planning.prefill import (
    ITEM_COST,
    MIN_PIECE_TILES,
    PIECE_WAVES,
    PrefillKernel,
    leading_decodes,
    plan_prefill,
    prefill_shape,
    prefill_wm,
)
from rocmforge_raw.runtime import get_backend


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def reference_plan(q_lens, kv_lens, kv_heads, ratio, bm, bn, slots, max_pieces):
    """(items, combines, q_starts, num_pieces) of the multi-token launch, item by item:
    an item is ``bm`` packed rows (token r // ratio) of one sequence and kv head; it reads
    positions up to where its last row stops seeing (causal, aligned to the end of the KV)."""
    units = []  # (s, row0, x, hi), in (sequence, kv head, row tile) order
    for s, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        rows = q * ratio
        for x in range(kv_heads):
            for row0 in range(0, rows, bm):
                last = min(row0 + bm, rows) - 1
                units.append((s, row0, x, kv - q + last // ratio + 1))
    tiles = [ceil(hi, bn) for *_, hi in units]
    pieces = [1] * len(units)
    if 0 < len(units) < PIECE_WAVES * slots:
        target = max(MIN_PIECE_TILES, ceil(sum(tiles), PIECE_WAVES * slots))
        pieces = [max(1, t // target) for t in tiles]
    per = [ceil(t, p) for t, p in zip(tiles, pieces)]
    pieces = [ceil(t, e) for t, e in zip(tiles, per)]
    if max_pieces is not None and sum(p for p in pieces if p > 1) > max_pieces:
        pieces, per = [1] * len(units), list(tiles)
    cost = [min(e * bn, u[3]) + ITEM_COST for e, u in zip(per, units)]
    order = sorted(range(len(units)), key=lambda i: (pieces[i] == 1, -cost[i], i))
    items, combines = [], []
    for i in order:
        s, row0, x, _ = units[i]
        if pieces[i] > 1:
            combines.append((len(items), pieces[i]))
        items += [(s, row0, x | (k << 16), pieces[i]) for k in range(pieces[i])]
    q_starts = [0]
    for q in q_lens:
        q_starts.append(q_starts[-1] + q)
    return items, combines, q_starts, sum(p for p in pieces if p > 1)


def reference_slots(tables, lens, q_lens, ref_cnt, block_size):
    """Each sequence's last q_len tokens' slots; -1 for a position of a block another
    sequence holds that an earlier sequence of the step writes already."""
    slots, written = [], set()
    for s, (n, q) in enumerate(zip(lens, q_lens)):
        for pos in range(n - q, n):
            block = int(tables[s, pos // block_size])
            slot = block * block_size + pos % block_size
            shared = ref_cnt[block] > 1
            slots.append(-1 if shared and slot in written else slot)
            if shared:
                written.add(slot)
    return slots


def random_step(rng):
    """A step as the Scheduler lists it: decodes first, then chunks, drafted tokens and more
    decodes; each sequence's kv length at least its query rows."""
    decodes = int(rng.integers(0, 20))
    rest = int(rng.integers(0, 10))
    longest = int(rng.choice([4, 64, 700]))
    q_lens = np.concatenate([np.ones(decodes, np.int64), rng.integers(1, longest, rest)])
    kv_lens = q_lens + rng.integers(0, int(rng.choice([1, 100, 3000])), len(q_lens))
    return q_lens.astype(np.int32), kv_lens.astype(np.int32)


@pytest.mark.parametrize("seed", range(8))
def test_the_multi_token_plan_is_what_its_items_mean(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        q_lens, kv_lens = random_step(rng)
        decodes = leading_decodes(q_lens)
        q_rest, kv_rest = q_lens[decodes:], kv_lens[decodes:]
        if not len(q_rest):
            continue
        backend = str(rng.choice(["cuda", "hip"]))
        dtype = np.dtype(rng.choice([np.float16, ml_dtypes.bfloat16, np.float32]))
        head_dim, ratio = int(rng.choice([64, 128, 256])), int(rng.choice([1, 2, 4, 8]))
        kv_heads = int(rng.choice([1, 2, 8]))
        wm = prefill_wm(backend, dtype, head_dim, int(q_rest.max()) * ratio)
        shape = prefill_shape(backend, dtype, dtype, head_dim, wm)
        slots = int(rng.choice([1, 16, 132, 264, 2000, 20000]))
        max_pieces = [None, None, 0, int(rng.integers(1, 200))][int(rng.integers(4))]
        work = plan_prefill(q_rest, kv_rest, kv_heads, ratio, shape.bm, shape.bn, slots,
                            max_pieces)
        items, combines, q_starts, num_pieces = reference_plan(
            q_rest.tolist(), kv_rest.tolist(), kv_heads, ratio, shape.bm, shape.bn, slots,
            max_pieces)
        assert work.items.dtype == work.combines.dtype == work.q_starts.dtype == np.int32
        assert work.items.reshape(-1, 4).tolist() == [list(i) for i in items]
        assert work.combines.reshape(-1, 2).tolist() == [list(c) for c in combines]
        assert work.q_starts.tolist() == q_starts
        assert work.num_pieces == num_pieces and type(work.num_pieces) is int


@pytest.mark.parametrize("seed", range(4))
def test_the_query_slots_are_each_new_tokens_slot(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        q_lens, lens = random_step(rng)
        block_size = int(rng.choice([1, 2, 8, 16, 32]))
        held = -(-lens // block_size)
        width = max(int(held.max(initial=0)), 1)
        num_blocks = int(held.sum()) + 4
        tables = np.zeros((len(lens), width), np.int32)
        for s, n in enumerate(held):
            tables[s, :n] = rng.integers(1, num_blocks, n)  # some held twice: shared
        ref_cnt = np.bincount(tables.ravel(), minlength=num_blocks).astype(np.int32)
        got = query_slots(tables, lens, q_lens, ref_cnt, block_size)
        assert got.dtype == np.int64
        assert got.tolist() == reference_slots(tables, lens, q_lens, ref_cnt, block_size)


def test_a_plan_over_lengths_shorter_than_their_queries_is_refused():
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 3 is less than query_lens\[1\] = 4"):
        plan_prefill(np.array([2, 4]), np.array([9, 3]), 2, 4, 64, 32, 100)


def test_query_slots_past_a_sequences_tokens_are_refused():
    tables, ref_cnt = np.array([[1, 2]], np.int32), np.ones(3, np.int32)
    with pytest.raises(ValueError, match="5 query tokens of 4"):
        query_slots(tables, np.array([4]), np.array([5]), ref_cnt, 2)
    with pytest.raises(ValueError, match=r"3 query tokens of 5 do not fit .* 2 blocks of 2"):
        query_slots(tables, np.array([5]), np.array([3]), ref_cnt, 2)


@pytest.mark.parametrize("args,match", [
    ((2, 4, 0, 32), "bm must be 1..any, got 0"),
    ((2, 4, -64, 32), "bm must be 1..any, got -64"),
    ((2, 4, 64, 0), "bn must be 1..any, got 0"),
    ((2, 0, 64, 32), "ratio must be 1..any, got 0"),
    ((0, 4, 64, 32), "num_kv_heads must be 1..65535, got 0"),
    ((1 << 16, 4, 64, 32), "num_kv_heads must be 1..65535, got 65536"),  # x is 16 bits
])
def test_a_plan_over_impossible_tiles_or_heads_is_refused_not_a_crash(args, match):
    """(The planning runs in C: a zero tile divided by zero, a negative one wrote past its
    array.)"""
    with pytest.raises(ValueError, match=match):
        plan_prefill(np.array([2, 200]), np.array([5, 300]), *args, 264)


@pytest.mark.parametrize("lens,match", [
    (np.array([2**32 + 5]), r"lens must be int32 values, got int64"),
    (np.array([5.0]), r"lens must be int32 values, got float64"),
])
def test_query_slots_refuse_lengths_int32_would_change(lens, match):
    tables, ref_cnt = np.array([[1, 2, 3]], np.int32), np.ones(4, np.int32)
    with pytest.raises(ValueError, match=match):
        query_slots(tables, lens, np.array([3]), ref_cnt, 2)


def stub_instance(wm: int) -> PrefillKernel:
    """A multi-token instance whose kernels prepare real launches on the host backend (a
    module that is never loaded: nothing launches)."""
    module = SimpleNamespace(backend=get_backend("host"), device=0, _check_open=lambda: None,
                             stream_of=lambda stream: None)
    kernels = []
    for handle in (1, 2):
        kernel = Kernel.__new__(Kernel)
        kernel.module, kernel.name, kernel.handle = module, f"k{handle}", handle
        kernels.append(kernel)
    shape = prefill_shape("cuda", np.dtype(np.float16), np.dtype(np.float16), 128, wm)
    return PrefillKernel(kernels[0], kernels[1], wm, shape, 8)


def test_a_reused_multi_token_launch_passes_what_a_fresh_one_packs():
    found = stub_instance(4)
    shape = found.shape
    works = [plan_prefill(np.array(q), np.array(kv), 2, 4, shape.bm, shape.bn, 8)
             for q, kv in (([300, 5], [900, 40]), ([7], [7]), ([64, 64, 64], [2000, 90, 64]))]
    launches: dict = {}
    for step, work in enumerate(works * 2):
        at = [(step + 1) << 20 | i << 8 for i in range(6)]  # this step's addresses
        args = (found, work, *at, 0.125 + step, 32, 8, 10 + step, 16, None)
        reused = prefill_launches(*args, launches)
        fresh = prefill_launches(*args)
        assert (reused[1] is None) == (fresh[1] is None) == (not len(work.combines))
        for old, new in zip(reused, fresh):
            if new is not None:
                assert old.num_args == new.num_args
                assert [old.slot(i) for i in range(old.num_args)] == [
                    new.slot(i) for i in range(new.num_args)]
        reused[0].set_float(PREFILL_SCALE_ARG, 3.0)  # as an fp8 step's layers set their scales
        reused[0].set_float(PREFILL_OUT_SCALE_ARG, 7.0)
    assert len(launches) == 2  # one multi-token launch and one combine, reused
