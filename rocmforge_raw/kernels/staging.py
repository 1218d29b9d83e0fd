"""Stream-ordered staging: pinned host memory, reusable device metadata, split-K scratch.

Memory the device may still read is never freed, reused or overwritten before an event
recorded after its last use has completed (DESIGN.md, stream order). Each reusable piece of
memory here carries a ``Fence``: the event of its last use. Reuse checks the fence; the host
waits on it (an event, never the whole device) only when the device is that far behind.
Freeing device or pinned memory waits for the whole device (cuMemFree, cuMemFreeHost,
hipFree), so memory outgrown here is never freed mid-stream: it is handed to the registry
(``release_after``) with an event after its last use, and waits there (``memory_stats()``)
until ``free_waiting()``, interpreter exit or its owner's ``close()`` frees it.

- ``PinnedBuffer``: page-locked host memory, which asynchronous host-to-device copies read
  when the device gets to them (so it must not change before then).
- ``Staging``: one slot of metadata: pinned bytes, their device copy, a split-K
  ``Workspace``, launches prepared for them, and the fence of their last use.
- ``StagingRing``: slots handed out in turn. A slot whose fence has not passed is skipped by
  adding a slot (up to ``max_depth``), so the host runs ahead of the device without waiting.
- ``Workspace``: split-K partials and counters, grown when a launch needs more.
Sizes are bytes. None of these is locked: their owner's lock (an op, a cache) covers them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..common import checks
from ..memory.array import DeviceArray
from ..memory.buffer import HipBuffer
from ..memory.stream import Event, Stream, stream_handle
from ..memory.waiting import defer_free, event_after, free_entry
from ..runtime import Backend, get_backend
from ._pack import pack_host, pack_pieces, pack_step

#: Alignment of each array a Staging packs (bytes): what a device load of it may assume.
ALIGN = 256


def _free_pinned(backend: Backend, ptr: int, device: int, pid: int) -> None:
    if os.getpid() == pid and not sys.is_finalizing():
        try:
            backend.host_free(ptr, device)
        except Exception as exc:  # a finalizer must not raise
            sys.stderr.write(f"rocmforge_raw: freeing pinned memory failed: {exc}\n")


class PinnedBuffer:
    """``nbytes`` (> 0) of page-locked host memory for ``device``; freed by ``close()`` or
    garbage collection (a finalizer that holds no reference to the buffer), or handed over
    with ``release_after``."""

    def __init__(self, nbytes: int, device: int, backend: Backend) -> None:
        self.nbytes, self.device, self.backend = nbytes, device, backend
        self.ptr = backend.host_alloc(nbytes, device)
        self._finalizer = weakref.finalize(self, _free_pinned, backend, self.ptr, device,
                                           os.getpid())
        self._finalizer.atexit = False
        self._waiting: Any = None  # the registry's entry after release_after

    def array(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        """``count`` elements of ``dtype`` at ``offset``, as a NumPy view (no copy)."""
        dtype = np.dtype(dtype)
        if not self._finalizer.alive or offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"{count} x {dtype} at offset {offset} do not fit a "
                             f"{self.nbytes}-byte pinned buffer (or it was closed)")
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr + offset)
        return np.frombuffer(raw, dtype, count)

    def close(self) -> None:
        """Free the memory now (once the device has passed it, if handed over). Idempotent."""
        if self._waiting is not None:
            entry, self._waiting = self._waiting, None
            free_entry(entry)
        else:
            self._finalizer()

    def release_after(self, after: Event | Stream | None = None) -> None:
        """Close now and free the memory once the device has passed ``after``, as
        ``HipBuffer.release_after`` does: until then it counts as ``waiting_other`` in
        ``memory_stats()``. Nothing happens once closed."""
        if not self._finalizer.alive:
            return
        event = event_after(after, self.backend, self.device)
        detached = self._finalizer.detach()
        if detached is not None:
            _, free, args, _ = detached
            self._waiting = defer_free(functools.partial(free, *args), self.nbytes, event)


class Fence:
    """The last use of some memory on the device: an event recorded on the stream that used
    it. ``passed()`` asks without waiting; ``wait()`` waits for that event alone. Memory
    given to ``retire`` is handed to the registry at the next mark."""

    def __init__(self, device: int, backend: Backend) -> None:
        self.device, self.backend = device, backend
        self._event: Event | None = None
        self._pending = False
        self._handover: list[HipBuffer | PinnedBuffer] = []

    def mark(self, stream: Stream | None) -> None:
        """The memory's last use so far was queued on ``stream`` just now."""
        if self._event is None:
            self._event = Event(self.device, self.backend)
        self._event.record(stream)
        self._pending = True
        if self._handover:  # an event of their own: this fence records its own again
            after = Event(self.device, self.backend).record(stream)
            handover, self._handover = self._handover, []
            for memory in handover:
                memory.release_after(after)

    def retire(self, memory: HipBuffer | PinnedBuffer) -> None:
        """Hand ``memory``, which launches up to this fence's next ``mark`` may use, to the
        registry at that mark (``release_after``): it waits there until the device has
        passed it. Its owner keeps it to ``close()`` (which frees it then) at its own end."""
        self._handover.append(memory)

    def passed(self) -> bool:
        if self._pending and self.backend.event_query(self._event.handle):
            self._pending = False
        return not self._pending

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def close(self) -> None:
        if self._event is not None:
            self._event.close()
            self._event = None
        self._pending = False
        self._handover = []  # their owner closes them


class Workspace:
    """Split-K scratch that lives across launches: partial outputs and the per-group
    counters through which the last CTA of a group finds out it is last (zero between
    launches: each launch resets the counters it uses). Grows on demand; an outgrown buffer
    is handed to the registry with an event on the stream of the ``get`` that outgrew it
    (it waits there, or until ``close()``: a free waits for the whole device), so use one
    per stream. Pass one to ``ops.paged_attention`` to avoid allocations per call. Its
    first ``get`` binds it to that device (of that backend) until ``close()``: another
    device's launch is refused."""

    def __init__(self) -> None:
        self._partials: HipBuffer | None = None
        self._counters: HipBuffer | None = None
        self._fence: Fence | None = None
        self._outgrown: list[HipBuffer] = []  # handed over; close() frees them

    def get(self, nbytes: int, counters: int, like: Any, stream: Stream | None = None
            ) -> tuple[HipBuffer, HipBuffer]:
        """(``nbytes`` of partials, ``counters`` int32 counters at zero) on ``like``'s
        device, for a launch about to be queued on ``stream`` (call ``used`` after it)."""
        nbytes, counters = checks.size(nbytes, "nbytes"), checks.size(counters, "counters")
        if not isinstance(like, (HipBuffer, DeviceArray)):
            raise TypeError(f"like must be a HipBuffer or DeviceArray, got {checks.show(like)}")
        self.check_device(like, "like")
        stream_handle(stream, "stream", like.backend, like.device)
        if self._fence is None:
            self._fence = Fence(like.device, like.backend)
        if self._partials is None or self._partials.nbytes < nbytes:
            self._partials = self._replace(self._partials, nbytes, like, stream)
        if self._counters is None or self._counters.nbytes < 4 * counters:
            self._counters = self._replace(self._counters, 4 * counters, like, stream)
            self._counters.fill(0, stream=stream)
        return self._partials, self._counters

    def ready(self, nbytes: int, counters: int) -> tuple[HipBuffer, HipBuffer] | None:
        """What ``get`` would hand out for ``nbytes`` and ``counters`` when the buffers hold
        that much already, else None (then ``get``): no checks, for a caller whose ``like``
        and stream an earlier ``get`` bound (a decode step's planner)."""
        partials, counts = self._partials, self._counters
        if (partials is not None and counts is not None and nbytes <= partials.nbytes
                and 4 * counters <= counts.nbytes):
            return partials, counts
        return None

    def check_device(self, like: Any, name: str) -> None:
        """``ValueError`` (naming ``name`` and both devices) unless ``like`` (a HipBuffer or
        DeviceArray) is on the device this workspace is bound to, or it is bound to none."""
        if self._fence is not None:
            checks.colocated("workspace", self._fence.backend, self._fence.device, name,
                             like.backend, like.device)

    def used(self, stream: Stream | None) -> None:
        """A launch that uses this workspace was just queued on ``stream``."""
        if self._fence is not None:  # else nothing was handed out yet
            self._fence.mark(stream)

    def _replace(self, old: HipBuffer | None, nbytes: int, like: Any,
                 stream: Stream | None) -> HipBuffer:
        """A new buffer of at least ``nbytes``; ``old`` is handed over after the work queued
        on ``stream`` so far (every earlier use of a workspace of one stream)."""
        new = HipBuffer(max(nbytes, 0 if old is None else 2 * old.nbytes, 1), like.device,
                        like.backend)
        if old is not None:
            old.release_after(stream)
            self._outgrown.append(old)
        return new

    def close(self) -> None:
        """Free the buffers, outgrown ones too (after the device has passed their last use)."""
        if self._fence is not None:
            self._fence.wait()
            self._fence.close()
        for buf in (self._partials, self._counters, *self._outgrown):
            if buf is not None:
                buf.close()
        self._partials = self._counters = self._fence = None
        self._outgrown = []


class Staging:
    """One slot: pinned host bytes, their device copy and a ``Workspace``, with the fence of
    their last use. ``put`` packs arrays and queues one asynchronous upload; ``launches``
    keeps launches prepared for this slot's addresses (cleared when the slot grows)."""

    def __init__(self, device: int, backend: Backend) -> None:
        self.device, self.backend = device, backend
        self.fence = Fence(device, backend)
        self.workspace = Workspace()
        self.launches: dict[tuple, Any] = {}
        self.host: PinnedBuffer | None = None
        self.buffer: HipBuffer | None = None
        self._used = 0  # bytes the puts since the last fence filled
        self._outgrown: list[PinnedBuffer | HipBuffer] = []

    def put(self, arrays: list[np.ndarray], stream: Stream | None, append: bool = False
            ) -> list[int]:
        """Copy ``arrays`` into pinned memory, each at a multiple of ``ALIGN`` bytes, and
        queue one upload on ``stream``. Returns each array's device address. The fence must
        have passed (``StagingRing.acquire`` sees to it); ``mark`` it after the last launch
        that reads these addresses. ``append`` keeps what earlier puts since the fence
        uploaded (their addresses stay valid) and places ``arrays`` after it."""
        start = self._used if append else 0
        capacity = 0 if self.buffer is None else self.buffer.nbytes
        base = 0 if self.host is None else self.host.ptr
        total, offsets = pack_host(base, capacity, arrays, start, ALIGN)  # copies if it fits
        if self.buffer is None or total > capacity:
            if self._reserve(max(total, ALIGN)) and start:  # a new buffer: earlier puts
                start = 0  # stay in the old one, kept
            total, offsets = pack_host(self.host.ptr, self.buffer.nbytes, arrays, start, ALIGN)
        return self._upload(start, total, offsets, stream)

    def put_step(self, slots: np.ndarray, lens: np.ndarray, tables: np.ndarray, groups: int,
                 ctas: int, rule: tuple, stream: Stream | None
                 ) -> tuple[list[int], tuple[int, int, int, bool, bool]]:
        """``put`` of a decode step's ``[slots, lens, tables]`` and of their work split
        (``cum16``, ``first_seq``: ``planning.plan_work`` of ``lens`` over ``groups`` units
        a sequence, ``ctas`` slots, ``rule`` from ``planning.split_rule``), computed straight
        into the pinned bytes (``_pack.pack_step``). Returns the five arrays' device
        addresses and the split's (num_ctas, per_cta, total, whole, lean)."""
        capacity = 0 if self.buffer is None else self.buffer.nbytes
        base = 0 if self.host is None else self.host.ptr
        end, offsets, num_ctas, per_cta, total, whole, lean = pack_step(
            base, capacity, ALIGN, slots, lens, tables, groups, ctas, rule)
        if not num_ctas:  # the step's layout outgrew the slot
            self._reserve(end)
            end, offsets, num_ctas, per_cta, total, whole, lean = pack_step(
                self.host.ptr, self.buffer.nbytes, ALIGN, slots, lens, tables, groups, ctas,
                rule)
            assert num_ctas, "a reserved slot holds its step"
        return self._upload(0, end, offsets, stream), (num_ctas, per_cta, total, whole, lean)

    def put_pieces(self, spans: np.ndarray, src: HipBuffer, dst: HipBuffer, piece: int,
                   stream: Stream | None) -> tuple[int, int]:
        """``put`` of the piece table of a span copy from ``src`` to ``dst`` (buffers of this
        slot's device), cut straight into the pinned bytes (``_pack.pack_pieces``: ``spans``
        int64 C-contiguous ``[n, 3]``, pieces of at most ``piece`` bytes). Returns (device
        address of the table, pieces); pieces -1 where the spans need the general checks
        (``pack_pieces``): nothing is uploaded then."""
        capacity = 0 if self.buffer is None else self.buffer.nbytes
        base = 0 if self.host is None else self.host.ptr
        args = (spans, src.ptr, dst.ptr, src.nbytes, dst.nbytes, piece)
        count, nbytes = pack_pieces(base, capacity, *args)
        if count > 0 and nbytes > capacity:
            self._reserve(nbytes)
            count, nbytes = pack_pieces(self.host.ptr, self.buffer.nbytes, *args)
            assert nbytes <= self.buffer.nbytes, "a reserved slot holds its pieces"
        if count <= 0:
            return 0, count
        return self._upload(0, nbytes, [0], stream)[0], count

    def _upload(self, start: int, end: int, offsets: Sequence[int], stream: Stream | None
                ) -> list[int]:
        """Queue the upload of the packed bytes ``[start, end)`` on ``stream`` (the puts
        since the fence now fill ``end`` bytes); the device addresses of ``offsets``."""
        if end > start:
            self.backend.upload(self.buffer.ptr + start, self.host.ptr + start, end - start,
                                stream_handle(stream, "stream", self.backend, self.device))
        self._used = end
        base = self.buffer.ptr
        return [base + offset for offset in offsets]

    def _reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes``; True when that took new buffers."""
        if self.buffer is not None and self.buffer.nbytes >= nbytes:
            return False
        if self.buffer is not None:
            nbytes = max(nbytes, 2 * self.buffer.nbytes)
        host = PinnedBuffer(nbytes, self.device, self.backend)
        try:
            buffer = HipBuffer(nbytes, self.device, self.backend)
        except BaseException:
            host.close()
            raise
        if self.buffer is not None:
            # outgrown: launches of the puts since the fence's last mark may still read it,
            # so it is handed over at the next mark
            assert self.host is not None
            for old in (self.host, self.buffer):
                self.fence.retire(old)
                self._outgrown.append(old)
        self.host, self.buffer = host, buffer
        self.launches.clear()
        return True

    def close(self) -> None:
        """Free everything, once the device has passed the last use."""
        self.fence.wait()
        self.workspace.close()
        self.launches.clear()
        for part in (self.host, self.buffer, *self._outgrown):
            if part is not None:
                part.close()
        self.host = self.buffer = None
        self._outgrown = []
        self.fence.close()


class StagingRing:
    """``Staging`` slots handed out in turn (see the module docstring)."""

    def __init__(self, device: int | None = None, backend: str | Backend | None = None,
                 depth: int = 2, max_depth: int = 16) -> None:
        self.backend = get_backend(backend)
        self.device = self.backend.get_device() if device is None else device
        self.max_depth = max(depth, max_depth)
        self.slots = [Staging(self.device, self.backend) for _ in range(max(depth, 1))]
        self._next = 0

    def acquire(self) -> Staging:
        """The next slot whose last use the device has passed: a new slot while the device
        lags (up to ``max_depth``), else the next one once its fence passes (a wait)."""
        if not self.slots:
            raise ValueError("this staging ring was closed")
        slot = self.slots[self._next]
        if not slot.fence.passed() and len(self.slots) < self.max_depth:
            slot = Staging(self.device, self.backend)
            self.slots.insert(self._next, slot)
        slot.fence.wait()
        self._next = (self._next + 1) % len(self.slots)
        return slot

    def put_back(self, slot: Staging) -> None:
        """``slot``, the last one ``acquire`` handed out, went unused after all (its plan
        failed; fence it first, for what it may have queued): it is handed out next again,
        so the slots keep their turns and a slot that another plan still reads is never
        handed out early (its fence is marked only when that plan retires)."""
        self._next = self.slots.index(slot)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots = []
