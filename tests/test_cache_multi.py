"""Steps of many query tokens per sequence through the KV cache: ``extend`` (many tokens at
once), ``cached_tokens``, ``batch(query_lens=...)`` with its write and attention, mixed
with decodes, against the reference over what the slab holds."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_ops import POISON, TOLERANCE, relative_error

from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.kernels import reference
from rocmforge_raw.memory.array import DeviceArray


def slab_planes(cache, layer):
    """Layer ``layer``'s K and V caches as host arrays (a copy)."""
    return cache.k_cache(layer).to_numpy(), cache.v_cache(layer).to_numpy()


def run_step(cache, rng, ids, q_lens, layers=(0, 1)):
    """Plan ids with q_lens, write random K/V for every query token, run attention with
    random queries on every layer; returns (meta, per-layer (query, out) host arrays)."""
    c = cache.config
    meta = cache.batch(ids, query_lens=q_lens)
    rows = int(np.sum(q_lens))
    results = []
    for layer in layers:
        kv = [rng.standard_normal((rows, c.num_kv_heads, c.head_dim), np.float32).astype(c.dtype)
              for _ in range(2)]
        key, value = (DeviceArray.from_numpy(a, backend=cache.slab.backend) for a in kv)
        q = rng.standard_normal((rows, c.num_q_heads, c.head_dim), np.float32).astype(c.dtype)
        query = DeviceArray.from_numpy(q, backend=cache.slab.backend)
        out = DeviceArray.empty(q.shape, c.dtype, backend=cache.slab.backend)
        out.buffer.fill(POISON)
        cache.write(layer, key, value, meta)
        cache.attention(layer, out, query, meta)
        results.append((q, out.to_numpy()))
        for array in (key, value, query, out):
            array.buffer.close()
    return meta, results


def check_step(cache, meta, results, layers=(0, 1)):
    c = cache.config
    for layer, (q, got) in zip(layers, results):
        k, v = slab_planes(cache, layer)
        want = reference.paged_attention_multi(
            q, k, v, meta.block_tables, meta.seq_lens,
            meta.query_lens if meta.query_lens is not None else np.ones(len(meta.seq_ids),
                                                                         np.int32),
            1.0 / math.sqrt(c.head_dim), np.float64)
        assert relative_error(got.astype(np.float64), want) < TOLERANCE[np.dtype(c.dtype)]


@pytest.fixture(params=[np.float16, ml_dtypes.bfloat16, np.float32],
                ids=lambda d: np.dtype(d).name)
def dtype(request):
    return np.dtype(request.param)


def test_a_mixed_step_matches_the_reference(backend, rng, dtype):
    """Decodes first, then a prefill chunk, a chunk grown by extend, a prefix hit's tail."""
    config = CacheConfig(2, 2, 64, 16, 200, dtype, num_q_heads=8)
    with KvCache(config, backend=backend) as cache:
        prompt = rng.integers(0, 1000, 90)
        for i, n in enumerate([30, 7, 50]):  # decoding sequences
            cache.add_sequence(f"d{i}", n)
        cache.append(["d0", "d1", "d2"])
        first = cache.add_sequence("chunked", tokens=prompt[:40])
        assert first.num_cached_tokens == 0
        meta, results = run_step(cache, rng, ["d0", "d1", "d2", "chunked"], [1, 1, 1, 40])
        check_step(cache, meta, results)
        grown = cache.extend(["chunked"], [50], tokens=prompt[40:])  # the next chunk
        assert grown.slot_mapping.size == 50
        hit = cache.add_sequence("hit", tokens=prompt[:70])  # 4 full blocks found
        assert hit.num_cached_tokens == 64
        cache.append(["d0", "d1", "d2"])
        meta, results = run_step(cache, rng, ["d0", "d1", "d2", "chunked", "hit"],
                                 [1, 1, 1, 50, 6])
        assert (meta.slot_mapping[-6:] >= 0).all() and meta.slot_mapping.size == 59
        check_step(cache, meta, results)
        cache.check_invariants()


def test_a_prompt_and_a_hit_on_its_fresh_blocks_in_one_step_write_them_once(backend, rng):
    """A prompt's fresh blocks that a second prompt hits before any step wrote them (two
    requests sharing a system prompt, admitted together): the step's first sequence whose
    rows reach a shared block writes it (the other's slots there are -1), and the K/V in
    the slab are the ones given for it, which both sequences then attend over."""
    config = CacheConfig(1, 1, 64, 8, 40, np.float32, num_q_heads=2)
    with KvCache(config, backend=backend) as cache:
        prompt = np.arange(24)
        cache.add_sequence("a", tokens=prompt)
        cache.add_sequence("b", tokens=np.concatenate([prompt, 100 + np.arange(8)]))
        assert cache.stats()["prefix_hits"] == 3
        meta = cache.batch(["a", "b"], query_lens=[24, 8])
        assert (meta.slot_mapping >= 0).all()  # a writes the shared blocks, b its own
        kv = rng.standard_normal((32, 1, 64), np.float32)
        key = DeviceArray.from_numpy(kv, backend=backend)
        cache.write(0, key, key, meta)
        k, _ = slab_planes(cache, 0)
        rows = k.reshape(-1, 64)[meta.slot_mapping]
        np.testing.assert_array_equal(rows, kv[:, 0])
        key.buffer.close()
        # both in one step over the same shared blocks: their first sequence writes them
        cache.add_sequence("c", tokens=prompt)
        meta = cache.batch(["b", "c"], query_lens=[32, 24])
        slots = meta.slot_mapping
        assert (slots[:32] >= 0).all() and (slots[32:] == -1).all()
        # a full hit recomputing its last token, listed first (decodes first): it writes
        # that position, the prompt the rest of the block
        cache.add_sequence("d", tokens=prompt)
        cache.add_sequence("e", tokens=prompt)
        meta = cache.batch(["e", "d"], query_lens=[1, 24])
        slots = meta.slot_mapping
        assert slots[0] >= 0 and (slots[1:24] >= 0).all() and slots[24] == -1
        assert slots[0] == slots[23] + 1  # e's position 23 beside d's 22: one block
        cache.check_invariants()


def test_one_row_each_is_the_decode_plan(backend, rng):
    config = CacheConfig(1, 2, 64, 16, 40, np.float16, num_q_heads=4)
    with KvCache(config, backend=backend) as cache:
        for i in range(3):
            cache.add_sequence(i, 5 + i)
        meta = cache.batch([0, 1, 2], query_lens=np.ones(3, np.int32))
        assert meta.query_lens is None and meta.slot_mapping.shape == (3,)


# --- extend --------------------------------------------------------------------------------
def test_extend_reserves_every_new_token_and_names_filled_blocks(backend):
    config = CacheConfig(1, 1, 64, 8, 64, np.float16)
    with KvCache(config, backend=backend) as cache:
        ids = np.arange(100)
        cache.add_sequence("a", tokens=ids[:5])
        grown = cache.extend(["a"], [30], tokens=ids[5:35])
        assert grown.slot_mapping.size == 30 and len(set(grown.slot_mapping.tolist())) == 30
        assert cache.stats()["tokens"] == 35
        assert cache.cached_tokens(ids[:40]) == 32  # four full blocks named
        cache.check_invariants()


def test_extend_copies_a_shared_last_block_first(backend):
    config = CacheConfig(1, 1, 64, 8, 64, np.float16)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 5)
        cache.fork("a", "b")
        cache.extend(["a"], [9])
        assert cache.stats()["cow_copies"] == 1
        cache.check_invariants()


def test_extend_preempts_others_never_its_own(backend):
    config = CacheConfig(1, 1, 64, 8, 9, np.float16)  # 8 usable blocks
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("old", 24)  # 3 blocks
        cache.add_sequence("a", 8)
        grown = cache.extend(["a"], [30])  # needs 4 more: only 4 free, then "old" goes
        assert grown.preempted == [] and cache.stats()["free_blocks"] == 0
        grown = cache.extend(["a"], [20])  # 3 more: "old" preempted
        assert grown.preempted == ["old"]
        before = cache.stats()
        with pytest.raises(CacheFullError):
            cache.extend(["a"], [100])
        assert cache.stats() == before
        cache.check_invariants()


@pytest.mark.parametrize("counts, error, words", [
    ([0], ValueError, "counts[0] = 0"),
    ([1.5], ValueError, "counts must be 1 integers"),
    ([1, 2], ValueError, "counts must be 1 integers"),
])
def test_extend_refuses_bad_counts_changing_nothing(backend, counts, error, words):
    config = CacheConfig(1, 1, 64, 8, 16, np.float16)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 5)
        before = cache.stats()
        with pytest.raises(error) as info:
            cache.extend(["a"], counts)
        assert words in str(info.value) and cache.stats() == before


def test_batch_refuses_bad_query_lens_keeping_the_plan(backend):
    config = CacheConfig(1, 1, 64, 8, 16, np.float16, num_q_heads=2)
    with KvCache(config, backend=backend) as cache:
        cache.add_sequence("a", 5)
        meta = cache.batch(["a"])
        for bad, words in (([6], "query_lens[0] = 6 is not in [1, 5]"),
                           ([0], "query_lens[0] = 0"), ([1, 1], "1 integers"),
                           ([1.0], "1 integers")):
            with pytest.raises(ValueError, match=words.replace("[", r"\[")):
                cache.batch(["a"], query_lens=np.asarray(bad))
        out = DeviceArray.empty((1, 2, 64), np.float16, backend=backend)
        query = DeviceArray.zeros((1, 2, 64), np.float16, backend=backend) if hasattr(
            DeviceArray, "zeros") else DeviceArray.from_numpy(np.zeros((1, 2, 64), np.float16),
                                                              backend=backend)
        cache.attention(0, out, query, meta)  # still current
        for array in (out, query):
            array.buffer.close()
