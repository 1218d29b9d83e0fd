"""MemoryPool: caching, size classes, limit, and use as HipBuffer's allocator."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.errors import BufferClosedError, OutOfMemoryError
from rocmforge_raw.memory.pool import size_class


@pytest.mark.parametrize("nbytes, expected", [
    (1, 512), (512, 512), (513, 640), (1000, 1024), (1025, 1280), (3 << 20, 3 << 20),
    ((1 << 20) + 1, (1 << 20) + (1 << 18)),
])
def test_size_classes_round_up_by_at_most_a_quarter(nbytes, expected):
    assert size_class(nbytes) == expected


def test_size_classes_end_at_two_to_the_62():
    assert size_class(1 << 62) == 1 << 62
    with pytest.raises(OverflowError, match=f"a pool block of {(1 << 62) + 1} bytes"):
        size_class((1 << 62) + 1)


def test_freed_block_is_reused(backend):
    pool = rf.MemoryPool(backend=backend)
    a = rf.HipBuffer(1000, pool=pool)
    ptr = a.ptr
    a.close()
    b = rf.HipBuffer(900, pool=pool)
    assert b.ptr == ptr
    stats = pool.stats()
    assert stats["hits"] == 1 and stats["misses"] == 1
    b.close()
    pool.free_all()
    assert pool.stats()["reserved_bytes"] == 0


def test_pooled_buffer_dropped_returns_block_to_cache(backend, rng):
    pool = rf.MemoryPool(backend=backend)
    data = rng.standard_normal(100).astype(np.float32)
    buf = rf.HipBuffer.from_numpy(data, pool=pool)
    np.testing.assert_array_equal(buf.to_numpy(np.float32), data)
    assert pool.stats()["in_use_blocks"] == 1
    del buf
    gc.collect()
    stats = pool.stats()
    assert stats["in_use_blocks"] == 0 and stats["cached_bytes"] == 512
    pool.free_all()


def test_limit_releases_cache_then_raises_with_numbers(backend):
    pool = rf.MemoryPool(backend=backend, limit=4096)
    a = rf.HipBuffer(2048, pool=pool)
    b = rf.HipBuffer(1024, pool=pool)
    b.close()  # 1024 cached
    c = rf.HipBuffer(2048, pool=pool)  # needs the cached 1024 released first
    assert pool.stats()["cached_bytes"] == 0
    with pytest.raises(OutOfMemoryError, match="requested 512 bytes with 0 of 4096 bytes free"):
        rf.HipBuffer(10, pool=pool)
    a.close()
    c.close()
    pool.free_all()


def test_a_limit_runs_from_zero_to_below_size_max(backend):
    pool = rf.MemoryPool(backend=backend, limit=0)
    with pytest.raises(OutOfMemoryError, match="requested 512 bytes with 0 of 0 bytes free"):
        rf.HipBuffer(1, pool=pool)
    with pytest.raises(ValueError, match=f"got {(1 << 64) - 1}"):
        rf.MemoryPool(backend=backend, limit=(1 << 64) - 1)
    assert rf.MemoryPool(backend=backend, limit=(1 << 64) - 2).limit == (1 << 64) - 2


def test_filling_the_limit_exactly_keeps_the_cache(backend):
    pool = rf.MemoryPool(backend=backend, limit=4096)
    rf.HipBuffer(1024, pool=pool).close()
    buf = rf.HipBuffer(3072, pool=pool)  # 1024 cached + 3072 = the limit: nothing released
    assert pool.stats()["cached_bytes"] == 1024 and pool.stats()["reserved_bytes"] == 4096
    buf.close()
    pool.free_all()


def test_a_failed_device_allocation_leaves_nothing_reserved():
    pool = rf.MemoryPool(backend="host")
    with pytest.raises(OutOfMemoryError):
        pool.allocate(1 << 60)
    assert pool.stats()["reserved_bytes"] == 0 and pool.stats()["in_use_blocks"] == 0


def test_a_pool_serves_its_own_backend_and_device_only(backend):
    pool = rf.MemoryPool(backend=backend)
    device = pool.device
    assert pool.serves(None, None) and pool.serves(backend, device)
    assert pool.serves(backend.name, None) and not pool.serves(backend, device + 1)
    assert not pool.serves("no-such-backend", None)
    buf = rf.HipBuffer(100, device, backend, pool=pool)
    with pytest.raises(ValueError, match="cannot allocate on backend"):
        rf.HipBuffer(100, device + 1, pool=pool)
    buf.close()
    pool.free_all()


def test_free_of_a_foreign_pointer_is_an_error(backend):
    pool = rf.MemoryPool(backend=backend)
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.free(0x1234)


def test_set_allocator_routes_new_buffers_through_the_pool(backend):
    pool = rf.MemoryPool(backend=backend)
    rf.set_allocator(pool)
    try:
        buf = rf.HipBuffer(4000, backend=backend.name)
        assert pool.stats()["in_use_blocks"] == 1
        buf.close()
        assert pool.stats()["cached_bytes"] == 4096
    finally:
        rf.set_allocator(None)
        pool.free_all()
    raw = rf.HipBuffer(4000, backend=backend)
    assert pool.stats()["in_use_blocks"] == 0
    raw.close()


def test_blocks_of_every_size_class_go_back_on_free_all(backend):
    pool = rf.MemoryPool(backend=backend)
    sizes = [(1 << k) + extra for k in range(9, 27) for extra in (-1, 0, 1, 3 << (k - 3))]
    for nbytes in sizes:
        rf.HipBuffer(nbytes, pool=pool).close()
    stats = pool.stats()
    assert stats["in_use_blocks"] == 0 and stats["misses"] == len(set(map(size_class, sizes)))
    assert stats["reserved_bytes"] == stats["cached_bytes"] == sum(set(map(size_class, sizes)))
    pool.free_all()
    assert pool.stats()["reserved_bytes"] == pool.stats()["cached_bytes"] == 0


def test_a_dropped_pool_gives_its_cached_blocks_back_to_the_device(gpu):
    device = gpu.get_device()
    pool = rf.MemoryPool(device, gpu)
    rf.HipBuffer(256 << 20, pool=pool).close()  # cached: still held from the device
    held = gpu.mem_info(device)[0]
    del pool
    gc.collect()
    assert gpu.mem_info(device)[0] - held >= 256 << 20


def test_close_gives_everything_back_refuses_while_in_use_and_is_idempotent(backend):
    pool = rf.MemoryPool(backend=backend)
    stream = rf.Stream(backend=backend)
    buf = rf.HipBuffer(4096, pool=pool.on(stream))
    ptr = pool.allocate(100)
    pool.free(pool.allocate(5000))  # one block cached
    before = (pool.stats(), pool.lane_states(), pool.lent_blocks())
    with pytest.raises(RuntimeError, match=r"2 blocks \(4608 bytes\) are still in use"):
        pool.close()
    assert (pool.stats(), pool.lane_states(), pool.lent_blocks()) == before
    assert not pool.closed
    buf.close()
    with pytest.raises(RuntimeError, match=r"1 block \(512 bytes\) is still in use"):
        pool.close()
    pool.free(ptr)
    pool.close()
    assert pool.closed and pool.stats()["reserved_bytes"] == 0 and pool.stats()["streams"] == 0
    pool.close()  # idempotent
    for use in (lambda: pool.allocate(8), lambda: rf.HipBuffer(8, pool=pool),
                lambda: rf.HipBuffer(8, pool=pool.on(stream)), lambda: pool.on(None)):
        with pytest.raises(BufferClosedError, match="MemoryPool was closed"):
            use()
    assert pool.stats()["reserved_bytes"] == 0
    stream.close()


def test_an_allocator_made_before_close_refuses_after_it(backend):
    pool = rf.MemoryPool(backend=backend)
    stream = rf.Stream(backend=backend)
    on_stream = pool.on(stream)
    pool.close()
    with pytest.raises(BufferClosedError, match="MemoryPool was closed"):
        rf.HipBuffer(8, pool=on_stream)
    assert pool.stats()["streams"] == 0
    stream.close()
