"""The attention variants through the KV cache: per-layer sliding windows and the logit cap
of ``CacheConfig``, sinks per ``attention`` call, on decode steps (each window's split
planned with the step) and on steps of many query tokens where no window bites; against
the reference over what the slab holds. Bad configs and sinks are refused by name, before
anything changes."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_ops import POISON, TOLERANCE, relative_error

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.kernels import reference
from rocmforge_raw.memory.array import DeviceArray

CAP = 2.5


def step(cache, rng, ids, layers, sinks=None, q_lens=None, scale=None):
    """Plan ``ids``, write random K/V for the step's rows and attend on ``layers`` (with
    ``sinks[layer]`` where given); returns the plan and each layer's (query, out, sinks)."""
    c, backend = cache.config, cache.slab.backend
    meta = cache.batch(ids, query_lens=q_lens)
    rows = len(ids) if q_lens is None else int(np.sum(q_lens))
    results = []
    for layer in layers:
        kv = [rng.standard_normal((rows, c.num_kv_heads, c.head_dim), np.float32).astype(c.dtype)
              for _ in range(2)]
        key, value = (DeviceArray.from_numpy(a, backend=backend) for a in kv)
        q = rng.standard_normal((rows, c.num_q_heads, c.head_dim), np.float32).astype(c.dtype)
        query = DeviceArray.from_numpy(q, backend=backend)
        out = DeviceArray.empty(q.shape, c.dtype, backend=backend)
        out.buffer.fill(POISON)
        given = None if sinks is None else sinks.get(layer)
        cache.write(layer, key, value, meta)
        cache.attention(layer, out, query, meta, scale, sinks=given)
        results.append((q, out.to_numpy(), None if given is None else given.to_numpy()))
        for array in (key, value, query, out):
            array.buffer.close()
    return meta, results


def close_all(sinks):
    for array in sinks.values():
        array.buffer.close()


def check(cache, meta, layers, results, scale=None):
    """Each layer's output is the reference's with the layer's window, the cap and sinks."""
    c = cache.config
    scale = 1.0 / math.sqrt(c.head_dim) if scale is None else scale
    q_lens = meta.query_lens
    for layer, (q, got, sinks) in zip(layers, results):
        k, v = cache.k_cache(layer).to_numpy(), cache.v_cache(layer).to_numpy()
        if q_lens is None:
            want = reference.paged_attention(
                q, k, v, meta.block_tables, meta.seq_lens, scale, np.float64,
                logit_softcap=c.logit_softcap, sinks=sinks, window=c.windows[layer])
        else:
            want = reference.paged_attention_multi(
                q, k, v, meta.block_tables, meta.seq_lens, q_lens, scale, np.float64,
                logit_softcap=c.logit_softcap, sinks=sinks, window=c.windows[layer])
        error = relative_error(got.astype(np.float64), want)
        assert error < TOLERANCE[np.dtype(c.dtype)], (layer, error)


def random_sinks(rng, heads, backend):
    return DeviceArray.from_numpy(rng.uniform(-1, 3, heads).astype(np.float32),
                                  backend=backend)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
def test_decode_steps_attend_within_each_layers_window(backend, dtype):
    """Layers alternate windows of 20 and 40 with global ones, a cap on every layer, sinks
    on two; sequences shorter and longer than each window, grown step by step."""
    rng = np.random.default_rng(1)
    windows = [20, None, 40, None]
    config = CacheConfig(4, 2, 64, 8, 80, dtype, num_q_heads=8, windows=windows,
                         logit_softcap=CAP)
    with KvCache(config, backend=backend) as cache:
        lens = {"short": 9, "middle": 33, "long": 70}
        for seq_id, n in lens.items():
            cache.add_sequence(seq_id, n)
            step(cache, rng, [seq_id], range(4), q_lens=None)  # (fills its last token only)
        sinks = {1: random_sinks(rng, 8, backend), 2: random_sinks(rng, 8, backend)}
        ids = list(lens)
        for _ in range(3):
            cache.append(ids)
            meta, results = step(cache, rng, ids, range(4), sinks)
            check(cache, meta, range(4), results)
        # a scale of the caller's reaches the windowed launches too
        cache.append(ids)
        meta, results = step(cache, rng, ids, range(4), sinks, scale=0.07)
        check(cache, meta, range(4), results, scale=0.07)
        cache.check_invariants()
        close_all(sinks)


def test_a_window_none_of_the_step_outgrows_runs_the_whole_sequences(backend):
    rng = np.random.default_rng(2)
    config = CacheConfig(2, 2, 64, 16, 16, np.float32, num_q_heads=4, windows=64)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 30)
        cache.add_sequence("b", 64)
        meta, results = step(cache, rng, ["a", "b"], range(2))
        check(cache, meta, range(2), results)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
def test_steps_of_many_query_tokens_attend_within_each_layers_window(backend, dtype):
    """Decodes (short, and past a window) mixed with a chunk and drafted tokens, in a cache
    of a narrow window, a wide one and a global layer: the decodes' splits and the
    multi-token launches of each window that bites, and of none."""
    rng = np.random.default_rng(3)
    config = CacheConfig(3, 2, 64, 8, 60, dtype, num_q_heads=4, windows=[20, 48, None],
                         logit_softcap=CAP)
    with KvCache(config, backend=backend) as cache:
        for seq_id, n in (("short", 12), ("long", 90), ("chunk", 40), ("draft", 70)):
            cache.add_sequence(seq_id, n)
        sinks = {0: random_sinks(rng, 4, backend), 2: random_sinks(rng, 4, backend)}
        ids = ["short", "long", "chunk", "draft"]
        meta, results = step(cache, rng, ids, range(3), sinks, q_lens=[1, 1, 24, 4])
        check(cache, meta, range(3), results)
        # no window bites: the plain launches serve every layer
        meta, results = step(cache, rng, ["short", "chunk"], range(3), sinks, q_lens=[1, 8])
        check(cache, meta, range(3), results)
        close_all(sinks)


def test_bad_sinks_are_refused_before_anything_runs(backend):
    config = CacheConfig(1, 2, 64, 16, 8, np.float32, num_q_heads=4, windows=8)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 20)
        meta = cache.batch(["a"])
        query = DeviceArray.from_numpy(np.ones((1, 4, 64), np.float32), backend=backend)
        out = DeviceArray.empty((1, 4, 64), np.float32, backend=backend)
        out.buffer.fill(POISON)
        wrong_shape = DeviceArray.from_numpy(np.zeros(2, np.float32), backend=backend)
        wrong_dtype = DeviceArray.from_numpy(np.zeros(4, np.float16), backend=backend)
        with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
            cache.attention(0, out, query, meta, sinks=wrong_shape)
        with pytest.raises((TypeError, ValueError), match="sinks"):
            cache.attention(0, out, query, meta, sinks=wrong_dtype)
        with pytest.raises(TypeError, match="sinks"):
            cache.attention(0, out, query, meta, sinks=np.zeros(4, np.float32))
        overlapping = DeviceArray(out.buffer, np.float32, (4,), 0)
        with pytest.raises(ValueError, match="sinks"):
            cache.attention(0, out, query, meta, sinks=overlapping)
        assert np.isnan(out.to_numpy()).all()  # nothing ran
        cache.attention(0, out, query, meta)  # the plan is still good
        assert not np.isnan(out.to_numpy()).any()
        for array in (query, out, wrong_shape, wrong_dtype):
            array.buffer.close()


@pytest.mark.parametrize("given, error, match", [
    (dict(windows=0), ValueError, "windows must be >= 1"),
    (dict(windows=[8, 0]), ValueError, r"windows\[1\] must be >= 1"),
    (dict(windows=[8]), ValueError, "windows must have 2 entries"),
    (dict(windows={8, 9}), TypeError, "windows"),
    (dict(windows=[8, 2.5]), TypeError, r"windows\[1\]"),
    (dict(windows=True), TypeError, "windows"),
    (dict(windows="8"), TypeError, "windows"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=float("nan")), ValueError, "logit_softcap"),
    (dict(logit_softcap="5"), TypeError, "logit_softcap"),
])
def test_bad_variants_in_a_config_are_refused_by_name(given, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(2, 2, 64, 16, 8, np.float32, **given)


def test_a_config_says_its_windows():
    config = CacheConfig(3, 2, 64, 16, 8, np.float32, windows=[8, None, 4096])
    assert config.windows == (8, None, 4096) and config.widest_window is None
    assert CacheConfig(3, 2, 64, 16, 8, np.float32, windows=[8, 16, 4]).widest_window == 16
    assert CacheConfig(3, 2, 64, 16, 8, np.float32, windows=np.int64(32)).windows == (32,) * 3
    assert CacheConfig(3, 2, 64, 16, 8, np.float32, windows=np.array(8)).windows == (8,) * 3
    assert CacheConfig(3, 2, 64, 16, 8, np.float32, windows=np.array([8, 4, 2])).windows == (
        8, 4, 2)
    assert CacheConfig(3, 2, 64, 16, 8, np.float32).windows == (None,) * 3


@pytest.mark.parametrize("given", [dict(windows=[8, None]), dict(logit_softcap=CAP)])
def test_a_step_graph_of_a_cache_with_variants_is_refused(backend, given):
    config = CacheConfig(2, 2, 64, 16, 8, np.float32, num_q_heads=4, **given)
    with KvCache(config, backend=backend) as cache, pytest.raises(NotImplementedError,
                                                                   match="step graph"):
        cache.step_graph()


def test_a_capped_step_of_many_tokens_the_kernel_cannot_cap_is_refused(backend):
    """gfx11's 16-bit head_dim 256 multi-token instance has no room for the cap: a cache
    there refuses capped steps of many query tokens by name before anything changes (no
    such GPU here: the planner's flag stands for it), and keeps taking decode steps."""
    config = CacheConfig(1, 2, 256, 16, 16, ml_dtypes.bfloat16, num_q_heads=4,
                         logit_softcap=CAP)
    with KvCache(config, backend=backend) as cache:
        assert cache._steps.multi_capless is False  # (no wave32 GPU here)
        cache._steps.multi_capless = True
        cache.add_sequence("a", 40)
        before = cache.stats()
        with pytest.raises(NotImplementedError, match="head_dim 256 on a wave32 GPU"):
            cache.batch(["a"], query_lens=[8])
        assert cache.stats() == before
        cache.batch(["a"])
