"""``bench --transfer``: a sequence's KV moved between two processes of one host.

A spawned sender process (the prefill side) holds one sequence in a cache whose slab it
publishes through the transport (``ipc`` or ``mooncake``), and sends its description; this
process (the decode side) imports it ``iters`` times (removing it in between) and reports the
median bytes per second of the transport's read alone and of the whole ``import_sequence``
(layout checks and bookkeeping included). Against them, measured in the same run: the memory
copy bandwidth of the same path, one copy of the same bytes through the same copy engine
into the receiving slab (from the sender's slab mapped here where the transport is IPC,
within the receiving slab otherwise, or from a buffer on the sender's device where that is
another): what a transport on this host approaches. GB/s count
the bytes moved (not read plus written, as ``bench --attention``'s copy does). ``host_us``
is the median host work of one read (``ReadTime.host_s``: checks, the piece table, queuing
the copies, the exporter's checks; the rest is waiting for the device), where the transport
says it (IPC, peer; on the host backend the copies themselves are host work), and
``import_host_us`` the median fixed host time of one whole import (``import_sequence`` less
the read's wait for the device: the description's checks, the allocation and bookkeeping,
and the read's host work; issue 45's target: below 100 us for 512 blocks). Two rows:
the sequence's blocks consecutive on both sides (one span per layer and K/V plane) and
scattered (every block its own span). The slab is random data, never zeros.

With the sender on another device of the host (``sender_device``, ``--from-device``), the
transport's copies are peer copies (through NVLink, xGMI or PCIe where the two devices have
peer access, staged through host memory by the runtime where not: ``peer_access`` says
which), and two more rows move the sequence between two caches of this one process
(transport ``peer``, ``PeerTransport``); the copy of each row is then a raw peer copy of the
same bytes from the sender's slab (``memcpy_peer``), the device pair's measured peer copy
bandwidth.

Over Mooncake, each row also holds its ceilings, measured in the same run (``ceilings``):
the engine's own batch of the same descriptors between two plain registered buffers (the
sender's in the sender process) and a TCP socket copy of the same bytes on loopback, ours as
a % of each, and where the time went (registration, posting, the wire; staging noted).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from ..cache import CacheConfig, KvCache
from ..cache.transfer.transport import ReadTime
from ..common import workers
from ..memory import ipc
from ..memory.buffer import HipBuffer
from ..runtime import Backend
from . import ceilings
from .timing import fill_random

#: Seconds the sender may take for any step before the benchmark gives up.
TIMEOUT = 300.0


def transfer_config(backend: Backend) -> CacheConfig:
    """A 32-layer bf16 model's cache (8 kv heads of 128) on a GPU, an 8-layer one on the
    host; room for two sequences of 4096 tokens (GPU) or 2048 (host), scattered or not."""
    layers, tokens = (8, 2048) if backend.name == "host" else (32, 4096)
    return CacheConfig(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16,
                       num_blocks=2 * tokens // 16 + 2, dtype="bfloat16")


def _link(transport: str) -> Any:
    from ..transport import IpcTransport, MooncakeTransport

    return IpcTransport() if transport == "ipc" else MooncakeTransport("127.0.0.1")


def _sender(backend: str, device: int, transport: str, scattered: bool, conn: Any) -> None:
    """The prefill side: a sequence filling half the cache (its blocks every other one when
    ``scattered``), its description sent; waits for a word to end. An error is sent as
    ``("error", traceback)``."""
    with workers.reporting(conn):
        _serve(backend, device, transport, scattered, conn)


def _serve(backend: str, device: int, transport: str, scattered: bool, conn: Any) -> None:
    config = transfer_config(_backend(backend))
    with _link(transport) as link, KvCache(config, device, backend, strict=True,
                                           shareable=transport == "ipc") as cache:
        conn.send(_hold_prompt(cache, link, scattered))
        if transport != "mooncake":
            conn.poll(TIMEOUT)
            return
        with ceilings.PlainEngine(cache.slab.buffer.nbytes, device, cache.slab.backend) as plain:
            fill_random(plain.buffer, np.random.default_rng(1), config.dtype)
            conn.send((plain.source(), link.registration_s))  # the engine's own, beside ours
            conn.poll(TIMEOUT)


def _hold_prompt(cache: KvCache, link: Any, scattered: bool) -> Any:
    """The sender's side: random data published through ``link``, a sequence filling half
    the cache (scattered or not); its description."""
    fill_random(cache.slab.buffer, np.random.default_rng(0), cache.config.dtype)
    link.publish(cache.slab)
    if scattered:
        _scatter(cache)
    tokens = (cache.config.num_blocks - 2) // 2 * cache.config.block_size
    cache.add_sequence("prompt", num_tokens=tokens)
    return cache.export_sequence("prompt")


def _scatter(cache: KvCache) -> None:
    """One-block fillers, every other one removed: the free blocks alternate."""
    config = cache.config
    for i in range(config.num_blocks - 1):
        cache.add_sequence(i, num_tokens=config.block_size)
    for i in range(0, config.num_blocks - 1, 2):
        cache.remove(i)


def _backend(name: str) -> Backend:
    from ..runtime import get_backend

    return get_backend(name)


def bench_transfer(backend: Backend, device: int, transport: str = "ipc", iters: int = 10,
                   sender_device: int | None = None) -> list[dict[str, Any]]:
    """One row per block layout: bytes, spans, transfer and import GB/s, copy GB/s, ratio,
    the sequence moving from a sender process on ``sender_device`` (default: ``device``)
    into a cache on ``device``. Across two devices, also one row per layout of the two
    caches in this one process (transport ``peer``: peer copies), against a raw peer copy
    of the same bytes."""
    sender = device if sender_device is None else backend.resolve_device(sender_device)
    rows = [_row(backend, device, sender, transport, scattered, iters)
            for scattered in (False, True)]
    if sender != device:
        rows += [_peer_row(backend, device, sender, scattered, iters)
                 for scattered in (False, True)]
    return rows


def _row(backend: Backend, device: int, sender_device: int, transport: str, scattered: bool,
         iters: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(backend.name, sender_device, transport,
                                               scattered, child), daemon=True)
    sender.start()
    child.close()  # the sender's end is the sender's alone: its exit reads as end of file
    try:
        desc = _receive(conn, sender)
        plain = _receive(conn, sender) if transport == "mooncake" else None
        with _link(transport) as link, contextlib.ExitStack() as held, \
                KvCache(transfer_config(backend), device, backend, strict=True) as cache:
            source = _copy_source(desc, link, cache, sender_device, held)
            seen: list[Any] = []
            row = _measure(transport, scattered, cache, link, desc, source, iters, seen)
            if plain is not None:
                row.update(_against_the_engine(row, link, seen, cache, plain[0], plain[1],
                                               iters))
            return row
    finally:
        with contextlib.suppress(OSError):  # a sender that failed has gone
            conn.send("end")
        sender.join(TIMEOUT)
        if sender.is_alive():
            sender.kill()
            sender.join()


def _copy_source(desc: Any, link: Any, cache: KvCache, sender_device: int,
                 held: contextlib.ExitStack) -> HipBuffer:
    """Where the copy a row is judged against reads: the sender's slab mapped here (IPC),
    else the receiving slab, or a buffer of its size on the sender's device where that is
    another (a peer copy, as the row's devices say; ``held`` frees it)."""
    ipc = desc.endpoints.get("ipc")
    if ipc is not None:
        mapped: HipBuffer = link.mapping(ipc, cache.slab.device)  # (where the read maps it)
        return mapped
    slab = cache.slab.buffer
    if sender_device == slab.device:
        return slab
    return held.enter_context(HipBuffer(slab.nbytes, sender_device, slab.backend))


def _peer_row(backend: Backend, device: int, sender_device: int, scattered: bool,
              iters: int) -> dict[str, Any]:
    """The sequence moved between two caches of this process on two devices."""
    from ..transport import PeerTransport

    config = transfer_config(backend)
    with PeerTransport() as link, \
            KvCache(config, sender_device, backend, strict=True) as sender, \
            KvCache(config, device, backend, strict=True) as cache:
        desc = _hold_prompt(sender, link, scattered)
        return _measure("peer", scattered, cache, link, desc, sender.slab.buffer, iters)


def _measure(transport: str, scattered: bool, cache: KvCache, link: Any, desc: Any,
             source: Any, iters: int, reads_seen: list[Any] | None = None) -> dict[str, Any]:
    """Import ``desc`` into ``cache`` (scattered too when ``scattered``) ``iters`` times,
    then copy as many bytes from ``source`` into the receiving slab: the row. The
    transport's ``last_read`` after each timed import is appended to ``reads_seen``."""
    if scattered:  # the receiving side scattered too
        _scatter(cache)
    reads, imports, parts = [], [], []
    for _ in range(iters + 1):  # the first one maps, connects or enables peer access
        start = time.perf_counter()
        done = cache.import_sequence(desc, link, "copy")
        imports.append(time.perf_counter() - start)
        reads.append(done.seconds)
        parts.append(getattr(link, "last_read", None))  # Mooncake's: post and wire
        cache.remove("copy")
    if reads_seen is not None:
        reads_seen += parts[1:]
    dst = cache.slab.buffer
    nbytes = done.nbytes
    copy_s = _copy_seconds(source, dst, nbytes, iters)
    transfer, whole = statistics.median(reads[1:]), statistics.median(imports[1:])
    host = [p.host_s for p in parts[1:] if isinstance(p, ReadTime)]  # IPC, peer
    fixed = [whole_s - p.wait_s for whole_s, p in zip(imports[1:], parts[1:])
             if isinstance(p, ReadTime)]
    remote = ipc.remote_device(source.ptr)  # (the sender's slab mapped on our device)
    sender = source.device if remote is None else remote
    backend, peer = dst.backend, sender != dst.device
    return {"transport": transport, "layout": "scattered" if scattered else "consecutive",
            "sender_device": sender, "receiver_device": dst.device,
            "peer_access": backend.peer_access(dst.device, sender) if peer else None,
            "bytes": nbytes, "blocks": done.blocks_moved, "spans": _spans(desc, cache.config),
            "transfer_gb_per_s": nbytes / transfer / 1e9,
            "import_gb_per_s": nbytes / whole / 1e9, "copy_gb_per_s": nbytes / copy_s / 1e9,
            "pct_of_copy": 100.0 * copy_s / transfer,
            "host_us": 1e6 * statistics.median(host) if host else None,
            "import_host_us": 1e6 * statistics.median(fixed) if fixed else None}


def _against_the_engine(row: dict[str, Any], link: Any, parts: list[Any], cache: KvCache,
                        plain: ceilings.PlainSource, slab_registration_s: float, iters: int
                        ) -> dict[str, Any]:
    """Mooncake's row beside its ceilings, measured now: the engine's own batch of the
    descriptors ours posted (the same bytes) between two plain buffers, and a TCP socket
    copy of the same bytes on loopback; where ours and the engine's time went."""
    runs, nbytes = parts[-1].runs, row["bytes"]
    dst = cache.slab.buffer
    engine = ceilings.engine_batch(plain, runs, dst.device, dst.backend, dst.nbytes, iters)
    tcp_s = ceilings.tcp_loopback_seconds(nbytes, iters)
    ours_s = nbytes / row["transfer_gb_per_s"] / 1e9
    staged = dst.backend.name != "host"  # the bench's engines run over TCP
    return {**ceilings.ceiling_fields(nbytes, ours_s, engine["seconds"], tcp_s),
            "descriptors": len(runs),
            "registration_ms": 1e3 * (link.registration_s + slab_registration_s),
            "post_ms": 1e3 * statistics.median(p.post_s for p in parts),
            "wire_ms": 1e3 * statistics.median(p.wire_s for p in parts),
            "engine_registration_ms": 1e3 * engine["registration_s"],
            "engine_post_ms": 1e3 * engine["post_s"], "engine_wire_ms": 1e3 * engine["wire_s"],
            "tcp_ms": 1e3 * tcp_s, "staged_through_host": staged,
            "staging": ceilings.STAGING if staged else None}


def _receive(conn: Any, sender: Any) -> Any:
    """The sender's next message; ``WorkerError`` if it failed (its last line; the whole
    traceback is logged), ended, or sent nothing in TIMEOUT seconds."""
    return workers.receive(conn, sender, "the sender process", TIMEOUT)


def _spans(desc: Any, config: CacheConfig) -> int:
    ids = np.asarray(desc.block_ids)
    runs = 1 + int(np.count_nonzero(np.diff(ids) != 1))
    return runs * 2 * config.num_layers


def _copy_seconds(src: Any, dst: Any, nbytes: int, iters: int) -> float:
    """Median seconds of one copy of ``nbytes`` from the end of ``src`` into ``dst`` (a
    device copy, or a peer copy from another device), waited for."""
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
