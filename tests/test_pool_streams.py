"""MemoryPool in stream order: a block freed on one stream goes to another only once an
event shows the device passed the free; on its own stream it is reused at once.

On the host backend events complete when recorded, so these tests drive a host backend whose
streams can be held busy (as behind a long kernel): events recorded on a held stream stay
pending until it is let go. The GPU tests at the end do the same with a real hold kernel.
"""

from __future__ import annotations

import time

import pytest

import rocmforge_raw as rf
from rocmforge_raw.memory.pool import MAX_FENCES
from rocmforge_raw.runtime.host import HostBackend

N = 4096  # one size class throughout


class HeldHost(HostBackend):
    """Host memory with a pretend device: ``hold(stream)`` keeps the events later recorded on
    ``stream`` (None: the default stream) pending until ``let_go(stream)``. Waiting for the
    device is an error here: the pool must only ever query."""

    name = "host"

    def __init__(self):
        super().__init__()
        self.held, self.pending = set(), {}
        self.created = self.destroyed = self.queries = 0

    def hold(self, stream):
        self.held.add(None if stream is None else stream.handle)

    def let_go(self, stream):
        handle = None if stream is None else stream.handle
        self.held.discard(handle)
        for event in self.pending.pop(handle, []):
            event[1] = True

    def event_create(self, device):
        self.created += 1
        return [0, True]

    def event_destroy(self, event, device):
        self.destroyed += 1

    def event_record(self, event, stream=None):
        event[1] = stream not in self.held
        if not event[1]:
            self.pending.setdefault(stream, []).append(event)

    def event_query(self, event):
        self.queries += 1
        return event[1]

    def event_synchronize(self, event):
        raise AssertionError("the pool waited for an event")

    def stream_synchronize(self, stream):
        raise AssertionError("the pool waited for a stream")

    def synchronize(self, device):
        raise AssertionError("the pool waited for the device")


@pytest.fixture
def device():
    """A held-host backend, a pool on it and two streams A and B."""
    backend = HeldHost()
    pool = rf.MemoryPool(backend=backend)
    a, b = rf.Stream(backend=backend), rf.Stream(backend=backend)
    yield backend, pool, a, b
    pool.free_all()
    assert pool.stats()["reserved_bytes"] == 0


def test_a_block_freed_on_a_busy_stream_is_reused_there_at_once(device):
    backend, pool, a, _ = device
    buf = rf.HipBuffer(N, pool=pool.on(a))
    ptr = buf.ptr
    backend.hold(a)
    buf.close()
    again = rf.HipBuffer(N, pool=pool.on(a))
    assert again.ptr == ptr and pool.stats()["hits"] == 1
    again.close()


@pytest.mark.parametrize("taker", ["other stream", "default stream"])
def test_a_block_goes_to_another_stream_only_after_the_device_passed_its_free(device, taker):
    backend, pool, a, b = device
    to = pool.on(b) if taker == "other stream" else pool
    buf = rf.HipBuffer(N, pool=pool.on(a))
    ptr = buf.ptr
    backend.hold(a)
    buf.close()
    early = rf.HipBuffer(N, pool=to)
    assert early.ptr != ptr and pool.stats()["handoffs"] == 0
    assert backend.queries >= 1  # it asked the event, and did not wait for it
    backend.let_go(a)
    later = rf.HipBuffer(N, pool=to)
    assert later.ptr == ptr and pool.stats()["handoffs"] == 1
    early.close()
    later.close()


def test_default_stream_blocks_go_to_a_stream_after_a_fence_event(device):
    backend, pool, a, _ = device
    buf = rf.HipBuffer(N, pool=pool)
    ptr = buf.ptr
    backend.hold(None)
    buf.close()  # the fast path: no event recorded at this free
    assert backend.created == 0
    held = rf.HipBuffer(N, pool=pool.on(a))  # records a fence on the default stream
    assert held.ptr != ptr and backend.created == 1
    backend.let_go(None)
    later = rf.HipBuffer(N, pool=pool.on(a))
    assert later.ptr == ptr
    held.close()
    later.close()


def test_own_stream_takes_the_newest_block_another_the_oldest(device):
    _, pool, a, b = device
    first, second = rf.HipBuffer(N, pool=pool.on(a)), rf.HipBuffer(N, pool=pool.on(a))
    ptrs = first.ptr, second.ptr
    first.close()
    second.close()
    mine, theirs = rf.HipBuffer(N, pool=pool.on(a)), rf.HipBuffer(N, pool=pool.on(b))
    assert (mine.ptr, theirs.ptr) == (ptrs[1], ptrs[0])
    mine.close()
    theirs.close()


def test_a_newer_free_waits_even_when_an_older_one_passed(device):
    backend, pool, a, b = device
    old, new = rf.HipBuffer(N, pool=pool.on(a)), rf.HipBuffer(N, pool=pool.on(a))
    old_ptr, new_ptr = old.ptr, new.ptr
    old.close()  # passed at once: the stream is idle
    backend.hold(a)
    new.close()  # behind the hold
    got = [rf.HipBuffer(N, pool=pool.on(b)) for _ in range(2)]
    assert got[0].ptr == old_ptr and got[1].ptr not in (old_ptr, new_ptr)
    for buf in got:
        buf.close()


def test_allocate_and_free_name_their_stream(device):
    backend, pool, a, b = device
    ptr = pool.allocate(N, stream=a)
    backend.hold(a)
    pool.free(ptr)  # in a's order, where it was allocated
    other = pool.allocate(N, stream=b)
    assert other != ptr
    pool.free(other, stream=a)  # cached on a, newest: a takes it first, then ptr
    assert pool.allocate(N, stream=a) == other and pool.allocate(N, stream=a) == ptr
    pool.free(other)
    pool.free(ptr, stream=b)  # last used on b: b may take it back at once
    assert pool.allocate(N, stream=b) == ptr
    pool.free(ptr, stream=None)
    assert pool.allocate(N) == ptr
    pool.free(ptr)
    backend.let_go(a)


def test_a_free_list_that_wraps_and_grows_keeps_every_block_once_in_order(device):
    _, pool, a, b = device
    bufs = [rf.HipBuffer(N, pool=pool.on(a)) for _ in range(10)]
    freed = [buf.ptr for buf in bufs]
    for buf in bufs[:8]:  # fills the first ring of 8
        buf.close()
    taken = rf.HipBuffer(N, pool=pool.on(b))  # the oldest leaves: the ring starts at 1
    assert taken.ptr == freed[0]
    for buf in bufs[8:]:  # wraps, then grows the ring
        buf.close()
    again = [rf.HipBuffer(N, pool=pool.on(a)) for _ in range(9)]
    assert [buf.ptr for buf in again] == freed[:0:-1]  # newest first, each once
    for buf in [taken, *again]:
        buf.close()


def test_pending_events_per_stream_are_bounded(device):
    backend, pool, a, b = device
    bufs = [rf.HipBuffer(N, pool=pool.on(a)) for _ in range(5 * MAX_FENCES)]
    backend.hold(a)
    for buf in bufs:
        buf.close()
    assert backend.created == MAX_FENCES  # past that, the newest event moved forward
    fresh = rf.HipBuffer(N, pool=pool.on(b))
    assert fresh.ptr not in {buf._ptr for buf in bufs}
    backend.let_go(a)
    taken = [rf.HipBuffer(N, pool=pool.on(b)) for _ in range(len(bufs))]
    assert {t.ptr for t in taken} == {buf._ptr for buf in bufs}
    for buf in [fresh, *taken]:
        buf.close()


def test_free_all_releases_every_stream_and_its_events(device):
    backend, pool, a, b = device
    for buf in [rf.HipBuffer(N, pool=pool.on(stream)) for stream in (None, a, b)]:
        buf.close()
    assert pool.stats()["streams"] == 2 and pool.stats()["cached_bytes"] == 3 * N
    on_a = pool.on(a)
    pool.free_all()
    stats = pool.stats()
    assert stats["reserved_bytes"] == stats["cached_bytes"] == 0 and stats["streams"] == 0
    assert backend.destroyed == backend.created
    buf = rf.HipBuffer(N, pool=on_a)  # an allocator made before still works
    buf.close()
    assert pool.stats()["streams"] == 1 and pool.stats()["cached_bytes"] == N


def test_blocks_lent_before_free_all_return_to_their_stream(device):
    _, pool, a, _ = device
    ptr = pool.allocate(N, stream=a)
    buf = rf.HipBuffer(N, pool=pool.on(a))
    pool.free_all()  # nothing of a's is cached: a's lane goes
    assert pool.stats()["streams"] == 0
    pool.free(ptr)
    buf.close()
    assert pool.stats()["streams"] == 1 and pool.stats()["cached_bytes"] == 2 * N
    # (the fixture's free_all must find both: none is stranded in a forgotten lane)


def test_blocks_freed_on_a_closed_stream_go_nowhere_until_free_all(device):
    backend, pool, a, b = device
    buf = rf.HipBuffer(N, pool=pool.on(a))
    ptr = buf.ptr
    a.close()
    created = backend.created
    buf.close()
    assert backend.created == created  # no event recorded on a destroyed stream
    other = rf.HipBuffer(N, pool=pool.on(b))
    assert other.ptr != ptr
    other.close()


def test_free_all_forgets_streams_whose_blocks_were_reused_or_handed_on(device):
    _, pool, a, b = device
    rf.HipBuffer(N, pool=pool.on(a)).close()
    rf.HipBuffer(N, pool=pool.on(a)).close()  # reused on a
    handed = rf.HipBuffer(N, pool=pool.on(b))  # a's block, handed on to b
    assert pool.stats()["handoffs"] == 1 and pool.stats()["hits"] == 2
    handed.close()
    ptr = pool.allocate(N)  # the default stream's own: no lane for it
    pool.free(ptr)
    assert pool.stats()["streams"] == 2
    pool.free_all()
    assert pool.stats()["streams"] == 0


def test_the_accounts_balance_across_streams(device):
    backend, pool, a, b = device
    backend.hold(a)
    live = []
    for i in range(30):
        stream = (None, a, b)[i % 3]
        live.append(rf.HipBuffer(N * (1 + i % 2), pool=pool.on(stream)))
        if i % 4 == 3:
            live.pop(0).close()
        stats = pool.stats()
        assert stats["reserved_bytes"] == stats["in_use_bytes"] + stats["cached_bytes"]
        assert stats["in_use_blocks"] == len(live)
    for buf in live:
        buf.close()
    assert pool.stats()["in_use_bytes"] == 0
    backend.let_go(a)


def test_a_stream_the_pool_cannot_serve_is_refused(device):
    backend, pool, a, _ = device
    with pytest.raises(TypeError, match="stream must be a Stream or None, got 5"):
        pool.on(5)
    with pytest.raises(TypeError, match="got 5"):
        pool.allocate(N, stream=5)
    stranger = rf.Stream(backend="host")
    with pytest.raises(ValueError, match="stream is on another host backend object than this "
                       "pool"):
        pool.on(stranger)
    closed = rf.Stream(backend=backend)
    closed.close()
    with pytest.raises(ValueError, match="was closed"):
        pool.on(closed)
    assert pool.on(None) is pool and pool.on(a).stream is a
    assert pool.stats()["in_use_blocks"] == 0


# --- on a GPU: a real hold kernel --------------------------------------------------------------
def _hold_ms(gpu, ms, stream):
    from test_step import _hold

    _hold(gpu, ms, stream)


def test_a_gpu_block_freed_behind_a_hold_stays_off_other_streams_until_it_ends(gpu):
    pool = rf.MemoryPool(backend=gpu)
    a, b = rf.Stream(backend=gpu), rf.Stream(backend=gpu)
    buf = rf.HipBuffer(1 << 20, pool=pool.on(a))
    ptr = buf.ptr
    _hold_ms(gpu, 10, a)  # loads the kernel
    a.synchronize()
    began = time.perf_counter()
    _hold_ms(gpu, 500, a)  # the kernel stands for work still using the block
    buf.close()
    other = rf.HipBuffer(1 << 20, pool=pool.on(b))
    same = rf.HipBuffer(1 << 20, pool=pool.on(a))
    assert time.perf_counter() - began < 0.4, "the checks ran after the hold: inconclusive"
    assert other.ptr != ptr and same.ptr == ptr  # not to B during the hold; to A at once
    same.close()  # freed on A again, behind the hold
    a.synchronize()
    later = rf.HipBuffer(1 << 20, pool=pool.on(b))
    assert later.ptr == ptr and pool.stats()["handoffs"] == 1
    for each in (other, later):
        each.close()
    pool.free_all()
    a.close()
    b.close()


def test_a_gpu_default_stream_block_goes_to_a_stream_only_after_its_hold(gpu):
    pool = rf.MemoryPool(backend=gpu)
    a = rf.Stream(backend=gpu)
    _hold_ms(gpu, 10, None)
    gpu.synchronize(gpu.get_device())
    buf = rf.HipBuffer(1 << 20, pool=pool)
    ptr = buf.ptr
    began = time.perf_counter()
    _hold_ms(gpu, 500, None)
    buf.close()
    early = [rf.HipBuffer(1 << 20, pool=pool.on(a)) for _ in range(3)]
    assert time.perf_counter() - began < 0.4, "the checks ran after the hold: inconclusive"
    assert ptr not in {e.ptr for e in early}
    gpu.synchronize(gpu.get_device())
    for _ in range(100):  # the fence event was recorded behind the hold: it completes now
        early.append(rf.HipBuffer(1 << 20, pool=pool.on(a)))
        if early[-1].ptr == ptr:
            break
        time.sleep(0.001)
    assert early[-1].ptr == ptr
    for each in early:
        each.close()
    pool.free_all()
    a.close()


def test_a_pool_allocation_refused_on_a_new_stream_leaves_the_stream_unknown():
    """``HipBuffer(n, pool=pool.on(s))`` for a stream the pool has not seen, refused at its
    limit: the pool is as before (no lane for ``s``); the next allocation that fits makes
    it. (``on`` used to register the lane before the allocation could fail.)"""
    backend = HeldHost()
    pool = rf.MemoryPool(backend=backend, limit=4 * N)
    with rf.Stream(backend=backend) as a, rf.Stream(backend=backend) as b:
        full = rf.HipBuffer(3 * N, pool=pool.on(a))
        before = pool.stats()
        with pytest.raises(rf.OutOfMemoryError, match="pool limit"):
            rf.HipBuffer(2 * N, pool=pool.on(b))
        assert pool.stats() == before and before["streams"] == 1
        with rf.HipBuffer(N, pool=pool.on(b)):
            assert pool.stats()["streams"] == 2
        full.close()
    pool.close()
