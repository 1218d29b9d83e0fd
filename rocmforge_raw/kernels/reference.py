"""NumPy implementations of the kernels: the host backend runs them, GPU tests compare to them.

Shapes follow DESIGN.md: q/out ``[num_seqs, num_q_heads, head_dim]``; each layer's K or V
cache ``[num_blocks, num_kv_heads, block_size, head_dim]``; ``block_tables`` int32
``[num_seqs, max_blocks]``; ``seq_lens`` int32; ``slot_mapping`` int64 (-1 skips); the slab
``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``. Softmax and accumulation
run in ``accum`` (float32 by default, float64 for tests). An fp8 cache (e4m3fn, e4m3fnuz)
holds codes with a per-layer K and V scale (``quantize``/``dequantize``, ml_dtypes).
"""

from __future__ import annotations

import math
import numbers

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


def _check_variants(num_q_heads: int, window: int | None, logit_softcap: float | None,
                    sinks: np.ndarray | None) -> None:
    """Refuse a window below 1, a cap not above 0 (or NaN) and sinks not ``[num_q_heads]``,
    naming the value."""
    if window is not None and (isinstance(window, (bool, np.bool_)) or not isinstance(
            window, numbers.Integral) or window < 1):
        raise ValueError(f"window must be an integer >= 1 (tokens), got {window!r}")
    if logit_softcap is not None and (
            isinstance(logit_softcap, (bool, np.bool_))
            or not isinstance(logit_softcap, numbers.Real)
            or not 0 < float(logit_softcap) < math.inf):
        raise ValueError(f"logit_softcap must be finite and > 0, got {logit_softcap!r}")
    if sinks is not None and np.shape(sinks) != (num_q_heads,):
        raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), got "
                         f"{np.shape(sinks)}")


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, last: np.ndarray, scale: float,
            accum: type, window: int | None, logit_softcap: float | None,
            sinks: np.ndarray | None) -> np.ndarray:
    """Attention of query rows ``q`` ``[rows, kv_heads, group, dim]`` over one sequence's
    ``k``/``v`` ``[kv_heads, tokens, dim]``: row ``i`` sees positions ``last[i] - window + 1
    .. last[i]`` (from 0 without a window). Scores are ``q.k * scale``, soft-capped to
    ``cap * tanh(s / cap)``; a head's sink joins the softmax's denominator only. Returns
    ``[rows, kv_heads, group, dim]``. Positions no row sees are never read (a window's
    freed blocks may hold anything)."""
    window = None if window is None else int(window)  # (a NumPy uint8 would wrap below)
    first = 0 if window is None else max(0, int(last.min()) - window + 1)
    k, v = k[:, first:], v[:, first:]
    scores = np.einsum("ihgd,htd->ihgt", q, k) * accum(scale)
    if logit_softcap is not None:
        cap = accum(logit_softcap)
        scores = cap * np.tanh(scores / cap)
    pos = first + np.arange(k.shape[1])[None, :]
    visible = pos <= last[:, None]
    if window is not None:
        visible &= pos > last[:, None] - window
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, accum).reshape(1, q.shape[1], q.shape[2], 1)
        top = np.maximum(top, sink)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sink - top)
    return np.einsum("ihgt,htd->ihgd", weights / total, v)


def _sequence_kv(k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray, length: int,
                 accum: type, k_scale: float, v_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's first ``length`` keys and values, ``[kv_heads, length, dim]`` each."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    blocks = table[: -(-length // block_size)]
    k = dequantize(k_cache[blocks], k_scale, accum)  # [blocks, heads, block_size, dim]
    v = dequantize(v_cache[blocks], v_scale, accum)
    k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
    v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
    return k, v


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, seq_lens: np.ndarray, scale: float,
                    accum: type = np.float32, k_scale: float = 1.0,
                    v_scale: float = 1.0, *, window: int | None = None,
                    logit_softcap: float | None = None,
                    sinks: np.ndarray | None = None) -> np.ndarray:
    """Decode attention of one query token per sequence; returns ``accum`` values. An fp8
    cache holds codes: K and V are ``code * k_scale`` and ``code * v_scale``. ``window``:
    each token sees its last ``window`` positions (itself included); ``logit_softcap``:
    scores become ``cap * tanh(s / cap)``; ``sinks`` ``[num_q_heads]``: one logit per head
    in the softmax's denominator only (gpt-oss)."""
    num_seqs, num_q_heads, head_dim = query.shape
    _check_variants(num_q_heads, window, logit_softcap, sinks)
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_seqs, num_q_heads, head_dim), accum)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        if length == 0:
            continue
        k, v = _sequence_kv(k_cache, v_cache, block_tables[s], length, accum, k_scale, v_scale)
        q = query[s].astype(accum).reshape(1, num_kv_heads, group, head_dim)
        out[s] = _attend(q, k, v, np.array([length - 1]), scale, accum, window, logit_softcap,
                         sinks).reshape(num_q_heads, head_dim)
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
                          k_scale: float = 1.0, v_scale: float = 1.0, *,
                          window: int | None = None, logit_softcap: float | None = None,
                          sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention of ``query_lens[s]`` query rows per sequence (``query`` ``[sum(query_lens),
    num_q_heads, head_dim]``, each sequence's rows consecutive, in order): row ``i`` of
    sequence ``s`` is its token ``seq_lens[s] - query_lens[s] + i`` and attends to cache
    positions ``0 .. seq_lens[s] - query_lens[s] + i`` (causal, aligned to the end of the
    sequence's KV; with a ``window``, its last ``window`` of them). Returns ``accum`` values
    shaped like ``query``; ``query_lens`` of ones is ``paged_attention`` (the variants too)."""
    _, num_q_heads, head_dim = query.shape
    _check_variants(num_q_heads, window, logit_softcap, sinks)
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = np.zeros(query.shape, accum)
    starts = query_starts(query_lens)
    for s in range(len(query_lens)):
        length, rows = int(seq_lens[s]), int(query_lens[s])
        if rows == 0:
            continue
        k, v = _sequence_kv(k_cache, v_cache, block_tables[s], length, accum, k_scale, v_scale)
        q = query[starts[s]: starts[s + 1]].astype(accum)  # [rows, heads, dim]
        q = q.reshape(rows, num_kv_heads, group, head_dim)
        last = length - rows + np.arange(rows)  # the last position row i sees
        out[starts[s]: starts[s + 1]] = _attend(q, k, v, last, scale, accum, window,
                                                logit_softcap, sinks).reshape(
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
