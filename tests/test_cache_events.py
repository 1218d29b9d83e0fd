"""Cache events: BlockStored / BlockRemoved / AllCleared, named by prefix hash, in operation
order, from a bounded queue that counts what it drops and never blocks."""

from __future__ import annotations

import numpy as np
import pytest
from tier_helpers import FlakyHost, write

from rocmforge_raw.cache import AllCleared, BlockRemoved, BlockStored, CacheConfig, KvCache
from rocmforge_raw.cache.blocks.prefix import block_hashes
from rocmforge_raw.errors import DeviceError

BS = 8


def cache_of(num_blocks: int = 8, host_blocks: int = 8, **kw) -> KvCache:
    return KvCache(CacheConfig(1, 1, 64, BS, num_blocks, "float32", host_blocks=host_blocks),
                   backend=kw.pop("backend", "host"), **kw)


def prompt(cache: KvCache, seq_id, tokens) -> None:
    tokens = np.asarray(tokens)
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    write(cache, reservation.slot_mapping[n:], tokens[n:])


def kinds(events) -> list[tuple]:
    return [(type(e).__name__, getattr(e, "block_hash", None), getattr(e, "tier", None))
            for e in events]


def test_a_prompt_stores_each_full_block_with_its_parent_and_tokens():
    tokens = np.arange(2 * BS + 3)
    h0, h1 = block_hashes(tokens, BS)
    with cache_of() as cache:
        prompt(cache, "a", tokens)
        batch = cache.events()
        assert batch.dropped == 0 and len(batch) == 2
        assert batch.events == [BlockStored(h0, None, tuple(range(BS)), "device"),
                                BlockStored(h1, h0, tuple(range(BS, 2 * BS)), "device")]
        prompt(cache, "b", tokens)  # hits: nothing new is stored
        assert list(cache.events()) == []
        assert not any(hasattr(e, "block_id") for e in batch)  # hashes, never block ids


def test_a_block_filled_by_appended_tokens_is_stored_with_its_parent():
    tokens = np.arange(BS + 5)
    with cache_of() as cache:
        prompt(cache, "a", tokens)
        (h0,) = block_hashes(tokens, BS)
        new = [100, 101, 102]
        for token in new:
            cache.append(["a"], tokens=[token])
        (stored,) = [e for e in cache.events() if e.block_hash != h0]
        whole = np.concatenate([tokens, new])
        assert stored == BlockStored(block_hashes(whole, BS)[1], h0,
                                     tuple(whole[BS : 2 * BS].tolist()), "device")


def test_demotion_and_promotion_move_a_prefix_between_the_tiers():
    tokens = np.arange(BS + 1)
    (h0,) = block_hashes(tokens, BS)
    with cache_of(num_blocks=4) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")
        cache.events()
        cache.add_sequence("filler", 3 * BS)  # reuses a's cached-free block: demoted
        assert kinds(cache.events()) == [("BlockRemoved", h0, "device"),
                                         ("BlockStored", h0, "host")]
        cache.finish("filler")
        prompt(cache, "b", tokens)  # found on the host tier only: promoted, moved
        events = cache.events().events
        assert kinds(events) == [("BlockStored", h0, "device"), ("BlockRemoved", h0, "host")]
        assert events[0] == BlockStored(h0, None, tuple(range(BS)), "device")


def test_without_a_host_tier_a_reused_prefix_block_is_announced_removed_and_forgotten():
    """A cached-free block that an allocation reuses leaves the device tier: announced, and
    no longer remembered (a cache without a host tier once kept every hash it ever stored:
    its events' memory grew with every distinct prompt)."""
    tokens = np.arange(BS + 1)
    (h0,) = block_hashes(tokens, BS)
    with cache_of(num_blocks=4, host_blocks=0) as cache:
        prompt(cache, "a", tokens)
        cache.finish("a")
        cache.events()
        cache.add_sequence("filler", 3 * BS)  # reuses a's cached-free block
        assert kinds(cache.events()) == [("BlockRemoved", h0, "device")]
        cache.finish("filler")
        rng = np.random.default_rng(0)
        for i in range(50):  # distinct prompts through a 3-block pool
            prompt(cache, i, rng.integers(0, 1 << 30, 2 * BS))
            cache.finish(i)
        cache.events()
        assert len(cache._events._known) <= cache.config.num_blocks


def test_the_queue_is_bounded_drops_the_oldest_and_counts_them():
    with cache_of(num_blocks=40, max_events=3) as cache:
        prompt(cache, "a", np.arange(5 * BS))
        assert cache.stats()["events_queued"] == 3
        batch = cache.events()
        assert batch.dropped == 2 and len(batch) == 3
        assert [e.token_ids[0] for e in batch] == [2 * BS, 3 * BS, 4 * BS]  # the newest
        assert cache.events().dropped == 0 and cache.stats()["events_dropped"] == 2


def test_no_queue_records_nothing():
    with cache_of(max_events=0) as cache:
        prompt(cache, "a", np.arange(3 * BS))
        assert list(cache.events()) == [] and cache.stats()["events_dropped"] == 0


def test_an_operation_that_fails_emits_nothing():
    with cache_of(num_blocks=4, strict=True) as cache:
        prompt(cache, "a", np.arange(2 * BS))
        cache.events()
        with pytest.raises(Exception, match="strict"):
            cache.add_sequence("b", tokens=np.arange(100, 100 + 3 * BS))
        with pytest.raises(ValueError):
            cache.append(["a", "a"], tokens=[1, 2])
        assert list(cache.events()) == []


def test_a_failed_copy_announces_only_what_it_forgot():
    backend = FlakyHost()
    with cache_of(num_blocks=4, backend=backend) as cache:
        prompt(cache, "a", np.arange(BS + 1))
        cache.finish("a")
        cache.events()
        backend.fail_in = 0
        with pytest.raises(DeviceError):
            cache.add_sequence("filler", 3 * BS)  # the demotion's copy fails
        assert list(cache.events()) == []  # nothing changed: nothing to announce
        cache.check_invariants()


def test_clearing_the_prefix_cache_is_one_event_and_needs_an_empty_cache():
    tokens = np.arange(2 * BS + 1)
    with cache_of(num_blocks=4) as cache:
        prompt(cache, "a", tokens)
        with pytest.raises(ValueError, match="holds 1 sequence"):
            cache.clear_prefix_cache()
        cache.finish("a")
        cache.add_sequence("filler", 3 * BS)  # every block: a's two prefixes demoted
        cache.finish("filler")
        prompt(cache, "c", np.arange(500, 500 + BS))  # and one prefix left on the device
        cache.finish("c")
        stats = cache.stats()
        assert stats["host_cached_blocks"] == 2 and stats["cached_free_blocks"] == 1
        cache.events()
        cache.clear_prefix_cache()
        assert list(cache.events()) == [AllCleared()]
        stats = cache.stats()
        assert stats["cached_free_blocks"] == stats["host_cached_blocks"] == 0
        # the forgotten blocks are free again, on both tiers
        assert stats["host_free_blocks"] == 8 and stats["free_blocks"] == 3
        reservation = cache.add_sequence("b", tokens=tokens)
        assert reservation.num_cached_tokens == 0
        cache.check_invariants()


def test_closing_a_cache_ends_its_events_with_all_cleared():
    cache = cache_of()
    prompt(cache, "a", np.arange(BS))
    cache.close()
    events = cache.events().events
    assert isinstance(events[0], BlockStored) and events[-1] == AllCleared()
    cache.close()
    assert list(cache.events()) == []


def test_events_keep_operation_order_across_tiers():
    with cache_of(num_blocks=4, host_blocks=1) as cache:
        for i in range(3):  # each prefix demoted, the host tier's one block reused
            prompt(cache, i, np.arange(100 * i, 100 * i + BS))
            cache.finish(i)
            cache.add_sequence("filler", 3 * BS)
            cache.finish("filler")
        events = cache.events().events
        hashes = [block_hashes(np.arange(100 * i, 100 * i + BS), BS)[0] for i in range(3)]
        host = [(type(e), e.block_hash) for e in events if e.tier == "host"]
        assert host == [(BlockStored, hashes[0]), (BlockRemoved, hashes[0]),
                        (BlockStored, hashes[1]), (BlockRemoved, hashes[1]),
                        (BlockStored, hashes[2])]


def test_an_undone_operation_announces_only_what_it_forgot():
    """An import whose read fails after its allocation demoted cached prefixes to the host
    tier is undone: the demotions' events (stored on the host, removed from the device)
    stay unpublished; only the prefix blocks the failed read may have written, which the
    cache forgets, are announced, once each."""
    from rocmforge_raw.errors import BufferClosedError
    from rocmforge_raw.transport import PeerTransport

    config = CacheConfig(2, 2, 64, 16, 8, "float32", num_q_heads=4, host_blocks=8)
    with PeerTransport() as link:
        with KvCache(CacheConfig(2, 2, 64, 16, 8, "float32", num_q_heads=4),
                     backend="host") as src:
            link.publish(src.slab)
            r = src.add_sequence("s", tokens=np.arange(5 * 16))
            write(src, r.slot_mapping, np.arange(5 * 16))
            desc = src.export_sequence("s")
        with KvCache(config, backend="host") as dst:
            old = np.arange(1000, 1000 + 7 * 16)
            r = dst.add_sequence("old", tokens=old)
            write(dst, r.slot_mapping, old)
            dst.finish("old")  # 7 cached prefix blocks: the import's 5 evict 5 of them
            hashes = set(block_hashes(old, 16))
            dst.events()
            with pytest.raises(BufferClosedError):
                dst.import_sequence(desc, link)
            events = kinds(dst.events())
            assert events and {tier for _, _, tier in events} == {"device"}
            assert {kind for kind, _, _ in events} == {"BlockRemoved"}
            forgotten = [h for _, h, _ in events]
            assert len(set(forgotten)) == len(forgotten) and set(forgotten) <= hashes
            stats = dst.stats()
            assert stats["host_cached_blocks"] == 0
            assert stats["cached_free_blocks"] == 7 - len(forgotten)
            dst.check_invariants()
