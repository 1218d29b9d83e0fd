"""NumPy implementations of the kernels: the host backend runs them, GPU tests compare to them.

Shapes follow DESIGN.md: q/out ``[num_seqs, num_q_heads, head_dim]``; each layer's K or V
cache ``[num_blocks, num_kv_heads, block_size, head_dim]``; ``block_tables`` int32
``[num_seqs, max_blocks]``; ``seq_lens`` int32; ``slot_mapping`` int64 (-1 skips); the slab
``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``. Softmax and accumulation
run in ``accum`` (float32 by default, float64 for tests).
"""

from __future__ import annotations

import numpy as np


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, seq_lens: np.ndarray, scale: float,
                    accum: type = np.float32) -> np.ndarray:
    """Decode attention of one query token per sequence; returns ``accum`` values."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_seqs, num_q_heads, head_dim), accum)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        if length == 0:
            continue
        blocks = block_tables[s, : -(-length // block_size)]
        # [blocks, heads, block_size, dim] -> [heads, tokens, dim]
        k = k_cache[blocks].astype(accum).transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        v = v_cache[blocks].astype(accum).transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        k, v = k[:, :length], v[:, :length]
        q = query[s].astype(accum).reshape(num_kv_heads, group, head_dim)
        scores = np.einsum("hgd,htd->hgt", q, k) * accum(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[s] = np.einsum("hgt,htd->hgd", weights, v).reshape(num_q_heads, head_dim)
    return out


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray,
                      v_cache: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Write token ``i``'s K/V rows at ``slot_mapping[i]`` in place; -1 leaves the cache."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    heads = np.arange(k_cache.shape[1])
    k_cache[blocks[:, None], heads[None, :], offsets[:, None]] = key[keep]
    v_cache[blocks[:, None], heads[None, :], offsets[:, None]] = value[keep]


def copy_blocks(slab: np.ndarray, pairs: np.ndarray) -> None:
    """For each (src, dst) row of ``pairs``, copy block src to dst in every layer, K and V."""
    if len(pairs):
        slab[:, :, pairs[:, 1]] = slab[:, :, pairs[:, 0]]
