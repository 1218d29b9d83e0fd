"""A graph for a token budget (``step_graph(token_budget=...)``): one capture replays steps of
any composition. The layout rules run everywhere; replays run on the GPU against the float64
reference, across compositions that change every step."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_cache_multi import check_step
from test_ops import POISON, relative_error

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.cache.step.graph_budget import (
    ITEM_SLACK,
    BudgetShape,
    _item_grid,
    decode_room,
)
from rocmforge_raw.cache.step.graph_layout import activations_of
from rocmforge_raw.kernels.planning import WORK_GRANULE, plan_work
from rocmforge_raw.kernels.planning._worksplit import prefix_sums
from rocmforge_raw.kernels.planning.prefill import item_capacity, plan_prefill
from rocmforge_raw.memory.array import DeviceArray

KV_HEADS, RATIO, BM, BN, SLOTS = 2, 4, 64, 32, 20


def budget_shape(tokens=64, seqs=4, width=12, room=200, pieces=8):
    """A shape as a capture of ``seqs`` rows a region with ``room`` tokens each makes."""
    rooms = np.full(seqs, room, np.int32)
    split = plan_work(KV_HEADS, 40, seqs, rooms)
    bound = prefix_sums(rooms, WORK_GRANULE, np.empty(seqs + 1, np.int64))
    items = item_capacity(tokens, seqs, KV_HEADS, RATIO, BM)
    return BudgetShape((), tokens, seqs, width, KV_HEADS, split.total, split.per_cta,
                       split.num_ctas, bound, items, pieces, max(pieces // 2, 1),
                       (KV_HEADS, RATIO, BM, BN, SLOTS))


def host_step(lens, q_lens, block_size=16):
    """A planned step of sequences of ``lens`` tokens, the last ``q_lens`` of them new."""
    blocks = sum(-(-n // block_size) for n in lens) + 2
    config = CacheConfig(1, KV_HEADS, 64, block_size, blocks, np.float16,
                         num_q_heads=KV_HEADS * RATIO)
    cache = KvCache(config, backend="host")
    ids = [f"s{i}" for i in range(len(lens))]
    for seq_id, n, q in zip(ids, lens, q_lens):
        cache.add_sequence(seq_id, n - q if n > q else n)
    grown = [(s, q) for s, n, q in zip(ids, lens, q_lens) if n > q]
    if grown:
        cache.extend(*map(list, zip(*grown)))
    return cache, cache.batch(ids, query_lens=np.array(q_lens, np.int32))


def test_a_replay_lays_any_composition_out_in_the_fixed_regions():
    shape = budget_shape()
    cache, meta = host_step([30, 100, 47, 9], [1, 1, 20, 9])
    with cache:
        arrays = shape.arrays((), meta)
        assert arrays is not None
        tables, lens, slots, cum16, first_seq, starts, items, combines = arrays
        bt = meta.block_tables
        w = bt.shape[1]
        np.testing.assert_array_equal(tables[:2, :w], bt[:2])  # the decodes
        np.testing.assert_array_equal(tables[4:6, :w], bt[2:])  # the chunks, from row seqs
        assert not tables[2:4].any() and not tables[6:].any() and not tables[:, w:].any()
        np.testing.assert_array_equal(lens, [30, 100, 1, 1, 47, 9, 0, 0])
        assert len(slots) == 64 and (slots[31:] == -1).all()
        np.testing.assert_array_equal(slots[:31], meta.slot_mapping)
        assert cum16[-1] * KV_HEADS == shape.total and len(first_seq) == shape.num_ctas
        np.testing.assert_array_equal(starts, [2, 22, 31, 31, 31])  # absolute query rows
        want = plan_prefill(np.array([20, 9]), np.array([47, 9]), KV_HEADS, RATIO, BM, BN,
                            SLOTS, max_pieces=shape.pieces)
        n = len(want.items)
        np.testing.assert_array_equal(items[:n], want.items)
        assert items.shape == (shape.items, 4) and not items[n:].any()
        assert combines.shape == (shape.combines, 2) and not combines[len(want.combines):].any()


def test_a_step_of_decodes_only_or_chunks_only_fills_the_other_region_with_padding():
    shape = budget_shape()
    for lens, q_lens, decodes in (([30, 40], [1, 1], 2), ([30, 40], [5, 40], 0)):
        cache, meta = host_step(lens, q_lens)
        with cache:
            _, all_lens, _, _, _, starts, items, _ = shape.arrays((), meta)
            assert (all_lens[decodes:4] == 1).all()
            if decodes:
                assert not items.any() and (starts == 2).all()
            else:
                assert items[0, 3] > 0
                np.testing.assert_array_equal(starts, [0, 5, 45, 45, 45])


@pytest.mark.parametrize("why, lens, q_lens, change", [
    ("more tokens than the budget", [80, 90], [40, 30], {}),
    ("more decodes than a region", [5, 6, 7, 8, 9], [1] * 5, {}),
    ("more chunks than a region", [5, 6, 7, 8, 9], [2] * 5, {}),
    ("a wider table", [190], [1], {"width": 11}),
    ("more decode work than the room", [300, 300], [1, 1], {"room": 100}),
    ("more items than the grid", [64, 64], [32, 32], {"tokens": 64, "seqs": 2}),
])
def test_a_step_that_does_not_fit_recaptures(why, lens, q_lens, change):
    shape = budget_shape(**change)
    if why == "more items than the grid":  # a grid sized for fewer rows than the step's
        shape = BudgetShape(*[getattr(shape, f) for f in (
            "activations", "tokens", "seqs", "width", "groups", "total", "per_cta",
            "num_ctas", "bound")], 3, shape.pieces, shape.combines, shape.prefill)
    cache, meta = host_step(lens, q_lens)
    with cache:
        assert shape.arrays((), meta) is None, why
        assert budget_shape(tokens=256, seqs=8, width=40, room=400).arrays((), meta) is not None


def test_other_activations_recapture():
    cache, meta = host_step([30], [1])
    with cache:
        assert budget_shape().arrays(((1, (64, 8, 64)),), meta) is None


def test_pieces_are_cut_only_where_their_records_fit():
    q_lens, lens = np.array([4]), np.array([4000])
    cut = plan_prefill(q_lens, lens, KV_HEADS, RATIO, BM, BN, SLOTS)
    assert cut.num_pieces > 1
    capped = plan_prefill(q_lens, lens, KV_HEADS, RATIO, BM, BN, SLOTS,
                          max_pieces=cut.num_pieces - 1)
    assert capped.num_pieces == 0 and len(capped.combines) == 0
    assert len(capped.items) == KV_HEADS and (capped.items[:, 3] == 1).all()
    shape = budget_shape(tokens=64, seqs=4, width=300, room=4200, pieces=cut.num_pieces - 1)
    cache, meta = host_step([4000], [4])
    with cache:
        *_, items, combines = shape.arrays((), meta)
        assert (items[:KV_HEADS, 3] == 1).all() and not combines.any()


def test_the_item_grid_holds_its_step_with_slack_and_never_shrinks():
    cache, meta = host_step([300, 60, 500], [1, 60, 200])
    tile = (BM, BN, SLOTS)
    with cache:
        step = len(plan_prefill(np.array([60, 200]), np.array([60, 500]), KV_HEADS, RATIO,
                                *tile).items)
        grid = _item_grid(None, meta, KV_HEADS, RATIO, tile, 1000)
        assert grid == int(np.ceil(ITEM_SLACK * step)) and grid > step
        assert _item_grid(None, meta, KV_HEADS, RATIO, tile, step) == step  # the bound
        old = budget_shape()  # a last capture of a larger grid keeps it
        assert _item_grid(old, meta, KV_HEADS, RATIO, tile, 1000) == max(old.items, grid)
    cache, decodes = host_step([300, 60], [1, 1])
    with cache:
        assert _item_grid(None, decodes, KV_HEADS, RATIO, tile, 1000) == 2 * KV_HEADS


def test_the_decode_room_holds_the_longest_sequences_of_any_step():
    """More sequences than decode rows (3 decodes and 3 chunks over 4 rows): the room is
    the 4 longest, each grown by the headroom; fewer: the rest is headroom alone."""
    lens = np.array([30, 500, 7, 90, 64, 1000])
    np.testing.assert_array_equal(decode_room(lens, 4, 16), [1016, 516, 106, 80])
    np.testing.assert_array_equal(decode_room(lens[:2], 4, 16), [516, 46, 16, 16])


def test_padded_work_refuses_what_its_grids_cannot_hold():
    work = plan_prefill(np.array([40]), np.array([50]), KV_HEADS, RATIO, BM, BN, SLOTS)
    with pytest.raises(ValueError, match="do not fit"):
        work.padded(len(work.items) - 1, 1)


def test_item_capacity_holds_every_composition(rng):
    tokens, seqs = 300, 7
    cap = item_capacity(tokens, seqs, KV_HEADS, RATIO, BM)
    for _ in range(200):
        n = int(rng.integers(1, seqs + 1))
        q_lens = np.maximum(1, rng.multinomial(tokens - n, np.ones(n) / n) + 1)
        work = plan_prefill(q_lens, q_lens + 10, KV_HEADS, RATIO, BM, BN, SLOTS, max_pieces=0)
        assert len(work.items) <= cap


def test_a_budget_graph_checks_its_arguments():
    config = CacheConfig(1, 2, 64, 16, 32, np.float16)
    with KvCache(config, backend="host") as cache:
        for kwargs, match in (({"token_budget": 0}, "token_budget"),
                              ({"token_budget": 1.5}, "token_budget"),
                              ({"token_budget": 64, "max_seqs": 0}, "max_seqs"),
                              ({"max_seqs": 8}, "max_seqs 8 is a budget graph's")):
            with pytest.raises((ValueError, TypeError), match=match):
                cache.step_graph(**kwargs)


# --- on the device ---------------------------------------------------------------------------
class BudgetSteps:
    """Sequences that each prefill a prompt in chunks and then decode, a random composition
    a step under a token budget: activations of ``budget`` rows, refilled with random values
    before each step (the rows past the step's tokens with NaN). With ``prefix``, sequence
    s0 starts with that many tokens cached (random values: the slab is filled first)."""

    def __init__(self, backend, rng, config, budget, prompts, prefix=0):
        self.rng, self.budget = rng, budget
        self.cache = KvCache(config, backend=backend)
        c = config
        self.act = np.dtype(c.activation_dtype)
        slab = self.cache.slab
        values = rng.standard_normal(slab.shape, np.float32) * 0.5
        slab.buffer.copy_from_host(values.astype(slab.dtype))
        self.left = {f"s{i}": int(n) for i, n in enumerate(prompts)}  # prompt tokens to go
        self.started = set()
        if prefix:
            self.cache.add_sequence("s0", prefix)
            self.started.add("s0")
        kv, q = (budget, c.num_kv_heads, c.head_dim), (budget, c.num_q_heads, c.head_dim)
        self.layers = [tuple(DeviceArray.empty(shape, self.act, backend=backend)
                             for shape in (kv, kv, q, q)) for _ in range(c.num_layers)]

    def next(self):
        """Decodes of the prompts done, then chunks of random lengths while the budget lasts
        (a sequence starts with its first chunk); the step's plan and its query rows."""
        decoding = [s for s, n in self.left.items() if n == 0]
        order = list(self.rng.permutation([s for s, n in self.left.items() if n > 0]))
        room = self.budget - len(decoding)
        chunks, q_lens = [], []
        for seq_id in order:
            if room <= 0:
                break
            size = int(min(self.left[seq_id], room, self.rng.integers(1, 40)))
            chunks.append(seq_id)
            q_lens.append(size)
            room -= size
        if decoding:
            self.cache.append(decoding)
        for seq_id, size in zip(chunks, q_lens):
            if seq_id in self.started:
                self.cache.extend([seq_id], [size])
            else:
                self.cache.add_sequence(seq_id, size)
                self.started.add(seq_id)
            self.left[seq_id] -= size
        meta = self.cache.batch(decoding + chunks,
                                query_lens=np.array([1] * len(decoding) + q_lens, np.int32))
        rows = len(decoding) + sum(q_lens)
        for key, value, query, out in self.layers:
            for array in (key, value, query):
                values = self.rng.standard_normal(array.shape, np.float32).astype(self.act)
                values[rows:] = np.nan  # rows past the step's: never read into its results
                array.buffer.copy_from_host(values)
            out.buffer.fill(POISON)
        return meta, rows

    def check(self, meta, rows):
        results = [(query.to_numpy()[:rows], out.to_numpy()[:rows])
                   for _, _, query, out in self.layers]
        check_step(self.cache, meta, results, layers=range(len(self.layers)))

    def close(self):
        for layer in self.layers:
            for array in layer:
                array.buffer.close()
        self.cache.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_capture_replays_steps_of_any_composition(gpu, rng, dtype):
    """Twelve prompts prefilled in random chunks under a budget of 96 tokens, then decoded:
    the decodes, chunks and members change every step, and one capture (and one more where
    the decode work outgrows its room) replays them all, each step equal to the float64
    reference."""
    config = CacheConfig(2, 2, 64, 16, 400, dtype, num_q_heads=8)
    steps = BudgetSteps(gpu, rng, config, 96, rng.integers(1, 120, 12))
    with steps.cache.step_graph(headroom=256, token_budget=96, max_seqs=12) as graph:
        kinds = []
        for _ in range(14):
            meta, rows = steps.next()
            kinds.append(graph.run(meta, steps.layers))
            steps.check(meta, rows)
        assert kinds[0] is False and graph.replays >= 9, kinds
    steps.close()


def test_budget_replays_equal_plain_launches_with_pieces_and_fp8(gpu, rng):
    """An fp8 cache (each layer's scales) and chunks over a long cached prefix, cut into
    pieces: each replay's outputs equal the plain launches of its plan."""
    config = CacheConfig(2, 2, 128, 16, 600, "float8_e4m3fn", num_q_heads=8,
                         activation_dtype=ml_dtypes.bfloat16,
                         kv_scales=((0.02, 0.05), (0.5, 0.01)))
    steps = BudgetSteps(gpu, rng, config, 256, [120, 5, 7], prefix=1500)
    pieces = 0
    with steps.cache.step_graph(headroom=64, token_budget=256, max_seqs=4) as graph:
        for _ in range(5):
            meta, rows = steps.next()
            graph.run(meta, steps.layers)
            pieces += int(graph._uploads is not None and graph.shape.arrays(
                activations_of(steps.layers), meta)[-1].any())
            for layer, (_, _, query, out) in enumerate(steps.layers):
                plain_q = DeviceArray.from_numpy(query.to_numpy()[:rows], backend=gpu)
                plain_out = DeviceArray.empty(plain_q.shape, steps.act, backend=gpu)
                steps.cache.attention(layer, plain_out, plain_q, meta)
                got = out.to_numpy()[:rows].astype(np.float64)
                assert relative_error(got, plain_out.to_numpy().astype(np.float64)) < 3e-2
                plain_q.buffer.close()
                plain_out.buffer.close()
        assert graph.replays >= 3 and pieces >= 1, (graph.replays, pieces)
    steps.close()


def test_a_step_over_the_budget_is_refused_and_changes_nothing(gpu, rng):
    config = CacheConfig(1, 2, 64, 16, 100, np.float16, num_q_heads=4)
    steps = BudgetSteps(gpu, rng, config, 32, [20, 20])
    with steps.cache.step_graph(token_budget=32) as graph:
        meta, rows = steps.next()
        assert graph.run(meta, steps.layers) is False
        steps.check(meta, rows)
        steps.cache.add_sequence("big", 40)
        big = steps.cache.batch(["big"], query_lens=np.array([40], np.int32))
        shape, captures = graph.shape, graph.captures
        with pytest.raises(ValueError, match="40 query tokens exceeds the graph's "
                                             "token_budget 32"):
            graph.run(big, steps.layers)
        assert graph.shape is shape and graph.captures == captures
    steps.close()
