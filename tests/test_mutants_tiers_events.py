"""Prefix events of imported blocks, pinned down by survivors of mutation testing (issue 44,
item 4).

An imported block is announced without tokens (the receiving cache never saw them); once a
prompt names it, the tokens are known and every later announcement carries them."""

from __future__ import annotations

import numpy as np
from tier_helpers import write

from rocmforge_raw.cache import BlockRemoved, BlockStored, CacheConfig, KvCache
from rocmforge_raw.cache.blocks.prefix import block_hashes
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

