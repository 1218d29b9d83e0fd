"""StreamOrder: a cache's copies between tiers, ordered with its other device work.

Copies between the slab and the host tier (swaps, demotions, promotions) are queued on the
stream of the operation that makes them. Work on that same stream is ordered by the stream
itself; work on other streams is ordered here, on the device, never by a host wait:

- before the copies, their stream waits for everything the other streams queued on the
  cache since the last copies (``before_copies``): a block is read only after the device's
  last use of it;
- after them, an event marks the copies (``after_copies``), and the first work another
  stream queues on the cache afterwards waits for that event (``used``): a block a copy
  reads is reused, and a host block it writes is read, only once the copy has passed.

The cache calls ``used(stream)`` before it queues work on ``stream`` (a step's plan, a
prefill write, a copy-on-write copy): one dictionary lookup while nothing changes. The
streams seen since the last copies are kept (so their work can be waited for); past
``MAX_STREAMS`` of them the device is synchronized once and the list starts again, so it
never grows without bound. Not locked: the cache's lock covers every call.
"""

from __future__ import annotations

from ...memory.stream import Event, Stream, stream_handle
from ...runtime import Backend

#: Streams remembered between two copies before one synchronization forgets them all.
MAX_STREAMS = 64


class StreamOrder:
    """The order of one cache's copies and its other device work (module docstring)."""

    def __init__(self, backend: Backend, device: int) -> None:
        self.backend, self.device = backend, device
        self._streams: dict[int, Stream | None] = {}  # id -> stream, since the last copies
        self._copy_stream: Stream | None = None
        self._copied = Event(device, backend)  # recorded after the last copies
        self._pending = False  # whether the device may not have passed ``_copied`` yet
        self._join: Event | None = None

    def used(self, stream: Stream | None) -> None:
        """``stream`` is about to queue work on the cache's memory."""
        key = id(stream)
        if key in self._streams:
            return
        if len(self._streams) >= MAX_STREAMS:
            self.backend.synchronize(self.device)  # all they queued is done: forget them
            self._streams.clear()
            self._pending = False
        self._streams[key] = stream
        if stream is not self._copy_stream and self._pending:
            if self.backend.event_query(self._copied.handle):
                self._pending = False
            else:
                self.backend.stream_wait_event(
                    stream_handle(stream, backend=self.backend, device=self.device),
                    self._copied.handle)

    def before_copies(self, stream: Stream | None) -> None:
        """Copies are about to be queued on ``stream``: it waits for the others' work."""
        handle = stream_handle(stream, backend=self.backend, device=self.device)  # activates it
        for other in self._streams.values():
            if other is stream:
                continue
            if other is not None and other.closed:  # its work cannot be marked any more
                self.backend.synchronize(self.device)
                continue
            if self._join is None:
                self._join = Event(self.device, self.backend)
            self._join.record(other)  # a wait takes the record of its call: reusable
            self.backend.stream_wait_event(handle, self._join.handle)

    def after_copies(self, stream: Stream | None) -> None:
        """Copies were just queued on ``stream``."""
        self._copied.record(stream)
        self._pending = True
        self._copy_stream = stream
        self._streams = {id(stream): stream}

    def wait(self) -> None:
        """Wait (on the host) until the device has passed the last copies."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def close(self) -> None:
        """Wait for the last copies, then destroy the events."""
        self.wait()
        for event in (self._copied, self._join):
            if event is not None:
                event.close()
        self._streams.clear()

    def __repr__(self) -> str:
        return f"<StreamOrder {len(self._streams)} streams, copies pending {self._pending}>"

