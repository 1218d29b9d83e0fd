"""PrefixTiers: prefix blocks across a cache's two tiers, the slab and the host tier.

- **Lookup**: a prompt's full blocks are found by prefix hash on the device or, failing
  that, on the host tier (``_lookup``); blocks found on the host tier only are copied into
  fresh device blocks (**promotion**, a host-tier hit) and leave the host tier.
- **Demotion**: a cached-free prefix block that an allocation is about to reuse is first
  copied to the host tier, unless the host tier holds its hash already; a full host tier
  gives up its least recently used cached blocks first (``HostTier.take``).
- **Naming**: blocks named by a prompt or by a token chain (``append(..., tokens=)``) are
  announced as ``BlockStored``; hashes leaving an index as ``BlockRemoved`` (``events``).

Atomicity: ``_allocate`` plans where each block goes (``BlockPool.peek``,
``HostTier.peek``), queues every copy, and only then changes the bookkeeping; if a copy
fails nothing changed, but for the cached blocks the queued copies may have reached, whose
prefixes are forgotten (``_forget_reached``, as ``import_sequence`` does). A promotion only
fills blocks that were free before the operation: a prompt that must preempt computes its
blocks that only the host tier holds instead of copying them in, so that a failed copy never
lands where a preempted sequence was. Methods with a leading underscore run with the lock
held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...memory.stream import Stream
from ..core import CacheCore, operation
from ..events import DEVICE, EventBatch


class PrefixTiers(CacheCore):
    """Prefix lookup, naming, demotion and promotion (see the module docstring)."""

    # --- events --------------------------------------------------------------------------------
    def events(self) -> EventBatch:
        """Drain the prefix events (``BlockStored``, ``BlockRemoved``, ``AllCleared``, in the
        order of the operations that made them) and the count the bounded queue dropped
        since the last drain. Works on a closed cache too (its last event: AllCleared)."""
        with self._lock:
            return self._events.drain()

    @operation
    def clear_prefix_cache(self) -> None:
        """Forget every prefix both tiers keep (one ``AllCleared`` event). Only an empty
        cache can: ``ValueError`` while it holds sequences."""
        held = len(self._rows.index) + (0 if self._host is None else len(self._host.sequences))
        if held:
            raise ValueError(f"the cache holds {held} sequence(s): finish or remove them "
                             "before clearing the prefix cache")
        self.pool.forget(self.pool.cached_ids())
        if self._host is not None:
            self._host.clear()
        self._events.cleared()

    # --- internals (lock held) -----------------------------------------------------------------
    def _prompt_blocks(self, need: int, hashes: list[bytes], tokens: np.ndarray | None,
                       now: float) -> tuple[np.ndarray, int, list[Any], list[Any]]:
        """The ``need`` blocks of a new prompt whose full blocks hash to ``hashes``: the
        leading ones found shared or promoted, the rest fresh (and named). Returns (block
        ids, blocks found, ids preempted, ids of them swapped out)."""
        found = self._lookup(hashes)  # (on the host tier, block) of the leading blocks found
        if self._needed(need - len(found), [b for h, b in found if not h],
                        self.pool.ref_cnt) + sum(h for h, _ in found) > self.pool.num_free:
            found = found[: next((i for i, (h, _) in enumerate(found) if h), len(found))]
        hits = [block for on_host, block in found if not on_host]
        fill = [block for on_host, block in found if on_host]
        fresh = need - len(hits)

        def blocks_needed(live: list[Any], ref_cnt: np.ndarray) -> int:
            return self._needed(fresh, hits, ref_cnt)  # hits off the free list count

        saved = None  # preempting before a copy: undone by a restore if the copy fails
        if self._host is not None and self._needed(fresh, hits, self.pool.ref_cnt) > \
                self.pool.num_free:
            saved = self._save()
        try:
            preempted, swapped = self._make_room(blocks_needed, [], self.stream, now)
            new = self._allocate(fresh, self.stream, hits, fill)
        except BaseException:
            if saved is not None:
                self._restore(saved)
            raise
        promoted = iter(new[: len(fill)].tolist())
        ids = np.array([next(promoted) if on_host else block for on_host, block in found]
                       + new[len(fill) :].tolist(), np.int32)
        self._name(ids, hashes, list(range(len(hashes))), tokens)  # (the hits keep theirs)
        self._promoted(fill)
        return ids, len(found), preempted, swapped

    def _lookup(self, hashes: list[bytes]) -> list[tuple[bool, int]]:
        """(on the host tier, block) for the leading run of ``hashes`` either tier holds,
        the device's block where both do."""
        if self._host is None:
            return [(False, block) for block in self.pool.lookup(hashes)]
        found, device, host = [], self.pool.index, self._host.index
        for digest in hashes:
            block = device.get(digest)
            if block is None:
                block = host.get(digest)
                if block is None:
                    break
                found.append((True, block))
            else:
                found.append((False, block))
        return found

    def _name(self, ids: np.ndarray, hashes: list[bytes], positions: list[int],
              tokens: np.ndarray | None) -> None:
        """Name blocks ``ids[i]`` by ``hashes[i]`` for ``i`` in ``positions`` (a prompt's
        blocks; ``tokens`` its ids) and announce those the index did not know."""
        bs = self.config.block_size
        for j in self.pool.register(ids[positions], [hashes[i] for i in positions]):
            i = positions[j]
            self._events.stored(hashes[i], DEVICE, hashes[i - 1] if i else None,
                                None if tokens is None else tokens[i * bs : (i + 1) * bs])

    def _promoted(self, blocks: list[int]) -> None:
        """Host blocks ``blocks`` were copied into fresh device blocks for a prompt: the
        unheld ones move (they leave the host tier)."""
        if blocks:
            host = self._tier
            for block in blocks:
                if host.ref_cnt[block] == 0:
                    host.drop(block)
            host.counts["promoted_blocks"] += len(blocks)
            host.counts["host_hits"] += len(blocks)

    def _chain(self, rows: np.ndarray, lens: np.ndarray, tokens: np.ndarray | None) -> None:
        """One token more on the chains of ``rows`` (``lens`` tokens before): name each
        block that filled by its hash."""
        for index, digest, parent, block in self._chains.push(rows, lens, tokens):
            last = self._rows.last_block[rows[index : index + 1]]
            if self.pool.register(last, [digest]):
                self._events.stored(digest, DEVICE, parent or None, block)

    def _tier_stats(self) -> dict[str, Any]:
        host = self._host
        counts = dict.fromkeys(("swapped_out_blocks", "swapped_in_blocks", "demoted_blocks",
                                "promoted_blocks", "host_hits"), 0)
        if host is not None:
            counts.update(host.counts)
        block = self.config.block_bytes
        out = counts["swapped_out_blocks"] + counts["demoted_blocks"]
        back = counts["swapped_in_blocks"] + counts["promoted_blocks"]
        asked = counts["host_hits"] + self.num_prefix_misses
        return {
            "host_blocks": self.config.host_blocks,
            "host_used_blocks": 0 if host is None else host.num_used,
            "host_cached_blocks": 0 if host is None else host.num_cached,
            "host_free_blocks": 0 if host is None else host.num_free,
            "swapped_sequences": 0 if host is None else len(host.sequences), **counts,
            "copied_out_bytes": out * block, "copied_in_bytes": back * block,
            "swapped_out_bytes": counts["swapped_out_blocks"] * block,
            "swapped_in_bytes": counts["swapped_in_blocks"] * block,
            "host_hit_rate": counts["host_hits"] / asked if asked else 0.0,
        }

    def _needed(self, fresh: int, hits: list[int], ref_cnt: np.ndarray) -> int:
        """Free blocks that ``fresh`` new blocks and taking ``hits`` use up."""
        return fresh + int(np.count_nonzero(ref_cnt[hits] == 0))

    def _allocate(self, count: int, stream: Stream | None, taking: Sequence[int] = (),
                  fill: list[int] | None = None) -> np.ndarray:
        """``pool.take(taking)`` then ``count`` fresh blocks, the first ``len(fill)`` of
        them filled from host blocks ``fill`` (paired in the order of their ids, so that
        consecutive blocks copy in one piece). Cached-free blocks the allocation reuses
        are demoted first. Copies before any change: if one fails, nothing changed but the
        forgetting of the cached blocks the copies reached."""
        pool, host = self.pool, self._host
        if host is None:
            return super()._allocate(count, stream, taking)
        self._allocation_mark = self._events.mark()  # (as the base class's)
        taking = list(taking)
        fill = fill or []
        ids, evicted = pool.peek(count, taking)
        if fill:
            ids[: len(fill)] = paired(fill, ids[: len(fill)])
        keep = set(fill)
        demote = [(b, h) for b, h in evicted if h not in host.index]
        demote = demote[: host.room_besides(keep)]
        dests = paired([b for b, _ in demote], host.peek(len(demote), keep))
        self._copies([b for b, _ in demote], dests, fill, ids[: len(fill)], stream)
        pool.take(taking)
        pool.allocate(count)
        host.take(len(demote), keep)  # the blocks peeked: before any touch reorders them
        for _, digest in evicted:
            self._events.removed(digest, DEVICE)
            if digest in host.index:
                host.touch(host.index[digest])
        for (_, digest), block in zip(demote, dests):
            host.name(block, digest)
        host.counts["demoted_blocks"] += len(demote)
        return ids

    def _copies(self, out_of: list[int], to: list[int], back_from: list[int], into: Any,
                stream: Stream | None) -> None:
        """Queue device blocks ``out_of`` -> host blocks ``to``, then host ``back_from`` ->
        device ``into``; the blocks written are remembered for a restore, and if a copy
        fails the cached ones among them forget their prefixes at once."""
        if not out_of and not back_from:
            return
        into = np.asarray(into).tolist()
        self._reached[0].extend(into)
        self._reached[1].extend(to)
        order, host = self._ordering, self._tier
        order.before_copies(stream)
        try:
            host.copy(out_of, to, True, stream)
            host.copy(into, back_from, False, stream)
        except BaseException:
            self._forget_reached(into, list(to))
            raise
        finally:
            order.after_copies(stream)

    def _forget_reached(self, device: list[int], host: list[int]) -> None:
        """Cached blocks among ``device`` and ``host``, which copies wrote, no longer hold
        their prefixes: they forget them (announced)."""
        for digest in self.pool.forget(device):
            self._events.removed(digest, DEVICE)
        for block in host:
            if self._tier.ref_cnt[block] == 0 and block in self._tier.hashes:
                self._tier.drop(block)


def paired(sources: list[int], targets: Any) -> list[int]:
    """``targets`` reordered so that the i-th smallest of ``sources`` goes to the i-th
    smallest target: blocks consecutive on one side meet consecutive ones on the other."""
    out = np.empty(len(sources), np.int64)
    out[np.argsort(sources)] = np.sort(targets)  # sources are distinct: any sort pairs alike
    result: list[int] = out.tolist()
    return result
