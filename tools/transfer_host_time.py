"""The host's share of one IPC transfer on the GPU path, measured without a GPU.

Usage: PYTHONPATH=$PWD python tools/transfer_host_time.py [iters] [blocks=N] [profile] (from
the repository root: the checkout's package, not an installed one, in both processes)

A spawned sender process holds a sequence of ``blocks`` blocks (default 512, the sequence
issue 45's target names) of 2 MiB (the GPU ``bench --transfer`` geometry: 32 layers, 8 kv
heads of 128, bfloat16, 16 tokens a block; 256 blocks: 512 MiB) in a shareable slab on the
host backend; this process imports it ``iters`` times, blocks consecutive (64 spans) and
scattered (one span a block and plane: 16 384 spans of 32 KiB for 256 blocks). The receiver takes
the path a GPU takes (``ops.by_kernel`` true), but the span kernel's launch does nothing and
the piece table's upload is not copied (on a GPU both are asynchronous calls of a few
microseconds): what is left is the host work of a transfer, the exporter checks, the span
checks, the piece table packed into pinned memory, the staging slot, the wait's event. The
bytes do not move (the slab's contents are never read). Prints the median microseconds of
``IpcTransport.read``, of the whole ``import_sequence`` and of its fixed host time (the
import less the read's wait for the device, ``ReadTime.wait_s``: what ``bench --transfer``
reports as ``import_host_us``), per layout; ``profile`` adds a cProfile of the imports. The
sender's ``/dev/shm`` slab and the receiver's slab are ``2 * blocks + 2`` blocks each
(untouched pages cost no memory).
"""

from __future__ import annotations

import cProfile
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from typing import Any

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.common import workers
from rocmforge_raw.kernels import ops
from rocmforge_raw.runtime import get_backend
from rocmforge_raw.transport import IpcTransport

CONFIG = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
TIMEOUT = 120.0


def _scatter(cache: KvCache) -> None:
    """One-block fillers, every other one removed: the free blocks alternate."""
    blocks = cache.config.num_blocks
    for i in range(blocks - 1):
        cache.add_sequence(i, num_tokens=cache.config.block_size)
    for i in range(0, blocks - 1, 2):
        cache.remove(i)


def _config(blocks: int) -> CacheConfig:
    return CacheConfig(**CONFIG, num_blocks=2 * blocks + 2)  # type: ignore[arg-type]


def _sender(scattered: bool, blocks: int, conn: Any) -> None:
    with workers.reporting(conn), IpcTransport() as link, \
            KvCache(_config(blocks), backend="host", strict=True, shareable=True) as cache:
        link.publish(cache.slab)
        if scattered:
            _scatter(cache)
        cache.add_sequence("prompt", num_tokens=blocks * cache.config.block_size)
        conn.send(cache.export_sequence("prompt"))
        conn.poll(TIMEOUT)


class _Launch:
    """A kernel that is never run: the launch is counted, nothing else."""

    def __init__(self) -> None:
        self.launches = 0

    def function(self, name: str) -> _Launch:
        return self

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.launches += 1


def _gpu_path() -> _Launch:
    """This process's span copies take the launch path, launching nothing."""
    stub = _Launch()
    ops.by_kernel = lambda backend: True  # type: ignore[assignment]
    ops.load_kernels = lambda *args, **kwargs: stub  # type: ignore[assignment]
    backend = get_backend("host")
    backend.upload = lambda *args, **kwargs: None  # type: ignore[method-assign]
    return stub


def measure(scattered: bool, iters: int, profile: bool, blocks: int = 512) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(scattered, blocks, child), daemon=True)
    sender.start()
    child.close()
    try:
        desc = workers.receive(conn, sender, "the sender process", TIMEOUT)
        stub = _gpu_path()
        with IpcTransport() as link, \
                KvCache(_config(blocks), backend="host", strict=True) as cache:
            if scattered:
                _scatter(cache)
            reads, imports, fixed = [], [], []
            profiler = cProfile.Profile() if profile else None
            for i in range(iters + 1):  # the first one maps
                if profiler is not None and i == 1:
                    profiler.enable()
                start = time.perf_counter()
                done = cache.import_sequence(desc, link, "copy")
                imports.append(time.perf_counter() - start)
                reads.append(done.seconds)
                assert link.last_read is not None
                fixed.append(imports[-1] - link.last_read.wait_s)
                cache.remove("copy")
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
            assert stub.launches == iters + 1, f"{stub.launches} launches, not one a read"
        return {"read_us": 1e6 * statistics.median(reads[1:]),
                "import_us": 1e6 * statistics.median(imports[1:]),
                "fixed_us": 1e6 * statistics.median(fixed[1:])}
    finally:
        conn.send("end")
        sender.join(TIMEOUT)


def main(argv: list[str]) -> None:
    iters = int(argv[0]) if argv and argv[0].isdigit() else 50
    profile = "profile" in argv
    blocks = next((int(a[7:]) for a in argv if a.startswith("blocks=")), 512)
    for scattered in (False, True):
        row = measure(scattered, iters, profile, blocks)
        layout = "scattered" if scattered else "consecutive"
        print(f"{blocks} blocks {layout:>11}: read {row['read_us']:7.1f} us   import "
              f"{row['import_us']:7.1f} us   fixed host {row['fixed_us']:7.1f} us"
              f"   (median of {iters})")


if __name__ == "__main__":
    main(sys.argv[1:])
