"""The decode op's attention variants (``ops.paged_attention(logit_softcap=, sinks=)``):
Gemma 2's soft-capped scores and gpt-oss's sinks against the float64 reference, on every
backend (the host backend runs the reference itself; the GPU kernels split and combine), and
bad values refused by name before anything is queued."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICE, MULTI_DEVICE
from test_ops import POISON, TOLERANCE, random_cache, random_tables, relative_error

from rocmforge_raw.kernels import ops, reference
from rocmforge_raw.memory.array import DeviceArray

LENS = [0, 1, 15, 17, 700, 3000]


def attend(backend, rng, dtype, head_dim, ratio, softcap, with_sinks, num_partitions=None,
           num_kv_heads=2, block_size=16, window=None):
    """One decode call with the variants: (output, reference with them, reference without)
    as float64. With a ``window``, the K/V of each sequence's tokens before it are NaN: a
    read of them shows."""
    num_q_heads = num_kv_heads * ratio
    num_blocks = sum(math.ceil(n / block_size) for n in LENS) + 3
    k, v, dk, dv = random_cache(rng, backend, dtype, num_blocks, num_kv_heads, block_size,
                                head_dim)
    tables = random_tables(rng, LENS, block_size, num_blocks)
    lens = np.asarray(LENS, np.int32)
    if window:
        for s, n in enumerate(LENS):
            for t in range(max(n - window, 0)):
                for cache in (k, v):
                    cache[tables[s, t // block_size], :, t % block_size] = np.nan
        dk.copy_from_host(k)
        dv.copy_from_host(v)
    q = rng.standard_normal((len(LENS), num_q_heads, head_dim), np.float32).astype(dtype)
    sinks = (rng.standard_normal(num_q_heads).astype(np.float32) * 3) if with_sinks else None
    arrays = [DeviceArray.from_numpy(a, DEVICE, backend) for a in
              (q, *(() if sinks is None else (sinks,)))]
    out = DeviceArray.empty(q.shape, dtype, DEVICE, backend)
    out.buffer.fill(POISON)
    ops.paged_attention(out, arrays[0], dk, dv, tables, lens, num_partitions=num_partitions,
                        logit_softcap=softcap, sinks=arrays[1] if with_sinks else None,
                        window=window)
    got = out.to_numpy().astype(np.float64)
    scale = 1.0 / math.sqrt(head_dim)
    want = reference.paged_attention(q, k, v, tables, lens, scale, np.float64,
                                     logit_softcap=softcap, sinks=sinks, window=window)
    plain = reference.paged_attention(q, k, v, tables, lens, scale, np.float64, window=window)
    for array in (out, dk, dv, *arrays):
        array.buffer.root.close()
    return got, want, plain


@pytest.mark.parametrize("softcap, with_sinks", [(1.5, False), (None, True), (2.0, True)],
                         ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("dtype, head_dim, ratio", [
    (np.float16, 128, 4), (ml_dtypes.bfloat16, 64, 8), (np.float32, 128, 1),
    (np.float16, 256, 2)], ids=lambda p: getattr(p, "__name__", str(p)))
@pytest.mark.parametrize("num_partitions", [None, 3], ids=["balanced", "three-pieces"])
def test_softcap_and_sinks_match_the_reference(backend, rng, dtype, head_dim, ratio, softcap,
                                               with_sinks, num_partitions):
    """Scores on the vector and the matrix units, outputs written whole and combined from
    pieces (the sinks join the combine once); the variants change these outputs."""
    got, want, plain = attend(backend, rng, dtype, head_dim, ratio, softcap, with_sinks,
                              num_partitions)
    assert relative_error(got, want) < TOLERANCE[np.dtype(dtype)]
    assert relative_error(got, plain) > 5 * TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("window", [37, 700], ids=["window-37", "window-700"])
@pytest.mark.parametrize("dtype, head_dim, ratio", [
    (np.float16, 128, 4), (ml_dtypes.bfloat16, 64, 8), (np.float32, 128, 1)],
    ids=lambda p: getattr(p, "__name__", str(p)))
@pytest.mark.parametrize("num_partitions", [None, 3], ids=["balanced", "three-pieces"])
def test_a_sliding_window_reads_only_its_tokens(backend, rng, dtype, head_dim, ratio, window,
                                                num_partitions):
    """Each sequence sees its last ``window`` tokens (37: not a multiple of a block; 700:
    longer than most); the tokens before are NaN in the cache and never read."""
    got, want, _ = attend(backend, rng, dtype, head_dim, ratio, 1.5, True, num_partitions,
                          window=window)
    assert relative_error(got, want) < TOLERANCE[np.dtype(dtype)]
    got, want, _ = attend(backend, rng, dtype, head_dim, ratio, None, False, num_partitions,
                          window=window)  # (the NaN before the window: a read of it shows)
    assert relative_error(got, want) < TOLERANCE[np.dtype(dtype)]


def _call(backend, **variants):
    """A decode call of one sequence with ``variants``; where it raises, its output is
    still all poison (nothing was queued) and the error goes on."""
    q = DeviceArray.from_numpy(np.ones((1, 4, 64), np.float16), DEVICE, backend)
    k = DeviceArray.from_numpy(np.ones((2, 2, 16, 64), np.float16), DEVICE, backend)
    out = DeviceArray.empty((1, 4, 64), np.float16, DEVICE, backend)
    out.buffer.fill(POISON)
    try:
        ops.paged_attention(out, q, k, k, np.array([[1]], np.int32), np.array([3], np.int32),
                            **variants)
    except Exception:
        assert (out.to_numpy().view(np.uint8) == POISON).all()
        raise
    finally:
        for array in (q, k, out):
            array.buffer.root.close()


def _sinks(backend, values, device=DEVICE):
    return DeviceArray.from_numpy(np.asarray(values), device, backend)


@pytest.mark.parametrize("cap, error, words", [
    (0, ValueError, "logit_softcap must lie in [1.1754944e-38, 2.3350708e+38] (> 0: a normal "
                    "float32, and times log2(e) too), got 0"),
    (-1.5, ValueError, "(> 0: a normal float32, and times log2(e) too), got -1.5"),
    (1e39, ValueError, "got 1e+39"),
    (2.4e38, ValueError, "got 2.4e+38"),  # (times log2(e): past float32)
    (1e-50, ValueError, "got 1e-50"),
    (1e-40, ValueError, "got 1e-40"),  # (subnormal: a GPU may flush it to 0, no cap)
    (math.nan, ValueError, "logit_softcap must be a finite number"),
    (math.inf, ValueError, "logit_softcap must be a finite number"),
    (True, TypeError, "logit_softcap must be a number"),
    ("30", TypeError, "logit_softcap must be a number"),
])
def test_a_bad_logit_cap_is_refused_before_anything_is_queued(backend, cap, error, words):
    with pytest.raises(error, match=re.escape(words)):
        _call(backend, logit_softcap=cap)


@pytest.mark.parametrize("window, error, words", [
    (0, ValueError, "window must be"), (-3, ValueError, "window must be"),
    (1 << 31, ValueError, "window must be"), (True, TypeError, "window must be an integer"),
    (2.5, TypeError, "window must be an integer"), ("9", TypeError, "window must be an integer"),
])
def test_a_bad_window_is_refused_before_anything_is_queued(backend, window, error, words):
    with pytest.raises(error, match=words):
        _call(backend, window=window)


def test_bad_sinks_are_refused_before_anything_is_queued(backend):
    for sinks, error, words in (
            (np.zeros(4, np.float32), TypeError, "sinks must be a DeviceArray, got"),
            (_sinks(backend, np.zeros(4, np.float16)), ValueError,
             "sinks must be float32, got float16"),
            (_sinks(backend, np.zeros(8, np.float32)), ValueError,
             r"sinks must have shape \(4,\) \(one logit a query head\), got \(8,\)"),
            (_sinks(backend, np.zeros((1, 4), np.float32)), ValueError,
             "sinks must have 1 dimensions, got shape")):
        with pytest.raises(error, match=words):
            _call(backend, sinks=sinks)
        if isinstance(sinks, DeviceArray):
            sinks.buffer.root.close()


def test_sinks_overlapping_the_output_are_refused(backend):
    """The kernels write ``out`` while other CTAs, and the combine, still read the sinks."""
    q = DeviceArray.from_numpy(np.ones((1, 4, 64), np.float16), DEVICE, backend)
    k = DeviceArray.from_numpy(np.ones((2, 2, 16, 64), np.float16), DEVICE, backend)
    out = DeviceArray.empty((1, 4, 64), np.float16, DEVICE, backend)
    out.buffer.fill(POISON)
    inside = DeviceArray(out.buffer, np.float32, (4,), 0)
    for query_lens in (None, np.array([1], np.int32)):
        with pytest.raises(ValueError, match=r"out .*overlaps sinks"):
            ops.paged_attention(out, q, k, k, np.array([[1]], np.int32),
                                np.array([3], np.int32), sinks=inside, query_lens=query_lens)
        assert (out.to_numpy().view(np.uint8) == POISON).all()
    for array in (q, k, out):
        array.buffer.root.close()


def test_sinks_on_another_device_are_refused(rng):
    if "host" not in MULTI_DEVICE:
        pytest.skip("the host backend has one device here")
    from rocmforge_raw.runtime import get_backend

    host = get_backend("host")
    other = _sinks(host, np.zeros(4, np.float32), 1 - DEVICE)
    with pytest.raises(ValueError, match=f"sinks is on host:{1 - DEVICE}, query on host"):
        _call(host, sinks=other)
    other.buffer.root.close()


@pytest.mark.parametrize("dtype, head_dim, ratio", [
    (np.float16, 128, 4), (ml_dtypes.bfloat16, 256, 8), (np.float32, 64, 2)],
    ids=lambda p: getattr(p, "__name__", str(p)))
@pytest.mark.parametrize("window", [None, 40, 150], ids=["all", "window-40", "window-150"])
def test_the_multi_token_op_takes_them_too(backend, rng, dtype, head_dim, ratio, window):
    """Decodes first (the decode kernel), then prefill rows past a cached prefix, a chunk and
    a long range cut into pieces (the multi-token kernel and its combine); with a window,
    the blocks wholly before each sequence's first row's window hold NaN, never read."""
    from test_multi_token import random_inputs

    q, k, v, tables, lens, q_lens, *_ = random_inputs(
        rng, dtype, head_dim, 16, ratio, [1, 1, 37, 5, 4], [9, 200, 37, 300, 2000])
    for s in range(len(lens)) if window else ():
        gone = max(0, int(lens[s]) - int(q_lens[s]) - window + 1) // 16
        k[tables[s, :gone]] = np.nan
        v[tables[s, :gone]] = np.nan
    sinks = rng.uniform(3, 7, q.shape[1]).astype(np.float32)
    arrays = [DeviceArray.from_numpy(a, DEVICE, backend) for a in (q, k, v, sinks)]
    out = DeviceArray.empty(q.shape, q.dtype, DEVICE, backend)
    out.buffer.fill(POISON)
    ops.paged_attention(out, arrays[0], arrays[1], arrays[2], tables, lens, query_lens=q_lens,
                        logit_softcap=2.0, sinks=arrays[3], window=window)
    got = out.to_numpy().astype(np.float64)
    for array in (out, *arrays):
        array.buffer.root.close()
    scale = 1.0 / math.sqrt(head_dim)
    want = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale, np.float64,
                                           logit_softcap=2.0, sinks=sinks, window=window)
    assert relative_error(got, want) < TOLERANCE[np.dtype(dtype)]
    if window is None:  # (with one, the NaN before it shows any read of it)
        plain = reference.paged_attention_multi(q, k, v, tables, lens, q_lens, scale,
                                                np.float64)
        assert relative_error(got, plain) > 5 * TOLERANCE[np.dtype(dtype)]


def test_a_capped_call_at_head_dim_256_takes_groups_of_at_most_four():
    """gfx11's 16-bit groups of 8 at head_dim 256 have no register left for the cap (their
    instances skip it, pa_math.h's CAPS): planning must never give them a capped call."""
    from rocmforge_raw.kernels import planning

    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        assert planning.attention_instance(dtype, 256, 8)[1] == 8
        assert planning.attention_instance(dtype, 256, 8, capped=True) == (
            f"rf_paged_attention_{planning.DTYPES[dtype]}_d256_g4", 4)
        assert planning.attention_instance(dtype, 128, 8, capped=True)[1] == 8
    assert planning.attention_instance(np.dtype(np.float32), 256, 8, capped=True)[1] == 8
