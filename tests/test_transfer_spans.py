"""An import's per-block work in C (``cache/transfer/_spans``) against the NumPy it replaces:
the same span tables, and block ids taken only where the Python checks would take them."""

from __future__ import annotations

import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig
from rocmforge_raw.cache.transfer import _spans
from rocmforge_raw.cache.transfer.sequences import block_spans

CONFIG = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=64, block_size=8, num_blocks=40,
                     dtype="float16")


def numpy_spans(src, dst, src_blocks, config):
    """block_spans as it was before the C pass: sort by destination, cut runs, per plane."""
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    chunk = config.block_bytes // (2 * config.num_layers)
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], cut])
    lengths = np.diff(np.append(starts, src.size))
    planes = np.arange(2 * config.num_layers, dtype=np.int64)[:, None]
    src_offsets = (planes * src_blocks + src[starts]) * chunk
    dst_offsets = (planes * config.num_blocks + dst[starts]) * chunk
    sizes = np.broadcast_to(lengths * chunk, src_offsets.shape)
    return np.stack([src_offsets.ravel(), dst_offsets.ravel(), sizes.ravel()], 1)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_the_c_table_equals_numpys_for_any_blocks(rng, dtype):
    for trial in range(300):
        n = int(rng.integers(1, 30))
        dst = rng.choice(np.arange(1, 40), n, replace=False)
        if trial % 3:  # mostly ascending, as an allocation hands them out
            dst = np.sort(dst)
        if trial % 5 == 0:  # runs
            dst = np.arange(1, n + 1)
        src = rng.integers(1, 50, n) if trial % 2 else np.arange(7, 7 + n)
        if trial % 7 == 0:
            src[n // 2 :] += 3  # two runs
        got = block_spans(src, dst.astype(dtype), 50, CONFIG)
        assert got.dtype == np.int64 and got.flags.c_contiguous
        assert np.array_equal(got, numpy_spans(src, dst, 50, CONFIG)), (src, dst)
    ascending = _spans.spans(np.arange(3, dtype=np.int64), np.array([1, 2, 3], dtype), 9, 9,
                             8, 2)
    assert ascending is not None and ascending.shape == (2, 3)
    assert _spans.spans(np.arange(3, dtype=np.int64), np.array([2, 1, 3], dtype), 9, 9, 8,
                        2) is None  # not ascending: the NumPy path sorts


def test_block_ids_are_taken_only_where_every_one_is_a_plain_int_in_range():
    assert _spans.block_ids((1, 2, 9), 10).tolist() == [1, 2, 9]
    for refused in [(0, 1), (1, 10), (1, True), (1, 2.0), (1, np.int64(2)), [1, 2], (),
                    (1, 2**70), (1, -(2**70)), (1, None), (1, "2")]:
        assert _spans.block_ids(refused, 10) is None, refused

    class Int(int):
        pass

    assert _spans.block_ids((1, Int(2)), 10) is None  # a subclass: the Python checks decide
