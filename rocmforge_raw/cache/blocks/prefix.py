"""Prefix hashes: the identity of a full block of prompt tokens.

Block ``i`` of a prompt is named by ``blake2b(hash of block i - 1 || its token ids)`` (16
bytes; block 0 chains from the empty string), so a hash names the block's tokens *and*
everything before them: two prompts share block ``i`` only if they agree on every token up
to its end. Token ids are hashed as little-endian int64, so the same ids give the same hash
whatever integer dtype they came in. A partial last block has no hash: it is never shared.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ...common import checks

#: Bytes of a block hash (blake2b digest size): collisions are out of reach at 2**64 blocks.
HASH_BYTES = 16


def token_ids(tokens: Any, name: str = "tokens", least: int = 0) -> np.ndarray:
    """``tokens`` as a non-empty 1-D little-endian int64 array of ids >= ``least`` (a
    copy-free view where it already is one); ``TypeError``/``ValueError`` naming ``name``
    and the bad id otherwise. (``least=-1``: -1 stands for an id not known.)"""
    array = np.asarray(tokens)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of token ids, got shape "
                         f"{array.shape}: {checks.show(tokens)}")
    if array.dtype.kind not in "iu" and not isinstance(tokens, np.ndarray):
        # NumPy made floats or objects of the ids (ints past int64, or not ids): name the first
        # bad one, or take them all as int64
        listed = list(tokens)
        for i, token in enumerate(listed):
            checks.integer(token, f"{name}[{i}]", least, np.iinfo(np.int64).max)
        array = np.array(listed, np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer token ids, got {array.dtype} "
                        f"{checks.show(tokens)}")
    if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(array.max())}, beyond int64")
    if array.dtype.kind == "i" and int(array.min()) < least:
        raise ValueError(f"{name} must be token ids >= {least}, got {int(array.min())} in "
                         f"{checks.show(tokens)}")
    return array.astype("<i8", copy=False)


def chain_hash(parent: bytes, block: np.ndarray) -> bytes:
    """The hash of a full block of token ids ``block`` (int64) after the block hashed
    ``parent`` (``b""`` for a sequence's first block)."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(np.ascontiguousarray(block, "<i8").tobytes())
    return digest.digest()


def block_hashes(tokens: np.ndarray, block_size: int) -> list[bytes]:
    """The chained hash of each *full* block of ``tokens`` (``token_ids``' array; see the
    module docstring)."""
    block_size = checks.integer(block_size, "block_size", 1)
    parent, hashes = b"", []
    for i in range(tokens.size // block_size):
        parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
