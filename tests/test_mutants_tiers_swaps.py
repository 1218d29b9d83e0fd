"""Swaps, demotions and events between the tiers, pinned down by the survivors of mutation
testing (issue 44): the times a swap keeps, counters that add up over operations, the host
tier's room when victims pin its cached prefix blocks, device hits on a swap-in, the parents
and tokens an event carries into another tier, and what an undone operation leaves in the
event queue's memory."""

from __future__ import annotations

import numpy as np
import pytest
from tier_helpers import FlakyHost, read, write

import rocmforge_raw as rf
from rocmforge_raw.cache import BlockRemoved, BlockStored, CacheConfig, CacheFullError, KvCache
from rocmforge_raw.cache.blocks.prefix import block_hashes
from rocmforge_raw.errors import DeviceError

BS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


def cache_of(num_blocks: int = 12, host_blocks: int = 16, **kw) -> KvCache:
    return KvCache(CacheConfig(1, 1, 64, BS, num_blocks, "float32", host_blocks=host_blocks),
                   backend=kw.pop("backend", "host"), **kw)


def added(cache: KvCache, seq_id, n: int, start: float) -> np.ndarray:
    values = start + np.arange(n, dtype=np.float32)
    write(cache, cache.add_sequence(seq_id, n).slot_mapping, values)
    return values


def prompt(cache: KvCache, seq_id, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    write(cache, reservation.slot_mapping[n:], tokens[n:])
    return tokens.astype(np.float32)


def remembered_as_held(cache: KvCache) -> None:
    """The event queue remembers a hash exactly while a tier holds it, with those tiers."""
    held: dict[bytes, set[str]] = {}
    for digest in cache.pool.index:
        held.setdefault(digest, set()).add("device")
    for digest in cache._host.index:
        held.setdefault(digest, set()).add("host")
    assert {h: k[2] for h, k in cache._events._known.items()} == held


# --- errors -------------------------------------------------------------------------------
def test_an_unhashable_id_is_named_in_the_error():
    with cache_of() as cache:
        with pytest.raises(TypeError, match=r"^sequence id must be hashable"):
            cache.seq_len(["a"])
        with pytest.raises(TypeError, match=r"^seq_ids\[1\] must be hashable"):
            cache.swap_out(["a", ["b"]])
        with pytest.raises(TypeError, match=r"^seq_ids must be an iterable of ids"):
            cache.swap_out("ab")


def test_a_swap_listing_a_sequence_twice_says_which():
    with cache_of() as cache:
        added(cache, "a", 3, 1.0)
        with pytest.raises(ValueError, match=r"^swap_out lists sequence 'a' twice$"):
            cache.swap_out(["a", "a"])


def test_a_swap_the_host_tier_cannot_hold_names_the_blocks_it_needs():
    """The blocks a victim's cached host prefixes would stop being reusable count too."""
    with cache_of(host_blocks=3) as cache:
        tokens = np.arange(2 * BS + 1)
        prompt(cache, "p", tokens)
        cache.swap_out(["p"])
        cache.finish("p")  # host blocks 0 and 1 cached by hash, 2 free
        prompt(cache, "q", np.concatenate([tokens[: 2 * BS], np.arange(500, 500 + BS + 1)]))
        with pytest.raises(CacheFullError, match=r"^needs 4 blocks but 3 are free: "
                                                 r"the host tier is full$"):
            cache.swap_out(["q"])  # 2 new blocks + 2 cached ones it pins > 3
        cache.check_invariants()


def test_forked_sequences_swapped_together_need_room_for_their_shared_blocks_once():
    with cache_of(host_blocks=3) as cache:
        a = added(cache, "a", 20, 1.0)
        cache.fork("a", "b")
        assert cache.swap_out(["a", "b"]) == 3
        np.testing.assert_array_equal(read(cache, "b"), a)


# --- finish, fork and times of a swapped sequence -----------------------------------------
def test_finishing_or_removing_a_swapped_sequence_returns_no_device_blocks():
    with cache_of() as cache:
        added(cache, "a", 20, 1.0)
        added(cache, "b", 20, 1.0)
        cache.swap_out(["a", "b"])
        assert cache.finish("a") == 0 and cache.remove("b") == 0


def test_a_swap_keeps_the_creation_time_and_marks_the_access():
    clock = Clock()
    with cache_of(clock=clock) as cache:
        added(cache, "a", 20, 1.0)
        clock.now = 2.0
        cache.swap_out(["a"])
        assert cache.times("a") == (1.0, 2.0)
        clock.now = 4.0
        cache.swap_in(["a"])
        assert cache.times("a") == (1.0, 4.0)


def test_a_preempted_sequence_is_swapped_out_at_the_time_of_the_preemption():
    clock = Clock()
    with cache_of(num_blocks=8, clock=clock) as cache:
        added(cache, "a", 3 * BS, 1.0)
        added(cache, "b", 3 * BS, 1.0)
        clock.now = 5.0
        assert cache.add_sequence("c", 3 * BS).swapped == ["a"]
        assert cache.times("a") == (1.0, 5.0)


def test_a_fork_of_a_swapped_sequence_is_created_now_with_no_slot_reserved():
    clock = Clock()
    with cache_of(clock=clock) as cache:
        added(cache, "a", 9, 1.0)
        cache.append(["a"])  # its last slot reserved
        clock.now = 2.0
        cache.swap_out(["a"])
        clock.now = 3.0
        cache.fork("a", "child")
        assert cache.times("a") == (1.0, 3.0) and cache.times("child") == (3.0, 3.0)
        cache.swap_in(["a", "child"])
        last = cache.block_ids("a")[-1] * BS + 9 % BS
        assert cache.batch(["a", "child"]).slot_mapping.tolist() == [last, -1]


# --- counters add up over operations --------------------------------------------------------
def test_swap_counters_add_up_over_swaps():
    with cache_of() as cache:
        added(cache, "a", 20, 1.0)
        for _ in range(2):
            cache.swap_out(["a"])
            assert cache.stats()["swapped_sequences"] == 1
            cache.swap_in(["a"])
        stats = cache.stats()
        assert stats["swapped_out_blocks"] == 6 and stats["swapped_in_blocks"] == 6


def test_demotion_and_promotion_counters_add_up_over_operations():
    with cache_of(num_blocks=4) as cache:
        prompts = [np.arange(100 * i, 100 * i + BS + 1) for i in range(2)]
        for i, tokens in enumerate(prompts):  # each prefix demoted by its own filler
            prompt(cache, i, tokens)
            cache.finish(i)
            cache.add_sequence("filler", 3 * BS)
            cache.finish("filler")
        for i, tokens in enumerate(prompts):  # each promoted by its own prompt
            assert prompt(cache, f"again {i}", tokens)[0] == tokens[0]
            cache.finish(f"again {i}")
        stats = cache.stats()
        assert stats["demoted_blocks"] >= 2 and stats["host_hits"] == 2
        assert stats["promoted_blocks"] == 2


# --- room on the host tier: cached prefix blocks a swap pins -------------------------------
def test_a_swap_never_reuses_the_cached_host_blocks_that_hold_its_own_prefix():
    with cache_of(num_blocks=16, host_blocks=4) as cache:
        tokens = np.arange(2 * BS + 1)
        prompt(cache, "p", tokens)
        cache.swap_out(["p"])
        cache.finish("p")  # host: blocks 0, 1 cached (p's prefix), 2, 3 free
        prompt(cache, "s", np.arange(300, 300 + BS + 1))
        cache.swap_out(["s"])
        cache.finish("s")  # host: 0, 1, 2 cached, least recently used first; 3 free
        assert cache._host.cached_ids() == [0, 1, 2]
        q = prompt(cache, "q", tokens)  # p's prefix hit on the device
        r = added(cache, "r", 3, 900.0)
        assert cache.swap_out(["q", "r"]) == 2  # q's last block and r's: into 3, then 2
        assert cache.stats()["host_cached_blocks"] == 0
        np.testing.assert_array_equal(read(cache, "q"), q)
        np.testing.assert_array_equal(read(cache, "r"), r)
        cache.check_invariants()


def test_a_swap_copies_only_the_blocks_whose_prefix_the_host_tier_lacks():
    with cache_of() as cache:
        tokens = np.arange(2 * BS + 1)
        a = prompt(cache, "a", tokens)
        assert cache.swap_out(["a"]) == 3
        prompt(cache, "b", tokens)  # a's prefix blocks, cached on the device
        assert cache.swap_out(["b"]) == 1  # its prefix is on the host tier (held by a)
        assert cache.stats()["host_used_blocks"] == 4
        cache.swap_in(["b"])
        np.testing.assert_array_equal(read(cache, "b"), a)
        cache.check_invariants()


def test_a_promotion_keeps_its_source_blocks_out_of_the_room_demotions_take():
    with cache_of(num_blocks=5, host_blocks=2) as cache:
        a, s = np.arange(BS), np.arange(600, 600 + BS)
        for seq_id, tokens in (("a", a), ("s", s)):
            prompt(cache, seq_id, tokens)
            cache.swap_out([seq_id])
            cache.finish(seq_id)
        assert cache._host.cached_ids() == [0, 1]  # a's prefix, the least recently used
        cache.add_sequence("x", 4 * BS)  # a's and s's device copies go (the host has them)
        cache.finish("x")
        for seq_id, start in (("y", 200), ("z", 300)):  # prefixes on the device only
            prompt(cache, seq_id, np.arange(start, start + BS + 1))
            cache.finish(seq_id)
        before = cache.stats()["demoted_blocks"]
        b = prompt(cache, "b", np.concatenate([a, np.arange(400, 400 + 3 * BS)]))
        stats = cache.stats()
        assert stats["promoted_blocks"] == 1
        assert stats["demoted_blocks"] - before == 1  # into s's host block, not a's
        np.testing.assert_array_equal(read(cache, "b"), b)
        cache.check_invariants()


# --- swap-in shares device blocks by hash --------------------------------------------------
def test_a_swap_in_shares_the_prefix_blocks_the_device_still_holds():
    with cache_of() as cache:
        a = prompt(cache, "a", np.arange(2 * BS + 1))
        cache.swap_out(["a"])  # a's prefix blocks stay cached on the device
        free = cache.stats()["free_blocks"]
        cache.swap_in(["a"])
        stats = cache.stats()
        assert stats["swapped_in_blocks"] == 1 and stats["free_blocks"] == free - 3
        assert stats["host_cached_blocks"] == 0 and stats["host_free_blocks"] == 16
        np.testing.assert_array_equal(read(cache, "a"), a)


def test_a_swap_in_announces_the_prefixes_it_brings_back_to_the_device():
    tokens = np.arange(2 * BS + 1)
    h0, h1 = block_hashes(tokens, BS)
    with cache_of(num_blocks=5) as cache:
        prompt(cache, "a", tokens)
        cache.swap_out(["a"])
        cache.add_sequence("x", 4 * BS)  # a's device copies are reused
        cache.finish("x")
        cache.events()
        cache.swap_in(["a"])
        events = cache.events().events
        assert [e for e in events if isinstance(e, BlockStored)] == [
            BlockStored(h0, None, tuple(range(BS)), "device"),
            BlockStored(h1, h0, tuple(range(BS, 2 * BS)), "device")]
        assert {e.block_hash for e in events if isinstance(e, BlockRemoved)} == {h0, h1}
        assert cache.stats()["host_cached_blocks"] == 0  # the host blocks left are freed


# --- events carry a block's parent and tokens into another tier ---------------------------
def test_a_queue_of_one_keeps_the_newest_event():
    with cache_of(max_events=1) as cache:
        prompt(cache, "a", np.arange(2 * BS))
        batch = cache.events()
        assert batch.dropped == 1 and [e.token_ids[0] for e in batch] == [BS]


def test_a_swapped_out_prefix_is_stored_on_the_host_with_its_parent_and_tokens():
    tokens = np.arange(2 * BS + 1)
    h0, h1 = block_hashes(tokens, BS)
    with cache_of() as cache:
        prompt(cache, "a", tokens)
        cache.events()
        cache.swap_out(["a"])
        assert cache.events().events == [BlockStored(h0, None, tuple(range(BS)), "host"),
                                         BlockStored(h1, h0, tuple(range(BS, 2 * BS)), "host")]


def test_a_demoted_prefix_is_stored_on_the_host_with_its_parent_and_tokens():
    tokens = np.arange(2 * BS + 1)
    h0, h1 = block_hashes(tokens, BS)
    with cache_of(num_blocks=5) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")
        cache.events()
        cache.add_sequence("x", 4 * BS)  # both prefix blocks demoted
        stored = [e for e in cache.events() if isinstance(e, BlockStored)]
        assert sorted(stored, key=lambda e: e.token_ids) == [
            BlockStored(h0, None, tuple(range(BS)), "host"),
            BlockStored(h1, h0, tuple(range(BS, 2 * BS)), "host")]


def test_an_undone_preemption_leaves_the_event_memory_as_the_tiers_hold():
    backend = FlakyHost()
    with cache_of(num_blocks=8, host_blocks=4, backend=backend) as cache:
        prompt(cache, "old", np.arange(700, 700 + 2 * BS))
        cache.swap_out(["old"])
        cache.finish("old")  # host: 2 cached blocks, 2 free
        prompt(cache, "x", np.arange(500, 500 + BS + 1))
        cache.finish("x")  # x's prefix cached on the device only
        p = prompt(cache, "p", np.arange(2 * BS + 1))  # 3 blocks, 2 named
        cache.events()
        remembered_as_held(cache)
        backend.fail_in = 2  # p's swap-out (two copies, a cached host block reused)
        # is undone when the demotion of a reused device prefix fails
        with pytest.raises(DeviceError):
            cache.add_sequence("big", 6 * BS)
        assert not cache.is_swapped("p")
        np.testing.assert_array_equal(read(cache, "p"), p)
        remembered_as_held(cache)
        cache.check_invariants()
        cache.finish("p")
        cache.add_sequence("big", 6 * BS)  # now it fits: p's and x's prefixes go
        remembered_as_held(cache)


def test_preemption_copies_run_on_the_caches_stream():
    from test_mutants_tiers_a import Recorder

    backend = Recorder()
    with rf.Stream(backend=backend) as stream, KvCache(
            CacheConfig(1, 1, 64, BS, 8, "float32", host_blocks=8), backend=backend,
            stream=stream) as cache:
        tokens = np.arange(BS + 1)
        prompt(cache, "p", tokens)
        cache.finish("p")
        added(cache, "a", 7 * BS, 1.0)  # p's prefix demoted
        cache.finish("a")
        prompt(cache, "c", tokens)  # and promoted
        added(cache, "d", 5 * BS, 1.0)
        prompt(cache, "e", np.arange(900, 900 + 3 * BS))  # a victim swapped out for it
        stats = cache.stats()
        assert stats["demoted_blocks"] == stats["promoted_blocks"] == 1
        assert stats["swapped_out_blocks"] > 0
        assert {s for *_, s in backend.copies} == {stream.handle}


def test_an_undone_prompt_that_preempted_puts_its_victim_back():
    backend = FlakyHost()
    with cache_of(num_blocks=8, host_blocks=4, backend=backend) as cache:
        prompt(cache, "old", np.arange(700, 700 + 2 * BS))
        cache.swap_out(["old"])
        cache.finish("old")
        prompt(cache, "x", np.arange(500, 500 + BS + 1))
        cache.finish("x")
        p = prompt(cache, "p", np.arange(2 * BS + 1))
        backend.fail_in = 2  # after p's swap-out, the demotion of x's prefix fails
        with pytest.raises(DeviceError):
            cache.add_sequence("big", tokens=np.arange(3000, 3000 + 6 * BS))
        assert not cache.is_swapped("p") and cache.stats()["preemptions"] == 0
        np.testing.assert_array_equal(read(cache, "p"), p)
        remembered_as_held(cache)
        cache.check_invariants()


def test_a_prompt_swaps_its_victim_out_at_the_time_of_the_preemption():
    clock = Clock()
    with cache_of(num_blocks=8, clock=clock) as cache:
        added(cache, "a", 3 * BS, 1.0)
        added(cache, "b", 3 * BS, 1.0)
        clock.now = 5.0
        reservation = cache.add_sequence("c", tokens=np.arange(3 * BS))
        assert reservation.swapped == ["a"] and cache.times("a") == (1.0, 5.0)


def test_a_victim_too_large_for_the_host_tier_is_dropped_and_the_next_still_swapped():
    with cache_of(num_blocks=8, host_blocks=2) as cache:
        added(cache, "a", 3 * BS, 1.0)
        b = added(cache, "b", BS, 50.0)
        reservation = cache.add_sequence("c", 7 * BS)
        assert reservation.preempted == ["a", "b"] and reservation.swapped == ["b"]
        assert "a" not in cache and cache.is_swapped("b")
        np.testing.assert_array_equal(read(cache, "b"), b)


# --- a prompt's hits among the blocks it needs -----------------------------------------------
def test_a_prompt_counts_its_cached_free_hit_among_the_blocks_it_preempts_for():
    tokens = np.arange(2 * BS + 1)
    with cache_of(num_blocks=7, host_blocks=8) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")  # 2 cached-free prefix blocks, 4 free
        added(cache, "v", 2 * BS, 5.0)
        reservation = cache.add_sequence(
            "b", tokens=np.concatenate([tokens[:BS], np.arange(100, 100 + 3 * BS + 1)]))
        assert reservation.num_cached_tokens == BS  # the hit, and 4 fresh blocks: 5 > 4
        assert reservation.preempted == reservation.swapped == ["v"]
        cache.check_invariants()


def test_a_prompt_that_must_preempt_computes_the_blocks_only_the_host_tier_holds():
    tokens = np.arange(2 * BS + 1)
    with cache_of(num_blocks=7, host_blocks=8) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")
        cache.add_sequence("x", 5 * BS)  # a's second block is demoted, its first stays
        cache.finish("x")
        added(cache, "v", 2 * BS, 5.0)
        reservation = cache.add_sequence(
            "b", tokens=np.concatenate([tokens[: 2 * BS], np.arange(100, 100 + 2 * BS + 1)]))
        assert reservation.preempted == ["v"]
        assert reservation.num_cached_tokens == BS  # the device's hit only: no promotion
        assert cache.stats()["promoted_blocks"] == 0
        cache.check_invariants()


@pytest.mark.parametrize("on_host", [False, True], ids=["demoting", "held-by-the-host-too"])
def test_an_undone_copy_on_write_leaves_the_event_memory_as_the_tiers_hold(monkeypatch,
                                                                           on_host):
    from rocmforge_raw.kernels import ops

    def failing_copy(*args, **kwargs):
        raise DeviceError("cuLaunchKernel", 719, "CUDA_ERROR_LAUNCH_FAILED", "injected")

    with cache_of(num_blocks=12, host_blocks=16) as cache:
        cache.add_sequence("parent", 12)  # 2 blocks, the second shared by both forks
        cache.fork("parent", "a")
        cache.fork("parent", "b")
        prompt(cache, "w", np.arange(72))
        if on_host:
            cache.swap_out(["w"])  # its prefixes on both tiers
        cache.finish("w")  # 9 cached-free blocks: the private copies evict two
        cache.events()
        monkeypatch.setattr(ops, "copy_blocks", failing_copy)
        with pytest.raises(DeviceError, match="injected"):
            cache.append(["a", "b"])
        remembered_as_held(cache)
        monkeypatch.undo()
        cache.append(["a", "b"])
        remembered_as_held(cache)
        cache.check_invariants()
