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

from .. import checks

#: Bytes of a block hash (blake2b digest size): collisions are out of reach at 2**64 blocks.
HASH_BYTES = 16


def token_ids(tokens: Any, name: str = "tokens") -> np.ndarray:
    """``tokens`` as a non-empty 1-D little-endian int64 array (a copy-free view where it
    already is one); ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    array = np.asarray(tokens)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer token ids, got {array.dtype} "
                        f"{checks.show(tokens)}")
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of token ids, got shape "
                         f"{array.shape}")
    if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(array.max())}, beyond int64")
    return array.astype("<i8", copy=False)


def block_hashes(tokens: np.ndarray, block_size: int) -> list[bytes]:
    """The chained hash of each *full* block of ``tokens`` (see the module docstring)."""
    full = tokens.size // block_size
    data = np.ascontiguousarray(tokens[: full * block_size]).view(np.uint8)
    step, parent, hashes = block_size * 8, b"", []
    for i in range(full):
        digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        digest.update(data[i * step : (i + 1) * step])  # type: ignore[arg-type]  # a buffer
        parent = digest.digest()
        hashes.append(parent)
    return hashes
