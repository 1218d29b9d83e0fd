"""The host tier's copies, invariant checks and counters, pinned down by the survivors of
mutation testing (issue 44): the direction and stream each 2-D copy is given, copies one plane
at a time where a pitch exceeds the driver's limit, the one-launch path (``by_kernel``) and
when it is taken, the messages of ``check_invariants``, and the tier statistics.

A GPU is not needed: ``Recorder`` is the host backend with a driver's pitch limit and a log of
its 2-D copies; the launch path runs through ``launcher``, which checks the piece table as
``ops.copy_pieces`` does and moves its bytes on the host."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from tier_helpers import poisoned, read, write

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.cache.tiers import host_tier
from rocmforge_raw.errors import DeviceError
from rocmforge_raw.kernels import ops
from rocmforge_raw.runtime.base import MAX_PITCH
from rocmforge_raw.runtime.host import HostBackend

BS = 8


class Recorder(HostBackend):
    """The host backend, refusing a 2-D copy of several rows whose pitch exceeds
    ``max_pitch`` (as a driver does past ``MAX_PITCH``); ``copies`` logs (width, rows,
    to_host, stream handle) of each."""

    name = "host"

    def __init__(self, max_pitch: int = MAX_PITCH) -> None:
        super().__init__()
        self.max_pitch = max_pitch
        self.copies: list[tuple[int, int, Any, Any]] = []

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, to_host: bool, stream: Any = None) -> None:
        if height > 1 and max(dst_pitch, src_pitch) > self.max_pitch:
            raise DeviceError("cuMemcpy2DAsync", 1, "CUDA_ERROR_INVALID_VALUE", "pitch")
        self.copies.append((width, height, to_host, stream))
        super().memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, to_host, stream)


def config(num_blocks: int = 12, host_blocks: int = 16, layers: int = 2, heads: int = 1,
           head_dim: int = 64, block_size: int = BS) -> CacheConfig:
    return CacheConfig(layers, heads, head_dim, block_size, num_blocks, "float32",
                       host_blocks=host_blocks)


def added(cache: KvCache, seq_id: str, n: int, start: float) -> np.ndarray:
    values = start + np.arange(n, dtype=np.float32)
    write(cache, cache.add_sequence(seq_id, n).slot_mapping, values)
    return values


def launcher(cache: KvCache, stream: Any, launches: list[int]) -> Any:
    """A stand-in for ``ops.copy_pieces`` on ``cache``'s device: checks the table's form,
    then moves each piece (the host backend's addresses are the host's)."""

    def copy_pieces(backend: Any, device: int, pieces: Any, on: Any) -> None:
        assert backend is cache.slab.backend and device == cache.slab.device
        assert on is stream
        assert isinstance(pieces, np.ndarray) and pieces.dtype == np.int64
        assert pieces.ndim == 2 and pieces.shape[1] == 3 and not (pieces & 15).any()
        assert pieces[:, 2].min() > 0 and pieces[:, 2].max() <= ops.PIECE_BYTES
        for src, dst, nbytes in pieces.tolist():
            ctypes.memmove(dst, src, nbytes)
        launches.append(len(pieces))

    return copy_pieces


# --- 2-D copies ----------------------------------------------------------------------------
def test_swap_copies_name_their_direction_and_the_operations_stream():
    backend = Recorder()
    with KvCache(config(), backend=backend) as cache, rf.Stream(backend=backend) as stream:
        a = added(cache, "a", 20, 1.0)
        backend.copies.clear()
        assert cache.swap_out(["a"], stream=stream) == 3
        chunk = cache.config.block_bytes // 4
        assert backend.copies == [(3 * chunk, 4, True, stream.handle)]
        backend.copies.clear()
        cache.swap_in(["a"], stream=stream)
        assert backend.copies == [(3 * chunk, 4, False, stream.handle)]
        np.testing.assert_array_equal(read(cache, "a"), a)


@pytest.mark.parametrize("limit, copies", [(32767, 4), (32768, 1)])
def test_a_pitch_past_the_drivers_limit_copies_one_plane_at_a_time(monkeypatch, limit, copies):
    # the host tier's pitch is 16 blocks of 2048 bytes (one block of one plane): 32768
    monkeypatch.setattr(host_tier, "MAX_PITCH", limit)
    backend = Recorder(limit)
    with poisoned(KvCache(config(), backend=backend)) as cache:
        a, b = added(cache, "a", 20, 1.0), added(cache, "b", 9, 50.0)
        backend.copies.clear()
        cache.swap_out(["a"])
        assert len(backend.copies) == copies
        assert all(rows * copies == 4 for _, rows, _, _ in backend.copies)
        np.testing.assert_array_equal(read(cache, "a"), a)
        added(cache, "c", 60, 500.0)  # overwrites the blocks "a" left
        cache.finish("c")
        cache.swap_in(["a"])
        np.testing.assert_array_equal(read(cache, "a"), a)
        np.testing.assert_array_equal(read(cache, "b"), b)
        cache.check_invariants()


# --- one launch ----------------------------------------------------------------------------
class Device(Recorder):
    """A backend of a device (any name but the host's): the tier moves by launches."""

    name = "device"


def launching_cache(monkeypatch, cfg: CacheConfig, stream_too: bool = True):
    """A cache whose host tier moves by launches (as on a device backend: ``Device``), on
    the host backend, whose K/V writes need no kernels."""
    backend = Recorder()
    cache = poisoned(KvCache(cfg, backend=backend))
    stream = rf.Stream(backend=backend) if stream_too else None
    launches: list[int] = []
    monkeypatch.setattr(cache._host, "by_kernel", True)
    monkeypatch.setattr(ops, "copy_pieces", launcher(cache, stream, launches))
    return cache, backend, stream, launches


def swap_both_ways(cache: KvCache, ids: list[str], stream: Any, values: dict) -> None:
    cache.swap_out(ids, stream=stream)
    for seq_id, want in values.items():
        np.testing.assert_array_equal(read(cache, seq_id), want)
    added(cache, "over", cache.stats()["free_blocks"] * cache.config.block_size, -9.0)
    cache.remove("over")
    cache.swap_in(ids, stream=stream)
    for seq_id, want in values.items():
        np.testing.assert_array_equal(read(cache, seq_id), want)
    cache.check_invariants()


def test_the_host_tier_moves_by_launches_on_a_device_backend_only():
    with KvCache(config(), backend=Recorder()) as cache:
        assert not cache._host.by_kernel
    with KvCache(config(), backend=Device()) as cache:  # every address 16-byte aligned
        assert cache._host.by_kernel is True


def test_runs_apart_move_by_one_launch_each_way(monkeypatch):
    cache, backend, stream, launches = launching_cache(monkeypatch, config())
    with cache, stream:
        a, _, c = (added(cache, s, BS, 10.0 * i) for i, s in enumerate("abc", 1))
        backend.copies.clear()
        swap_both_ways(cache, ["a", "c"], stream, {"a": a, "c": c})
        assert launches == [2 * 4, 2 * 4]  # two runs, four planes, a piece each
        assert not backend.copies


def test_a_single_run_moves_by_2d_copies_not_a_launch(monkeypatch):
    cache, backend, stream, launches = launching_cache(monkeypatch, config())
    with cache, stream:
        a = added(cache, "a", 3 * BS, 1.0)
        backend.copies.clear()
        swap_both_ways(cache, ["a"], stream, {"a": a})
        assert not launches and len(backend.copies) == 2


def test_a_pitch_past_the_limit_counts_a_copy_per_plane_when_choosing_a_launch(monkeypatch):
    monkeypatch.setattr(host_tier, "MAX_PITCH", 1024)
    cache, backend, stream, launches = launching_cache(monkeypatch, config())
    with cache, stream:
        a = added(cache, "a", 3 * BS, 1.0)
        backend.copies.clear()
        swap_both_ways(cache, ["a"], stream, {"a": a})
        assert launches == [4, 4] and not backend.copies


def test_a_launch_cuts_a_run_of_small_blocks_longer_than_a_piece(monkeypatch):
    cache, backend, stream, launches = launching_cache(monkeypatch, config(40, 40))
    with cache, stream:  # 33 blocks of 2048 bytes a plane: 67584 bytes, past a piece
        a, _, c = added(cache, "a", 33 * BS, 1.0), added(cache, "b", BS, 0.0), added(
            cache, "c", BS, 5000.0)
        backend.copies.clear()
        swap_both_ways(cache, ["a", "c"], stream, {"a": a, "c": c})
        assert launches == [3 * 4] * 2 and not backend.copies  # 2 + 1 pieces a plane


def big_blocks() -> CacheConfig:
    """One layer, blocks of 1 MiB: 512 KiB a plane, cut into 64 KiB pieces."""
    return config(num_blocks=12, host_blocks=12, layers=1, heads=8, head_dim=256,
                  block_size=64)


def test_runs_averaging_the_threshold_move_by_2d_copies(monkeypatch):
    cache, backend, stream, launches = launching_cache(monkeypatch, big_blocks())
    with cache, stream:
        bs = cache.config.block_size
        a, _, c = added(cache, "a", 4 * bs, 1.0), added(cache, "b", bs, 0.0), added(
            cache, "c", 4 * bs, 5000.0)
        backend.copies.clear()  # 8 blocks of 1 MiB in two runs: 4 MiB a copy, not below
        swap_both_ways(cache, ["a", "c"], stream, {"a": a, "c": c})
        assert not launches and len(backend.copies) == 4


def test_a_launch_cuts_runs_longer_than_a_piece(monkeypatch):
    cache, backend, stream, launches = launching_cache(monkeypatch, big_blocks())
    with cache, stream:
        bs = cache.config.block_size
        a, _, c = (added(cache, s, bs, 1000.0 * i) for i, s in enumerate("abc", 1))
        backend.copies.clear()
        swap_both_ways(cache, ["a", "c"], stream, {"a": a, "c": c})
        assert launches == [2 * 2 * 8] * 2 and not backend.copies  # runs, planes, pieces


# --- check_invariants names what broke --------------------------------------------------------
def corrupt_held_and_free(host: Any) -> None:
    host.sequences["x"] = host_tier.Swapped(np.array([5]), 1, 0.0, 0.0, False, None)
    host.ref_cnt[5] = 1
    host._free.remove(4)  # block 5 stays free too: counted twice, one block fewer


CORRUPTIONS = {
    "host ref counts differ from holders": lambda h: h.ref_cnt.__setitem__(3, 1),
    "a host block is free twice": lambda h: (h._free.remove(4), h._free.append(5)),
    "a host block is free and cached": lambda h: h._cached.__setitem__(h._free[0], None),
    "host free + cached + held != total": lambda h: h._free.pop(),
    "a free host block is held": corrupt_held_and_free,
    "a free host block keeps a hash": lambda h: (h.hashes.__setitem__(h._free[0], b"f"),
                                                 h.index.__setitem__(b"f", h._free[0])),
    "a cached host block has no hash": lambda h: (h._free.remove(6),
                                                  h._cached.__setitem__(6, None)),
    "host index differs": lambda h: h.index.__setitem__(h.hashes[0], 1),
}


@pytest.mark.parametrize("message", sorted(CORRUPTIONS))
def test_check_invariants_names_the_broken_invariant_of_the_host_tier(message):
    with KvCache(config(), backend="host") as cache:
        reservation = cache.add_sequence("p", tokens=np.arange(2 * BS + 1))
        write(cache, reservation.slot_mapping, np.zeros(2 * BS + 1))
        cache.swap_out(["p"])
        cache.finish("p")  # host blocks 0 and 1 cached, by hash
        assert cache._host.cached_ids() == [0, 1]
        cache.check_invariants()
        CORRUPTIONS[message](cache._host)
        with pytest.raises(AssertionError, match=f"^{message}$".replace("+", r"\+")):
            cache.check_invariants()


# --- statistics --------------------------------------------------------------------------------
TIER_KEYS = ("host_blocks", "host_used_blocks", "host_cached_blocks", "host_free_blocks",
             "swapped_sequences", "swapped_out_blocks", "swapped_in_blocks", "demoted_blocks",
             "promoted_blocks", "host_hits", "copied_out_bytes", "copied_in_bytes",
             "swapped_out_bytes", "swapped_in_bytes", "host_hit_rate")


def test_a_cache_without_a_host_tier_reports_every_tier_statistic_as_zero():
    with KvCache(CacheConfig(1, 1, 64, BS, 8, "float32"), backend="host") as cache:
        cache.add_sequence("a", 2 * BS)
        stats = cache.stats()
        assert {k: stats[k] for k in TIER_KEYS} == dict.fromkeys(TIER_KEYS, 0)
        assert isinstance(stats["host_hit_rate"], float)


def test_a_fresh_host_tier_has_a_hit_rate_of_zero():
    with KvCache(config(), backend="host") as cache:
        stats = cache.stats()
        assert stats["host_hit_rate"] == 0.0 and stats["host_free_blocks"] == 16


def test_the_bytes_copied_each_way_add_swaps_to_demotions_and_promotions():
    tokens = np.arange(1000, 1000 + 3 * BS + 2)
    with KvCache(config(num_blocks=6), backend="host") as cache:
        block = cache.config.block_bytes
        reservation = cache.add_sequence("a", tokens=tokens)
        write(cache, reservation.slot_mapping, tokens)
        cache.finish("a")
        added(cache, "filler", 5 * BS, 7.0)  # demotes the 3 prefix blocks
        cache.swap_out(["filler"])  # 5 blocks out
        cache.swap_in(["filler"])  # and back
        cache.finish("filler")
        reservation = cache.add_sequence("b", tokens=tokens)  # promotes the 3 again
        stats = cache.stats()
        assert (stats["demoted_blocks"], stats["swapped_out_blocks"]) == (3, 5)
        assert (stats["promoted_blocks"], stats["swapped_in_blocks"]) == (3, 5)
        assert stats["copied_out_bytes"] == 8 * block and stats["copied_in_bytes"] == 8 * block
        assert stats["swapped_out_bytes"] == stats["swapped_in_bytes"] == 5 * block
        assert stats["swapped_sequences"] == 0
        assert stats["host_hits"] == 3
