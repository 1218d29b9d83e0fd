"""Blocks that leave every layer's window go back to the pool: a cache whose layers all
have windows frees a sequence's blocks wholly before the widest one as it grows
(``KvCache.batch``), the null block in their table entries, counted in ``stats()``; the
attention never reads them (the null block is poisoned with NaN); forks share what is
left, prefix caching still finds the freed prompt blocks while they stay cached; swapping
and exporting such a sequence are refused by name, nothing changed; a step of many query
tokens frees what its first row no longer sees."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_variants import check, close_all, random_sinks, step

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.memory.array import DeviceArray

BLOCK = 8


def poison_null_block(cache):
    """NaN in every layer's null block (K and V): a kernel that reads it makes NaN."""
    for layer in range(cache.config.num_layers):
        for plane in (cache.k_cache(layer), cache.v_cache(layer)):
            block = DeviceArray(plane.buffer, plane.dtype, plane.shape[1:], 0)
            block.copy_from_host(np.full(plane.shape[1:], np.nan, plane.dtype))


def windowed(backend, windows=(20, 12), blocks=40, **extra):
    config = CacheConfig(len(windows), 2, 64, BLOCK, blocks, np.float32, num_q_heads=4,
                         windows=list(windows), logit_softcap=4.0, **extra)
    return KvCache(config, backend=backend)


def test_blocks_before_the_widest_window_are_freed_as_sequences_grow(backend):
    rng = np.random.default_rng(4)
    with windowed(backend) as cache:
        poison_null_block(cache)
        cache.add_sequence("a", 5)
        cache.add_sequence("b", 30)
        sinks = {1: random_sinks(rng, 4, backend)}
        free_before = cache.stats()["free_blocks"]
        dropped = 0
        for _ in range(40):
            cache.append(["a", "b"])
            meta, results = step(cache, rng, ["a", "b"], range(2), sinks)
            check(cache, meta, range(2), results)
            for seq_id, length in zip(("a", "b"), meta.seq_lens.tolist()):
                gone = max(0, length - 20) // BLOCK  # wholly before the widest window
                table = cache.block_ids(seq_id)
                assert (table[:gone] == 0).all() and (table[gone:] != 0).all(), (seq_id, table)
            stats = cache.stats()
            assert stats["window_dropped_blocks"] >= dropped
            dropped = stats["window_dropped_blocks"]
            cache.check_invariants()
        # a: 45 tokens keep blocks 3..5 (3 dropped); b: 70 tokens keep 6..8 (6 dropped)
        assert dropped == 3 + 6
        stats = cache.stats()
        assert stats["used_blocks"] == 3 + 3 and stats["free_blocks"] == free_before + 5 - 6
        assert stats["tokens"] == (45 - 24) + (70 - 48)
        cache.remove("a")
        cache.remove("b")
        assert cache.stats()["used_blocks"] == 0
        cache.check_invariants()
        close_all(sinks)


def test_a_cache_with_a_global_layer_keeps_every_block(backend):
    rng = np.random.default_rng(5)
    with windowed(backend, windows=(20, None)) as cache:
        cache.add_sequence("a", 60)
        for _ in range(3):
            cache.append(["a"])
            meta, results = step(cache, rng, ["a"], range(2))
            check(cache, meta, range(2), results)
        assert cache.stats()["window_dropped_blocks"] == 0
        assert (meta.block_tables[0, :8] != 0).all()


def test_a_fork_shares_the_blocks_left_and_frees_its_own(backend):
    rng = np.random.default_rng(6)
    with windowed(backend) as cache:
        poison_null_block(cache)
        cache.add_sequence("parent", 40)
        step(cache, rng, ["parent"], range(2))  # drops blocks 0 and 1 (tokens 0..15)
        cache.fork("parent", "child")
        cache.check_invariants()
        used = cache.stats()["used_blocks"]
        for _ in range(10):
            cache.append(["parent", "child"])
            meta, results = step(cache, rng, ["parent", "child"], range(2))
            check(cache, meta, range(2), results)
            cache.check_invariants()
        assert cache.stats()["window_dropped_blocks"] > 2
        cache.remove("parent")
        cache.remove("child")
        cache.check_invariants()
        assert cache.stats()["used_blocks"] == 0 < used


def test_prefix_caching_finds_the_freed_prompt_blocks(backend):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 1000, 48)
    with windowed(backend) as cache:
        cache.add_sequence("first", tokens=prompt)
        step(cache, rng, ["first"], range(2))
        assert cache.stats()["window_dropped_blocks"] == 3  # tokens 0..23 of 48
        cache.add_sequence("second", tokens=prompt)
        # all six blocks of the prompt are found: the three freed (still cached) and the
        # three "first" holds
        assert cache.stats()["prefix_hits"] == 6
        assert (cache.block_ids("second")[:3] != 0).all()
        cache.check_invariants()


def test_swapping_or_exporting_a_sequence_with_freed_blocks_is_refused(backend):
    rng = np.random.default_rng(8)
    with windowed(backend, host_blocks=16) as cache:
        cache.add_sequence("a", 40)
        step(cache, rng, ["a"], range(2))
        before = cache.stats()
        with pytest.raises(NotImplementedError, match="left every window"):
            cache.swap_out(["a"])
        with pytest.raises(NotImplementedError, match="left every window"):
            cache.export_sequence("a")
        assert cache.stats() == before
        cache.check_invariants()


def test_a_step_of_many_tokens_frees_what_its_first_row_no_longer_sees(backend):
    rng = np.random.default_rng(9)
    with windowed(backend) as cache:
        poison_null_block(cache)
        cache.add_sequence("a", 60)
        cache.add_sequence("b", 9)
        meta, results = step(cache, rng, ["b", "a"], range(2), q_lens=[1, 16])
        check(cache, meta, range(2), results)
        # a's first query row is token 44: it sees from 25 on, so blocks 0..2 are gone
        assert cache.stats()["window_dropped_blocks"] == 3
        table = cache.block_ids("a")
        assert (table[:3] == 0).all() and (table[3:] != 0).all()
        cache.check_invariants()


def test_query_rows_reaching_back_into_freed_blocks_are_refused(backend):
    """Rows older than an earlier step's first query would need keys already freed: the
    step is refused by name before anything changes, and the usual steps go on."""
    rng = np.random.default_rng(10)
    with windowed(backend) as cache:
        cache.add_sequence("a", 60)
        step(cache, rng, ["a"], range(2))  # a decode: frees the blocks before token 40
        before = cache.stats()
        with pytest.raises(ValueError, match=r"query_lens\[0\] = 20 reaches back to token 21"):
            cache.batch(["a"], query_lens=[20])
        assert cache.stats() == before
        cache.extend(["a"], [4])  # four new tokens: their rows see from token 41 on
        meta, results = step(cache, rng, ["a"], range(2), q_lens=[4])
        check(cache, meta, range(2), results)
        cache.check_invariants()


def test_a_step_whose_plan_fails_frees_nothing(backend, monkeypatch):
    """Blocks leave only once the step is planned: a plan that raises (here: out of memory
    for its staging) leaves every block and count as it was."""
    with windowed(backend) as cache:
        cache.add_sequence("a", 60)
        before, table = cache.stats(), cache.block_ids("a")

        def fails(*args, **kwargs):
            raise MemoryError("no staging memory")

        monkeypatch.setattr(cache._steps, "plan", fails)
        with pytest.raises(MemoryError):
            cache.batch(["a"])
        assert cache.stats() == before
        np.testing.assert_array_equal(cache.block_ids("a"), table)
        monkeypatch.undo()
        cache.batch(["a"])
        assert cache.stats()["window_dropped_blocks"] == 5
        cache.check_invariants()
