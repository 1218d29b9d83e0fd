"""NumPy implementations of the kernels: the host backend runs them, GPU tests compare to them.

Shapes follow DESIGN.md: q/out ``[num_seqs, num_q_heads, head_dim]``; each layer's K or V
cache ``[num_blocks, num_kv_heads, block_size, head_dim]``; ``block_tables`` int32
``[num_seqs, max_blocks]``; ``seq_lens`` int32; ``slot_mapping`` int64 (-1 skips); the slab
``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``. Softmax and accumulation
run in ``accum`` (float32 by default, float64 for tests). An fp8 cache (e4m3fn, e4m3fnuz)
holds codes with a per-layer K and V scale (``quantize``/``dequantize``, ml_dtypes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: The fp8 cache formats and the largest magnitude each stores (writes saturate there).
FP8_LIMITS = {np.dtype(ml_dtypes.float8_e4m3fn): 448.0, np.dtype(ml_dtypes.float8_e4m3fnuz): 240.0}


def quantize(x: np.ndarray, scale: float, dtype: np.dtype) -> np.ndarray:
    """``x / scale`` as fp8 ``dtype`` codes, computed as the write kernel does: float32
    ``x * float32(1 / scale)``, saturated at the format's limit, rounded to nearest even."""
    inverse = np.float32(1.0 / scale)
    limit = np.float32(FP8_LIMITS[np.dtype(dtype)])
    scaled = x.astype(np.float32) * inverse
    return np.clip(scaled, -limit, limit).astype(dtype)


def dequantize(codes: np.ndarray, scale: float, accum: type = np.float32) -> np.ndarray:
    """The values fp8 ``codes`` stand for: ``code * scale`` in ``accum``."""
    return codes.astype(accum) * accum(scale)


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, seq_lens: np.ndarray, scale: float,
                    accum: type = np.float32, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> np.ndarray:
    """Decode attention of one query token per sequence; returns ``accum`` values. An fp8
    cache holds codes: K and V are ``code * k_scale`` and ``code * v_scale``."""
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
        k = dequantize(k_cache[blocks], k_scale, accum)
        v = dequantize(v_cache[blocks], v_scale, accum)
        k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        k, v = k[:, :length], v[:, :length]
        q = query[s].astype(accum).reshape(num_kv_heads, group, head_dim)
        scores = np.einsum("hgd,htd->hgt", q, k) * accum(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[s] = np.einsum("hgt,htd->hgd", weights, v).reshape(num_q_heads, head_dim)
    return out



def query_starts(query_lens: np.ndarray) -> np.ndarray:
    """Where each sequence's query rows start, and the total: the exclusive prefix sum of
    ``query_lens`` (int64 ``[num_seqs + 1]``)."""
    starts = np.zeros(len(query_lens) + 1, np.int64)
    np.cumsum(query_lens, out=starts[1:])
    return starts


def paged_attention_multi(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                          block_tables: np.ndarray, seq_lens: np.ndarray,
                          query_lens: np.ndarray, scale: float, accum: type = np.float32,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """Attention of ``query_lens[s]`` query rows per sequence (``query`` ``[sum(query_lens),
    num_q_heads, head_dim]``, each sequence's rows consecutive, in order): row ``i`` of
    sequence ``s`` is its token ``seq_lens[s] - query_lens[s] + i`` and attends to cache
    positions ``0 .. seq_lens[s] - query_lens[s] + i`` (causal, aligned to the end of the
    sequence's KV). Returns ``accum`` values shaped like ``query``; ``query_lens`` of ones is
    ``paged_attention``."""
    _, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = np.zeros(query.shape, accum)
    starts = query_starts(query_lens)
    for s in range(len(query_lens)):
        length, rows = int(seq_lens[s]), int(query_lens[s])
        if rows == 0:
            continue
        blocks = block_tables[s, : -(-length // block_size)]
        k = dequantize(k_cache[blocks], k_scale, accum)
        v = dequantize(v_cache[blocks], v_scale, accum)
        k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
        v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
        q = query[starts[s]: starts[s + 1]].astype(accum)  # [rows, heads, dim]
        q = q.reshape(rows, num_kv_heads, group, head_dim)
        scores = np.einsum("ihgd,htd->ihgt", q, k) * accum(scale)
        last = length - rows + np.arange(rows)  # the last position row i sees
        visible = np.arange(length)[None, :] <= last[:, None]  # [rows, tokens]
        scores = np.where(visible[:, None, None, :], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[starts[s]: starts[s + 1]] = np.einsum("ihgt,htd->ihgd", weights, v).reshape(
            rows, num_q_heads, head_dim)
    return out

def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray,
                      v_cache: np.ndarray, slot_mapping: np.ndarray, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write token ``i``'s K/V rows at ``slot_mapping[i]`` in place; -1 leaves the cache. An
    fp8 cache gets ``quantize(key, k_scale)`` and ``quantize(value, v_scale)``."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    heads = np.arange(k_cache.shape[1])
    key, value = key[keep], value[keep]
    if k_cache.dtype in FP8_LIMITS:
        key = quantize(key, k_scale, k_cache.dtype)
        value = quantize(value, v_scale, v_cache.dtype)
    k_cache[blocks[:, None], heads[None, :], offsets[:, None]] = key
    v_cache[blocks[:, None], heads[None, :], offsets[:, None]] = value


def copy_blocks(slab: np.ndarray, pairs: np.ndarray) -> None:
    """For each (src, dst) row of ``pairs``, copy block src to dst in every layer, K and V."""
    if len(pairs):
        slab[:, :, pairs[:, 1]] = slab[:, :, pairs[:, 0]]
