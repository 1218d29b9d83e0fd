"""fp8 (e4m3fn, e4m3fnuz) KV caches: quantizing writes, dequantizing attention, the cache.

The write kernel's codes equal ml_dtypes' cast of the clipped float32 ``x * (1 / scale)`` bit
for bit; attention over codes matches the float64 reference over the dequantized codes as
closely as the 16-bit kernels match theirs; against the float64 attention over the original
(unquantized) K/V, the error is the format's (stated below and asserted).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_ops import POISON, random_tables, relative_error

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.kernels import ops, reference
from rocmforge_raw.memory.array import DeviceArray

FP8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz]
ACT = [np.float16, ml_dtypes.bfloat16]
TOLERANCE = {np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 2e-2}
#: Relative error (Frobenius norm) of fp8 attention against float64 attention over the
#: unquantized K/V (standard normal, per-tensor scales max|x| / limit): e4m3 keeps 3
#: mantissa bits, so each element is off by up to 1/16 and the output by a few per cent.
QUANTIZED_TOLERANCE = 0.06


def _names(p):
    return getattr(p, "__name__", str(p))


def to_device(array, backend):
    return DeviceArray.from_numpy(np.ascontiguousarray(array), backend=backend)


def special_values(dtype, limit, scale):
    """Values that test rounding and saturation: zeros of both signs, ties, subnormals, the
    limit and beyond it, as ``dtype``."""
    units = np.array([0.0, -0.0, 1.0, -1.0, 1.0625, 1.1875, 0.5 ** 7, 1.5 * 0.5 ** 9,
                      0.5 ** 11, limit, limit * 1.02, -limit * 4, 17.0, -300.0])
    return (units * scale).astype(dtype)


@pytest.mark.parametrize("cache_dtype", FP8, ids=_names)
@pytest.mark.parametrize("act", ACT, ids=_names)
def test_writes_quantize_exactly_as_ml_dtypes(backend, rng, cache_dtype, act):
    num_blocks, heads, block_size, head_dim = 6, 2, 16, 64
    limit = reference.FP8_LIMITS[np.dtype(cache_dtype)]
    k_scale, v_scale = 0.37, 2.5
    key = (rng.standard_normal((20, heads, head_dim), np.float32) * 40).astype(act)
    value = (rng.standard_normal((20, heads, head_dim), np.float32) * 900).astype(act)
    key[0, 0, :14] = special_values(act, limit, k_scale)
    value[0, 1, :14] = special_values(act, limit, v_scale)
    slots = rng.permutation(num_blocks * block_size)[:20].astype(np.int64)
    slots[3] = -1
    shape = (num_blocks, heads, block_size, head_dim)
    k_cache = DeviceArray.empty(shape, cache_dtype, backend=backend)
    v_cache = DeviceArray.empty(shape, cache_dtype, backend=backend)
    for cache in (k_cache, v_cache):
        cache.buffer.fill(0x11)
    arrays = [to_device(x, backend) for x in (key, value)]
    ops.reshape_and_cache(*arrays, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    want_k = np.full(shape, 0x11, np.uint8).view(cache_dtype)
    want_v = want_k.copy()
    reference.reshape_and_cache(key, value, want_k, want_v, slots, k_scale, v_scale)
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        np.testing.assert_array_equal(got.to_numpy().view(np.uint8), want.view(np.uint8))
    codes = want_v.astype(np.float32)
    assert np.abs(codes).max() == limit  # saturated, never NaN or infinite
    for array in (k_cache, v_cache, *arrays):
        array.buffer.root.close()


def e4m3_values(cache_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every code of the format and the value it stands for (NaN for the NaN codes), decoded
    from its bits here: sign, 4 exponent bits (bias 7; 8 for e4m3fnuz), 3 mantissa bits,
    subnormals below exponent 1. e4m3fn's NaNs are S.1111.111; e4m3fnuz's one NaN is 0x80
    (it has no -0)."""
    codes = np.arange(256)
    fnuz = np.dtype(cache_dtype) == np.dtype(ml_dtypes.float8_e4m3fnuz)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    bias = 8 if fnuz else 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** (1 - bias),
                         (1 + mantissa / 8) * 2.0 ** (exponent - bias))
    values = sign * magnitude
    values[(codes == 0x80) if fnuz else ((codes & 0x7F) == 0x7F)] = np.nan
    return codes, values


def quantize_by_the_formula(x, scale, cache_dtype) -> np.ndarray:
    """The documented write, computed without any fp8 cast: y = float32(x) * float32(1 /
    scale) (float32 arithmetic), saturated at the format's largest value, then the nearest
    code's bits, a tie going to the code with an even mantissa (and a zero keeping y's sign
    where the format has -0)."""
    codes, values = e4m3_values(cache_dtype)
    finite = ~np.isnan(values)
    codes, values = codes[finite], values[finite]
    limit = np.max(values)
    y = np.clip(np.asarray(x, np.float32) * np.float32(1.0 / scale), -limit, limit)
    out = np.empty(y.shape, np.uint8)
    for index, target in np.ndenumerate(y.astype(np.float64)):
        distance = np.abs(values - target)
        best = np.flatnonzero(distance == distance.min())
        if len(best) > 1:  # a tie: the even mantissa; between +0 and -0, y's sign
            even = best[(codes[best] & 1) == 0]
            best = even if len(even) else best
            signed = best[np.signbit(values[best]) == np.signbit(target)]
            best = signed if len(signed) else best
        out[index] = codes[best[0]]
    return out


@pytest.mark.parametrize("cache_dtype", FP8, ids=_names)
@pytest.mark.parametrize("act", ACT, ids=_names)
def test_writes_quantize_by_the_documented_formula(backend, rng, cache_dtype, act):
    """Against codes computed from the formula here, not by the reference: values at and
    next to every midpoint between two codes (where rounding twice, say through float16,
    lands on the other side), zeros, subnormals, the limit and past it, random values."""
    _, values = e4m3_values(cache_dtype)
    ladder = np.unique(np.abs(values[~np.isnan(values)]))
    midpoints = (ladder[1:] + ladder[:-1]) / 2
    for k_scale, v_scale in ((1 / (1 + 2.0**-12), 0.37), (2.5, 1 / (1 - 2.0**-11))):
        tokens = np.concatenate([midpoints, -midpoints, ladder, [0.0, -0.0, 1e-9, 3e3]])
        tokens = np.concatenate([tokens, rng.standard_normal(200) * 60.0])
        n = -(-tokens.size // 64)
        flat = np.resize(tokens, n * 64)
        key = (flat * k_scale).astype(act).reshape(n, 1, 64)
        value = (flat * v_scale).astype(act).reshape(n, 1, 64)
        slots = np.arange(n, dtype=np.int64)
        shape = (-(-n // 16), 1, 16, 64)
        k_cache, v_cache = (DeviceArray.empty(shape, cache_dtype, backend=backend)
                            for _ in range(2))
        for cache in (k_cache, v_cache):  # every byte defined: slots past n must keep it
            cache.buffer.fill(0x5A)
        arrays = [to_device(a, backend) for a in (key, value)]
        ops.reshape_and_cache(*arrays, k_cache, v_cache, slots, k_scale=k_scale,
                              v_scale=v_scale)
        for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
            got = cache.to_numpy().view(np.uint8).reshape(-1, 64)
            np.testing.assert_array_equal(
                got[:n], quantize_by_the_formula(x.reshape(n, 64), scale, cache_dtype))
            assert (got[n:] == 0x5A).all(), "a write reached past the step's slots"
        for array in (k_cache, v_cache, *arrays):
            array.buffer.root.close()


def fp8_attention(backend, rng, cache_dtype, act, head_dim, block_size, ratio, seq_lens,
                  num_kv_heads=2, num_partitions=None):
    """(kernel output, float64 reference over the codes, float64 reference over the
    unquantized K/V) for random K/V quantized with per-tensor scales."""
    num_q_heads = num_kv_heads * ratio
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    limit = reference.FP8_LIMITS[np.dtype(cache_dtype)]
    k = rng.standard_normal(shape, np.float32).astype(act)
    v = (rng.standard_normal(shape, np.float32) * 3).astype(act)
    k_scale = float(np.abs(k.astype(np.float32)).max()) / limit
    v_scale = float(np.abs(v.astype(np.float32)).max()) / limit
    k8 = reference.quantize(k, k_scale, cache_dtype)
    v8 = reference.quantize(v, v_scale, cache_dtype)
    tables = random_tables(rng, seq_lens, block_size, num_blocks)
    lens = np.asarray(seq_lens, np.int32)
    q = rng.standard_normal((len(seq_lens), num_q_heads, head_dim), np.float32).astype(act)
    dq, dk, dv = (to_device(x, backend) for x in (q, k8, v8))
    out = DeviceArray.empty(q.shape, act, backend=backend)
    out.buffer.fill(POISON)
    scale = 1.0 / math.sqrt(head_dim)
    ops.paged_attention(out, dq, dk, dv, tables, lens, num_partitions=num_partitions,
                        k_scale=k_scale, v_scale=v_scale)
    got = out.to_numpy().astype(np.float64)
    on_codes = reference.paged_attention(q, k8, v8, tables, lens, scale, np.float64,
                                         k_scale, v_scale)
    exact = reference.paged_attention(q, k, v, tables, lens, scale, np.float64)
    for array in (out, dq, dk, dv):
        array.buffer.root.close()
    return got, on_codes, exact


MATRIX = [(c, a, d, b, r) for c in FP8 for a in ACT for d in ops.HEAD_DIMS
          for b in (8, 16, 128) for r in (1, 4, 8)]


@pytest.mark.parametrize("cache_dtype, act, head_dim, block_size, ratio", MATRIX, ids=_names)
def test_fp8_attention_matches_reference_on_gpu(gpu, rng, cache_dtype, act, head_dim,
                                                block_size, ratio):
    lens = [1, block_size + 1, 1000, 9000, 0]
    got, on_codes, exact = fp8_attention(gpu, rng, cache_dtype, act, head_dim, block_size,
                                         ratio, lens)
    assert relative_error(got, on_codes) < TOLERANCE[np.dtype(act)]
    assert relative_error(got, exact) < QUANTIZED_TOLERANCE


@pytest.mark.parametrize("cache_dtype", FP8, ids=_names)
def test_fp8_attention_on_host_and_its_quantization_error(rng, cache_dtype):
    got, on_codes, exact = fp8_attention("host", rng, cache_dtype, np.float16, 128, 16, 4,
                                         [3, 40, 300])
    assert relative_error(got, on_codes) < TOLERANCE[np.dtype(np.float16)]
    assert 1e-3 < relative_error(got, exact) < QUANTIZED_TOLERANCE  # quantized, not exact


@pytest.mark.parametrize("parts", [3, 64])
def test_fp8_split_k_on_gpu(gpu, rng, parts):
    got, on_codes, _ = fp8_attention(gpu, rng, ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16,
                                     128, 16, 8, [5, 700, 3000], num_partitions=parts)
    assert relative_error(got, on_codes) < TOLERANCE[np.dtype(ml_dtypes.bfloat16)]


# --- the cache -------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_an_fp8_cache_step_matches_the_ops_with_each_layers_scales(backend, rng, cache_dtype):
    scales = ((0.02, 0.05), (0.5, 0.01))
    config = CacheConfig(2, 2, 64, 16, 12, cache_dtype, num_q_heads=8,
                         activation_dtype="bfloat16", kv_scales=scales)
    act = ml_dtypes.bfloat16
    assert config.bytes_per_token == 2 * 2 * 2 * 64  # one byte per element
    with KvCache(config, backend=backend) as cache:
        prompt = cache.add_sequence("a", 37)
        cache.add_sequence("b", 5)
        for layer in range(2):
            kv = to_device(rng.standard_normal((37, 2, 64), np.float32).astype(act), backend)
            cache.write(layer, kv, kv, prompt.slot_mapping)
            kv.buffer.root.close()
        cache.append(["a", "b"])
        meta = cache.batch(["a", "b"])
        q = to_device(rng.standard_normal((2, 8, 64), np.float32).astype(act), backend)
        key = to_device(rng.standard_normal((2, 2, 64), np.float32).astype(act), backend)
        out = DeviceArray.empty((2, 8, 64), act, backend=backend)
        want = DeviceArray.empty((2, 8, 64), act, backend=backend)
        for layer, (k_scale, v_scale) in enumerate(scales):
            cache.write(layer, key, key, meta)
            cache.attention(layer, out, q, meta)
            ops.paged_attention(want, q, cache.k_cache(layer), cache.v_cache(layer),
                                meta.block_tables, meta.seq_lens, k_scale=k_scale,
                                v_scale=v_scale)
            np.testing.assert_array_equal(out.to_numpy(), want.to_numpy())
            written = cache.k_cache(layer).to_numpy()[meta.slot_mapping // 16, :,
                                                      meta.slot_mapping % 16]
            np.testing.assert_array_equal(
                written.view(np.uint8),
                reference.quantize(key.to_numpy(), k_scale, config.dtype).view(np.uint8))
        for array in (q, key, out, want):
            array.buffer.root.close()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"activation_dtype": "float32"}, ValueError, "must be float16 or bfloat16"),
    ({"kv_scales": [(1.0, 1.0)]}, ValueError, r"must be 2 \(k_scale, v_scale\) pairs"),
    ({"kv_scales": [(1.0, 0.0), (1.0, 1.0)]}, ValueError,
     r"kv_scales\[0\] v_scale must lie in \[1.1754944e-38, 7.5955881e\+35\] .*, got 0.0"),
    ({"kv_scales": [(1.0, "x"), (1.0, 1.0)]}, TypeError, r"kv_scales\[0\] v_scale .*'x'"),
    ({"kv_scales": 3}, TypeError, "one \\(k_scale, v_scale\\) pair per layer"),
    ({"kv_scales": [(1.0, 1.0), {4.0, 0.5}]}, TypeError,
     r"kv_scales\[1\] must be a \(k_scale, v_scale\) pair .*got \{"),
    ({"kv_scales": {(1.0, 1.0), (2.0, 2.0)}}, TypeError, "kv_scales must be one .*got \\{"),
    ({"kv_scales": [(1e-40, 1.0), (1.0, 1.0)]}, ValueError, r"kv_scales\[0\] k_scale .*1e-40"),
    ({"kv_scales": [(1.0, 1.0), (1.0, 1e39)]}, ValueError, r"kv_scales\[1\] v_scale .*1e\+39"),
    ({"kv_scales": [(2**1100, 1.0), (1.0, 1.0)]}, ValueError, r"k_scale .* float range"),
    ({"dtype": "float16", "kv_scales": [(1.0, 1.0)] * 2}, ValueError, "fp8 caches only"),
    ({"dtype": "float16", "activation_dtype": "bfloat16"}, ValueError, "only an fp8 cache"),
])
def test_bad_fp8_configs_are_refused(kwargs, error, words):
    base = {"dtype": "float8_e4m3fn"}
    with pytest.raises(error, match=words):
        CacheConfig(2, 2, 64, 16, 8, **{**base, **kwargs})


def test_fp8_ops_refuse_what_they_cannot_serve(backend):
    k8 = DeviceArray.empty((4, 1, 16, 64), ml_dtypes.float8_e4m3fn, backend=backend)
    q32 = DeviceArray.empty((1, 1, 64), np.float32, backend=backend)
    q16 = DeviceArray.empty((1, 1, 64), np.float16, backend=backend)
    k16 = DeviceArray.empty((4, 1, 16, 64), np.float16, backend=backend)
    tables, lens = np.ones((1, 1), np.int32), np.ones(1, np.int32)
    with pytest.raises(ValueError, match="query must be float16 or bfloat16 with a "
                                         "float8_e4m3fn k_cache, got float32"):
        ops.paged_attention(q32, q32, k8, k8, tables, lens)
    with pytest.raises(ValueError, match=r"k_scale 2\.0 applies to fp8 caches only"):
        ops.paged_attention(q16, q16, k16, k16, tables, lens, k_scale=2.0)
    with pytest.raises(ValueError, match=r"v_scale must lie in \[.*\] .*, got -1\.0"):
        ops.paged_attention(q16, q16, k8, k8, tables, lens, v_scale=-1.0)
    with pytest.raises(ValueError, match="v_cache must be float8_e4m3fn, got float16"):
        ops.reshape_and_cache(q16, q16, k8, k16, np.zeros(1, np.int64))
    for array in (k8, q32, q16, k16):
        array.buffer.root.close()
