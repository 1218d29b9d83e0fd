"""The per-step plan: batch() once, then one launch per layer call, in stream order."""

from __future__ import annotations

import math
import time

import ml_dtypes
import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.cache import BatchMetadata, CacheConfig, KvCache
from rocmforge_raw.kernels import ops, reference
from rocmforge_raw.kernels.module import load_kernels
from rocmforge_raw.kernels.staging import StagingRing
from rocmforge_raw.memory.array import DeviceArray

TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def _random(rng, shape, dtype, backend):
    return DeviceArray.from_numpy(rng.standard_normal(shape, np.float32).astype(dtype),
                                  backend=backend)


def _hold(backend, ms, stream=None):
    """Keep ``stream``'s device busy for ``ms`` milliseconds (queued, not waited for)."""
    load_kernels("basic", backend=backend).function("rf_hold_ns").launch(
        1, 32, np.uint64(int(ms * 1e6)), stream=stream)


class Decoder:
    """A small model decoding through the step API: every step appends one token to each
    sequence, plans the batch, writes the new K/V and runs attention in every layer."""

    def __init__(self, backend, rng, dtype="float32", lens=(1, 15, 16, 17, 90), q_heads=4,
                 stream=None, **config):
        shape = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
        shape.update(config)
        blocks = sum(-(-(n + 40) // shape["block_size"]) for n in lens) + 1
        self.cache = KvCache(CacheConfig(**shape, num_blocks=blocks, dtype=dtype),
                             backend=backend, stream=stream)
        self.backend, self.rng, self.q_heads = backend, rng, q_heads
        self.ids = [f"s{i}" for i in range(len(lens))]
        c = self.cache.config
        for sid, n in zip(self.ids, lens):
            slots = self.cache.add_sequence(sid, n).slot_mapping
            for layer in range(c.num_layers):
                kv = _random(rng, (n, c.num_kv_heads, c.head_dim), c.dtype, backend)
                self.cache.write(layer, kv, kv, slots)
                kv.buffer.close()
        self.arrays = []

    def inputs(self):
        """Per layer: the step's new K and V rows, a query, and an output poisoned with NaN
        (made before a hold: uploads on the default stream would wait for it)."""
        c = self.cache.config
        n, kv_shape = len(self.ids), (len(self.ids), c.num_kv_heads, c.head_dim)
        layers = []
        for _ in range(c.num_layers):
            k, v = (_random(self.rng, kv_shape, c.dtype, self.backend) for _ in range(2))
            q = _random(self.rng, (n, self.q_heads, c.head_dim), c.dtype, self.backend)
            out = DeviceArray.empty(q.shape, c.dtype, backend=self.backend)
            out.buffer.fill(0xFF)  # NaN: an unwritten output cannot pass
            layers.append((k, v, q, out))
            self.arrays += [k, v, q, out]
        return layers

    def step(self, inputs=None):
        """One decode step; returns (metadata, [(query, out) per layer])."""
        inputs = inputs or self.inputs()
        self.cache.append(self.ids)
        meta = self.cache.batch(self.ids)
        for layer, (k, v, q, out) in enumerate(inputs):
            self.cache.write(layer, k, v, meta)
            self.cache.attention(layer, out, q, meta)
        return meta, [(q, out) for _, _, q, out in inputs]

    def check(self, tables, lens, per_layer):
        """Each layer's output against the float64 reference over the cache as it is now
        (later steps only add tokens past ``lens``)."""
        c = self.cache.config
        for layer, (q, out) in enumerate(per_layer):
            want = reference.paged_attention(
                q.to_numpy(), self.cache.k_cache(layer).to_numpy(),
                self.cache.v_cache(layer).to_numpy(), tables, lens,
                1 / math.sqrt(c.head_dim), np.float64)
            got = out.to_numpy().astype(np.float64)
            assert not np.isnan(got).any(), f"layer {layer}: output not written"
            error = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert error < TOLERANCE[c.dtype.name], f"layer {layer}: relative error {error}"

    def close(self):
        for array in self.arrays:
            array.buffer.root.close()
        self.cache.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_decode_loop_through_the_step_plan_matches_the_reference(backend, rng, dtype):
    model = Decoder(backend, rng, dtype)
    for _ in range(18):  # crosses block boundaries: new blocks mid-loop
        meta, per_layer = model.step()
        model.check(meta.block_tables, meta.seq_lens, per_layer)
    model.close()


def test_write_with_a_plan_puts_each_new_token_at_its_reserved_slot(backend, rng):
    model = Decoder(backend, rng, lens=(5, 16))
    reservation = model.cache.append(model.ids)
    meta = model.cache.batch(model.ids)
    np.testing.assert_array_equal(meta.slot_mapping, reservation.slot_mapping)
    c = model.cache.config
    key = rng.standard_normal((2, c.num_kv_heads, c.head_dim), np.float32)
    model.cache.write(1, DeviceArray.from_numpy(key, backend=backend),
                      DeviceArray.from_numpy(-key, backend=backend), meta)
    planes = model.cache.k_cache(1).to_numpy(), model.cache.v_cache(1).to_numpy()
    for i, slot in enumerate(reservation.slot_mapping):
        block, offset = divmod(int(slot), c.block_size)
        np.testing.assert_array_equal(planes[0][block, :, offset], key[i])
        np.testing.assert_array_equal(planes[1][block, :, offset], -key[i])
    model.close()


def test_metadata_is_refused_once_stale_foreign_or_on_another_stream(backend, rng):
    model = Decoder(backend, rng, lens=(5, 16))
    other = Decoder(backend, rng, lens=(3,))
    cache, c = model.cache, model.cache.config
    q = _random(rng, (2, 4, c.head_dim), c.dtype, backend)
    out = DeviceArray.empty(q.shape, c.dtype, backend=backend)
    cache.attention(0, out, q, cache.batch(model.ids))  # current: fine
    changes = {"append": lambda: cache.append(model.ids),
               "batch": lambda: cache.batch(model.ids),
               "fork": lambda: cache.fork("s0", "f"), "finish": lambda: cache.finish("f")}
    for change in changes.values():
        meta = cache.batch(model.ids)
        change()
        with pytest.raises(ValueError, match="batch metadata is stale"):
            cache.attention(0, out, q, meta)
    meta = cache.batch(model.ids)
    with pytest.raises(ValueError, match="metadata from this cache's batch"):
        cache.attention(0, out, q, other.cache.batch(other.ids))
    with pytest.raises(ValueError, match="metadata from this cache's batch"):
        cache.write(0, q, q, BatchMetadata(model.ids, meta.block_tables, meta.seq_lens,
                                           meta.slot_mapping))
    with rf.Stream(backend=backend) as stream, pytest.raises(ValueError, match="stream differs"):
        cache.attention(0, out, q, meta, stream=stream)
    for array in (q, out):
        array.buffer.close()
    model.close()
    other.close()


def test_step_calls_check_shapes_dtypes_and_layer(backend, rng):
    model = Decoder(backend, rng, lens=(5, 16))
    cache, c = model.cache, model.cache.config
    meta = cache.batch(model.ids)
    q = _random(rng, (2, 4, c.head_dim), c.dtype, backend)  # read by the launches that pass
    wrong = DeviceArray.empty((3, 4, c.head_dim), c.dtype, backend=backend)
    half = DeviceArray.empty((2, 4, c.head_dim), np.float16, backend=backend)
    kv = _random(rng, (2, c.num_kv_heads, c.head_dim), c.dtype, backend)
    three = DeviceArray.empty((2, 3, c.head_dim), c.dtype, backend=backend)
    with pytest.raises(ValueError, match="num_q_heads 3 is not a multiple of num_kv_heads 2"):
        cache.attention(0, three, three, meta)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 64\), got \(3, 4, 64\)"):
        cache.attention(0, wrong, q, meta)
    with pytest.raises(ValueError, match="query must be float32, got float16"):
        cache.attention(0, q, half, meta)
    with pytest.raises(TypeError, match="query must be a DeviceArray, not ndarray"):
        cache.attention(0, q, np.zeros((2, 4, 64), np.float32), meta)
    with pytest.raises(IndexError, match=r"layer 2 outside \[0, 2\)"):
        cache.attention(2, q, q, meta)
    with pytest.raises(ValueError, match=r"key must have shape \(2, 2, 64\), got \(2, 4, 64\)"):
        cache.write(0, q, q, meta)
    with pytest.raises(ValueError, match="scale must be a finite number, got nan"):
        cache.attention(0, q, q, meta, scale=float("nan"))
    out = DeviceArray.empty(q.shape, c.dtype, backend=backend)
    cache.write(1, kv, kv, meta)  # nothing above changed the plan: it still works
    cache.attention(1, out, q, meta)
    for array in (q, out, wrong, half, kv, three):
        array.buffer.close()
    model.close()


def test_a_plan_attends_with_the_scale_each_call_asks_for(backend, rng):
    model = Decoder(backend, rng, lens=(40,))
    cache, c = model.cache, model.cache.config
    meta = cache.batch(model.ids)
    q = _random(rng, (1, 4, c.head_dim), c.dtype, backend)
    outs = [DeviceArray.empty(q.shape, c.dtype, backend=backend) for _ in range(3)]
    for out, scale in zip(outs, (0.5, None, 0.5)):
        cache.attention(0, out, q, meta, scale=scale)
    k, v = cache.k_cache(0).to_numpy(), cache.v_cache(0).to_numpy()
    for out, scale in zip(outs, (0.5, 1 / math.sqrt(c.head_dim), 0.5)):
        want = reference.paged_attention(q.to_numpy(), k, v, meta.block_tables, meta.seq_lens,
                                         scale, np.float64)
        np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-4, atol=1e-5)
    for array in (q, *outs):
        array.buffer.close()
    model.close()


def test_num_q_heads_in_the_config_plans_attention_in_batch(backend, rng):
    config = CacheConfig(1, 2, 64, 16, 8, "float32", num_q_heads=8)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 20)
        meta = cache.batch(["a"])
        assert meta._q_shape == (1, 8, 64)
        q = DeviceArray.empty((1, 4, 64), np.float32, backend=backend)
        with pytest.raises(ValueError, match=r"query must have shape \(1, 8, 64\)"):
            cache.attention(0, q, q, meta)
        q.buffer.close()
    with pytest.raises(ValueError, match="num_q_heads 6 is not a multiple of num_kv_heads 4"):
        CacheConfig(1, 4, 64, 16, 8, "float32", num_q_heads=6)


def test_a_closed_cache_refuses_new_work(backend):
    cache = KvCache(CacheConfig(1, 2, 64, 16, 8, "float32"), backend=backend)
    cache.add_sequence("a", 3)
    cache.close()
    cache.close()
    for call in (lambda: cache.add_sequence("b", 1), lambda: cache.append(["a"]),
                 lambda: cache.batch(["a"])):
        with pytest.raises(rf.BufferClosedError, match="KvCache was closed"):
            call()


# --- on the device: stream order, no synchronization --------------------------------------
@pytest.mark.timing
def test_plans_survive_a_device_far_behind(gpu, rng):
    """Steps queued behind a long hold: each step's metadata lives in its own staging slot
    until the device passed its launches, dropped plans included; then every result is
    checked against the reference."""
    model = Decoder(gpu, rng, "bfloat16")
    model.step()  # loads the kernels
    inputs = [model.inputs() for _ in range(6)]
    done = rf.Event(backend=gpu)
    _hold(gpu, 300)
    began = time.perf_counter()
    steps = []
    for step_inputs in inputs:
        meta, per_layer = model.step(step_inputs)
        steps.append((meta.block_tables, meta.seq_lens, per_layer))
        del meta  # dropped while the device has not even started on it
    done.record()
    assert time.perf_counter() - began < 0.2 and not gpu.event_query(done.handle), (
        "the steps waited for the device")
    done.synchronize()
    for tables, lens, per_layer in steps:
        model.check(tables, lens, per_layer)
    assert len(model.cache._steps.ring.slots) >= 3, "slots were reused before the device passed"
    done.close()
    model.close()


def test_one_off_ops_queue_behind_a_hold_and_stay_correct(gpu, rng):
    dtype, heads, dim, bs = np.float16, 2, 64, 16
    num_blocks = 64
    shape = (num_blocks, heads, bs, dim)
    k, v = (rng.standard_normal(shape, np.float32).astype(dtype) for _ in range(2))
    dk, dv = DeviceArray.from_numpy(k, backend=gpu), DeviceArray.from_numpy(v, backend=gpu)
    calls = []
    for _ in range(24):  # more calls than the ring's slots: some must wait for a fence
        lens = rng.integers(1, 200, 3).astype(np.int32)
        tables = rng.integers(1, num_blocks, (3, 13)).astype(np.int32)
        q = rng.standard_normal((3, 8, dim), np.float32).astype(dtype)
        calls.append((q, tables, lens, DeviceArray.empty(q.shape, dtype, backend=gpu),
                      DeviceArray.from_numpy(q, backend=gpu)))
    ops.paged_attention(calls[0][3], calls[0][4], dk, dv, calls[0][1], calls[0][2])  # loads
    _hold(gpu, 200)
    for _, tables, lens, out, dq in calls:
        ops.paged_attention(out, dq, dk, dv, tables, lens)
    for q, tables, lens, out, dq in calls:
        want = reference.paged_attention(q, k, v, tables, lens, 1 / math.sqrt(dim), np.float64)
        got = out.to_numpy().astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
        out.buffer.close()
        dq.buffer.close()
    dk.buffer.close()
    dv.buffer.close()


@pytest.mark.timing
def test_the_per_layer_path_launches_from_c_without_waiting(gpu, rng):
    model = Decoder(gpu, rng, "float16", num_layers=4)
    model.step()  # loads the kernels
    c = model.cache.config
    q = _random(rng, (len(model.ids), 4, c.head_dim), c.dtype, gpu)
    out = DeviceArray.empty(q.shape, c.dtype, backend=gpu)
    kv = _random(rng, (len(model.ids), c.num_kv_heads, c.head_dim), c.dtype, gpu)
    model.cache.append(model.ids)
    done = rf.Event(backend=gpu)
    _hold(gpu, 300)
    began = time.perf_counter()
    meta = model.cache.batch(model.ids)
    for layer in range(c.num_layers):
        model.cache.write(layer, kv, kv, meta)
        model.cache.attention(layer, out, q, meta)
    done.record()
    assert time.perf_counter() - began < 0.2 and not gpu.event_query(done.handle)
    assert meta._write.fallbacks == 0 and meta._attention.fallbacks == 0, "not launched from C"
    done.synchronize()
    done.close()
    for array in (q, out, kv):
        array.buffer.close()
    model.close()


@pytest.mark.timing
def test_two_caches_on_two_streams_run_concurrently(gpu, rng):
    with rf.Stream(backend=gpu) as slow, rf.Stream(backend=gpu) as fast:
        a = Decoder(gpu, rng, "float16", stream=slow)
        b = Decoder(gpu, rng, "float16", stream=fast)
        a_done, b_done = rf.Event(backend=gpu), rf.Event(backend=gpu)
        a.step(), b.step()  # loads the kernels
        a_inputs, b_inputs = a.inputs(), b.inputs()
        slow.synchronize()
        fast.synchronize()
        _hold(gpu, 500, slow)
        a_meta, a_layers = a.step(a_inputs)
        a_done.record(slow)
        b_meta, b_layers = b.step(b_inputs)
        b_done.record(fast)
        began = time.perf_counter()
        b_done.synchronize()
        assert time.perf_counter() - began < 0.3, "cache b waited for cache a's stream"
        assert not gpu.event_query(a_done.handle)
        b.check(b_meta.block_tables, b_meta.seq_lens, b_layers)
        a_done.synchronize()
        a.check(a_meta.block_tables, a_meta.seq_lens, a_layers)
        for model, event in ((a, a_done), (b, b_done)):
            event.close()
            model.close()


@pytest.mark.timing
def test_a_staging_ring_grows_while_the_device_lags_and_waits_past_its_depth(gpu):
    ring = StagingRing(gpu.get_device(), gpu, depth=2, max_depth=3)  # the suite's device
    data = np.arange(64, dtype=np.int64)
    _hold(gpu, 200)
    slots = []
    for _ in range(3):
        slot = ring.acquire()
        slot.put([data], None)
        slot.fence.mark(None)
        slots.append(slot)
    assert len(ring.slots) == 3 and len({id(s) for s in slots}) == 3
    began = time.perf_counter()
    assert ring.acquire() is slots[0]  # full: waits for the oldest fence, not the device
    assert time.perf_counter() - began > 0.05
    ring.close()


def test_a_prepared_launch_patches_pointers_and_floats_per_call(gpu):
    kernel = load_kernels("basic", backend=gpu).function("rf_fill_f32")
    with rf.HipBuffer(4096, backend=gpu) as a, rf.HipBuffer(4096, backend=gpu) as b:
        launch = kernel.prepare(4, 256, 0, 2.5, np.uint64(1024), patch=(0,))
        launch(a.ptr)
        launch.set_float(1, -1.0)
        launch(b.ptr)
        assert (a.to_numpy(np.float32) == 2.5).all() and (b.to_numpy(np.float32) == -1).all()
        assert launch.slot(0) == b.ptr and launch.fallbacks == 0


def test_bf16_step_plans_match_ml_dtypes_rounding(backend, rng):
    """The bf16 plan writes exactly the rounded values the host reference holds."""
    model = Decoder(backend, rng, "bfloat16", lens=(7,))
    model.cache.append(model.ids)
    meta = model.cache.batch(model.ids)
    key = rng.standard_normal((1, 2, 64), np.float32).astype(ml_dtypes.bfloat16)
    model.cache.write(0, DeviceArray.from_numpy(key, backend=backend),
                      DeviceArray.from_numpy(key, backend=backend), meta)
    block, offset = divmod(int(meta.slot_mapping[0]), 16)
    assert (model.cache.k_cache(0).to_numpy()[block, :, offset] == key[0]).all()
    model.close()


def test_a_new_cache_reads_as_zeros(backend):
    config = CacheConfig(2, 2, 64, 16, 5, "float16")
    with rf.HipBuffer(config.total_bytes, backend=backend) as dirty:
        dirty.fill(0xFF)  # the memory the cache is likely to get next
    with KvCache(config, backend=backend) as cache:
        assert not cache.slab.to_numpy().view(np.uint16).any()
