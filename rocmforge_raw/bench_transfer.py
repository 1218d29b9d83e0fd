"""``bench --transfer``: a sequence's KV moved between two processes of one host.

A spawned sender process (the prefill side) holds one sequence in a cache whose slab it
publishes through the transport (``ipc`` or ``mooncake``), and sends its description; this
process (the decode side) imports it ``iters`` times (removing it in between) and reports the
median bytes per second of the transport's read alone and of the whole ``import_sequence``
(layout checks and bookkeeping included). Against them, measured in the same run: the memory
copy bandwidth of the same path, one copy of the same bytes through the same copy engine
into the receiving slab (from the sender's slab mapped here where the transport is IPC,
within the receiving slab otherwise): what a transport on this host approaches. GB/s count
the bytes moved (not read plus written, as ``bench --attention``'s copy does). Two rows:
the sequence's blocks consecutive on both sides (one span per layer and K/V plane) and
scattered (every block its own span). The slab is random data, never zeros.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import time
import traceback
from typing import Any

import numpy as np

from .bench import fill_random
from .cache import CacheConfig, KvCache
from .runtime import Backend

#: Seconds the sender may take for any step before the benchmark gives up.
TIMEOUT = 300.0


def transfer_config(backend: Backend) -> CacheConfig:
    """A 32-layer bf16 model's cache (8 kv heads of 128) on a GPU, an 8-layer one on the
    host; room for two sequences of 4096 tokens (GPU) or 2048 (host), scattered or not."""
    layers, tokens = (8, 2048) if backend.name == "host" else (32, 4096)
    return CacheConfig(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16,
                       num_blocks=2 * tokens // 16 + 2, dtype="bfloat16")


def _link(transport: str) -> Any:
    from .transport import IpcTransport, MooncakeTransport

    return IpcTransport() if transport == "ipc" else MooncakeTransport("127.0.0.1")


def _sender(backend: str, device: int, transport: str, scattered: bool, conn: Any) -> None:
    """The prefill side: a sequence filling half the cache (its blocks every other one when
    ``scattered``), its description sent; waits for a word to end. An error is sent as
    ``("error", traceback)``."""
    try:
        _serve(backend, device, transport, scattered, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _serve(backend: str, device: int, transport: str, scattered: bool, conn: Any) -> None:
    config = transfer_config(_backend(backend))
    tokens = (config.num_blocks - 2) // 2 * config.block_size
    with _link(transport) as link, KvCache(config, device, backend, strict=True,
                                           shareable=transport == "ipc") as cache:
        fill_random(cache.slab.buffer, np.random.default_rng(0), config.dtype)
        link.publish(cache.slab)
        if scattered:  # one-block fillers, every other one removed: the free blocks alternate
            for i in range(config.num_blocks - 1):
                cache.add_sequence(i, num_tokens=config.block_size)
            for i in range(0, config.num_blocks - 1, 2):
                cache.remove(i)
        cache.add_sequence("prompt", num_tokens=tokens)
        conn.send(cache.export_sequence("prompt"))
        conn.poll(TIMEOUT)


def _backend(name: str) -> Backend:
    from .runtime import get_backend

    return get_backend(name)


def bench_transfer(backend: Backend, device: int, transport: str = "ipc",
                   iters: int = 10) -> list[dict[str, Any]]:
    """One row per block layout: bytes, spans, transfer and import GB/s, copy GB/s, ratio."""
    return [_row(backend, device, transport, scattered, iters) for scattered in (False, True)]


def _row(backend: Backend, device: int, transport: str, scattered: bool,
         iters: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(backend.name, device, transport, scattered, child),
                         daemon=True)
    sender.start()
    child.close()  # the sender's end is the sender's alone: its exit reads as end of file
    try:
        desc = _receive(conn, sender)
        config = transfer_config(backend)
        with _link(transport) as link, KvCache(config, device, backend, strict=True) as cache:
            if scattered:  # the receiving side scattered too
                for i in range(config.num_blocks - 1):
                    cache.add_sequence(i, num_tokens=config.block_size)
                for i in range(0, config.num_blocks - 1, 2):
                    cache.remove(i)
            reads, imports = [], []
            for _ in range(iters + 1):  # the first one maps or connects: left out
                start = time.perf_counter()
                done = cache.import_sequence(desc, link, "copy")
                imports.append(time.perf_counter() - start)
                reads.append(done.seconds)
                cache.remove("copy")
            copy_s = _copy_seconds(link, desc, cache, done.nbytes, iters)
        nbytes = done.nbytes
        transfer, whole = statistics.median(reads[1:]), statistics.median(imports[1:])
        copy_gbs = nbytes / copy_s / 1e9
        return {"transport": transport, "layout": "scattered" if scattered else "consecutive",
                "bytes": nbytes, "blocks": done.blocks_moved,
                "spans": _spans(desc, cache.config), "transfer_gb_per_s": nbytes / transfer / 1e9,
                "import_gb_per_s": nbytes / whole / 1e9, "copy_gb_per_s": copy_gbs,
                "pct_of_copy": 100.0 * copy_s / transfer}
    finally:
        with contextlib.suppress(OSError):  # a sender that failed has gone
            conn.send("end")
        sender.join(TIMEOUT)
        if sender.is_alive():
            sender.kill()
            sender.join()


def _receive(conn: Any, sender: Any) -> Any:
    """The sender's description; its error raised here as a ``RuntimeError``."""
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"the sender process sent nothing in {TIMEOUT} s")
    try:
        message = conn.recv()
    except EOFError:
        sender.join(TIMEOUT)
        raise RuntimeError(f"the sender process ended (exit code {sender.exitcode}) before "
                           "it sent its description") from None
    if isinstance(message, tuple) and message[:1] == ("error",):
        raise RuntimeError(f"the sender process failed:\n{message[1]}")
    return message


def _spans(desc: Any, config: CacheConfig) -> int:
    ids = np.asarray(desc.block_ids)
    runs = 1 + int(np.count_nonzero(np.diff(ids) != 1))
    return runs * 2 * config.num_layers


def _copy_seconds(link: Any, desc: Any, cache: KvCache, nbytes: int, iters: int) -> float:
    """Median seconds of one copy of ``nbytes`` into the receiving slab, from the sender's
    slab mapped here (IPC) or from the receiving slab itself, waited for."""
    dst = cache.slab.buffer
    ipc = desc.endpoints.get("ipc")
    src = dst if ipc is None else link.mapping(ipc)
    backend, device = dst.backend, dst.device
    times = []
    for _ in range(iters + 1):
        start = time.perf_counter()
        if src.device == device:
            backend.memcpy_dtod(dst.ptr, src.ptr + src.nbytes - nbytes, nbytes)
        else:
            backend.memcpy_peer(dst.ptr, device, src.ptr + src.nbytes - nbytes, src.device,
                                nbytes)
        backend.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])

