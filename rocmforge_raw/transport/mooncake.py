"""MooncakeTransport: caches on other hosts (or processes), through Mooncake's Transfer Engine.

Why Mooncake rather than NIXL: its PyPI wheels cover every backend of this package (a no-GPU
build for the host backend and CI, CUDA 12/13 builds, a ROCm build for the hip backend,
where NIXL publishes CUDA builds only), and its peer-to-peer handshake needs no metadata
service: each engine listens on a port of its own and a reader names the peer by
``host:port``. NIXL's agents (register memory, exchange metadata, post a read, poll) map on
this same interface: a ``NixlTransport`` would be one more file beside this one.

Each ``MooncakeTransport`` owns one engine (``initialize(host, "P2PHANDSHAKE", protocol,
device)``; TCP by default, RDMA with ``protocol="rdma"`` and the NIC's name). ``publish``
registers a buffer (a cache's slab, once, at the cache's start) and returns its endpoint
(``host:port``, address, size); ``read`` registers the receiving buffer on first use, waits
for the work queued on the receiving stream, then posts one batch of reads (spans that
continue one another on both sides merged: one descriptor a run) and returns when the engine
says the bytes arrived (``last_read``: the time posting the batch and the time on the
wire). A registered buffer counts as an outside consumer of its memory (like a DLPack
export): closing it while registered frees the memory only once ``close()`` unregisters it,
so the engine never reads or writes freed memory. A transport dropped without ``close()`` is
closed when it is collected.
"""

from __future__ import annotations

import importlib.metadata
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache.transfer.transport import Transport, merged_spans, read_timeout, wait
from ..common import checks
from ..errors import BackendUnavailableError, TransferError
from ..memory.buffer import HipBuffer
from ..memory.stream import Stream

#: What reaches each backend's memory: the package names of Mooncake's builds.
_REACHES = {"host": lambda dist: True,
            "cuda": lambda dist: not any(k in dist for k in ("non-cuda", "rocm", "npu", "musa")),
            "hip": lambda dist: "rocm" in dist}


@dataclass(frozen=True)
class MooncakeEndpoint:
    """A buffer registered with the engine listening at ``session`` (``host:port``)."""

    session: str
    address: int
    nbytes: int


def engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class; ``BackendUnavailableError`` saying what to
    install where it cannot be loaded."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise BackendUnavailableError(
            f"Mooncake's Transfer Engine cannot be loaded ({exc}): pip install "
            "'rocmforge_raw[transfer]' (a GPU machine: mooncake-transfer-engine-cuda13 or "
            "-rocm instead); it needs libibverbs.so.1 (Debian: libibverbs1)") from exc
    return TransferEngine


def _distribution() -> str:
    """The installed build of Mooncake (its package name)."""
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    return names[0] if names else "mooncake"


#: The engine's transports this class drives (the engine takes any name and reports nothing).
PROTOCOLS = ("tcp", "rdma")
#: What ``batch_transfer_async_read`` returns for a batch it did not post (0, or -1 as an
#: unsigned 64-bit id where it could not reach the peer).
_NO_BATCH = (0, -1, 2**64 - 1)


@dataclass(frozen=True)
class ReadTimes:
    """Where one read's time went: ``runs`` (int64 ``[n, 3]``: the merged spans posted, one
    descriptor each), ``post_s`` seconds building and submitting the batch (the engine
    queues its descriptors and returns), ``wire_s`` seconds from then until the engine
    reported every byte arrived (its TCP or RDMA transfer, and on a GPU over TCP the
    engine's own device<->host staging)."""

    runs: np.ndarray
    post_s: float
    wire_s: float

    @property
    def seconds(self) -> float:
        return self.post_s + self.wire_s


def batch_read(engine: Any, session: str, src_address: int, dst_ptr: int,
               runs: np.ndarray) -> tuple[float, float]:
    """Post ``runs`` (int64 ``[n, 3]``: source offset, destination offset, bytes) as one
    batch of reads from ``src_address`` of the engine at ``session`` into ``dst_ptr`` and
    wait for it: (post, wire) seconds; ``TransferError`` if the engine fails the batch."""
    start = time.perf_counter()
    batch = engine.batch_transfer_async_read(
        session, (dst_ptr + runs[:, 1]).tolist(), (src_address + runs[:, 0]).tolist(),
        runs[:, 2].tolist())
    posted = time.perf_counter()
    status = -1 if batch in _NO_BATCH else engine.get_batch_transfer_status([batch])
    if status != 0:
        raise TransferError(f"reading {int(runs[:, 2].sum())} bytes in {len(runs)} spans "
                            f"from {session} failed (batch {batch}, status {status}; the "
                            "engine's log says why)")
    return posted - start, time.perf_counter() - posted

class MooncakeTransport(Transport):
    """One Transfer Engine listening on ``hostname`` (peer-to-peer handshake, no metadata
    server); ``protocol`` ``tcp`` or ``rdma`` (then ``device_name``: the NICs, such as
    ``mlx5_0``)."""

    name = "mooncake"
    #: Seconds this transport spent registering buffers with the engine (each once).
    registration_s = 0.0
    #: The latest read's times (None before the first).
    last_read: ReadTimes | None = None

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        for arg, value in (("hostname", hostname), ("protocol", protocol),
                           ("device_name", device_name)):
            if not isinstance(value, str):
                raise TypeError(f"{arg} must be a str, got {checks.show(value)}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self._engine = engine_class()()
        status = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if status != 0:
            raise TransferError(f"Mooncake's engine did not start on {hostname} over "
                                f"{protocol} (status {status}; its log says why)")
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, tuple[HipBuffer, Any]] = {}  # ptr -> (buffer, end)
        # holds the engine, not the transport: it stops once every buffer is unregistered
        self._release = weakref.finalize(self, _unregister_all, self._engine, self._registered)

    @staticmethod
    def reaches(backend: str) -> bool:
        """Whether the installed build of the engine can reach ``backend``'s memory."""
        return _REACHES.get(backend, lambda dist: False)(_distribution())

    def _publish(self, buffer: HipBuffer) -> MooncakeEndpoint:
        self._register(buffer)
        return MooncakeEndpoint(self.session, buffer.ptr, buffer.nbytes)

    def _register(self, buffer: HipBuffer) -> None:
        """Register ``buffer`` with the engine once; it stays allocated until ``close()``
        (callers checked that the transport is open)."""
        if buffer.ptr in self._registered:
            return
        if not self.reaches(buffer.backend.name):
            raise TransferError(f"the installed {_distribution()} cannot reach "
                                f"{buffer.backend.name} memory: install "
                                "mooncake-transfer-engine-cuda13 (NVIDIA) or "
                                "mooncake-transfer-engine-rocm (AMD)")
        end = buffer._export()  # the memory outlives a close() while the engine may use it
        start = time.perf_counter()
        status = self._engine.register_memory(buffer.ptr, buffer.nbytes)
        self.registration_s += time.perf_counter() - start
        if status != 0:
            end()
            raise TransferError(f"Mooncake's engine refused to register {buffer!r} "
                                f"(status {status})")
        self._registered[buffer.ptr] = (buffer, end)

    def endpoint_nbytes(self, endpoint: Any) -> int:
        return _endpoint(endpoint).nbytes

    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None, *, timeout: float | None = None) -> None:
        """One batch of the engine for the whole read: ``spans`` merged where they continue
        one another on both sides (``merged_spans``), posted at once, then waited for;
        ``last_read`` says how long each part took."""
        self._check_open()
        timeout = read_timeout(timeout)
        endpoint = _endpoint(endpoint)
        spans = checks.spans(spans, endpoint.nbytes, dst.nbytes)
        self._register(dst.root)
        if not spans.size:
            return
        start = time.perf_counter()  # the limit holds for the wait and the batch together
        wait(dst, stream, timeout)  # the engine writes outside the stream: after that work
        runs = merged_spans(spans)
        self.last_read = ReadTimes(runs, *batch_read(self._engine, endpoint.session,
                                                     endpoint.address, dst.ptr, runs))
        took = time.perf_counter() - start
        if timeout is not None and took > timeout:
            raise TransferError(f"the read took {took:.3g} s, more than timeout={timeout:g} s "
                                "(the engine's call cannot be cut short)")

    def close(self) -> None:
        """Unregister every buffer (closed ones are freed now) and stop the engine."""
        super().close()
        for buffer, _ in self._registered.values():
            self._forget(buffer)
        self._release()
        self._engine = None  # the engine stops listening when it is destroyed


def _endpoint(endpoint: Any) -> MooncakeEndpoint:
    if not isinstance(endpoint, MooncakeEndpoint):
        raise TypeError(f"a mooncake endpoint is a MooncakeEndpoint, got "
                        f"{checks.show(endpoint)}")
    return endpoint


def _unregister_all(engine: Any, registered: dict[int, tuple[HipBuffer, Any]]) -> None:
    """Unregister each buffer from ``engine``, then end its export (a closed one is freed)."""
    while registered:
        ptr, (_, end) = registered.popitem()
        engine.unregister_memory(ptr)
        end()
