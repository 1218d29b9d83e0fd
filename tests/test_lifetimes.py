"""Lifetimes: DLPack consumers outlive close(), fixed array fields, closed objects refuse use."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw import DeviceArray, Event, Stream
from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.errors import BufferClosedError

CONFIG = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, block_size=8, num_blocks=8,
                     dtype="float32")


def live() -> int:
    gc.collect()
    return rf.memory_stats()["live_buffers"]


# --- DLPack exports defer close() -----------------------------------------------------------
def test_numpy_keeps_reading_a_closed_buffer_until_it_lets_go(rng):
    data = rng.standard_normal(4096).astype(np.float32)
    before = live()
    buf = rf.HipBuffer.from_numpy(data, backend="host")
    array = np.from_dlpack(buf.typed(np.float32))
    buf.close()
    assert buf.closed
    with pytest.raises(BufferClosedError):
        buf.ptr  # noqa: B018
    # Were the memory freed, this allocation of the same size would likely reuse it.
    with rf.HipBuffer.from_numpy(np.full_like(data, -7.0), backend="host"):
        np.testing.assert_array_equal(array, data)
    assert live() == before + 1, "the exported buffer is still live"
    del array
    assert live() == before, "freed once NumPy let go"


def test_the_free_waits_for_the_last_of_several_consumers():
    before = live()
    buf = rf.HipBuffer.from_numpy(np.arange(8, dtype=np.int32), backend="host")
    first = np.from_dlpack(buf.typed(np.int32))
    second = np.from_dlpack(buf.typed(np.int32, 4, 16))
    buf.close()
    del first
    assert live() == before + 1
    np.testing.assert_array_equal(second, [4, 5, 6, 7])
    del second
    assert live() == before


def test_an_unconsumed_capsule_releases_its_hold_when_dropped():
    before = live()
    buf = rf.HipBuffer(64, backend="host")
    capsule = buf.typed(np.uint8).__dlpack__()
    buf.close()
    assert live() == before + 1
    del capsule
    assert live() == before


def test_a_closed_buffer_cannot_be_exported():
    buf = rf.HipBuffer(64, backend="host")
    typed = buf.typed(np.uint8)
    buf.close()
    with pytest.raises(BufferClosedError, match="closed"):
        np.from_dlpack(typed)


def _consumers():
    found = []
    try:
        import torch

        found.append(("torch", torch.from_dlpack, lambda t: t.cpu().numpy(),
                      torch.cuda.synchronize))
    except ImportError:
        pass
    try:
        import cupy

        found.append(("cupy", cupy.from_dlpack, cupy.asnumpy,
                      cupy.cuda.runtime.deviceSynchronize))
    except ImportError:
        pass
    return found


def test_torch_and_cupy_keep_reading_a_closed_gpu_buffer_until_they_let_go(gpu, rng):
    consumers = _consumers()
    if not consumers:
        pytest.skip("neither torch nor cupy is installed")
    data = rng.standard_normal(1 << 20).astype(np.float32)
    for name, from_dlpack, to_host, synchronize in consumers:
        before = live()
        buf = rf.HipBuffer.from_numpy(data, backend=gpu)
        tensor = from_dlpack(buf.typed(np.float32))
        buf.close()
        with rf.HipBuffer.from_numpy(np.full_like(data, -7.0), backend=gpu):
            np.testing.assert_array_equal(to_host(tensor), data, err_msg=name)
        assert live() == before + 1, f"{name} still holds the buffer"
        del tensor
        synchronize()
        assert live() == before, f"freed once {name} let go"


# --- DeviceArray fields ------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("shape", (1 << 20,)), ("dtype", np.dtype(np.int8)),
                                          ("buffer", None)])
def test_device_array_fields_are_read_only(field, value):
    with rf.HipBuffer(64, backend="host") as buf:
        array = buf.typed(np.float32)
        with pytest.raises(AttributeError, match=f"DeviceArray.{field} is read-only"):
            setattr(array, field, value)
        with pytest.raises(AttributeError, match="read-only"):
            delattr(array, field)
        assert array.shape == (16,) and array.dtype == np.float32


def test_device_arrays_copy_as_themselves_and_never_pickle():
    with rf.HipBuffer(64, backend="host") as buf:
        array = buf.typed(np.float32)
        assert copy.copy(array) is array
        for duplicate in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be pickled"):
                duplicate(array)


# --- closed streams and events -----------------------------------------------------------
def _closed(kind):
    obj = kind(backend="host")
    obj.close()
    obj.close()  # idempotent
    return obj


@pytest.mark.parametrize("use", [
    lambda s: s.synchronize(), lambda s: s.handle,
    lambda s: rf.HipBuffer(64, backend="host").fill(0, stream=s),
    lambda s: Event(backend="host").record(s),
    lambda s: rf.LaunchConfig(1, 64, stream=s),
    lambda s: KvCache(CONFIG, backend="host", stream=s),
], ids=["synchronize", "handle", "fill", "event-record", "launch-config", "cache"])
def test_a_closed_stream_refuses_every_use(use):
    stream = _closed(Stream)
    assert stream.closed
    with pytest.raises(BufferClosedError, match="Stream was closed"):
        use(stream)


@pytest.mark.parametrize("use", [
    lambda e: e.record(), lambda e: e.synchronize(),
    lambda e: e.elapsed_ms_since(Event(backend="host").record()),
    lambda e: Event(backend="host").record().elapsed_ms_since(e),
], ids=["record", "synchronize", "elapsed-end", "elapsed-start"])
def test_a_closed_event_refuses_every_use(use):
    with pytest.raises(BufferClosedError, match="Event was closed"):
        use(_closed(Event))


@pytest.mark.parametrize("recorded", ["start", "end"])
def test_elapsed_time_needs_both_events_recorded(recorded):
    start, end = Event(backend="host"), Event(backend="host")
    (start if recorded == "start" else end).record()
    missing = "this" if recorded == "start" else "start"
    with pytest.raises(ValueError, match=f"{missing} event was never recorded"):
        end.elapsed_ms_since(start)
    start.close()
    end.close()


def test_streams_and_events_cannot_be_copied():
    for kind in (Stream, Event):
        with kind(backend="host") as obj:
            for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match="cannot be copied"):
                    duplicate(obj)


# --- closed caches -----------------------------------------------------------------------
CACHE_USES = {
    "add_sequence": lambda c: c.add_sequence("new", 3), "append": lambda c: c.append(["a"]),
    "fork": lambda c: c.fork("a", "b"), "finish": lambda c: c.finish("a"),
    "remove": lambda c: c.remove("a"), "batch": lambda c: c.batch(["a"]),
    "seq_len": lambda c: c.seq_len("a"), "block_ids": lambda c: c.block_ids("a"),
    "times": lambda c: c.times("a"), "seq_ids": lambda c: c.seq_ids(),
    "len": len, "contains": lambda c: "a" in c, "can_allocate": lambda c: c.can_allocate(1),
    "can_append": lambda c: c.can_append(["a"]), "stats": lambda c: c.stats(),
    "finished": lambda c: c.finished(), "check_invariants": lambda c: c.check_invariants(),
    "k_cache": lambda c: c.k_cache(0), "v_cache": lambda c: c.v_cache(0),
    "write": lambda c: c.write(0, None, None, np.zeros(0, np.int64)),
}


@pytest.mark.parametrize("use", list(CACHE_USES.values()), ids=list(CACHE_USES))
def test_a_closed_cache_refuses_every_use(use):
    cache = KvCache(CONFIG, backend="host")
    cache.add_sequence("a", 5)
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(BufferClosedError, match="KvCache was closed"):
        use(cache)


def test_closing_a_cache_frees_its_slab_at_once_and_once(backend):
    """The slab (every layer's K and V) goes back when close() returns, not at garbage
    collection; a second close() frees nothing more."""
    before = rf.memory_stats()
    cache = KvCache(CONFIG, backend=backend)
    cache.add_sequence("a", 5)
    cache.batch(["a"])
    held = rf.memory_stats()
    assert held["live_bytes"] - before["live_bytes"] >= CONFIG.total_bytes
    cache.close()
    after = rf.memory_stats()  # the cache object is still alive here
    assert cache.closed and cache.slab.buffer.closed
    assert after["live_bytes"] == before["live_bytes"]
    assert after["num_frees"] - before["num_frees"] == after["num_allocs"] - before["num_allocs"]
    cache.close()
    assert rf.memory_stats()["num_frees"] == after["num_frees"]


def test_a_closed_cache_refuses_its_last_plan():
    cache = KvCache(CONFIG, backend="host")
    cache.add_sequence("a", 5)
    meta = cache.batch(["a"])
    q = DeviceArray.empty((1, 1, 64), np.float32, backend="host")
    cache.close()
    with pytest.raises(BufferClosedError, match="KvCache was closed"):
        cache.attention(0, q, q, meta)
    q.buffer.root.close()


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_cache_cannot_be_copied(duplicate):
    with KvCache(CONFIG, backend="host") as cache, pytest.raises(
            TypeError, match=r"KvCache .* cannot be copied"):
        duplicate(cache)
