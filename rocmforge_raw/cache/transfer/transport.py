"""The transport interface: publish a slab on the sending side, read spans of it on the other.

A sender *publishes* a buffer (a cache's slab) through a transport once: ``publish(buffer)``
returns an *endpoint*, a picklable value that tells a receiver where the bytes are, and
remembers it for the buffer while the transport lives (``published(buffer)``:
``KvCache.export_sequence`` puts every endpoint of its slab into the sequence's description). A
receiver *reads*: ``read(endpoint, dst, spans, stream)`` copies each span ``(src_offset,
dst_offset, nbytes)`` of the published buffer into ``dst`` and returns once the bytes have
arrived (what the sender waits for before it may reuse them), or raises
``TransferError``/``IpcError`` naming why: ``TransferError`` too when they have not arrived
within ``timeout`` seconds (the runtime's copies may still be queued then, on ``stream``,
before anything queued there later). Writes into ``dst`` are ordered after the work
already queued on ``stream``: a copy engine of the runtime queues on it, an outside engine
waits for it first. Offsets and sizes are bytes.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...common import checks
from ...errors import TransferError
from ...kernels import ops
from ...memory.buffer import HipBuffer
from ...memory.stream import Event, Stream

#: buffer -> {transport name: (the transport that published it, held weakly: a transport
#: dropped unclosed is collected, its endpoint, which dies with it)}
_published: weakref.WeakKeyDictionary[HipBuffer, dict[str, tuple[weakref.ref[Any], Any]]] = \
    weakref.WeakKeyDictionary()
#: Seconds between two looks at the device while a read with a timeout waits for it.
_POLL_S = 50e-6


def published(buffer: HipBuffer) -> dict[str, Any]:
    """The endpoints ``buffer`` is published with by live transports (not collected, not
    closed), by transport name (the latest of each)."""
    return {name: endpoint for name, (transport, endpoint) in
            _published.get(buffer.root, {}).items()
            if (live := transport()) is not None and not live.closed}


@dataclass(frozen=True)
class ReadTime:
    """Where a read through the runtime's copies went (``IpcTransport``, ``PeerTransport``:
    ``last_read``): ``host_s`` seconds of host work (checks, the piece table, queuing the
    copies, the exporter's checks) and ``wait_s`` seconds blocked on the device until the
    bytes arrived (on the host backend the copies themselves are host work)."""

    host_s: float
    wait_s: float


class Transport(ABC):
    """Moves spans of a published buffer into a local one. ``close()`` (or ``with``) lets go
    of everything it registered or mapped; it is idempotent, and a closed transport
    publishes and reads no more (``TransferError``)."""

    #: The key of this transport's endpoints in a sequence description.
    name: ClassVar[str]
    _closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"this {type(self).__name__} was closed")

    def publish(self, buffer: Any) -> Any:
        """Make ``buffer`` (a root ``HipBuffer``, or a ``DeviceArray`` of one: a cache's slab)
        readable through this transport; returns its endpoint (the same one again later)."""
        self._check_open()
        root = root_buffer(buffer)
        endpoints = _published.setdefault(root, {})
        if not self._published_by_me(endpoints):
            endpoints[self.name] = (weakref.ref(self), self._publish(root))
        return endpoints[self.name][1]

    def _published_by_me(self, endpoints: dict[str, tuple[weakref.ref[Any], Any]]) -> bool:
        return self.name in endpoints and endpoints[self.name][0]() is self

    @abstractmethod
    def _publish(self, buffer: HipBuffer) -> Any: ...

    @abstractmethod
    def endpoint_nbytes(self, endpoint: Any) -> int:
        """The size in bytes of the buffer ``endpoint`` names (``TypeError`` for an endpoint
        of another transport): what a description's counts are checked against."""

    @abstractmethod
    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None, *, timeout: float | None = None) -> None:
        """Copy ``spans`` (int64 ``[n, 3]``: src offset, dst offset, bytes) of the buffer
        ``endpoint`` names into ``dst``; return once they have arrived, ``TransferError``
        if that takes more than ``timeout`` seconds (None: no limit; else a number > 0,
        checked before anything is mapped, registered or copied: ``read_timeout``)."""

    def close(self) -> None:
        """Let go of what this transport registered or mapped (subclasses extend this)."""
        self._closed = True

    def _forget(self, buffer: HipBuffer) -> None:
        """``buffer`` is published through this transport no more."""
        endpoints = _published.get(buffer, {})
        if self._published_by_me(endpoints):
            del endpoints[self.name]

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} holds mappings or an engine and cannot be "
                        "pickled: send its endpoints (they are plain values)")


def root_buffer(buffer: Any) -> HipBuffer:
    """The open root ``HipBuffer`` of ``buffer`` (a HipBuffer or a DeviceArray)."""
    buf = getattr(buffer, "buffer", buffer)
    if not isinstance(buf, HipBuffer):
        raise TypeError(f"buffer must be a HipBuffer or a DeviceArray, got "
                        f"{checks.show(buffer)}")
    buf.ptr  # noqa: B018 - raises BufferClosedError once closed
    return buf.root


def read_timeout(timeout: Any) -> float | None:
    """A read's ``timeout`` as seconds (a float > 0), or None (no limit): checked before a
    read maps, registers, copies or waits for anything (a NaN limit would never pass)."""
    if timeout is None:
        return None
    seconds = checks.real(timeout, "timeout")
    if seconds <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got "
                         f"{checks.show(timeout)}")
    return seconds


def _event(dst: HipBuffer) -> Event:
    """This thread's event of ``dst``'s device, made once and re-recorded by each ``wait``
    of the thread (one thread waits on it at a time; a wait that timed out leaves it
    pending, and the next record replaces that point)."""
    events = getattr(_events, "by_device", None)
    if events is None:
        events = _events.by_device = {}
    event = events.get((dst.backend, dst.device))
    if event is None or event.closed:
        event = events[(dst.backend, dst.device)] = Event(dst.device, dst.backend)
    return event


def _forget_events() -> None:
    """In a forked child: the events are the parent's."""
    global _events
    _events = threading.local()


_events = threading.local()
os.register_at_fork(after_in_child=_forget_events)


def wait(dst: HipBuffer, stream: Stream | None, timeout: float | None = None) -> float:
    """Block until the work queued on ``stream`` of ``dst``'s device has passed (the copies a
    transport queued, or what ran before an outside engine may write); ``TransferError``
    once ``timeout`` seconds passed first (the work stays queued). Returns the seconds spent
    blocked on the device (after the event's record)."""
    event = _event(dst).record(stream)
    start = time.perf_counter()
    if timeout is None:
        event.synchronize()
        return time.perf_counter() - start
    deadline = time.monotonic() + timeout
    while not dst.backend.event_query(event.handle):
        if time.monotonic() >= deadline:
            raise TransferError(f"the read did not complete within timeout={timeout:g} s")
        time.sleep(_POLL_S)
    return time.perf_counter() - start


def copy_spans(dst: HipBuffer, src: HipBuffer, spans: np.ndarray,
               stream: Stream | None, timeout: float | None = None) -> float:
    """Copy ``spans`` of ``src`` (on ``dst``'s device or another device of its backend)
    into ``dst`` on ``stream`` (``ops.copy_spans``: one launch where ``dst``'s device
    reaches ``src``, runtime copies where it does not), then wait for them (at most
    ``timeout`` seconds, as ``wait``); returns the seconds blocked in that wait."""
    ops.copy_spans(dst, src, spans, stream=stream)
    return wait(dst, stream, timeout)


def merged_spans(spans: np.ndarray) -> np.ndarray:
    """``spans`` (checked int64 ``[n, 3]``) with empty ones dropped and each run of spans that
    continue one another on both sides (in source order) made one: the same bytes in the
    fewest contiguous copies a descriptor-per-span engine is given."""
    spans = spans[spans[:, 2] > 0]
    if len(spans) < 2:
        return spans
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    ends = spans[:-1, :2] + spans[:-1, 2:]
    cut = np.flatnonzero((spans[1:, 0] != ends[:, 0]) | (spans[1:, 1] != ends[:, 1])) + 1
    starts = np.concatenate([[0], cut])
    sizes = np.add.reduceat(spans[:, 2], starts)
    return np.column_stack([spans[starts, :2], sizes])
