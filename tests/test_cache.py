"""The paged KV cache: one test per review finding, then properties, threads and kernels."""

from __future__ import annotations

import gc
import math
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.cache import BlockPool, CacheConfig, CacheFullError, KvCache
from rocmforge_raw.kernels import reference
from rocmforge_raw.memory.array import DeviceArray


def small_cache(backend="host", num_blocks=9, block_size=8, dtype="float32", **kw):
    return KvCache(CacheConfig(2, 2, 64, block_size, num_blocks, dtype), backend=backend, **kw)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# --- review findings -----------------------------------------------------------------------
def test_removal_returns_every_block_once():
    with small_cache() as cache:
        cache.add_sequence("a", 20)
        cache.fork("a", "b")
        cache.append(["b"])
        assert cache.remove("a") == 1  # its own last block; the 2 shared ones stay with b
        assert cache.remove("b") == 3
        assert cache.stats()["free_blocks"] == cache.config.num_blocks - 1
        with pytest.raises(KeyError, match="no sequence 'b'"):
            cache.remove("b")
        cache.check_invariants()


def test_a_run_of_blocks_freed_comes_back_in_order():
    """Blocks a removal frees are handed out again lowest first, so a sequence that follows
    one holds the same ascending run (copies and transfers of it are one span a plane)."""
    with small_cache(num_blocks=12) as cache:
        cache.add_sequence("a", 32)
        cache.add_sequence("b", 24)
        run = cache.block_ids("a").tolist()
        assert run == sorted(run)
        cache.remove("a")
        cache.add_sequence("c", 32)
        assert cache.block_ids("c").tolist() == run
        cache.remove("b")
        cache.remove("c")
        cache.add_sequence("d", 56)  # both runs, each ascending, c's first (freed last)
        assert cache.block_ids("d")[:4].tolist() == run
        assert np.all(np.diff(cache.block_ids("d")[4:]) == 1)
        cache.check_invariants()


def test_closing_the_cache_returns_its_memory(backend):
    before = rf.memory_stats()["live_bytes"]
    cache = small_cache(backend.name)
    assert rf.memory_stats()["live_bytes"] == before + cache.config.total_bytes
    cache.add_sequence(1, 30)
    del cache
    gc.collect()
    assert rf.memory_stats()["live_bytes"] == before


def test_freeing_a_block_not_held_is_an_error_never_an_underflow():
    pool = BlockPool(5)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    refs = pool.ref_cnt.copy()
    with pytest.raises(ValueError, match=f"cannot free block {ids[0]}: it is not held"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match=f"block {ids[1]} freed 2 times but held 1 times"):
        pool.free(np.array([ids[1], ids[1]]))
    with pytest.raises(ValueError, match=r"ids run 1\.\.4"):
        pool.free(np.array([0]))
    np.testing.assert_array_equal(pool.ref_cnt, refs)
    assert pool.ref_cnt.min() >= 0


def test_finishing_frees_without_an_explicit_remove():
    with small_cache() as cache:
        cache.add_sequence("req", 17)
        assert cache.finish("req") == 3
        assert "req" not in cache and cache.stats()["used_blocks"] == 0
        assert cache.finished()["req"][1] == 17


def test_finished_records_stay_bounded_by_count_and_age():
    clock = FakeClock()
    with small_cache(max_finished=5, finished_ttl_s=60, clock=clock) as cache:
        for i in range(50):
            cache.add_sequence(i, 1)
            cache.finish(i)
            clock.now += 1
        assert sorted(cache.finished()) == [45, 46, 47, 48, 49]
        clock.now += 58
        assert sorted(cache.finished()) == [48, 49]
        clock.now += 100
        assert cache.finished() == {} and cache.stats()["finished_records"] == 0


def test_lru_sequence_is_preempted_first_and_reported():
    clock = FakeClock()
    with small_cache(num_blocks=5, clock=clock) as cache:  # 4 usable blocks of 8
        for name in ("old", "mid", "new"):
            cache.add_sequence(name, 8)
            clock.now += 1
        cache.batch(["old"])  # touching "old" makes "mid" the least recently used
        clock.now += 1
        reservation = cache.add_sequence("big", 16)
        assert reservation.preempted == ["mid"]
        assert "mid" not in cache and {"old", "new", "big"} <= {*cache.seq_ids()}
        assert cache.stats()["preemptions"] == 1
        cache.check_invariants()


def test_strict_mode_raises_instead_of_preempting_and_changes_nothing():
    with small_cache(num_blocks=3, strict=True) as cache:
        cache.add_sequence("a", 16)
        before = cache.stats()
        with pytest.raises(CacheFullError, match="needs 1 blocks but 0 are free"):
            cache.append(["a"])
        with pytest.raises(CacheFullError):
            cache.add_sequence("b", 1)
        assert cache.stats() == before and cache.seq_len("a") == 16


def test_prompt_larger_than_the_whole_cache_is_refused_before_preempting():
    with small_cache(num_blocks=3) as cache:
        cache.add_sequence("a", 4)
        with pytest.raises(CacheFullError, match="exceeds the whole cache"):
            cache.add_sequence("b", 17)
        assert "a" in cache


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_blocks=1 << 26, num_layers=1 << 27, num_kv_heads=1), OverflowError,
     "overflows 64-bit"),
    (dict(num_blocks=(1 << 31) - 1), ValueError, "rows per K/V plane exceed 2147483647"),
    (dict(num_blocks=1), ValueError, r"num_blocks must be in \[2,"),
    (dict(head_dim=100), ValueError, "head_dim 100 is not supported"),
    (dict(block_size=12), ValueError, "block_size 12 is not supported"),
    (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be an integer"),
    (dict(dtype="float64"), ValueError, "dtype float64 is not supported"),
])
def test_bad_configs_are_rejected(kwargs, error, words):
    args = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=100,
                dtype="float16") | kwargs
    with pytest.raises(error, match=words):
        CacheConfig(**args)


def test_config_larger_than_the_device_is_rejected_before_allocating(backend):
    total = backend.properties(DEVICE).total_bytes
    config = CacheConfig(80, 8, 128, 16, 2 * total // (80 * 2 * 8 * 128 * 16 * 2) + 2)
    before = rf.memory_stats()
    with pytest.raises(rf.OutOfMemoryError, match=str(config.total_bytes)):
        KvCache(config, backend=backend)
    assert rf.memory_stats()["live_buffers"] == before["live_buffers"]


@pytest.mark.parametrize("layers, heads", [(1, 1), (32, 8), (80, 64)])
def test_sizes_scale_with_kv_heads_and_layers(layers, heads):
    config = CacheConfig(layers, heads, 128, 16, 1000, "bfloat16")
    assert config.bytes_per_token == layers * 2 * heads * 128 * 2
    assert config.total_bytes == config.bytes_per_token * 16 * 1000
    budget = CacheConfig.for_memory(layers, heads, 128, 16, "bfloat16",
                                    budget_bytes=config.total_bytes + 1)
    assert budget.num_blocks == 1000


def test_for_memory_uses_a_fraction_of_free_device_memory(backend):
    # free memory may change while the config reads it (other processes): bracket its read
    before, _ = backend.mem_info(DEVICE)
    config = CacheConfig.for_memory(2, 2, 64, 16, "float16", fraction=0.01, backend=backend)
    after, _ = backend.mem_info(DEVICE)
    low, high = sorted((before, after))
    assert 0 < config.total_bytes <= high * 0.01
    assert low * 0.01 < config.total_bytes + config.block_bytes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_is_a_working_cache(dtype):
    with small_cache(dtype=dtype) as cache:
        assert cache.k_cache(1).dtype == np.dtype(
            {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype])
        assert cache.k_cache(0).shape == (9, 2, 8, 64)
        assert cache.v_cache(1).ptr - cache.k_cache(0).ptr == 3 * cache.k_cache(0).nbytes


# --- behaviour -------------------------------------------------------------------------------
def test_batch_metadata_pads_with_the_null_block_and_maps_last_slots():
    with small_cache(num_blocks=20) as cache:
        a = cache.add_sequence("a", 3).slot_mapping
        cache.add_sequence("b", 17)
        r = cache.append(["a", "b"])
        meta = cache.batch(["b", "a"])
        assert meta.block_tables.dtype == np.int32 and meta.seq_lens.dtype == np.int32
        assert meta.slot_mapping.dtype == np.int64
        np.testing.assert_array_equal(meta.seq_lens, [18, 4])
        assert meta.block_tables.shape == (2, 3) and (meta.block_tables[1, 1:] == 0).all()
        assert r.slot_mapping[0] == a[-1] + 1
        np.testing.assert_array_equal(meta.slot_mapping, r.slot_mapping[::-1])


def test_fork_shares_and_the_first_write_copies_on_write():
    with small_cache(num_blocks=20) as cache:
        cache.add_sequence("p", 12)
        cache.fork("p", "c")
        shared = cache.block_ids("p")
        assert (cache.pool.ref_cnt[shared] == 2).all()
        cache.append(["c"])
        assert cache.block_ids("c")[1] != shared[1] and cache.block_ids("c")[0] == shared[0]
        assert cache.stats()["cow_copies"] == 1
        cache.append(["p"])  # p is now the only holder of its last block: no copy
        assert cache.stats()["cow_copies"] == 1 and cache.block_ids("p")[1] == shared[1]
        cache.check_invariants()


def test_can_allocate_and_can_append_do_not_raise():
    with small_cache(num_blocks=3) as cache:
        assert cache.can_allocate(16) and not cache.can_allocate(17)
        assert not cache.can_allocate(0)
        cache.add_sequence("a", 16)
        assert not cache.can_append(["a"]) and not cache.can_append(["zz"])
        assert not cache.can_append(["a", "a"])


def test_preempted_member_of_an_append_gets_slot_minus_one():
    clock = FakeClock()
    with small_cache(num_blocks=3, clock=clock) as cache:
        cache.add_sequence("a", 8)
        clock.now += 1
        cache.add_sequence("b", 8)
        r = cache.append(["a", "b"])  # both need a block, none free: the LRU ("a") goes
        assert r.preempted == ["a"] and r.slot_mapping[0] == -1 and r.slot_mapping[1] >= 0
        cache.check_invariants()


def test_sixteen_threads_keep_the_invariants():
    cache = small_cache(num_blocks=64, block_size=8)
    errors = []
    stop = time.monotonic() + 2.0

    def worker(t):
        rng = np.random.default_rng(t)
        mine = []
        try:
            while time.monotonic() < stop:
                op = rng.integers(5)
                if op == 0 or not mine:
                    sid = (t, int(rng.integers(1 << 30)))
                    cache.add_sequence(sid, int(rng.integers(1, 30)))
                    mine.append(sid)
                elif op == 1:
                    live = [s for s in mine if s in cache]
                    if live:
                        cache.append(live[:3])
                elif op == 2:
                    child = (t, int(rng.integers(1 << 30)))
                    parent = mine[int(rng.integers(len(mine)))]
                    if parent in cache:
                        cache.fork(parent, child)
                        mine.append(child)
                else:
                    sid = mine.pop(int(rng.integers(len(mine))))
                    if sid in cache:
                        (cache.finish if op == 3 else cache.remove)(sid)
        except (KeyError, CacheFullError):
            pass  # another thread preempted one of ours: expected, not an error
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    cache.check_invariants()
    for sid in list(cache.seq_ids()):
        cache.remove(sid)
    assert cache.stats()["free_blocks"] == 63
    cache.close()


# --- with the kernels --------------------------------------------------------------------
def _attend_and_compare(cache, layer, seq_ids, contents, rng, tol):
    """Attention through batch() metadata vs. attention over each sequence's own K/V."""
    c = cache.config
    q_heads = c.num_kv_heads * 2
    backend = cache.slab.backend
    q = rng.standard_normal((len(seq_ids), q_heads, c.head_dim), np.float32).astype(c.dtype)
    out = DeviceArray.empty(q.shape, c.dtype, backend=backend)
    meta = cache.batch(seq_ids)
    cache.attention(layer, out, DeviceArray.from_numpy(q, backend=backend), meta)
    got = out.to_numpy().astype(np.float64)
    for i, sid in enumerate(seq_ids):
        k, v = (np.stack(x).astype(np.float64) for x in zip(*contents[sid]))
        qf = q[i].astype(np.float64).reshape(c.num_kv_heads, 2, c.head_dim)
        scores = np.einsum("hgd,thd->hgt", qf, k) / math.sqrt(c.head_dim)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        want = np.einsum("hgt,thd->hgd", w, v).reshape(q_heads, c.head_dim)
        err = np.linalg.norm(got[i] - want) / np.linalg.norm(want)
        assert err < tol, f"{sid}: relative error {err}"


def _write(cache, layer, slots, rng):
    c = cache.config
    shape = (len(slots), c.num_kv_heads, c.head_dim)
    k = rng.standard_normal(shape, np.float32).astype(c.dtype)
    v = rng.standard_normal(shape, np.float32).astype(c.dtype)
    backend = cache.slab.backend
    cache.write(layer, DeviceArray.from_numpy(k, backend=backend),
                DeviceArray.from_numpy(v, backend=backend), slots)
    return list(zip(k, v))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 1e-2),
                                        ("bfloat16", 2e-2)])
def test_kernels_through_batch_metadata_after_fork_cow_and_preemption(backend, rng, dtype, tol):
    clock = FakeClock()
    config = CacheConfig(2, 2, 64, 16, 12, dtype)
    with KvCache(config, backend=backend, clock=clock) as cache:
        contents = {}
        for sid, n in (("a", 20), ("b", 33)):
            contents[sid] = _write(cache, 1, cache.add_sequence(sid, n).slot_mapping, rng)
            clock.now += 1
        cache.fork("a", "a2")
        contents["a2"] = list(contents["a"])
        for _ in range(5):  # decode: every write lands in the right (copied) block
            r = cache.append(["a", "a2", "b"])
            new = _write(cache, 1, r.slot_mapping, rng)
            for sid, kv in zip(["a", "a2", "b"], new):
                contents[sid].append(kv)
            clock.now += 1
        assert cache.stats()["cow_copies"] >= 1
        _attend_and_compare(cache, 1, ["a", "a2", "b"], contents, rng, tol)
        # preemption of the LRU sequence, then its re-add (recompute) and attention again
        cache.batch(["a", "a2"])
        clock.now += 1
        big = cache.add_sequence("c", 100)
        assert big.preempted and "b" in big.preempted
        contents["c"] = _write(cache, 1, big.slot_mapping, rng)
        for sid in big.preempted:
            del contents[sid]
        cache.remove("c")
        contents.pop("c")
        readd = cache.add_sequence("b", 38)
        contents["b"] = _write(cache, 1, readd.slot_mapping, rng)
        live = [s for s in ("a", "a2", "b") if s in cache]
        _attend_and_compare(cache, 1, live, contents, rng, tol)
        cache.check_invariants()


def test_reference_attention_agrees_with_batch_layout():
    """The metadata layout is the one the reference (and so the kernels) read."""
    rng = np.random.default_rng(5)
    with small_cache(num_blocks=20, block_size=8) as cache:
        cache.add_sequence("x", 13)
        meta = cache.batch(["x"])
        from rocmforge_raw.kernels.ops import host_view

        k = host_view(cache.k_cache(0))
        k[...] = rng.standard_normal(k.shape)
        q = rng.standard_normal((1, 4, 64)).astype(np.float32)
        out = reference.paged_attention(q, k, k, meta.block_tables, meta.seq_lens, 0.125)
        assert out.shape == (1, 4, 64) and np.isfinite(out).all()


def test_a_config_whose_planes_have_more_rows_than_the_kernels_index_is_refused():
    from rocmforge_raw.cache.config import MAX_ROWS

    with pytest.raises(ValueError, match=r"524288 blocks x 64 kv heads x 128 tokens = "
                                         r"4294967296 rows per K/V plane exceed 2147483647"):
        CacheConfig(1, 64, 128, 128, 2**19, "float16")
    fits = CacheConfig(1, 64, 128, 128, MAX_ROWS // (64 * 128), "float16")
    assert fits.num_blocks * 64 * 128 <= MAX_ROWS
    assert CacheConfig.for_memory(1, 64, 128, 128, budget_bytes=1 << 50).num_blocks == (
        fits.num_blocks)
