"""Prefix events of imported blocks, and what a promotion's copies leave recorded, pinned down
by survivors of mutation testing (issue 44, item 4).

An imported block is announced without tokens (the receiving cache never saw them); once a
prompt names it, the tokens are known and every later announcement carries them. A promotion
reads host blocks and writes device blocks: a failed one forgets only what it may have
written, and a restore after its copies forgets the device blocks they wrote.

``EventQueue`` remembers a hash's parent and tokens while any tier holds it; an undone
operation (``truncate``) gives that memory back as well as taking its events back, so that a
later store in another tier is still announced with them. No public operation undoes a
clear (``clear_prefix_cache`` cannot fail after it), so that case is held at the queue."""

from __future__ import annotations

import numpy as np
import pytest
from tier_helpers import FlakyHost, read, write

from rocmforge_raw.cache import BlockRemoved, BlockStored, CacheConfig, KvCache
from rocmforge_raw.cache.blocks.prefix import block_hashes
from rocmforge_raw.cache.events import DEVICE, HOST, EventQueue
from rocmforge_raw.errors import DeviceError
from rocmforge_raw.transport import PeerTransport

BS = 8


def config(num_blocks: int, host_blocks: int = 0) -> CacheConfig:
    return CacheConfig(1, 1, 64, BS, num_blocks, "float32", host_blocks=host_blocks)


def prompt(cache: KvCache, seq_id: str, tokens: np.ndarray) -> None:
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    write(cache, reservation.slot_mapping[n:], tokens[n:])


def stored(cache: KvCache) -> set[BlockStored]:
    """The ``BlockStored`` events drained from ``cache`` (a demotion's order is the pool's)."""
    return {e for e in cache.events() if isinstance(e, BlockStored)}


def test_an_imported_block_named_by_a_prompt_is_announced_with_its_tokens():
    """Imported (no tokens), demoted to the host tier (still no tokens), then promoted by a
    prompt of its tokens: the device's ``BlockStored`` carries them, and so does the host
    tier's when it is demoted again."""
    tokens = np.arange(2 * BS + 1)
    h0, h1 = block_hashes(tokens, BS)
    with PeerTransport() as link, KvCache(config(8), backend="host") as src:
        link.publish(src.slab)
        prompt(src, "s", tokens)
        desc = src.export_sequence("s")
        with KvCache(config(4, host_blocks=4), backend="host") as dst:
            dst.import_sequence(desc, link)
            assert dst.events().events == [BlockStored(h0, None, (), "device"),
                                           BlockStored(h1, h0, (), "device")]
            dst.finish("s")
            dst.add_sequence("filler", 3 * BS)  # reuses both imported blocks: demoted
            dst.finish("filler")
            assert stored(dst) == {BlockStored(h0, None, (), "host"),
                                   BlockStored(h1, h0, (), "host")}
            prompt(dst, "b", tokens)  # found on the host tier only: promoted, named
            first, second = tuple(range(BS)), tuple(range(BS, 2 * BS))
            assert dst.events().events == [
                BlockStored(h0, None, first, "device"), BlockStored(h1, h0, second, "device"),
                BlockRemoved(h0, "host"), BlockRemoved(h1, "host")]
            dst.finish("b")
            dst.add_sequence("filler", 3 * BS)  # demoted again: the tokens stay known
            assert stored(dst) == {BlockStored(h0, None, first, "host"),
                                   BlockStored(h1, h0, second, "host")}
            dst.check_invariants()


def test_a_failed_promotion_keeps_the_host_blocks_it_read_from_and_forgets_nothing_else():
    """A promotion's copy into the device fails: the host tier's prefix blocks it read from
    were not written, so they keep their prefixes (exactly; nothing on the host tier is
    forgotten, nothing announced), and the same prompt then promotes them, bytes intact."""
    backend = FlakyHost()
    tokens = np.arange(900, 900 + 2 * BS + 1)
    h0, h1 = block_hashes(tokens, BS)
    with KvCache(config(4, host_blocks=4), backend=backend) as cache:
        prompt(cache, "p", tokens)
        cache.finish("p")
        cache.add_sequence("filler", 3 * BS)  # p's two prefixes demoted to the host tier
        cache.finish("filler")
        host_index = dict(cache._host.index)
        assert set(host_index) == {h0, h1}
        cache.events()
        backend.fail_in = 0  # the promotion's copy (no demotion before it)
        with pytest.raises(DeviceError):
            cache.add_sequence("q", tokens=tokens)
        assert cache._host.index == host_index and list(cache.events()) == []
        cache.check_invariants()
        reservation = cache.add_sequence("q", tokens=tokens)
        assert reservation.num_cached_tokens == 2 * BS
        assert cache.stats()["promoted_blocks"] == 2
        write(cache, reservation.slot_mapping[2 * BS:], tokens[2 * BS:])
        np.testing.assert_array_equal(read(cache, "q"), tokens)


def test_a_restore_after_a_promotions_copies_forgets_the_device_blocks_they_wrote():
    """``_copies`` records the device blocks a promotion writes for a restore, as device
    blocks: a restore later in the operation forgets the cached prefix such a block held
    (announced) and leaves the host tier's prefixes alone. No public operation restores
    after a promotion today (a prompt that must preempt computes its host-only blocks
    instead), so this holds the contract ``_restore`` relies on, at the method."""
    tokens = np.arange(900, 900 + 2 * BS + 1)
    other = np.arange(100, 100 + BS + 1)
    (r0,) = block_hashes(other, BS)
    with KvCache(config(4, host_blocks=4), backend="host") as cache:
        prompt(cache, "p", tokens)
        cache.finish("p")
        cache.add_sequence("filler", 3 * BS)  # p's two prefixes demoted to the host tier
        cache.finish("filler")
        prompt(cache, "r", other)
        cache.finish("r")  # r0 cached-free on the device
        host_index = dict(cache._host.index)
        source = host_index[block_hashes(tokens, BS)[0]]
        target = cache.pool.index[r0]
        cache.events()
        with cache._lock:
            saved = cache._save()
            cache._copies([], [], [source], [target], None)
            cache._restore(saved)
            cache._events.commit()  # as the operation's end would
        assert r0 not in cache.pool.index and cache._host.index == host_index
        assert list(cache.events()) == [BlockRemoved(r0, "device")]
        cache.check_invariants()


# --- the queue's memory of parents and tokens ------------------------------------------------
PARENT, BLOCK = b"p" * 16, b"b" * 16


def announced(queue: EventQueue) -> list:
    queue.commit()
    return queue.drain().events


def test_a_store_that_brings_the_tokens_brings_the_parent_with_them():
    queue = EventQueue(8)
    queue.stored(BLOCK, DEVICE)  # known by hash alone, as an imported block can be
    queue.stored(BLOCK, HOST, PARENT, np.array([5, 6]))
    assert announced(queue) == [BlockStored(BLOCK, None, (), DEVICE),
                                BlockStored(BLOCK, PARENT, (5, 6), HOST)]


@pytest.mark.parametrize("also_on_host", [False, True], ids=["device-only", "both-tiers"])
def test_an_undone_removal_keeps_the_parent_and_tokens_for_a_later_store(also_on_host):
    """The device's removal of a prefix is undone: the device still holds it, so once the
    host tier's copy (if any) is gone, a new host copy is still announced in full."""
    queue = EventQueue(16)
    queue.stored(BLOCK, DEVICE, PARENT, np.array([5, 6]))
    if also_on_host:
        queue.stored(BLOCK, HOST)
    announced(queue)
    mark = queue.mark()
    queue.removed(BLOCK, DEVICE)
    queue.truncate(mark)
    assert announced(queue) == []
    if also_on_host:
        queue.removed(BLOCK, HOST)
        assert announced(queue) == [BlockRemoved(BLOCK, HOST)]
    queue.stored(BLOCK, HOST)
    assert announced(queue) == [BlockStored(BLOCK, PARENT, (5, 6), HOST)]


def test_an_undone_clear_keeps_the_parent_and_tokens_of_the_prefixes_still_held():
    queue = EventQueue(16)
    queue.stored(BLOCK, DEVICE, PARENT, np.array([5, 6]))
    announced(queue)
    mark = queue.mark()
    queue.cleared()
    queue.truncate(mark)
    assert announced(queue) == []
    queue.stored(BLOCK, HOST)
    assert announced(queue) == [BlockStored(BLOCK, PARENT, (5, 6), HOST)]
