"""The NumPy reference's attention variants (issue 47): a sliding window, logit soft-capping
and attention sinks, in the decode and the multi-token reference alike, each checked
against a token-by-token float64 derivation of its definition."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rocmforge_raw.kernels import reference


def paged(rng, lens, block_size=4, kv_heads=2, head_dim=8, spare=3):
    """A cache whose sequences' blocks lie in random order, and the tables naming them."""
    need = [-(-n // block_size) for n in lens]
    blocks = sum(need) + spare
    k = rng.standard_normal((blocks, kv_heads, block_size, head_dim))
    v = rng.standard_normal((blocks, kv_heads, block_size, head_dim))
    order = rng.permutation(blocks)
    tables = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[at: at + n]
        at += n
    return k, v, tables


def by_definition(q, k, v, table, length, rows, scale, window, cap, sinks):
    """Row i of the sequence (token length - rows + i), head h: a loop over the positions it
    sees, straight from the variants' definitions."""
    block_size, heads = k.shape[2], q.shape[1]
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(rows):
        me = length - rows + i
        for h in range(heads):
            x = h // group
            seen, logits = [], []
            for p in range(length):
                if p > me or (window is not None and me - p >= window):
                    continue
                key = k[table[p // block_size], x, p % block_size]
                s = float(q[i, h] @ key) * scale
                if cap is not None:
                    s = cap * math.tanh(s / cap)
                seen.append(p)
                logits.append(s)
            top = max(logits + ([sinks[h]] if sinks is not None else []))
            w = [math.exp(s - top) for s in logits]
            total = sum(w) + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
            for p, wp in zip(seen, w):
                out[i, h] += wp / total * v[table[p // block_size], x, p % block_size]
    return out


VARIANTS = [
    pytest.param(None, None, None, id="plain"),
    pytest.param(5, None, None, id="window"),
    pytest.param(1, None, None, id="window-1"),
    pytest.param(None, 0.7, None, id="softcap"),
    pytest.param(None, None, True, id="sinks"),
    pytest.param(6, 1.5, True, id="all"),
]


@pytest.mark.parametrize("window,cap,with_sinks", VARIANTS)
def test_multi_token_variants_follow_their_definitions(window, cap, with_sinks):
    rng = np.random.default_rng(47)
    lens, q_lens = np.array([13, 9, 21, 4]), np.array([3, 1, 7, 4])
    k, v, tables = paged(rng, lens)
    heads = 4
    sinks = rng.standard_normal(heads) * 2 if with_sinks else None
    q = rng.standard_normal((int(q_lens.sum()), heads, 8))
    got = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, 0.4, np.float64,
                                          window=window, logit_softcap=cap, sinks=sinks)
    starts = reference.query_starts(q_lens)
    for s in range(len(lens)):
        rows = slice(starts[s], starts[s + 1])
        want = by_definition(q[rows], k, v, tables[s], lens[s], q_lens[s], 0.4, window, cap,
                             sinks)
        np.testing.assert_allclose(got[rows], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window,cap,with_sinks", VARIANTS)
def test_decode_variants_equal_one_query_row_each(window, cap, with_sinks):
    rng = np.random.default_rng(7)
    lens = np.array([1, 8, 17, 30])
    k, v, tables = paged(rng, lens)
    sinks = rng.standard_normal(4) if with_sinks else None
    q = rng.standard_normal((4, 4, 8))
    decode = reference.paged_attention(q, k, v, tables, lens, 0.3, np.float64, window=window,
                                       logit_softcap=cap, sinks=sinks)
    multi = reference.paged_attention_multi(q, k, v, tables, lens, np.ones(4, np.int64), 0.3,
                                            np.float64, window=window, logit_softcap=cap,
                                            sinks=sinks)
    np.testing.assert_allclose(decode, multi, rtol=1e-12, atol=1e-12)
    for s in range(4):
        want = by_definition(q[s:s + 1], k, v, tables[s], lens[s], 1, 0.3, window, cap, sinks)
        np.testing.assert_allclose(decode[s:s + 1], want, rtol=1e-12, atol=1e-12)


def test_a_window_never_reads_the_blocks_that_left_it():
    """Blocks wholly before every query row's window may hold anything (a windowed cache
    frees them and its table names the null block there): NaN in them changes nothing."""
    rng = np.random.default_rng(3)
    lens, q_lens = np.array([40]), np.array([6])
    k, v, tables = paged(rng, lens)
    q = rng.standard_normal((6, 4, 8))
    clean = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, 0.5, np.float64,
                                            window=8)
    first = 40 - 6 - 8 + 1  # the earliest position any row sees
    gone = tables[0, : first // 4]  # blocks wholly before it
    k[gone], v[gone] = np.nan, np.nan
    dirty = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, 0.5, np.float64,
                                            window=8)
    np.testing.assert_array_equal(clean, dirty)


def test_a_window_covering_the_sequence_and_a_sink_at_minus_infinity_change_nothing():
    rng = np.random.default_rng(5)
    lens = np.array([11, 3])
    k, v, tables = paged(rng, lens)
    q = rng.standard_normal((2, 4, 8))
    plain = reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64)
    np.testing.assert_array_equal(
        reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64, window=11), plain)
    np.testing.assert_allclose(
        reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64,
                                  sinks=np.full(4, -np.inf)), plain, rtol=1e-15, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 0}, r"window must be an integer >= 1 \(tokens\), got 0"),
    ({"window": -3}, "got -3"),
    ({"window": 2.5}, "got 2.5"),
    ({"window": True}, "got True"),
    ({"logit_softcap": 0.0}, "logit_softcap must be finite and > 0, got 0.0"),
    ({"logit_softcap": float("inf")}, "got inf"),
    ({"window": 4.0}, "got 4.0"),
    ({"logit_softcap": -1.0}, "got -1.0"),
    ({"logit_softcap": float("nan")}, "got nan"),
    ({"logit_softcap": "2"}, "logit_softcap must be finite and > 0, got '2'"),
    ({"logit_softcap": True}, "got True"),
    ({"window": np.bool_(True)}, "got np.True_"),
    ({"sinks": np.zeros(3)}, r"sinks must have shape \(4,\) \(one per query head\), got \(3,\)"),
    ({"sinks": np.zeros((4, 1))}, r"got \(4, 1\)"),
])
def test_bad_variant_values_are_refused_by_name(kwargs, match):
    rng = np.random.default_rng(1)
    lens = np.array([5])
    k, v, tables = paged(rng, lens)
    q = rng.standard_normal((1, 4, 8))
    with pytest.raises(ValueError, match=match):
        reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64, **kwargs)
    with pytest.raises(ValueError, match=match):
        reference.paged_attention_multi(q, k, v, tables, lens, np.ones(1, np.int64), 0.5,
                                        np.float64, **kwargs)


def test_a_window_of_a_narrow_numpy_integer_is_its_value():
    """(``last - window`` in uint8 would wrap: the window is taken as a Python int.)"""
    rng = np.random.default_rng(2)
    lens = np.array([300])
    k, v, tables = paged(rng, lens)
    q = rng.standard_normal((1, 4, 8))
    np.testing.assert_array_equal(
        reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64, window=np.uint8(200)),
        reference.paged_attention(q, k, v, tables, lens, 0.5, np.float64, window=200))
