"""Helpers of the host-tier tests: write K/V values, read a sequence back from whichever tier
holds it, and a host backend whose copies between tiers can be made to fail (a stand-in for a
failing driver, which the host's memcpy never is)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from rocmforge_raw.cache import KvCache
from rocmforge_raw.errors import DeviceError
from rocmforge_raw.memory.array import DeviceArray
from rocmforge_raw.runtime.host import HostBackend


class FlakyHost(HostBackend):
    """The host backend, but ``fail_in = n`` makes the (n+1)-th next 2-D copy raise (the
    copies before it are done, as an asynchronous engine would have queued them)."""

    name = "host"

    def __init__(self) -> None:
        super().__init__()
        self.fail_in: int | None = None

    def memcpy_2d(self, *args: Any, **kwargs: Any) -> None:
        if self.fail_in is not None:
            if self.fail_in == 0:
                self.fail_in = None
                raise DeviceError("cuMemcpy2DAsync", 700, "CUDA_ERROR_ILLEGAL_ADDRESS",
                                  "injected")
            self.fail_in -= 1
        super().memcpy_2d(*args, **kwargs)


def write(cache: KvCache, slots: Any, values: Any) -> None:
    """K = V = ``values[i]`` (every element of the row) at ``slots[i]``, every layer."""
    c = cache.config
    rows = np.repeat(np.asarray(values, np.float32)[:, None, None], c.head_dim, 2)
    rows = np.repeat(rows, c.num_kv_heads, 1).astype(c.dtype)
    array = DeviceArray.from_numpy(rows, cache.slab.device, cache.slab.backend)
    for layer in range(c.num_layers):
        cache.write(layer, array, array, np.asarray(slots, np.int64))
    array.buffer.root.close()


def host_planes(cache: KvCache) -> np.ndarray:
    """The host tier's memory, ``[2 * num_layers, host_blocks, kv heads, block, head_dim]``,
    once the copies queued so far are done."""
    c, host = cache.config, cache._host
    cache._order.wait()
    count = host.memory.nbytes // c.dtype.itemsize
    return host.memory.array(c.dtype, count).reshape(
        2 * c.num_layers, host.num_blocks, c.num_kv_heads, c.block_size, c.head_dim)


def poisoned(cache: KvCache) -> KvCache:
    """``cache`` with its host tier filled with NaN: pinned memory is not cleared, so host
    memory that no copy reached would otherwise read as whatever an earlier test left at the
    same address (often the very values a test writes again)."""
    host_planes(cache)[...] = np.nan
    return cache


def read(cache: KvCache, seq_id: Hashable, layer: int | None = None) -> np.ndarray:
    """The K values of ``seq_id``'s tokens (first element of each row) in ``layer`` (default
    the last), from the slab or, swapped out, from the host tier; V must match them."""
    c = cache.config
    layer = c.num_layers - 1 if layer is None else layer
    positions = np.arange(cache.seq_len(seq_id))
    bs = c.block_size
    if cache.is_swapped(seq_id):
        planes = host_planes(cache)
        blocks = cache._host.sequences[seq_id].blocks
        k, v = planes[2 * layer], planes[2 * layer + 1]
    else:
        blocks = cache.block_ids(seq_id)
        k, v = cache.k_cache(layer).to_numpy(), cache.v_cache(layer).to_numpy()
    keys = k[blocks[positions // bs], 0, positions % bs, 0].astype(np.float32)
    values = v[blocks[positions // bs], 0, positions % bs, 0].astype(np.float32)
    np.testing.assert_array_equal(keys, values)
    return keys


def snapshot(cache: KvCache) -> dict:
    """What a failed operation must leave as it was; cached prefixes may only be forgotten."""
    host = cache._host
    return {
        "ids": cache.seq_ids(), "lens": [cache.seq_len(s) for s in cache.seq_ids()],
        "tables": {s: tuple(cache.block_ids(s)) for s in cache.seq_ids()
                   if not cache.is_swapped(s)},
        "swapped": {s: tuple(r.blocks) for s, r in host.sequences.items()},
        "ref": cache.pool.ref_cnt.tolist(), "host_ref": host.ref_cnt.tolist(),
        "free": cache.stats()["free_blocks"], "host_room": host.room,
        "index": set(cache.pool.index.items()), "host_index": set(host.index.items()),
    }


def assert_as_before(cache: KvCache, before: dict, values: dict) -> None:
    after = snapshot(cache)
    for key in ("index", "host_index"):
        assert after.pop(key) <= before.pop(key), f"{key} gained entries"
    assert after == before
    for seq_id, want in values.items():
        np.testing.assert_array_equal(read(cache, seq_id), want)
    cache.check_invariants()
