"""TokenChains: the prefix chain of each sequence whose token ids the cache knows.

A sequence added by its token ids (``add_sequence(tokens=...)``) has a chain: the hash of
its last full block (``b""`` before the first) and the ids of the tokens in its partial
last block. ``append(..., tokens=ids)`` pushes each new token's id; when a block fills, its
hash is chained over the parent's (``prefix.chain_hash``) and the cache names the block by
it, so a later prompt that repeats the conversation so far finds every full block. An
``append`` without ids ends the chains of the sequences it grows (their later blocks are
never named: the cache no longer knows what they hold). Sequences added by count, or
imported, have none.

Kept per row of ``SequenceRows`` in NumPy arrays, so ``push`` is a few array operations
plus one hash per block that fills. Not locked: the cache's lock covers every call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .prefix import chain_hash

#: A chain held outside a row (a swapped-out sequence): (parent hash, ids of the tail).
Chain = tuple[bytes, np.ndarray]


class TokenChains:
    """Chains by row: ``known[row]``, ``parents[row]``, ``tails[row, :length % block]``."""

    def __init__(self, block_size: int, rows: int = 16) -> None:
        self.block_size = block_size
        self.known = np.zeros(rows, bool)
        self.tails = np.zeros((rows, block_size), np.int64)
        self.parents: list[bytes] = [b""] * rows
        self.count = 0  # rows with a chain: push skips all work while 0

    def _fit(self, row: int) -> None:
        size = self.known.size
        if row >= size:
            grow = max(row + 1, 2 * size) - size
            self.known = np.concatenate([self.known, np.zeros(grow, bool)])
            self.tails = np.concatenate([self.tails, np.zeros((grow, self.block_size),
                                                              np.int64)])
            self.parents += [b""] * grow

    def start(self, row: int, chain: Chain | None) -> None:
        """Give ``row`` the chain ``chain`` (None: none)."""
        self.stop(row)
        if chain is not None:
            self._fit(row)
            parent, tail = chain
            self.known[row] = True
            self.parents[row] = parent
            self.tails[row, : len(tail)] = tail
            self.count += 1

    def stop(self, row: int) -> None:
        """``row`` has no chain any more (released, or grown without ids)."""
        if row < self.known.size and self.known[row]:
            self.known[row] = False
            self.count -= 1

    def get(self, row: int, length: int) -> Chain | None:
        """``row``'s chain for a sequence of ``length`` tokens (a copy), or None."""
        if row >= self.known.size or not self.known[row]:
            return None
        return self.parents[row], self.tails[row, : length % self.block_size].copy()

    def push(self, rows: np.ndarray, lens: np.ndarray, tokens: np.ndarray | None
             ) -> list[tuple[int, bytes, bytes, np.ndarray]]:
        """One token more for each of ``rows`` (of ``lens`` tokens before it), whose ids
        are ``tokens`` (None, or an id -1: unknown, which ends the chain). Returns, for
        each block that filled, (index into ``rows``, its hash, its parent's hash, its
        token ids)."""
        if not self.count or not rows.size:
            return []
        self._fit(int(rows.max()))
        chained = np.flatnonzero(self.known[rows])
        if chained.size and tokens is not None:
            unknown = tokens[chained] < 0
            if unknown.any():
                for row in rows[chained[unknown]].tolist():
                    self.stop(row)
                chained = chained[~unknown]
        if not chained.size:
            return []
        if tokens is None:
            for row in rows[chained].tolist():
                self.stop(row)
            return []
        where = rows[chained]
        offsets = lens[chained] % self.block_size
        self.tails[where, offsets] = tokens[chained]
        filled = []
        for index in chained[offsets == self.block_size - 1].tolist():
            row = int(rows[index])
            parent, block = self.parents[row], self.tails[row].copy()
            self.parents[row] = chain_hash(parent, block)
            filled.append((index, self.parents[row], parent, block))
        return filled

    def push_many(self, row: int, length: int, tokens: np.ndarray | None
                  ) -> list[tuple[int, bytes, bytes, np.ndarray]]:
        """``tokens`` (ids, -1 unknown; None: none known) pushed on ``row``'s chain, whose
        sequence held ``length`` tokens before them: ``push`` for many tokens of one row, a
        block at a time. Returns, for each block that filled, (its index in the sequence,
        its hash, its parent's hash, its token ids). An unknown id ends the chain there."""
        if not self.count or row >= self.known.size or not self.known[row]:
            return []
        if tokens is None:
            self.stop(row)
            return []
        unknown = np.flatnonzero(tokens < 0)
        known = tokens if not unknown.size else tokens[: int(unknown[0])]
        bs, filled, at = self.block_size, [], 0
        while at < known.size:
            offset = (length + at) % bs
            take = min(bs - offset, known.size - at)
            self.tails[row, offset: offset + take] = known[at: at + take]
            at += take
            if offset + take == bs:
                parent, block = self.parents[row], self.tails[row].copy()
                self.parents[row] = chain_hash(parent, block)
                filled.append(((length + at - 1) // bs, self.parents[row], parent, block))
        if unknown.size:
            self.stop(row)
        return filled

    def snapshot(self) -> tuple[Any, ...]:
        return self.known.copy(), self.tails.copy(), list(self.parents), self.count

    def restore(self, state: tuple[Any, ...]) -> None:
        self.known, self.tails, self.parents, self.count = state
