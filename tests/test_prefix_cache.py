"""Prefix caching: full prompt blocks found by their chained hash are shared, freed ones keep
their contents until reused (least recently freed first), and nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest

from rocmforge_raw.cache import BlockPool, CacheConfig, CacheFullError, KvCache
from rocmforge_raw.cache.blocks.prefix import block_hashes, token_ids
from rocmforge_raw.kernels.ops import host_view
from rocmforge_raw.memory.array import DeviceArray

BS = 8


def cache_of(num_blocks=12, **kw) -> KvCache:
    return KvCache(CacheConfig(1, 1, 64, BS, num_blocks, "float32"), backend="host", **kw)


def prefill(cache: KvCache, seq_id, tokens) -> np.ndarray:
    """Add ``seq_id`` with ``tokens`` and write K = V = its token ids (a function of the
    prompt, as a model's K/V are) for the uncached tokens only; returns the slots."""
    tokens = np.asarray(tokens)
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    values = np.repeat(tokens[n:].astype(np.float32)[:, None, None], 64, 2)
    array = DeviceArray.from_numpy(values, backend="host")
    cache.write(0, array, array, reservation.slot_mapping[n:])
    return reservation


def read_back(cache: KvCache, seq_id) -> np.ndarray:
    keys = host_view(cache.k_cache(0))
    blocks, n = cache.block_ids(seq_id), cache.seq_len(seq_id)
    positions = np.arange(n)
    return keys[blocks[positions // BS], 0, positions % BS, 0]


def test_requests_sharing_a_system_prompt_share_its_full_blocks():
    system = np.arange(100, 100 + 3 * BS + 5)  # 3 full blocks and 5 tokens
    with cache_of() as cache:
        a = prefill(cache, "a", np.concatenate([system, [1, 2, 3]]))
        b = prefill(cache, "b", np.concatenate([system, [7, 8, 9, 10]]))
        assert a.num_cached_tokens == 0 and b.num_cached_tokens == 3 * BS
        assert (cache.block_ids("a")[:3] == cache.block_ids("b")[:3]).all()
        assert cache.block_ids("a")[3] != cache.block_ids("b")[3]  # the partial block
        assert (cache.pool.ref_cnt[cache.block_ids("b")[:3]] == 2).all()
        for seq_id, tail in (("a", [1, 2, 3]), ("b", [7, 8, 9, 10])):
            np.testing.assert_array_equal(read_back(cache, seq_id),
                                          np.concatenate([system, tail]))
        stats = cache.stats()
        # a: 4 full blocks, none found; b: 4, 3 of them found
        assert (stats["prefix_hits"], stats["prefix_misses"]) == (3, 5)
        assert stats["prefix_hit_rate"] == pytest.approx(3 / 8)
        cache.check_invariants()


def test_a_partial_last_block_is_never_shared():
    prompt = np.arange(2 * BS + 3)
    with cache_of() as cache:
        prefill(cache, "a", prompt)
        b = prefill(cache, "b", prompt)
        assert b.num_cached_tokens == 2 * BS
        assert cache.block_ids("a")[2] != cache.block_ids("b")[2]
        cache.append(["a", "b"])  # each writes its own last block: no copy-on-write
        assert cache.stats()["cow_copies"] == 0
        cache.check_invariants()


def test_a_fully_cached_prompt_leaves_its_last_token_to_compute():
    prompt = np.arange(2 * BS)
    with cache_of() as cache:
        prefill(cache, "a", prompt)
        b = prefill(cache, "b", prompt)
        assert b.num_cached_tokens == 2 * BS - 1
        assert (cache.block_ids("a") == cache.block_ids("b")).all()
        np.testing.assert_array_equal(read_back(cache, "b"), prompt)
        meta = cache.batch(["a", "b"])  # a step's write before an append skips the shared slot
        assert meta.slot_mapping.tolist() == [cache.block_ids("a")[1] * BS + BS - 1, -1]
        cache.append(["b"])  # the shared last block is full: b grows a block of its own
        assert cache.block_ids("b")[2] not in cache.block_ids("a")
        cache.check_invariants()


def test_a_block_is_named_by_everything_before_it():
    with cache_of() as cache:
        prefill(cache, "a", np.arange(3 * BS))
        other = np.arange(3 * BS)
        other[0] = 999  # the first block differs; the next two hold the same ids
        assert prefill(cache, "b", other).num_cached_tokens == 0
        assert not set(cache.block_ids("a")) & set(cache.block_ids("b"))


def test_a_block_is_named_by_its_position_and_prefix_not_its_tokens_alone():
    x, y, z = np.arange(BS), np.arange(100, 100 + BS), np.arange(200, 200 + BS)
    xy, zy, yy = (block_hashes(np.concatenate(p), BS) for p in ((x, y), (z, y), (y, y)))
    assert xy[1] != zy[1] and xy[1] != block_hashes(y, BS)[0] and yy[0] != yy[1]
    with cache_of() as cache:
        prefill(cache, "xy", np.concatenate([x, y]))
        # y again, first: its block in "xy" follows x, so it is not this one
        assert prefill(cache, "yz", np.concatenate([y, z])).num_cached_tokens == 0
        assert not set(cache.block_ids("xy")) & set(cache.block_ids("yz"))
        # y twice in one prompt: two blocks, and a second such prompt shares both in order
        prefill(cache, "yy", np.concatenate([y, y, [1]]))
        again = prefill(cache, "yy again", np.concatenate([y, y, [2]]))
        first, second = cache.block_ids("yy"), cache.block_ids("yy again")
        assert again.num_cached_tokens == 2 * BS and first[0] != first[1]
        assert second[:2].tolist() == first[:2].tolist()
        np.testing.assert_array_equal(read_back(cache, "yy again")[: 2 * BS],
                                      np.concatenate([y, y]))
        cache.check_invariants()


def test_register_keeps_an_indexed_digest_and_a_named_block():
    pool = BlockPool(8)
    a, b = (int(x) for x in pool.allocate(2))
    pool.register(np.array([a]), [b"h1"])
    pool.register(np.array([b]), [b"h1"])  # the digest is taken: b stays nameless
    pool.register(np.array([a]), [b"h2"])  # a is named already: h2 names nothing
    assert pool.index == {b"h1": a} and pool.hashes == {a: b"h1"}
    assert pool.lookup([b"h1"]) == [a] and pool.lookup([b"h2"]) == []
    pool.check()


def test_lookup_stops_at_the_first_miss():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    pool.register(ids, [b"h0", b"h1", b"h2"])
    assert pool.lookup([b"h0", b"h1", b"h2"]) == ids.tolist()
    assert pool.lookup([b"h0", b"missing", b"h2"]) == [int(ids[0])]
    assert pool.lookup([b"missing", b"h1"]) == []


def test_token_dtype_does_not_change_the_hash():
    tokens = np.arange(2 * BS)
    assert block_hashes(token_ids(tokens.astype(np.int32)), BS) == \
        block_hashes(token_ids(tokens.astype(np.uint16)), BS) == \
        block_hashes(token_ids(list(tokens)), BS)


def test_a_freed_block_keeps_its_contents_until_reused():
    prompt = np.arange(50, 50 + 3 * BS)
    with cache_of() as cache:
        prefill(cache, "a", prompt)
        blocks = cache.block_ids("a")
        assert cache.finish("a") == 3
        stats = cache.stats()
        assert stats["cached_free_blocks"] == 3 and stats["free_blocks"] == 11
        b = prefill(cache, "b", np.concatenate([prompt, [1]]))
        assert b.num_cached_tokens == 3 * BS and (cache.block_ids("b")[:3] == blocks).all()
        np.testing.assert_array_equal(read_back(cache, "b"), np.concatenate([prompt, [1]]))
        assert cache.stats()["cached_free_blocks"] == 0
        cache.check_invariants()


def test_cached_free_blocks_are_reused_last_and_least_recently_freed_first():
    with cache_of(num_blocks=9) as cache:  # 8 usable blocks
        prefill(cache, "old", np.arange(2 * BS))
        prefill(cache, "new", np.arange(500, 500 + 2 * BS))
        old, new = cache.block_ids("old"), cache.block_ids("new")
        cache.finish("old")
        cache.finish("new")
        cache.add_sequence("plain", 4 * BS)  # the 4 never-cached blocks go first
        assert not set(cache.block_ids("plain")) & (set(old) | set(new))
        assert cache.stats()["cached_free_blocks"] == 4
        cache.add_sequence("more", BS)  # evicts the tail of the oldest chain first
        assert cache.block_ids("more")[0] == old[1]
        assert cache.pool.cached_ids().tolist() == [old[0], new[1], new[0]]
        assert prefill(cache, "again", np.arange(2 * BS)).num_cached_tokens == BS
        assert cache.block_ids("again").tolist() == [old[0], new[1]]  # hit, then evicted
        assert cache.pool.cached_ids().tolist() == [new[0]]
        assert cache.stats()["prefix_hits"] == 1
        cache.check_invariants()


def test_fork_and_copy_on_write_keep_working_on_prefix_blocks():
    prompt = np.arange(2 * BS + 2)
    with cache_of() as cache:
        prefill(cache, "a", prompt)
        prefill(cache, "b", prompt)
        cache.fork("b", "c")
        slots = cache.append(["c"]).slot_mapping
        assert cache.stats()["cow_copies"] == 1  # c's copy of the partial block it shared
        array = DeviceArray.from_numpy(np.full((1, 1, 64), -1, np.float32), backend="host")
        cache.write(0, array, array, slots)
        np.testing.assert_array_equal(read_back(cache, "c"), np.concatenate([prompt, [-1]]))
        for seq_id in "ab":
            np.testing.assert_array_equal(read_back(cache, seq_id), prompt)
        assert (cache.pool.ref_cnt[cache.block_ids("a")[:2]] == 3).all()
        cache.check_invariants()


def test_preemption_frees_blocks_that_the_new_prompt_then_hits():
    prompt = np.arange(4 * BS)
    with cache_of(num_blocks=7) as cache:  # 6 usable blocks
        prefill(cache, "a", np.concatenate([prompt, [7]]))  # 5 blocks, least recently used
        cache.add_sequence("x", BS)
        b = prefill(cache, "b", np.concatenate([prompt, np.arange(900, 900 + 2 * BS)]))
        # a's tail block and x's block make the 2 fresh blocks: both go, a's prefix stays
        assert b.preempted == ["a", "x"] and b.num_cached_tokens == 4 * BS
        np.testing.assert_array_equal(read_back(cache, "b")[: 4 * BS], prompt)
        assert cache.stats()["preemptions"] == 2
        cache.check_invariants()


def test_preemption_spares_a_sequence_whose_blocks_the_new_prompt_shares():
    """Preempting a sequence that holds only blocks the new prompt hits frees nothing (they
    come straight back): only the sequences that make room go, LRU first."""
    prompt = np.arange(4 * BS)
    with cache_of(num_blocks=7) as cache:  # 6 usable blocks
        prefill(cache, "a", prompt)  # 4 blocks, least recently used
        cache.add_sequence("x", 2 * BS)
        b = prefill(cache, "b", np.concatenate([prompt, np.arange(900, 900 + 2 * BS)]))
        assert b.preempted == ["x"] and b.num_cached_tokens == 4 * BS
        assert cache.block_ids("b")[:4].tolist() == cache.block_ids("a").tolist()
        assert cache.stats()["preemptions"] == 1
        cache.check_invariants()
    with cache_of(num_blocks=9) as cache:  # the case: 8 usable blocks
        prefill(cache, "A", np.arange(2 * BS))  # the prefix
        cache.add_sequence("D", 4 * BS)
        cache.add_sequence("E", 2 * BS)
        cache.batch(["D"])
        cache.batch(["E"])  # A, then D, then E by recency
        n = prefill(cache, "N", np.concatenate([np.arange(2 * BS), np.arange(200, 200 + 3 * BS)]))
        assert n.preempted == ["D"] and n.num_cached_tokens == 2 * BS
        assert sorted(cache.seq_ids()) == ["A", "E", "N"]
        cache.check_invariants()


def test_strict_mode_refuses_without_touching_the_index():
    with cache_of(num_blocks=4, strict=True) as cache:
        prefill(cache, "a", np.arange(2 * BS))
        before = (cache.pool.free_ids().tolist(), dict(cache.pool.index), cache.stats())
        with pytest.raises(CacheFullError):
            cache.add_sequence("b", tokens=np.arange(100, 100 + 2 * BS))
        assert (cache.pool.free_ids().tolist(), dict(cache.pool.index), cache.stats()) == before


@pytest.mark.parametrize("tokens, error, match", [
    (np.arange(4.0), TypeError, "tokens must be integer token ids, got float64"),
    (np.array([True, False]), TypeError, "tokens must be integer token ids, got bool"),
    (np.zeros((2, 8), np.int64), ValueError, r"1-D array of token ids, got shape \(2, 8\)"),
    (np.zeros(0, np.int64), ValueError, r"non-empty .* got shape \(0,\)"),
    (np.array([2**64 - 1], np.uint64), ValueError, "beyond int64"),
    ([], ValueError, r"non-empty .* got shape \(0,\): \[\]"),
    ([5, -1, -2], ValueError, r"token ids >= 0, got -2 in \[5, -1, -2\]"),
    (np.array([3, -7]), ValueError, "token ids >= 0, got -7"),
    ([1, 2**70], ValueError, rf"tokens\[1\] must be <= {2**63 - 1}, got {2**70}"),
    ([1, 2**64 - 1], ValueError, rf"tokens\[1\] must be <= {2**63 - 1}, got {2**64 - 1}"),
    ([1, None], TypeError, r"tokens\[1\] must be an integer, got None"),
])
def test_bad_tokens_are_refused_and_change_nothing(tokens, error, match):
    with cache_of() as cache:
        prefill(cache, "a", np.arange(2 * BS))
        before = (cache.pool.free_ids().tolist(), dict(cache.pool.index), cache.stats())
        with pytest.raises(error, match=match):
            cache.add_sequence("b", tokens=tokens)
        assert (cache.pool.free_ids().tolist(), dict(cache.pool.index), cache.stats()) == before
        assert "b" not in cache


def test_add_sequence_takes_exactly_one_of_a_count_and_tokens():
    with cache_of() as cache:
        for kwargs in ({}, {"num_tokens": 3, "tokens": [1, 2, 3]}):
            with pytest.raises(TypeError, match="exactly one of num_tokens and tokens"):
                cache.add_sequence("a", **kwargs)
        assert len(cache) == 0


def test_an_undone_allocation_puts_evicted_blocks_back_in_the_index():
    pool = BlockPool(4)
    held = pool.allocate(3)
    pool.register(held, [b"h0", b"h1", b"h2"])
    pool.free(held[:2])  # two cached-free blocks; the free stack is empty
    before = pool.snapshot()
    ids = pool.allocate(2)  # evicts both (least recently freed first: held[1], held[0])
    assert ids.tolist() == [held[1], held[0]] and pool.lookup([b"h0"]) == []
    pool.undo_allocate(ids)
    after = pool.snapshot()
    assert after[1].tolist() == before[1].tolist() and after[2:] == before[2:]
    assert (after[0] == before[0]).all() and pool.lookup([b"h0", b"h1"]) == held[:2].tolist()
    pool.check()


@pytest.mark.parametrize("corrupt", ["drop_index", "hash_on_stack", "free_cached"])
def test_check_invariants_names_a_broken_prefix_index(corrupt):
    with cache_of() as cache:
        prefill(cache, "a", np.arange(2 * BS + 1))
        cache.add_sequence("x", 1)
        pool = cache.pool
        if corrupt == "drop_index":
            pool.index.pop(next(iter(pool.index)))
        elif corrupt == "hash_on_stack":
            pool.hashes[int(pool.free_ids()[-1])] = b"stray"
        else:
            cache.finish("a")
            pool.ref_cnt[pool.cached_ids()[0]] = 1
        with pytest.raises(AssertionError):
            cache.check_invariants()
