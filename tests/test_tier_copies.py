"""The copies a host tier runs on: 2-D copies and downloads between device and pinned memory
(every backend), a stream waiting for another's event, and StreamOrder, which orders a
cache's copies between tiers after the device's last use of what they read and before any
reuse of what they wrote, across streams, without waiting on the host.

On the host backend events complete when recorded, so StreamOrder's decisions are checked
against a host backend whose streams can be held busy (events recorded on a held stream stay
pending) and which records each wait it is asked for; the GPU tests do the same with a real
hold kernel and check the bytes."""

from __future__ import annotations

import numpy as np
import pytest
from test_step import _hold
from tier_helpers import read, write

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.cache.tiers.order import MAX_STREAMS, StreamOrder
from rocmforge_raw.kernels.staging import PinnedBuffer
from rocmforge_raw.runtime.host import HostBackend


@pytest.mark.parametrize("to_host", [True, False])
def test_a_2d_copy_moves_rows_between_pitches(backend, rng, to_host):
    rows, width, device_pitch, host_pitch = 6, 96, 256, 160
    device = backend.get_device()
    data = rng.integers(0, 255, rows * max(device_pitch, host_pitch), np.uint8)
    with rf.HipBuffer.from_numpy(data, device, backend) as buf:
        pinned = PinnedBuffer(data.size, device, backend)
        host = pinned.array(np.uint8, data.size)
        host[:] = data[::-1]
        before_device, before_host = buf.to_numpy(np.uint8).copy(), host.copy()
        if to_host:
            backend.memcpy_2d(pinned.ptr + 8, host_pitch, buf.ptr + 16, device_pitch, width,
                              rows, True)
        else:
            backend.memcpy_2d(buf.ptr + 16, device_pitch, pinned.ptr + 8, host_pitch, width,
                              rows, False)
        backend.synchronize(device)
        got_device, got_host = buf.to_numpy(np.uint8), host.copy()
        pinned.close()
    src, dst = ((before_device, got_host) if to_host else (before_host, got_device))
    src_pitch, src_off, dst_pitch, dst_off = ((device_pitch, 16, host_pitch, 8) if to_host
                                              else (host_pitch, 8, device_pitch, 16))
    want = (before_host if to_host else before_device).copy()
    for row in range(rows):
        want[dst_off + row * dst_pitch : dst_off + row * dst_pitch + width] = src[
            src_off + row * src_pitch : src_off + row * src_pitch + width]
    np.testing.assert_array_equal(dst, want)  # the rows, and nothing between them


def test_a_download_lands_in_pinned_memory(backend, rng):
    data = rng.integers(0, 255, 1 << 16, np.uint8)
    device = backend.get_device()
    with rf.HipBuffer.from_numpy(data, device, backend) as buf, rf.Stream(device, backend) as s:
        pinned = PinnedBuffer(data.size, device, backend)
        backend.download(pinned.ptr, buf.ptr, data.size, s.handle)
        s.synchronize()
        np.testing.assert_array_equal(pinned.array(np.uint8, data.size), data)
        pinned.close()


def test_a_stream_waits_for_another_s_event_on_the_device(gpu):
    with rf.Stream(backend=gpu) as held, rf.Stream(backend=gpu) as waiting:
        _hold(gpu, 10, held)  # loads the kernel
        held.synchronize()
        _hold(gpu, 300, held)
        mark, after = rf.Event(backend=gpu), rf.Event(backend=gpu)
        mark.record(held)
        gpu.stream_wait_event(waiting.handle, mark.handle)
        after.record(waiting)  # nothing else on ``waiting``: it completes after the hold
        assert not gpu.event_query(after.handle), "the wait did not hold the stream back"
        after.synchronize()
        assert gpu.event_query(mark.handle)
        mark.close()
        after.close()


class HeldHost(HostBackend):
    """Host memory with a pretend device: events recorded on a held stream stay pending
    until ``let_go``; every ``stream_wait_event`` is kept as (the stream that waits, the
    stream the event was recorded on)."""

    name = "host"

    def __init__(self) -> None:
        super().__init__()
        self.held, self.pending, self.waits = set(), {}, []

    def event_create(self, device):
        return [0, True]

    def event_record(self, event, stream=None):
        event[0], event[1] = stream, stream not in self.held
        if not event[1]:
            self.pending.setdefault(stream, []).append(event)

    def let_go(self, stream):
        self.held.discard(stream)
        for event in self.pending.pop(stream, []):
            event[1] = True

    def event_query(self, event):
        return event[1]

    def stream_wait_event(self, stream, event):
        self.waits.append((stream, event[0]))


def test_copies_wait_for_the_other_streams_and_later_work_waits_for_the_copies():
    backend = HeldHost()
    a, b, c = (rf.Stream(backend=backend) for _ in range(3))
    order = StreamOrder(backend, 0)
    order.used(a)
    order.used(b)
    assert backend.waits == []  # no copies yet: nothing to wait for
    order.before_copies(a)
    assert backend.waits == [(a.handle, b.handle)]  # a waits for b's work
    backend.held.add(a.handle)  # the copies stay in flight
    order.after_copies(a)
    backend.waits.clear()
    order.used(a)  # a itself is ordered by the stream
    order.used(b)  # b must not reuse what the copies read before they pass
    order.used(b)  # once is enough
    assert backend.waits == [(b.handle, a.handle)]
    backend.let_go(a.handle)  # the copies passed: a newcomer need not wait
    order.used(c)
    assert backend.waits == [(b.handle, a.handle)]
    order.close()
    for stream in (a, b, c):
        stream.close()


def test_the_streams_remembered_between_copies_are_bounded():
    backend = HeldHost()
    order = StreamOrder(backend, 0)
    streams = [rf.Stream(backend=backend) for _ in range(MAX_STREAMS + 5)]
    for stream in streams:
        order.used(stream)
    assert len(order._streams) <= MAX_STREAMS  # one synchronization forgot the older ones
    order.close()
    for stream in streams:
        stream.close()


def _cache(backend, **kw):
    config = CacheConfig(2, 1, 64, 8, 12, "float32", host_blocks=8)
    return KvCache(config, backend=backend, **kw)


def test_a_swap_out_waits_for_a_write_queued_on_another_stream(gpu):
    with rf.Stream(backend=gpu) as copies, rf.Stream(backend=gpu) as writes, \
            _cache(gpu) as cache:
        slots = cache.add_sequence("a", 20).slot_mapping
        _hold(gpu, 10, writes)
        writes.synchronize()
        _hold(gpu, 300, writes)  # the write below runs only after this
        rows = rf.DeviceArray.from_numpy(np.repeat(np.arange(1, 21, dtype=np.float32)[
            :, None, None], 64, 2), backend=gpu)
        for layer in range(2):
            cache.write(layer, rows, rows, slots, stream=writes)
        cache.swap_out(["a"], stream=copies)  # must copy what the write wrote, not zeros
        cache.swap_in(["a"], stream=copies)
        np.testing.assert_array_equal(read(cache, "a"), np.arange(1, 21))
        rows.buffer.root.close()


def test_work_on_another_stream_waits_for_a_swap_that_reads_what_it_reuses(gpu):
    with rf.Stream(backend=gpu) as copies, rf.Stream(backend=gpu) as writes, \
            _cache(gpu) as cache:
        write(cache, cache.add_sequence("a", 40).slot_mapping, np.arange(1, 41))
        _hold(gpu, 10, copies)
        copies.synchronize()
        _hold(gpu, 300, copies)  # the swap's copies run only after this
        cache.swap_out(["a"], stream=copies)
        slots = cache.add_sequence("b", 80).slot_mapping  # a's blocks among them
        rows = rf.DeviceArray.from_numpy(np.full((80, 1, 64), -1.0, np.float32), backend=gpu)
        for layer in range(2):
            cache.write(layer, rows, rows, slots, stream=writes)  # must wait for the copies
        cache.remove("b")
        cache.swap_in(["a"], stream=copies)
        np.testing.assert_array_equal(read(cache, "a"), np.arange(1, 41))
        rows.buffer.root.close()


def test_scattered_blocks_swap_by_one_launch_and_runs_by_2d_copies(backend, monkeypatch):
    """A sequence whose blocks alternate with another's swaps out and back in (to blocks
    that alternate again) through ``rf_copy_pieces`` (no 2-D copy on a GPU: many short ones
    would cost more than the launch), one whose blocks are consecutive by one 2-D copy each
    way; the bytes are exact either way. The host backend always copies in 2-D."""
    calls = []
    memcpy_2d = backend.memcpy_2d
    monkeypatch.setattr(backend, "memcpy_2d", lambda *a: (calls.append(a), memcpy_2d(*a)))
    with _cache(backend) as cache:
        slots: dict[str, list[int]] = {"a": [], "b": []}
        for i in range(3):  # blocks a0 b0 a1 b1 a2 b2: "a" scattered
            for seq_id in slots:
                if i == 0:
                    slots[seq_id] += cache.add_sequence(seq_id, 8).slot_mapping.tolist()
                for _ in range(8 if i else 0):
                    slots[seq_id] += cache.append([seq_id]).slot_mapping.tolist()
        for seq_id, base in (("a", 100), ("b", 200)):
            write(cache, slots[seq_id], np.arange(base, base + 24))
        assert np.diff(cache.block_ids("a")).min() > 1  # scattered
        cache.swap_out(["a"])
        assert len(calls) == (3 if backend.name == "host" else 0)
        np.testing.assert_array_equal(read(cache, "a"), np.arange(100, 124))  # host tier
        cache.remove("b")
        calls.clear()
        cache.swap_in(["a"])
        assert np.diff(cache.block_ids("a")).min() > 1  # scattered again
        assert len(calls) == (3 if backend.name == "host" else 0)
        np.testing.assert_array_equal(read(cache, "a"), np.arange(100, 124))
    with _cache(backend) as cache:
        write(cache, cache.add_sequence("c", 24).slot_mapping, np.arange(300, 324))
        assert np.diff(cache.block_ids("c")).tolist() == [1, 1]
        calls.clear()
        cache.swap_out(["c"])  # consecutive blocks on both sides: one 2-D copy
        assert len(calls) == 1
        cache.swap_in(["c"])
        np.testing.assert_array_equal(read(cache, "c"), np.arange(300, 324))


@pytest.mark.parametrize("to_host", [True, False])
def test_the_launch_table_names_the_same_bytes_as_the_2d_copies(to_host):
    """``HostTier._pieces``: each row of the table one launch reads is one run of one plane,
    from the slab to the host tier's pinned memory (``to_host``) or back, at the addresses
    and of the size the 2-D copies would move."""
    with _cache(rf.get_backend("host")) as cache:
        tier = cache._tier
        dev, host = np.array([1, 5, 8], np.int64), np.array([0, 2, 4], np.int64)
        lengths = np.array([2, 1, 3], np.int64)
        table = tier._pieces(dev, host, lengths, to_host).reshape(tier.planes, 3, 3)
        for plane in range(tier.planes):
            for run in range(3):
                at_dev = tier.slab_ptr + (plane * tier.slab_blocks + dev[run]) * tier.chunk
                at_host = tier.memory.ptr + (plane * tier.num_blocks + host[run]) * tier.chunk
                src, dst = (at_dev, at_host) if to_host else (at_host, at_dev)
                assert table[plane, run].tolist() == [src, dst, lengths[run] * tier.chunk]
