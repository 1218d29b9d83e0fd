"""Mixed steps as one graph: decodes with prefill chunks or drafted tokens
(``batch(query_lens=...)``) captured once and replayed while their composition holds. The
capture rules run everywhere; replays run on the GPU, against the float64 reference and
against the same step's plain launches."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_cache_multi import check_step
from test_ops import POISON, TOLERANCE, relative_error

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.cache.step.graph_layout import GraphShape
from rocmforge_raw.kernels.planning import plan_work
from rocmforge_raw.memory.array import DeviceArray


# --- the capture's rules (no device) ----------------------------------------------------------
def test_a_mixed_capture_replays_only_its_query_lengths_and_splits_only_its_decodes():
    lens = np.array([40, 70, 300, 500], np.int32)
    split = plan_work(8, 100, 2, lens[:2] + 16)
    shape = GraphShape(("a", "b", "c", "d"), (), 30, 8, split.total, split.per_cta,
                       split.num_ctas, None, (1, 1, 64, 64), 2)
    grown = lens + np.array([16, 16, 4000, 4000], np.int32)  # chunks: no bound but the width
    work = shape.admits(("a", "b", "c", "d"), (), 30, grown, (1, 1, 64, 64))
    assert work is not None and len(work) == 2
    cum16, first_seq = work
    assert cum16.size == 3 and cum16[-1] * 8 == split.total  # the two decodes' work only
    assert first_seq.size == split.num_ctas
    for why, q_lens in {"other lengths": (1, 1, 64, 32), "a decode became a chunk":
                        (1, 2, 64, 64), "a plain decode step": None}.items():
        assert shape.admits(("a", "b", "c", "d"), (), 30, lens, q_lens) is None, why
    assert shape.admits(("a", "b", "c", "d"), (), 30, lens + np.array([100, 0, 0, 0], np.int32),
                        (1, 1, 64, 64)) is None, "a decode outgrew its room"
    chunks = GraphShape(("c", "d"), (), 30, 0, 0, 0, 0, None, (64, 64), 0)
    assert chunks.admits(("c", "d"), (), 30, lens[2:] + 4000, (64, 64)) == ()
    assert chunks.admits(("c", "d"), (), 31, lens[2:], (64, 64)) is None, "a wider table"


# --- on the device ---------------------------------------------------------------------------
class MixedSteps:
    """Sequences ``d*`` decoding and ``p*`` prefilled ``chunk`` tokens a step (or verifying
    ``chunk`` drafted tokens), with one set of device activations for every step (a graph
    replays at fixed addresses) refilled with random values before each step."""

    def __init__(self, backend, rng, config, decodes, prompts, chunk):
        self.backend, self.rng = backend, rng
        self.cache = KvCache(config, backend=backend)
        c = config
        self.ids = [f"d{i}" for i in range(len(decodes))] + [f"p{i}" for i in
                                                               range(len(prompts))]
        for seq_id, n in zip(self.ids, list(decodes) + list(prompts)):
            self.cache.add_sequence(seq_id, int(n))
        self.q_lens = np.array([1] * len(decodes) + [chunk] * len(prompts), np.int32)
        rows = int(self.q_lens.sum())
        self.act = np.dtype(c.activation_dtype)
        kv, q = (rows, c.num_kv_heads, c.head_dim), (rows, c.num_q_heads, c.head_dim)
        self.layers = [tuple(DeviceArray.empty(shape, self.act, backend=backend)
                             for shape in (kv, kv, q, q)) for _ in range(c.num_layers)]
        self.want = DeviceArray.empty(q, self.act, backend=backend)
        self.decodes = len(decodes)

    def next(self):
        """Reserve the next step's tokens and plan it; fresh random activations."""
        decoding, prefilling = self.ids[:self.decodes], self.ids[self.decodes:]
        if decoding:
            self.cache.append(decoding)
        if prefilling:
            self.cache.extend(prefilling, self.q_lens[self.decodes:].tolist())
        self.written = []  # each layer's new key and value rows, as sent
        for key, value, query, _ in self.layers:
            for array in (key, value, query):
                values = self.rng.standard_normal(array.shape, np.float32).astype(self.act)
                array.buffer.copy_from_host(values)
                if array is not query:
                    self.written.append(values)
        for *_, out in self.layers:
            out.buffer.fill(POISON)
        return self.cache.batch(self.ids, query_lens=self.q_lens)

    def check_against_plain_launches(self, meta):
        """Each layer's replayed output equals the same step's plain launches (the K/V the
        replay wrote are in the cache; only the attention runs again)."""
        tolerance = TOLERANCE[self.act] if self.cache.config.dtype == self.act else 3e-2
        for layer, (_, _, query, out) in enumerate(self.layers):
            self.want.buffer.fill(POISON)
            self.cache.attention(layer, self.want, query, meta)
            got, want = out.to_numpy().astype(np.float64), self.want.to_numpy()
            assert relative_error(got, want.astype(np.float64)) < tolerance, layer

    def check_against_the_reference(self, meta):
        """The replay wrote every new token's K/V at the step's slots, and each layer's
        output is the float64 reference's over the cache."""
        slots, bs = meta.slot_mapping, self.cache.config.block_size
        mine = slots >= 0  # (-1: a token of a shared block, written before)
        for layer in range(len(self.layers)):
            for plane, sent in zip((self.cache.k_cache(layer), self.cache.v_cache(layer)),
                                   self.written[2 * layer : 2 * layer + 2]):
                held = plane.to_numpy()[slots[mine] // bs, :, slots[mine] % bs]
                np.testing.assert_array_equal(held, sent[mine])
        results = [(query.to_numpy(), out.to_numpy()) for _, _, query, out in self.layers]
        check_step(self.cache, meta, results, layers=range(len(self.layers)))

    def close(self):
        for layer in self.layers:
            for array in layer:
                array.buffer.close()
        self.want.buffer.close()
        self.cache.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_replayed_mixed_steps_match_the_reference_across_blocks_and_recaptures(gpu, rng,
                                                                               dtype):
    """Decodes and prefill chunks of 24 tokens, 12 steps from captures with 48 tokens of
    headroom: the chunks outgrow the tables' width (re-captures) while steps in between
    replay, and every step equals the float64 reference."""
    config = CacheConfig(2, 2, 64, 16, 200, dtype, num_q_heads=8)
    steps = MixedSteps(gpu, rng, config, decodes=(5, 17, 90), prompts=(1, 40), chunk=24)
    with steps.cache.step_graph(headroom=48) as graph:
        kinds = []
        for _ in range(12):
            meta = steps.next()
            kinds.append(graph.run(meta, steps.layers))
            steps.check_against_the_reference(meta)
        assert kinds[0] is False and graph.captures >= 2 and graph.replays >= 6, kinds
    steps.close()


@pytest.mark.parametrize("case", ["chunks only", "drafted tokens", "fp8"])
def test_replays_equal_the_plain_launches_of_the_same_step(gpu, rng, case):
    """Steps of chunks alone (no decode launch), of 4 drafted tokens a sequence after
    decodes, and of an fp8 cache (each layer's scales): every replay's output equals the
    plain launches of its plan."""
    if case == "fp8":
        config = CacheConfig(2, 2, 128, 16, 300, "float8_e4m3fn", num_q_heads=8,
                             activation_dtype="bfloat16", kv_scales=((0.02, 0.05), (0.5, 0.01)))
        decodes, prompts, chunk = (33, 200), (3, 500), 16
    else:
        config = CacheConfig(2, 2, 128, 16, 300, ml_dtypes.bfloat16, num_q_heads=8)
        decodes, prompts, chunk = {"chunks only": ((), (1, 7, 300), 40),
                                   "drafted tokens": ((9, 600), (30, 31, 400), 4)}[case]
    steps = MixedSteps(gpu, rng, config, decodes, prompts, chunk)
    with steps.cache.step_graph(headroom=64) as graph:
        for _ in range(4):
            meta = steps.next()
            graph.run(meta, steps.layers)
            steps.check_against_plain_launches(meta)
        assert graph.replays >= 2
    steps.close()


def test_other_query_lengths_or_members_recapture(gpu, rng):
    config = CacheConfig(1, 2, 64, 16, 100, np.float16, num_q_heads=4)
    steps = MixedSteps(gpu, rng, config, decodes=(10,), prompts=(5,), chunk=8)
    with steps.cache.step_graph() as graph:
        assert graph.run(steps.next(), steps.layers) is False
        assert graph.run(steps.next(), steps.layers) is True
        old = steps.layers  # the same members, another token count: other activations
        steps.q_lens[-1] = 4
        steps.layers = [tuple(DeviceArray.empty((5, *a.shape[1:]), a.dtype, backend=gpu)
                              for a in layer) for layer in old]
        meta = steps.next()
        assert graph.run(meta, steps.layers) is False
        steps.check_against_the_reference(meta)
        assert graph.run(steps.next(), steps.layers) is True
        assert graph.captures == 2 and graph.replays == 2
    for layer in old:
        for array in layer:
            array.buffer.close()
    steps.close()


def test_a_capture_that_fails_after_its_upload_leaves_no_stale_graph(gpu, rng, monkeypatch):
    """A mixed capture uploads its work items before it records: if it then fails, the
    current graph's metadata may be overwritten, so the next step captures again (and is
    right) instead of replaying it."""
    config = CacheConfig(1, 2, 64, 16, 100, np.float16, num_q_heads=4)
    steps = MixedSteps(gpu, rng, config, decodes=(10,), prompts=(5, 30), chunk=8)
    with steps.cache.step_graph() as graph:
        assert graph.run(steps.next(), steps.layers) is False
        steps.q_lens[-1] = 4  # another composition (same rows: its layers fit as they are)
        steps.q_lens[-2] = 12
        meta = steps.next()

        def failing(*args):
            raise RuntimeError("instantiate failed")

        with monkeypatch.context() as patch:
            patch.setattr(gpu, "graph_instantiate", failing)
            with pytest.raises(RuntimeError, match="instantiate failed"):
                graph.run(meta, steps.layers)
        assert graph.shape is None
        steps.q_lens[-1], steps.q_lens[-2] = 8, 8
        meta = steps.next()
        assert graph.run(meta, steps.layers) is False  # captured again, not replayed
        steps.check_against_the_reference(meta)
    steps.close()
