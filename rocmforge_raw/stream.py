"""Streams and events: ordered queues of device work, and timestamps in them."""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

from .runtime import Backend, get_backend


def _destroy(destroy: Any, handle: Any, device: int, pid: int) -> None:
    """Finalizer body: destroy in the owning process only, never raising."""
    if os.getpid() != pid or sys.is_finalizing():
        return
    try:
        destroy(handle, device)
    except Exception as exc:
        sys.stderr.write(f"rocmforge_raw: destroying {handle!r} failed: {exc}\n")


class Stream:
    """A device work queue. ``close()`` (or ``with``, or garbage collection) destroys it."""

    def __init__(self, device: int | None = None, backend: str | Backend | None = None) -> None:
        self.backend = get_backend(backend)
        self.device = self.backend.get_device() if device is None else device
        self.handle: Any = self.backend.stream_create(self.device)
        self._finalizer = weakref.finalize(
            self, _destroy, self.backend.stream_destroy, self.handle, self.device, os.getpid())
        self._finalizer.atexit = False

    def synchronize(self) -> None:
        """Wait until every operation queued so far has finished."""
        self.backend.stream_synchronize(self.handle)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Event:
    """A point in a stream; ``end.elapsed_ms_since(start)`` times the work between two."""

    def __init__(self, device: int | None = None, backend: str | Backend | None = None) -> None:
        self.backend = get_backend(backend)
        self.device = self.backend.get_device() if device is None else device
        self.handle: Any = self.backend.event_create(self.device)
        self._finalizer = weakref.finalize(
            self, _destroy, self.backend.event_destroy, self.handle, self.device, os.getpid())
        self._finalizer.atexit = False

    def record(self, stream: Stream | None = None) -> Event:
        self.backend.event_record(self.handle, None if stream is None else stream.handle)
        return self

    def synchronize(self) -> None:
        self.backend.event_synchronize(self.handle)

    def elapsed_ms_since(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event; both must have completed."""
        return self.backend.event_elapsed_ms(start.handle, self.handle)

    def close(self) -> None:
        self._finalizer()
