"""What a captured step fixes and what each replay uploads (``graph.StepGraph``).

``padded_work`` lays a step's real work out over the split a graph was captured with (every
sequence its own work in whole pieces where that fits, else plus an even share of the slack;
the kernel skips what lies past each sequence's length); ``GraphShape`` says which steps
replay a capture; ``PinnedUploads`` copies each replay's metadata into pinned host memory
and queues its upload to the graph's fixed device addresses, each pinned buffer reused once
the event after its upload passed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels.planning import WORK_GRANULE, AttentionPlan
from ...kernels.planning._worksplit import first_sequences, prefix_sums
from ...kernels.planning.prefill import PrefillKernel, PrefillWork
from ...kernels.staging import ALIGN, Fence, PinnedBuffer
from ...memory.array import DeviceArray
from ...memory.stream import Stream

Layer = tuple[DeviceArray, DeviceArray, DeviceArray, DeviceArray]  # key, value, query, out
#: Each layer's key, value, query and output as (address, shape), None where not an array.
Activations = tuple[tuple[Any, Any], ...]


#: Where arrays lie in one buffer: each one's (byte offset, shape).
Placement = list[tuple[int, tuple[int, ...]]]


def pack_layout(arrays: list[tuple[Any, tuple[int, ...]]]) -> tuple[Placement, int]:
    """Each array's (offset, shape) when arrays of these (dtype, shape) lie one after
    another, each at an ALIGN boundary, and the bytes they span."""
    layout, offset = [], 0
    for dtype, dims in arrays:
        layout.append((offset, tuple(dims)))
        offset += -(-int(np.prod(dims)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    return layout, offset


def padded_work(lens: np.ndarray, groups: int, total: int, per_cta: int, num_ctas: int,
                bound: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The work layout of a split captured for ``total`` work tokens (``num_ctas`` CTAs of
    ``per_cta``) over sequences of ``lens`` (int32): ``cum16`` (int64 ``[n + 1]``) and
    ``first_seq`` (int32 ``[num_ctas]``, the sequence holding each CTA's first work token),
    with ``cum16[n] * groups == total``. Each sequence gets its own work (its length rounded
    up to WORK_GRANULE, at least one granule) up to whole shares of ``per_cta`` where all of
    that fits (every CTA then holds one piece of one unit, as ``plan_work`` pads a split;
    the last sequence takes the rest), else its own work plus an even share of the slack in
    whole granules, the first ones one more. None when the lengths need more than ``bound``
    work tokens a group (None: ``total // groups``)."""
    n = lens.size
    cum16 = np.empty(n + 1, np.int64)
    need = prefix_sums(np.ascontiguousarray(lens, np.int32), WORK_GRANULE, cum16)
    room = total // groups
    if n == 0 or total % groups or need > (room if bound is None else min(bound, room)):
        return None
    work = np.diff(cum16)
    whole = -(-work // per_cta) * per_cta
    if room % per_cta == 0 and int(whole.sum()) <= room:
        whole[-1] += room - int(whole.sum())  # whole shares: the rest is too
        cum16[1:] = np.cumsum(whole)
    else:
        spare, extra = divmod((room - need) // WORK_GRANULE, n)
        pads = np.full(n + 1, spare * WORK_GRANULE, np.int64)
        pads[0] = 0
        pads[1 : extra + 1] += WORK_GRANULE
        cum16 += np.cumsum(pads)
    first_seq = np.empty(num_ctas, np.int32)
    first_sequences(cum16, groups, per_cta, first_seq)
    return cum16, first_seq


@dataclass(frozen=True)
class GraphShape:
    """What a captured graph fixed: its members in order, their activations' addresses and
    shapes, the block tables' width and the decode attention's split (``total`` work tokens
    in ``num_ctas`` CTAs of ``per_cta``, ``groups`` units per sequence), and the work tokens
    a group the members' lengths may need before a re-capture (``bound``: their room,
    rounded as their work is; None: ``total // groups``). A step of many query tokens per
    sequence also fixes its ``query_lens`` (so its token count and the multi-token kernel's
    work items); its split covers the ``decodes`` leading sequences (None: all of them;
    0: no decode launch, ``total`` 0)."""

    members: tuple[Hashable, ...]
    activations: Activations
    width: int
    groups: int
    total: int
    per_cta: int
    num_ctas: int
    bound: int | None = None
    query_lens: tuple[int, ...] | None = None
    decodes: int | None = None

    def admits(self, members: tuple[Hashable, ...], activations: Activations, width: int,
               lens: np.ndarray, query_lens: tuple[int, ...] | None = None
               ) -> tuple[np.ndarray, ...] | None:
        """The decode launch's work layout (``padded_work``: ``cum16``, ``first_seq``; none
        without decodes) of a step of these members, activations, table width, lengths and
        query lengths if it replays this capture; None if it must re-capture."""
        if (members != self.members or activations != self.activations
                or width > self.width or query_lens != self.query_lens):
            return None
        if self.decodes == 0:
            return ()
        return padded_work(lens if self.decodes is None else lens[:self.decodes], self.groups,
                           self.total, self.per_cta, self.num_ctas, self.bound)


@dataclass
class CapturePlan:
    """What a capture records: its ``shape`` (what later steps must match: a
    ``GraphShape``, or a ``graph_budget.BudgetShape``, each with the tables' ``width``), the
    step's upload (``arrays``: tables, lengths, slots, the decode split's arrays, then the
    multi-token work's unless ``fixed``), the decode launch's plan and the multi-token
    instance and work (None: no such launch), the table row the multi-token sequences start
    at and the byte offset of their query rows. ``fixed``: the multi-token work is uploaded
    once, at the capture, and each replay's upload leaves it out. ``shapes``: what the
    arrays take in the graph's metadata (None: their own; a narrower table is padded)."""

    shape: Any
    arrays: list[np.ndarray]
    decode: AttentionPlan | None
    multi: tuple[PrefillKernel, PrefillWork] | None
    prefill_row: int
    q_offset: int
    fixed: bool
    shapes: list[tuple[Any, tuple[int, ...]]] | None = None

    def layout_shapes(self) -> list[tuple[Any, tuple[int, ...]]]:
        return self.shapes or [(a.dtype, a.shape) for a in self.arrays]


def activations_of(layers: Sequence[Layer]) -> Activations:
    """The address and shape of every layer's key, value, query and output, in order (None
    for what is not an array: the capture's checks then say what it is)."""
    return tuple((getattr(array, "ptr", None), getattr(array, "shape", None))
                 for layer in layers for array in layer)


class PinnedUploads:
    """Pinned host buffers taken in turn, each reused once the device has passed its last
    upload: a new one while the device lags (up to ``max_depth``), else a wait for the
    oldest (an event, never the whole device)."""

    def __init__(self, device: int, backend: Any, max_depth: int = 16) -> None:
        self.device, self.backend, self.max_depth = device, backend, max_depth
        self.buffers: list[tuple[PinnedBuffer, Fence]] = []
        self._outgrown: list[PinnedBuffer] = []  # freed by close(): a free waits for the device
        self._next = 0

    def upload(self, arrays: list[np.ndarray], layout: list[tuple[int, tuple[int, ...]]],
               target: int, stream: Stream | None) -> None:
        """Copy ``arrays`` into a free pinned buffer, each at its (offset, shape) of
        ``layout`` (an array narrower than its shape is padded with zeros along its last
        axis), and queue one upload of it to device address ``target`` on ``stream``."""
        offset, shape = layout[-1]
        nbytes = offset + int(np.prod(shape)) * arrays[-1].itemsize
        pinned, fence = self._take(nbytes)
        for array, (offset, shape) in zip(arrays, layout):
            view = pinned.array(array.dtype, int(np.prod(shape)), offset).reshape(shape)
            width = array.shape[-1]
            view[..., :width] = array
            view[..., width:] = 0
        self.backend.upload(target, pinned.ptr, nbytes, None if stream is None else
                            stream.handle)
        fence.mark(stream)

    def _take(self, nbytes: int) -> tuple[PinnedBuffer, Fence]:
        """The next buffer (of at least ``nbytes``) whose last upload the device passed."""
        if self.buffers and not self.buffers[self._next][1].passed() and (
                len(self.buffers) < self.max_depth):
            self.buffers.insert(self._next, self._new(nbytes))
        elif not self.buffers:
            self.buffers.append(self._new(nbytes))
        pinned, fence = self.buffers[self._next]
        fence.wait()
        if pinned.nbytes < nbytes:  # outgrown: waits until close() or free_waiting()
            fence.retire(pinned)
            self._outgrown.append(pinned)
            pinned = PinnedBuffer(max(nbytes, 2 * pinned.nbytes), self.device, self.backend)
            self.buffers[self._next] = pinned, fence
        self._next = (self._next + 1) % len(self.buffers)
        return pinned, fence

    def _new(self, nbytes: int) -> tuple[PinnedBuffer, Fence]:
        return (PinnedBuffer(max(nbytes, ALIGN), self.device, self.backend),
                Fence(self.device, self.backend))

    def close(self) -> None:
        for pinned, fence in self.buffers:
            fence.wait()
            fence.close()
            pinned.close()
        for pinned in self._outgrown:
            pinned.close()
        self.buffers, self._outgrown = [], []
