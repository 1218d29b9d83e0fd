"""PeerTransport: caches of one process, on one device or two (peer copies).

The endpoint names the published slab within this process; a read copies each span with
hipMemcpyPeerAsync / cuMemcpyPeerAsync on the receiving cache's stream (the runtime stages
through host memory where the two devices have no peer access; on one device it is a plain
device copy), then waits for the copies. An endpoint taken to another process is refused.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache.transfer.transport import ReadTime, Transport, copy_spans, read_timeout
from ..common import checks
from ..errors import BufferClosedError
from ..memory.buffer import HipBuffer
from ..memory.stream import Stream

_ids = itertools.count(1)
_buffers: dict[int, weakref.ref[HipBuffer]] = {}


def _forget(number: int, _: object) -> None:
    """A published buffer died: its number goes with it."""
    _buffers.pop(number, None)


@dataclass(frozen=True)
class PeerEndpoint:
    """A published buffer of process ``pid``, by its number there."""

    pid: int
    number: int


class PeerTransport(Transport):
    """Reads spans of a slab published in this same process."""

    name = "peer"
    #: Where the last read's time went (host work, waiting for the device).
    last_read: ReadTime | None = None

    def _publish(self, buffer: HipBuffer) -> PeerEndpoint:
        number = next(_ids)
        _buffers[number] = weakref.ref(buffer, functools.partial(_forget, number))
        return PeerEndpoint(os.getpid(), number)

    def endpoint_nbytes(self, endpoint: Any) -> int:
        return _source(endpoint, open_only=False).nbytes  # (a closed one has its size)

    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None, *, timeout: float | None = None) -> None:
        start = time.perf_counter()
        self._check_open()
        timeout = read_timeout(timeout)
        src = _source(endpoint)
        if src.backend is not dst.backend:
            raise ValueError(f"the sender's slab is {src.backend.name} memory, the receiver's "
                             f"{dst.backend.name}: peer copies stay within one backend")
        waited = copy_spans(dst, src, spans, stream, timeout)
        self.last_read = ReadTime(time.perf_counter() - start - waited, waited)


def _source(endpoint: Any, open_only: bool = True) -> HipBuffer:
    """The buffer a peer endpoint of this process names (open, with ``open_only``)."""
    if not isinstance(endpoint, PeerEndpoint):
        raise TypeError(f"a peer endpoint is a PeerEndpoint, got {checks.show(endpoint)}")
    if endpoint.pid != os.getpid():
        raise ValueError(f"a peer endpoint names memory of process {endpoint.pid}, and "
                         "peer copies stay in one process: use IpcTransport across "
                         "processes")
    ref = _buffers.get(endpoint.number)
    src = None if ref is None else ref()
    if src is None or (open_only and src.closed):
        raise BufferClosedError("the sender's slab was closed")
    return src
