"""Streams and events: ordered queues of device work, and timestamps in them.

Both own a runtime handle, destroyed by ``close()``, ``with`` or garbage collection (a
finalizer that holds no reference to the object). A closed stream or event refuses every use
with ``BufferClosedError``; neither can be copied or pickled (a copy would share the handle).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

from ..common import checks
from ..errors import BufferClosedError
from ..runtime import Backend, get_backend


def _destroy(destroy: Any, handle: Any, device: int, pid: int) -> None:
    """Finalizer body: destroy in the owning process only, never raising."""
    if os.getpid() != pid or sys.is_finalizing():
        return
    try:
        destroy(handle, device)
    except Exception as exc:
        sys.stderr.write(f"rocmforge_raw: destroying {handle!r} failed: {exc}\n")


def stream_handle(stream: Any, name: str = "stream", backend: Backend | None = None,
                  device: int | None = None) -> Any:
    """The runtime handle of ``stream`` (None: the default stream, None); a clear error for
    anything but an open ``Stream`` (of ``device`` of ``backend``, when they are given).
    Given a ``device``, that device is activated (``Backend.activate``) for the call the
    handle is for: the binding's default stream is the active device's, and a stream is
    used with its own device active."""
    if stream is None:
        if backend is not None and device is not None:
            backend.activate(device)
        return None
    if not isinstance(stream, Stream):
        raise TypeError(f"{name} must be a Stream or None, got {checks.show(stream)}")
    if backend is not None and (stream.backend is not backend or stream.device != device):
        checks.colocated(name, stream.backend, stream.device, "the work it would order",
                         backend, device)
    if backend is not None and device is not None:
        backend.activate(device)
    return stream.handle


class _Handle:
    """A runtime object (stream or event) of one device, destroyed exactly once."""

    kind = "handle"

    def __init__(self, device: int | None, backend: str | Backend | None, create: Any,
                 destroy: Any) -> None:
        self.backend = get_backend(backend)
        self.device = self.backend.resolve_device(device)
        self._handle: Any = create(self.device)
        self._finalizer = weakref.finalize(
            self, _destroy, destroy, self._handle, self.device, os.getpid())
        self._finalizer.atexit = False

    @property
    def handle(self) -> Any:
        """The runtime's handle; ``BufferClosedError`` once closed."""
        if not self._finalizer.alive:
            raise BufferClosedError(f"this {self.kind} was closed and cannot be used")
        return self._handle

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy the handle now. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(f"a {self.kind} owns a runtime handle and cannot be copied or pickled")

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"<{self.kind} {self.backend.name}:{self.device} at {id(self):#x}{state}>"


class Stream(_Handle):
    """A device work queue. ``close()`` (or ``with``, or garbage collection) destroys it."""

    kind = "Stream"

    def __init__(self, device: int | None = None, backend: str | Backend | None = None) -> None:
        backend = get_backend(backend)
        super().__init__(device, backend, backend.stream_create, backend.stream_destroy)

    def synchronize(self) -> None:
        """Wait until every operation queued so far has finished."""
        self.backend.stream_synchronize(self.handle)


class Event(_Handle):
    """A point in a stream; ``end.elapsed_ms_since(start)`` times the work between two."""

    kind = "Event"

    def __init__(self, device: int | None = None, backend: str | Backend | None = None) -> None:
        backend = get_backend(backend)
        super().__init__(device, backend, backend.event_create, backend.event_destroy)
        self.recorded = False

    def record(self, stream: Stream | None = None) -> Event:
        """Mark the point in ``stream`` (None: the default stream) that work has reached."""
        stream_of = stream_handle(stream, "stream", self.backend, self.device)
        self.backend.event_record(self.handle, stream_of)
        self.recorded = True
        return self

    def synchronize(self) -> None:
        self.backend.event_synchronize(self.handle)

    def elapsed_ms_since(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event; both must have been recorded (on one
        device) and completed."""
        if not isinstance(start, Event):
            raise TypeError(f"start must be an Event, got {checks.show(start)}")
        for which, event in (("start", start), ("this", self)):
            event.handle  # noqa: B018 - raises if closed
            if not event.recorded:
                raise ValueError(f"{which} event was never recorded: record() it first")
        checks.colocated("start event", start.backend, start.device, "this one",
                         self.backend, self.device)
        return self.backend.event_elapsed_ms(start.handle, self.handle)
