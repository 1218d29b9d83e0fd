"""The host tier: swapping out and in, preemption that swaps, demotion and promotion of prefix
blocks, least-recently-used eviction, atomicity when a copy fails, streams and threads.

Every test runs on the host backend; those taking ``backend`` also run on each GPU backend
that answers (pinned host memory, asynchronous 2-D copies on the cache's stream)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tier_helpers import FlakyHost, assert_as_before, read, snapshot, write

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.errors import DeviceError

BS = 8


def config(num_blocks: int = 12, host_blocks: int = 16, layers: int = 2) -> CacheConfig:
    return CacheConfig(layers, 1, 64, BS, num_blocks, "float32", host_blocks=host_blocks)


def added(cache: KvCache, seq_id, n: int, start: float) -> np.ndarray:
    """Add ``seq_id`` with ``n`` tokens valued ``start, start + 1, ...``; returns them."""
    values = start + np.arange(n, dtype=np.float32)
    write(cache, cache.add_sequence(seq_id, n).slot_mapping, values)
    return values


def prompt(cache: KvCache, seq_id, tokens) -> int:
    """Add ``seq_id`` by its token ids, K = V = the ids for the uncached tokens; returns
    how many were cached."""
    tokens = np.asarray(tokens)
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    write(cache, reservation.slot_mapping[n:], tokens[n:])
    return n


def test_a_swapped_sequence_comes_back_exactly(backend):
    with KvCache(config(), backend=backend) as cache:
        a, b = added(cache, "a", 20, 1.0), added(cache, "b", 13, 100.0)
        free = cache.stats()["free_blocks"]
        assert cache.swap_out(["a"]) == 3
        assert cache.is_swapped("a") and not cache.is_swapped("b")
        assert cache.swapped_ids() == ["a"] and "a" in cache and len(cache) == 2
        stats = cache.stats()
        assert stats["free_blocks"] == free + 3 and stats["host_used_blocks"] == 3
        assert stats["swapped_out_blocks"] == 3 and stats["swapped_out_bytes"] == 3 * (
            cache.config.block_bytes)
        np.testing.assert_array_equal(read(cache, "a"), a)
        cache.check_invariants()
        added(cache, "c", 40, 500.0)  # reuses the blocks "a" left
        cache.finish("c")
        cache.swap_in(["a"])
        assert not cache.is_swapped("a") and cache.stats()["host_used_blocks"] == 0
        assert cache.stats()["swapped_in_blocks"] == 3
        np.testing.assert_array_equal(read(cache, "a"), a)
        np.testing.assert_array_equal(read(cache, "b"), b)
        cache.check_invariants()


def test_preemption_swaps_the_victim_out_instead_of_dropping_it(backend):
    with KvCache(config(num_blocks=8), backend=backend) as cache:
        a = added(cache, "a", 24, 1.0)
        added(cache, "b", 24, 100.0)
        reservation = cache.add_sequence("c", 24)  # 3 + 3 + 3 blocks > 7: "a" goes
        assert reservation.preempted == ["a"] and reservation.swapped == ["a"]
        assert cache.is_swapped("a") and cache.stats()["preemptions"] == 1
        write(cache, reservation.slot_mapping, np.zeros(24))
        cache.remove("c")
        cache.swap_in(["a"])
        np.testing.assert_array_equal(read(cache, "a"), a)
        cache.check_invariants()


def test_victims_the_host_tier_cannot_hold_are_dropped():
    with KvCache(config(num_blocks=8, host_blocks=3), backend="host") as cache:
        added(cache, "a", 24, 1.0)
        added(cache, "b", 24, 100.0)
        reservation = cache.add_sequence("c", 56)  # needs all 7 blocks: both go
        assert reservation.preempted == ["a", "b"] and reservation.swapped == ["a"]
        assert cache.is_swapped("a") and "b" not in cache
        cache.check_invariants()


def test_an_explicit_swap_out_is_all_or_nothing():
    with KvCache(config(host_blocks=4), backend="host") as cache:
        a, b = added(cache, "a", 24, 1.0), added(cache, "b", 24, 100.0)
        with pytest.raises(CacheFullError, match="host tier is full"):
            cache.swap_out(["a", "b"])
        assert cache.swapped_ids() == [] and cache.stats()["host_free_blocks"] == 4
        np.testing.assert_array_equal(read(cache, "a"), a)
        np.testing.assert_array_equal(read(cache, "b"), b)
        cache.check_invariants()


def test_append_and_batch_refuse_a_swapped_sequence_and_say_what_to_do():
    with KvCache(config(), backend="host") as cache:
        added(cache, "a", 5, 1.0)
        cache.swap_out(["a"])
        for call in (lambda: cache.append(["a"]), lambda: cache.batch(["a"]),
                     lambda: cache.block_ids("a"), lambda: cache.swap_out(["a"])):
            with pytest.raises(ValueError, match="'a' is swapped out to the host tier: swap_in"):
                call()
        cache.swap_in(["a"])
        with pytest.raises(ValueError, match="not swapped out"):
            cache.swap_in(["a"])
        with pytest.raises(KeyError, match="no sequence 'x'"):
            cache.swap_in(["x"])


def test_a_cache_without_a_host_tier_says_so():
    with KvCache(config(host_blocks=0), backend="host") as cache:
        added(cache, "a", 5, 1.0)
        with pytest.raises(ValueError, match="no host tier"):
            cache.swap_out(["a"])
        assert cache.stats()["host_blocks"] == 0 and not cache.can_swap_in(["a"])


@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_host_blocks_is_checked(value):
    with pytest.raises((TypeError, ValueError), match="host_blocks"):
        config(host_blocks=value)


def test_a_reserved_slot_is_reserved_again_after_a_swap():
    with KvCache(config(), backend="host") as cache:
        added(cache, "a", 9, 1.0)
        cache.append(["a"])
        cache.fork("a", "child")  # no slot reserved
        cache.swap_out(["a", "child"])
        cache.swap_in(["a", "child"])
        last = cache.block_ids("a")[-1] * BS + 9 % BS
        assert cache.batch(["a", "child"]).slot_mapping.tolist() == [last, -1]


def test_a_fork_of_a_swapped_sequence_shares_its_host_blocks(backend):
    with KvCache(config(), backend=backend) as cache:
        a = added(cache, "a", 20, 1.0)
        cache.swap_out(["a"])
        cache.fork("a", "child")
        assert cache.is_swapped("child") and cache.stats()["host_used_blocks"] == 3
        cache.swap_in(["child"])
        np.testing.assert_array_equal(read(cache, "child"), a)
        np.testing.assert_array_equal(read(cache, "a"), a)  # still on the host tier
        cache.finish("child")
        cache.swap_in(["a"])
        np.testing.assert_array_equal(read(cache, "a"), a)
        cache.check_invariants()


def test_sequences_swapped_together_copy_a_shared_block_once():
    with KvCache(config(), backend="host") as cache:
        a = added(cache, "a", 20, 1.0)
        cache.fork("a", "b")
        assert cache.swap_out(["a", "b"]) == 3
        cache.swap_in(["a", "b"])
        assert (cache.block_ids("a") == cache.block_ids("b")).all()
        assert cache.stats()["swapped_in_blocks"] == 3
        np.testing.assert_array_equal(read(cache, "b"), a)
        cache.check_invariants()


def test_a_freed_prefix_block_is_demoted_before_reuse_and_promoted_by_a_later_hit(backend):
    tokens = np.arange(1000, 1000 + 3 * BS + 2)
    with KvCache(config(num_blocks=6), backend=backend) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")
        assert cache.stats()["cached_free_blocks"] == 3
        added(cache, "filler", 5 * BS, 7.0)  # every free block: the 3 prefixes are reused
        stats = cache.stats()
        assert stats["demoted_blocks"] == 3 and stats["host_cached_blocks"] == 3
        cache.finish("filler")
        assert prompt(cache, "b", tokens) == 3 * BS
        stats = cache.stats()
        assert stats["host_hits"] == 3 and stats["promoted_blocks"] == 3
        assert stats["host_cached_blocks"] == 0  # promoted blocks leave the host tier
        assert stats["prefix_hits"] == 3 and stats["host_hit_rate"] == pytest.approx(3 / 6)
        np.testing.assert_array_equal(read(cache, "b"), tokens)
        cache.check_invariants()


def test_finishing_a_swapped_sequence_keeps_its_prefixes_on_the_host_tier():
    tokens = np.arange(2 * BS + 3)
    with KvCache(config(num_blocks=6), backend="host") as cache:
        prompt(cache, "a", tokens)
        cache.swap_out(["a"])
        added(cache, "filler", 5 * BS, 7.0)  # the device's cached copies are reused
        cache.finish("a")
        assert cache.stats()["host_cached_blocks"] == 2
        cache.finish("filler")
        assert prompt(cache, "b", tokens) == 2 * BS
        np.testing.assert_array_equal(read(cache, "b"), tokens)


def test_the_host_tier_evicts_its_least_recently_used_prefixes_first():
    with KvCache(config(num_blocks=4, host_blocks=2, layers=1), backend="host") as cache:
        for i, seq_id in enumerate("abc"):  # three one-block prefixes, demoted in turn
            prompt(cache, seq_id, np.arange(100 * i, 100 * i + BS + 1))
            cache.finish(seq_id)
            added(cache, "filler", 3 * BS, 7.0)
            cache.finish("filler")
        assert cache.stats()["host_cached_blocks"] == 2
        assert prompt(cache, "a2", np.arange(BS)) == 0  # "a", least recently used, went
        assert prompt(cache, "c2", np.arange(200, 200 + BS + 1)) == BS


def test_swap_in_never_preempts():
    with KvCache(config(num_blocks=8), backend="host") as cache:
        a = added(cache, "a", 24, 1.0)
        cache.swap_out(["a"])
        b = added(cache, "b", 48, 100.0)
        assert not cache.can_swap_in(["a"])
        with pytest.raises(CacheFullError, match="needs 3 blocks but 1 are free: swap_in never"):
            cache.swap_in(["a"])
        assert cache.is_swapped("a") and not cache.is_swapped("b")
        cache.swap_out(["b"])
        assert cache.can_swap_in(["a"])
        cache.swap_in(["a"])
        np.testing.assert_array_equal(read(cache, "a"), a)
        np.testing.assert_array_equal(read(cache, "b"), b)
        cache.check_invariants()


def test_a_prompt_that_must_preempt_computes_what_only_the_host_tier_holds():
    tokens = np.arange(300, 300 + 2 * BS + 1)
    with KvCache(config(num_blocks=6), backend="host") as cache:
        prompt(cache, "p", tokens)
        cache.finish("p")
        added(cache, "filler", 5 * BS, 7.0)  # p's prefixes are demoted to the host tier
        assert prompt(cache, "q", tokens) == 0  # full: promoting would copy into "filler"
        assert cache.stats()["host_hits"] == 0 and cache.is_swapped("filler")
        np.testing.assert_array_equal(read(cache, "q"), tokens)
        cache.check_invariants()


def _extend_to_block_end(cache: KvCache, seq_id) -> None:
    while cache.seq_len(seq_id) % BS:
        write(cache, cache.append([seq_id]).slot_mapping, [0.0])


def _fill_free(cache: KvCache, plain_only: bool = False) -> None:
    """A sequence over every free block (or only those that hold no prefix)."""
    blocks = cache.pool.num_plain_free if plain_only else cache.stats()["free_blocks"]
    added(cache, "fill", blocks * BS, 0.0)


# (prepare, act): ``act`` is one operation that copies between the tiers
OPERATIONS = {
    "swap_out": (None, lambda cache: cache.swap_out(["a"])),
    "swap_in": (None, lambda cache: cache.swap_in(["s"])),
    "preempting add": (None, lambda cache: cache.add_sequence("new", 5 * BS)),
    "demoting add": (None, lambda cache: cache.add_sequence("new", 3 * BS)),
    "promoting add": (None, lambda cache: cache.add_sequence(
        "new", tokens=np.arange(900, 900 + 2 * BS))),
    "preempting append": (lambda cache: (_extend_to_block_end(cache, "a"), _fill_free(cache)),
                          lambda cache: cache.append(["a"])),
    "demoting append": (lambda cache: (_extend_to_block_end(cache, "a"),
                                       _fill_free(cache, plain_only=True)),
                        lambda cache: cache.append(["a"])),
}


@pytest.mark.parametrize("fail_in", [0, 1])
@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_copy_that_fails_leaves_both_tiers_as_before(operation, fail_in):
    backend = FlakyHost()
    prepare, act = OPERATIONS[operation]
    with KvCache(config(num_blocks=10, layers=1), backend=backend) as cache:
        prompt(cache, "p", np.arange(900, 900 + 2 * BS))  # promoted by "promoting add"
        cache.swap_out(["p"])
        cache.finish("p")  # its prefixes stay cached on the host tier only:
        added(cache, "filler", 9 * BS, 7.0)  # the device's copies are reused
        cache.finish("filler")
        values = {"a": added(cache, "a", 2 * BS + 1, 1.0), "s": added(cache, "s", 2 * BS, 50.0)}
        cache.swap_out(["s"])
        prompt(cache, "q", np.arange(300, 300 + 2 * BS + 1))
        cache.finish("q")  # two cached-free prefixes, demoted by a demoting allocation
        values["b"] = added(cache, "b", 2 * BS, 70.0)
        if prepare is not None:
            prepare(cache)
            values["a"] = read(cache, "a")
        before = snapshot(cache)
        backend.fail_in = fail_in
        try:
            act(cache)
        except DeviceError:
            assert_as_before(cache, before, values)
        else:  # it made fewer copies than that: the failure is left for the next one
            assert fail_in > 0 and backend.fail_in is not None, "the first copy did not fail"
            backend.fail_in = None
            cache.check_invariants()


def test_copies_on_other_streams_are_ordered_and_come_back_exactly(backend):
    with rf.Stream(backend=backend) as s1, rf.Stream(backend=backend) as s2, \
            KvCache(config(), backend=backend, stream=s1) as cache:
        a = added(cache, "a", 20, 1.0)  # written on s1, the cache's stream
        cache.append(["a"], stream=s2)
        meta = cache.batch(["a"], stream=s2)
        rows = DeviceArrayRows(cache, [21.0])
        cache.write(0, rows.array, rows.array, meta)
        cache.write(1, rows.array, rows.array, meta)
        cache.swap_out(["a"], stream=s1)  # waits for s2's write on the device
        cache.swap_in(["a"], stream=s2)  # waits for s1's copies
        rows.close()
        np.testing.assert_array_equal(read(cache, "a"), np.append(a, 21.0))
        cache.check_invariants()


class DeviceArrayRows:
    """One K/V row per value, on the cache's device (closed by ``close``)."""

    def __init__(self, cache: KvCache, values: list[float]) -> None:
        c = cache.config
        data = np.repeat(np.asarray(values, np.float32)[:, None, None], c.head_dim, 2)
        self.array = rf.DeviceArray.from_numpy(data, cache.slab.device, cache.slab.backend)

    def close(self) -> None:
        self.array.buffer.root.close()


def test_threads_swapping_their_own_sequences_keep_every_invariant():
    errors: list[BaseException] = []
    with KvCache(config(num_blocks=40, host_blocks=60), backend="host") as cache:
        def work(worker: int) -> None:
            rng = np.random.default_rng(worker)
            mine: dict = {}  # this worker's sequences and their values
            try:
                for step in range(60):
                    seq_id = (worker, step % 3)
                    if seq_id not in cache:
                        values = added(cache, seq_id, int(rng.integers(1, 20)), 1000.0 * worker)
                        mine[seq_id] = values
                    elif cache.is_swapped(seq_id):
                        cache.swap_in([seq_id])
                    elif rng.random() < 0.5:
                        cache.swap_out([seq_id])
                    else:
                        cache.finish(seq_id)
                        del mine[seq_id]
                    with cache._lock:  # others may preempt them between two calls
                        for held, values in mine.items():
                            if held in cache:
                                np.testing.assert_array_equal(read(cache, held), values)
            except BaseException as exc:  # reported below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(w,)) for w in range(4)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        assert not errors, errors[0]
        cache.check_invariants()


def test_a_cached_host_block_a_failed_demotion_overwrote_is_forgotten():
    backend = FlakyHost()
    tokens = np.arange(500, 500 + BS + 1)
    with KvCache(config(num_blocks=6, host_blocks=2, layers=1), backend=backend) as cache:
        prompt(cache, "x", tokens)
        cache.finish("x")
        added(cache, "filler", 5 * BS, 7.0)  # x's prefix is demoted to host block 0
        cache.finish("filler")
        for seq_id, start in (("y", 600), ("z", 700)):  # two cached-free prefixes, apart
            prompt(cache, seq_id, np.arange(start, start + BS + 1))
        cache.finish("y")
        cache.finish("z")
        backend.fail_in = 1  # the first demotion lands in host block 0, the second fails
        with pytest.raises(DeviceError):
            cache.add_sequence("w", cache.stats()["free_blocks"] * BS)
        assert prompt(cache, "x2", tokens) == 0  # forgotten: a hit would read z's block
        np.testing.assert_array_equal(read(cache, "x2"), tokens)
        cache.check_invariants()


def test_a_swapped_sequence_is_not_exported():
    with KvCache(config(), backend="host") as cache:
        added(cache, "a", 5, 1.0)
        cache.swap_out(["a"])
        with pytest.raises(ValueError, match="swapped out to the host tier: swap_in"):
            cache.export_sequence("a")


def test_a_restore_forgets_the_cached_host_block_a_successful_swap_wrote(monkeypatch):
    from rocmforge_raw.kernels import ops

    tokens = np.arange(500, 500 + BS + 1)
    with KvCache(config(num_blocks=6, host_blocks=1, layers=1), backend="host") as cache:
        prompt(cache, "x", tokens)
        cache.finish("x")
        added(cache, "filler", 5 * BS, 7.0)  # x's prefix is demoted: the host tier's block
        cache.finish("filler")
        added(cache, "c", 3, 10.0)
        added(cache, "d", 2 * BS, 20.0)
        a = added(cache, "a", BS + 1, 30.0)
        cache.fork("a", "b")  # a's last block is shared: its append copies it first

        def failing_copy(*args, **kwargs):
            raise DeviceError("cuLaunchKernel", 719, "CUDA_ERROR_LAUNCH_FAILED", "injected")

        monkeypatch.setattr(ops, "copy_blocks", failing_copy)
        with pytest.raises(DeviceError):  # c was swapped into the host block, then undone
            cache.append(["a"])
        monkeypatch.undo()
        assert not cache.swapped_ids()
        for seq_id in ("c", "d", "b"):
            cache.finish(seq_id)
        np.testing.assert_array_equal(read(cache, "a"), a)
        assert prompt(cache, "x2", tokens) == 0  # forgotten: a hit would read c's values
        np.testing.assert_array_equal(read(cache, "x2"), tokens)
        cache.check_invariants()


def test_a_device_prefix_evicted_while_on_the_host_tier_becomes_its_most_recent():
    """Prefix P reaches the host tier first (a swapped-out sharer, then removed), Q after
    it; P's device copy is then evicted: P is used now, so when R's demotion needs room
    the host tier lets Q go (its least recent), not P."""
    bs = 8
    config = CacheConfig(1, 1, 64, bs, 5, "float32", host_blocks=2)  # 4 usable blocks
    with KvCache(config, backend="host") as cache:
        p, q, r = (np.arange(k * 100, k * 100 + bs) for k in (1, 2, 3))

        def prompt(seq_id, tokens):
            reservation = cache.add_sequence(seq_id, tokens=tokens)
            write(cache, reservation.slot_mapping, tokens)

        def evict_all():  # a filler taking every device block, then removed
            cache.add_sequence("filler", 4 * bs)
            cache.remove("filler")

        def found(tokens):
            return cache.cached_tokens(np.append(tokens, 1))

        prompt("x", np.append(p, 7))
        cache.add_sequence("y", tokens=np.append(p, 9))  # shares P's block with x
        cache.swap_out(["x"])
        cache.remove("x")  # P cached on the host tier; its device block held by y
        prompt("q", q)
        cache.finish("q")
        cache.add_sequence("filler", 2 * bs)  # Q demoted: after P
        cache.remove("filler")
        cache.finish("y")
        evict_all()  # P leaves the device, already on the host tier: used now
        assert cache.stats()["host_cached_blocks"] == 2 and found(p) == found(q) == bs
        prompt("r", r)
        cache.finish("r")
        evict_all()  # R demoted into a full host tier
        assert (found(p), found(q), found(r)) == (bs, 0, bs)
        cache.check_invariants()
