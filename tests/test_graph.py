"""A decode step as one graph: the layout rules (on every backend), replays against the float64
reference (GPU), and the backends' graph calls."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_step import Decoder, _hold

import rocmforge_raw as rf
from rocmforge_raw.cache.step.graph_layout import GraphShape, padded_work
from rocmforge_raw.errors import DeviceError
from rocmforge_raw.kernels.planning import plan_work
from rocmforge_raw.memory.array import DeviceArray


def _round16(n):
    return max(16, -(-int(n) // 16) * 16)


# --- the layout of a replay (pure rules, no device) ---------------------------------------
@pytest.mark.parametrize("groups, headroom", [(1, 0), (8, 16), (2, 128), (4, 1000)])
def test_padded_work_keeps_the_captured_total_and_gives_each_sequence_its_own(rng, groups,
                                                                            headroom):
    for _ in range(20):
        lens = rng.integers(1, 3000, rng.integers(1, 40)).astype(np.int32)
        split = plan_work(groups, 132 * 3, lens.size, lens + headroom)
        grown = (lens + rng.integers(0, headroom + 1, lens.size)).astype(np.int32)
        cum16, first_seq = padded_work(grown, groups, split.total, split.per_cta,
                                       split.num_ctas)
        work = np.diff(cum16)
        assert cum16[0] == 0 and cum16[-1] * groups == split.total
        assert (work >= [_round16(n) for n in grown]).all() and (work % 16 == 0).all()
        assert work.max() - work.min() <= max(w - _round16(n) for w, n in zip(work, grown)) + (
            max(_round16(n) for n in grown) - min(_round16(n) for n in grown))
        units = np.repeat(cum16[:-1] * groups, 1)  # where each sequence's units start
        for cta, seq in enumerate(first_seq):  # the sequence holding the CTA's first token
            start = cta * split.per_cta
            assert units[seq] <= start < cum16[seq + 1] * groups
        assert split.num_ctas == -(-split.total // split.per_cta)


def test_padded_work_spreads_the_slack_over_every_sequence():
    lens = np.array([100, 100, 100, 100], np.int32)  # 112 work tokens each
    cum16, _ = padded_work(lens, 1, 4 * 112 + 5 * 16, 64, 8)
    assert np.diff(cum16).tolist() == [144, 128, 128, 128]


def test_padded_work_refuses_lengths_past_the_captured_total():
    lens = np.array([100, 100], np.int32)
    assert padded_work(lens, 2, 2 * 2 * 112, 64, 7) is not None
    assert padded_work(lens + 12, 2, 2 * 2 * 112, 64, 7) is not None  # 112: still fits
    assert padded_work(lens + 13, 2, 2 * 2 * 112, 64, 7) is None  # 113 needs 128
    assert padded_work(np.zeros(0, np.int32), 2, 64, 64, 1) is None


def test_a_padded_capture_lays_each_step_out_in_whole_pieces(rng):
    """Captured with a split padded to whole pieces (the device's multiprocessors known),
    each replay gives every sequence its work in whole pieces, so every CTA holds one piece
    of one unit; the rest of the capture's work goes to the last sequence, past its length."""
    lens = np.full(8, 1000, np.int32)
    room = lens + 128
    split = plan_work(8, 396, 8, room, sms=132)
    assert (np.diff(split.cum16) % split.per_cta == 0).all()  # the capture is padded
    bound = sum(_round16(n) for n in room)
    for step in range(0, 129, 16):
        grown = lens + step
        cum16, first_seq = padded_work(grown, 8, split.total, split.per_cta, split.num_ctas,
                                       bound)
        work = np.diff(cum16)
        assert cum16[-1] * 8 == split.total and (work % split.per_cta == 0).all()
        assert (work >= [_round16(n) for n in grown]).all()
        for cta, seq in enumerate(first_seq):
            start = cta * split.per_cta  # a CTA starts a piece inside one sequence's units
            assert cum16[seq] * 8 <= start < cum16[seq + 1] * 8
            assert (start - cum16[seq] * 8) % split.per_cta == 0


def test_a_padded_capture_is_outgrown_by_its_headroom_not_by_its_padding():
    lens = np.full(8, 1000, np.int32)
    room = lens + 8
    split = plan_work(8, 396, 8, room, sms=132)
    bound = sum(_round16(n) for n in room)
    assert split.total // 8 > bound  # the padding holds more than the headroom
    assert padded_work(lens + 8, 8, split.total, split.per_cta, split.num_ctas, bound)
    assert padded_work(lens + 9, 8, split.total, split.per_cta, split.num_ctas, bound) is None
    # one past its own room by more than a piece, the others shorter: within the bound,
    # but no longer in whole pieces: each gets its work and an even share of the slack
    uneven = np.array([1040] + [992] * 7, np.int32)
    cum16, _ = padded_work(uneven, 8, split.total, split.per_cta, split.num_ctas, bound)
    work = np.diff(cum16)
    assert cum16[-1] * 8 == split.total and (work % split.per_cta != 0).any()
    assert (work >= [_round16(n) for n in uneven]).all() and work.max() - work.min() <= 64


def test_a_capture_is_replayed_only_for_its_members_activations_width_and_work():
    lens = np.array([40, 70], np.int32)
    split = plan_work(8, 100, 2, lens + 16)
    shape = GraphShape(("a", "b"), ((1, (2, 8, 64)),), 6, 8, split.total, split.per_cta,
                       split.num_ctas)
    assert shape.admits(("a", "b"), ((1, (2, 8, 64)),), 6, lens + 16) is not None
    assert shape.admits(("a", "b"), ((1, (2, 8, 64)),), 5, lens) is not None
    refused = {"order": (("b", "a"), ((1, (2, 8, 64)),), 6, lens),
               "membership": (("a", "c"), ((1, (2, 8, 64)),), 6, lens),
               "activations": (("a", "b"), ((2, (2, 8, 64)),), 6, lens),
               "wider table": (("a", "b"), ((1, (2, 8, 64)),), 7, lens),
               "outgrown work": (("a", "b"), ((1, (2, 8, 64)),), 6, lens + 40)}
    for why, args in refused.items():
        assert shape.admits(*args) is None, why


# --- what runs everywhere: refusals ---------------------------------------------------------
def test_graphs_on_the_host_backend_are_a_clear_error(rng):
    host = rf.get_backend("host")
    for call in (lambda: host.graph_begin(None), lambda: host.graph_end(None),
                 lambda: host.graph_instantiate(None, 0), lambda: host.graph_launch(None, None),
                 lambda: host.graph_destroy(None, None, 0)):
        with pytest.raises(NotImplementedError, match=r"host backend has no graphs.*GPU"):
            call()
    model = Decoder(host, rng, lens=(5, 16))
    with model.cache.step_graph() as graph:
        model.cache.append(model.ids)
        meta = model.cache.batch(model.ids)
        with pytest.raises(NotImplementedError, match="host backend has no graphs"):
            graph.run(meta, model.inputs())
        assert graph.captures == graph.replays == 0
    model.close()


def test_a_graph_refuses_stale_plans_foreign_plans_and_bad_arguments(backend, rng):
    model = Decoder(backend, rng, lens=(5, 16))
    other = Decoder(backend, rng, lens=(3,))
    cache = model.cache
    layers = model.inputs()
    with cache.step_graph() as graph:
        changes = {"append": lambda: cache.append(model.ids),
                   "fork": lambda: cache.fork("s0", "f"), "finish": lambda: cache.finish("f"),
                   "prefix sharing": lambda: cache.add_sequence("p", tokens=np.arange(40)),
                   "preemption": lambda: cache.add_sequence(
                       "big", 16 * cache.pool.num_free + 1),  # preempts the least recent
                   "removal": lambda: cache.remove("big")}
        for why, change in changes.items():
            meta = cache.batch(["s0"])
            change()
            with pytest.raises(ValueError, match="batch metadata is stale"):
                graph.run(meta, layers)
            assert why != "preemption" or cache.stats()["preemptions"] > 0
        with pytest.raises(ValueError, match="metadata from this cache's batch"):
            graph.run(other.cache.batch(other.ids), layers)
        with pytest.raises(TypeError, match="headroom must be an integer"):
            cache.step_graph(headroom=1.5)
        with pytest.raises(ValueError, match="headroom must be >= 0"):
            cache.step_graph(headroom=-1)
        assert graph.captures == 0
    graph.close()
    graph.close()
    meta = cache.batch(["s0"])
    with pytest.raises(ValueError, match="StepGraph was closed"):
        graph.run(meta, layers)
    model.close()
    other.close()


def test_hip_graph_calls_reach_debians_runtime_and_report_its_status(
        hip_runtime_without_device):
    """hip.py's graph calls go through hip-python into libamdhip64; with no device each
    returns a failing status, which check() raises as DeviceError naming the API."""
    from rocmforge_raw.runtime.hip import HipBackend

    hip = object.__new__(HipBackend)  # its __init__ refuses: no device answers here
    calls = {"hipStreamBeginCapture": lambda: hip.graph_begin(None),
             "hipStreamEndCapture": lambda: hip.graph_end(None),
             "hipGraphLaunch": lambda: hip.graph_launch(None, None)}
    for api, call in calls.items():
        with pytest.raises(DeviceError, match=api):
            call()


# --- on the device ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_replayed_steps_match_the_reference_across_blocks_and_recaptures(gpu, rng, dtype):
    """Steps replayed from one capture (tables, lengths and slots updated in place) equal
    the float64 reference; crossing the headroom re-captures, and then replays again."""
    model = Decoder(gpu, rng, dtype, lens=(1, 15, 16, 17, 90))
    layers = model.inputs()
    with model.cache.step_graph(headroom=8) as graph:
        kinds = []
        for _ in range(20):  # crosses block boundaries and the 8-token headroom
            model.cache.append(model.ids)
            meta = model.cache.batch(model.ids)
            for _, _, _, out in layers:
                out.buffer.fill(0xFF)  # NaN: an output the replay did not write fails
            kinds.append(graph.run(meta, layers))
            model.check(meta.block_tables, meta.seq_lens, [(q, o) for _, _, q, o in layers])
        assert kinds[0] is False and graph.captures >= 2 and graph.replays >= 14
        assert graph.captures + graph.replays == 20
    model.close()


def test_a_new_membership_or_new_activations_recapture(gpu, rng):
    model = Decoder(gpu, rng, "float16", lens=(20, 40, 60))
    layers = model.inputs()
    with model.cache.step_graph() as graph:
        model.cache.append(model.ids)
        assert graph.run(model.cache.batch(model.ids), layers) is False
        model.cache.append(model.ids)
        assert graph.run(model.cache.batch(model.ids), layers) is True
        model.cache.finish("s2")
        model.cache.add_sequence("s9", 33)
        model.ids = ["s0", "s1", "s9"]
        model.cache.append(model.ids)
        meta = model.cache.batch(model.ids)
        assert graph.run(meta, layers) is False  # same shape, other members: re-captured
        model.check(meta.block_tables, meta.seq_lens, [(q, o) for _, _, q, o in layers])
        model.cache.append(model.ids)
        fresh = model.inputs()
        meta = model.cache.batch(model.ids)
        assert graph.run(meta, fresh) is False
        model.check(meta.block_tables, meta.seq_lens, [(q, o) for _, _, q, o in fresh])
        assert graph.captures == 3 and graph.replays == 1
    model.close()


@pytest.mark.timing
def test_planning_ahead_never_waits_and_never_overwrites_what_the_device_reads(gpu, rng):
    """The serving loop's plan-ahead: steps queued behind a long hold, each next step's
    bookkeeping and upload made at once (the device has not started); every step equals the
    reference, so no upload overwrote metadata an earlier step's kernels were to read."""
    model = Decoder(gpu, rng, "bfloat16", lens=(3, 16, 31, 200))
    layers = [model.inputs() for _ in range(3)]
    model.step()  # loads the kernels
    done = rf.Event(backend=gpu)
    model.cache.append(model.ids)
    meta = model.cache.batch(model.ids)
    _hold(gpu, 300)
    began = time.perf_counter()
    steps = []
    for inputs in layers:
        for layer, (k, v, q, out) in enumerate(inputs):
            model.cache.write(layer, k, v, meta)
            model.cache.attention(layer, out, q, meta)
        steps.append((meta.block_tables, meta.seq_lens, [(q, o) for _, _, q, o in inputs]))
        model.cache.append(model.ids)  # plan ahead: the next step, the device still held
        meta = model.cache.batch(model.ids)
    done.record()
    assert time.perf_counter() - began < 0.2 and not gpu.event_query(done.handle), (
        "planning ahead waited for the device")
    done.synchronize()
    for tables, lens, per_layer in steps:
        model.check(tables, lens, per_layer)
    done.close()
    model.close()


@pytest.mark.timing
def test_replays_planned_ahead_never_wait_and_read_their_own_metadata(gpu, rng):
    """Graph replays queued behind a hold, each next step planned at once: the fixed
    metadata is updated in place in stream order, so each replay reads its own step's
    tables and lengths (outputs saved by device copies after each replay)."""
    with rf.Stream(backend=gpu) as stream:
        model = Decoder(gpu, rng, "float16", lens=(3, 16, 31, 200), stream=stream)
        layers = model.inputs()
        saved = [[DeviceArray.empty(out.shape, out.dtype, backend=gpu) for *_, out in layers]
                 for _ in range(3)]
        with model.cache.step_graph() as graph:
            model.cache.append(model.ids)
            assert graph.run(model.cache.batch(model.ids), layers) is False  # captures
            model.cache.append(model.ids)
            meta = model.cache.batch(model.ids)
            stream.synchronize()
            done = rf.Event(backend=gpu)
            _hold(gpu, 300, stream)
            began = time.perf_counter()
            steps = []
            for copies in saved:
                assert graph.run(meta, layers) is True
                for copy, (*_, out) in zip(copies, layers):
                    copy.buffer.copy_from(out.buffer, stream=stream)
                steps.append((meta.block_tables, meta.seq_lens))
                model.cache.append(model.ids)  # plan ahead
                meta = model.cache.batch(model.ids)
            done.record(stream)
            assert time.perf_counter() - began < 0.2 and not gpu.event_query(done.handle), (
                "replays planned ahead waited for the device")
            done.synchronize()
            for (tables, lens), copies in zip(steps, saved):
                model.check(tables, lens, [(q, copy) for (_, _, q, _), copy in
                                           zip(layers, copies)])
            assert graph.replays == 3
            done.close()
        for copies in saved:
            for copy in copies:
                copy.buffer.close()
        model.close()


def test_a_graph_checks_its_layers_before_capturing(gpu, rng):
    model = Decoder(gpu, rng, "float16", lens=(20, 40))
    layers = model.inputs()
    wrong = DeviceArray.empty((2, 3, 64), np.float16, backend=gpu)
    with model.cache.step_graph() as graph:
        model.cache.append(model.ids)
        meta = model.cache.batch(model.ids)
        with pytest.raises(ValueError, match="layers must be 2 tuples"):
            graph.run(meta, layers[:1])
        with pytest.raises(ValueError, match=r"query must have shape \(2, 4, 64\)"):
            graph.run(meta, [layers[0], (*layers[1][:2], wrong, layers[1][3])])
        with pytest.raises(TypeError, match="key must be a DeviceArray"):
            graph.run(meta, [layers[0], (np.zeros(3), *layers[1][1:])])
        assert graph.captures == 0
        assert graph.run(meta, layers) is False and graph.captures == 1
    wrong.buffer.close()
    model.close()
