"""Memory the device may still use, handed over until it has passed: the public face of the
registry's waiting memory (``_registry``), and the event such memory waits for.

An owner that stops using memory the device may still read or write hands it over instead of
freeing it (a free waits for the whole device, DESIGN.md: stream order): a root buffer with
``HipBuffer.release_after(after)``, other memory with ``defer_free``. From then it is closed
to its owner and counted as waiting in ``memory_stats()``; ``free_waiting()`` frees it once
the device has passed its last use, as do interpreter exit and the owner's ``close()`` of it.
"""

from __future__ import annotations

from typing import Any

from ..common import checks
from ._registry import add_holder, defer_free, free_entry, free_waiting
from .stream import Event, Stream

__all__ = ["add_holder", "defer_free", "event_after", "free_entry", "free_waiting"]


def event_after(after: Event | Stream | None, backend: Any, device: int) -> Event:
    """The event that memory of ``device`` of ``backend`` waits for, from what
    ``release_after`` takes: an ``Event`` recorded after the memory's last use (kept as it
    is: its latest record is what is waited for), or the ``Stream`` (None: the default
    stream of ``device``) where that use was queued, on which a new event is recorded now."""
    if isinstance(after, Event):
        if after.backend is not backend:
            checks.colocated("the event", after.backend, after.device, "the memory", backend,
                             device)
        after.handle  # noqa: B018 - raises BufferClosedError if closed
        if not after.recorded:
            raise ValueError("the event was never recorded: record it after the memory's "
                             "last use on the device")
        return after
    if after is None:
        return Event(device, backend).record(None)
    if not isinstance(after, Stream):
        raise TypeError(f"after must be an Event, a Stream or None, got {checks.show(after)}")
    if after.backend is not backend:
        checks.colocated("the stream", after.backend, after.device, "the memory", backend,
                         device)
    return Event(after.device, backend).record(after)
