"""The transport interface: publish a slab on the sending side, read spans of it on the other.

A sender *publishes* a buffer (a cache's slab) through a transport once: ``publish(buffer)``
returns an *endpoint*, a picklable value that tells a receiver where the bytes are, and
remembers it for the buffer while the transport lives (``published(buffer)``:
``KvCache.export_sequence`` puts every endpoint of its slab into the sequence's description). A
receiver *reads*: ``read(endpoint, dst, spans, stream)`` copies each span ``(src_offset,
dst_offset, nbytes)`` of the published buffer into ``dst`` and returns once the bytes have
arrived (what the sender waits for before it may reuse them), or raises
``TransferError``/``IpcError`` naming why. Writes into ``dst`` are ordered after the work
already queued on ``stream``: a copy engine of the runtime queues on it, an outside engine
waits for it first. Offsets and sizes are bytes.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from .. import checks
from ..buffer import HipBuffer
from ..stream import Event, Stream, stream_handle

#: buffer -> {transport name: (the transport that published it, held weakly: a transport
#: dropped unclosed is collected, its endpoint, which dies with it)}
_published: weakref.WeakKeyDictionary[HipBuffer, dict[str, tuple[weakref.ref[Any], Any]]] = \
    weakref.WeakKeyDictionary()


def published(buffer: HipBuffer) -> dict[str, Any]:
    """The endpoints ``buffer`` is published with by live transports, by transport name (the
    latest of each)."""
    return {name: endpoint for name, (transport, endpoint) in
            _published.get(buffer.root, {}).items() if transport() is not None}


class Transport(ABC):
    """Moves spans of a published buffer into a local one. ``close()`` (or ``with``) lets go
    of everything it registered or mapped; it is idempotent."""

    #: The key of this transport's endpoints in a sequence description.
    name: ClassVar[str]

    def publish(self, buffer: Any) -> Any:
        """Make ``buffer`` (a root ``HipBuffer``, or a ``DeviceArray`` of one: a cache's slab)
        readable through this transport; returns its endpoint (the same one again later)."""
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
    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None) -> None:
        """Copy ``spans`` (int64 ``[n, 3]``: src offset, dst offset, bytes) of the buffer
        ``endpoint`` names into ``dst``; return once they have arrived."""

    def close(self) -> None:
        """Let go of what this transport registered or mapped."""
        return None

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


def check_spans(spans: Any, src_nbytes: int, dst: HipBuffer) -> np.ndarray:
    """``spans`` as int64 ``[n, 3]``, each inside the source's ``src_nbytes`` and ``dst``."""
    spans = np.asarray(spans)
    if spans.dtype.kind not in "iu" or spans.ndim != 2 or spans.shape[1] != 3:
        raise ValueError(f"spans must be integers shaped [n, 3] (src offset, dst offset, "
                         f"bytes), got {spans.dtype} {spans.shape}")
    spans = spans.astype(np.int64, copy=False)
    if spans.size and (spans.min() < 0 or (spans[:, 0] + spans[:, 2]).max() > src_nbytes
                       or (spans[:, 1] + spans[:, 2]).max() > dst.nbytes):
        raise ValueError(f"a span lies outside the {src_nbytes}-byte source or the "
                         f"{dst.nbytes}-byte destination")
    checked: np.ndarray = spans
    return checked


def wait(dst: HipBuffer, stream: Stream | None) -> None:
    """Block until the work queued on ``stream`` of ``dst``'s device has passed (the copies a
    transport queued, or what ran before an outside engine may write)."""
    with Event(dst.device, dst.backend) as event:
        event.record(stream).synchronize()


def copy_spans(dst: HipBuffer, src_addr: int, src_device: int, spans: np.ndarray,
               stream: Stream | None) -> None:
    """Queue the copies of ``spans`` from ``src_addr`` (on ``src_device`` of ``dst``'s
    backend) on ``stream``, then wait for them: a copy within one device is a device-to-device
    copy, across devices a peer copy, direct where the two devices allow peer access (turned
    on each way at the first copy between them), staged through the host by the runtime
    where they do not."""
    backend, base = dst.backend, dst.ptr
    handle = stream_handle(stream, "stream", backend, dst.device)  # before any peer state
    if src_device != dst.device:  # memcpy_peer makes dst's device active again
        backend.peer_access(dst.device, src_device)
        backend.peer_access(src_device, dst.device)
    for src_offset, dst_offset, nbytes in spans.tolist():
        if src_device == dst.device:
            backend.memcpy_dtod(base + dst_offset, src_addr + src_offset, nbytes, handle)
        else:
            backend.memcpy_peer(base + dst_offset, dst.device, src_addr + src_offset,
                                src_device, nbytes, handle)
    wait(dst, stream)
