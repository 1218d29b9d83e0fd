"""What the one-off ops share: a staging ring per device (pinned memory for their metadata,
reused once the device has passed it, given back by ``release_staging``, which
``rocmforge_raw.free_waiting()`` and interpreter exit call), host views of host-backend arrays
and the checks of integer metadata given on the host or the device."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from ..common import checks
from ..memory.array import DeviceArray
from ..memory.stream import Stream
from ..memory.waiting import add_holder
from ..runtime import Backend
from .planning import device_ints, host_ints
from .staging import Staging, StagingRing


def host_view(array: DeviceArray) -> np.ndarray:
    """A NumPy array over a host-backend DeviceArray's memory (no copy)."""
    if not isinstance(array, DeviceArray):
        raise TypeError(f"array must be a DeviceArray, got {checks.show(array)}")
    if array.backend.name != "host":
        raise ValueError(f"host_view needs host memory, not {array.backend.name}")
    raw: Any = (ctypes.c_char * array.nbytes).from_address(array.ptr) if array.nbytes else b""
    return np.frombuffer(raw, array.dtype).reshape(array.shape)


_rings: dict[tuple[int, int], tuple[threading.Lock, StagingRing]] = {}
_rings_lock = threading.Lock()


def release_staging() -> None:
    """Free the staging memory the one-off ops keep per device (pinned and device buffers,
    once the device has passed their last use); the next op allocates it again.
    ``rocmforge_raw.free_waiting()`` calls this first, as does interpreter exit."""
    with _rings_lock:
        rings = list(_rings.values())
        _rings.clear()
    for lock, ring in rings:
        with lock:
            ring.close()


def _forget_rings() -> None:
    """In a forked child: the rings are the parent's (its memory, its device contexts)."""
    global _rings_lock
    _rings.clear()
    _rings_lock = threading.Lock()  # a thread of the parent may have held it


add_holder(release_staging)
os.register_at_fork(after_in_child=_forget_rings)


class Place(NamedTuple):
    """A device of a backend, as ``staging`` keys its rings."""

    backend: Backend
    device: int


@contextmanager
def staging(like: DeviceArray | Place, stream: Stream | None) -> Iterator[Staging]:
    """A staging slot of ``like``'s device for one launch; its fence is marked on ``stream``
    afterwards (also when the launch raised: an upload may be queued already)."""
    key = (id(like.backend), like.device)
    with _rings_lock:
        if key not in _rings:
            _rings[key] = threading.Lock(), StagingRing(like.device, like.backend)
        lock, ring = _rings[key]
    with lock:
        slot = ring.acquire()
        try:
            yield slot
        finally:
            slot.fence.mark(stream)


def metadata(values: Any, name: str, dtype: Any, ndim: int, shape: tuple[int, ...] | None,
              like: DeviceArray, like_name: str) -> np.ndarray | None:
    """Host metadata as a checked array; device metadata checked by shape and place (on
    ``like``'s device; None returned), except on the host backend, where it is host memory
    and read in place."""
    if not isinstance(values, DeviceArray):
        array = host_ints(values, name, dtype, shape)
        if array.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
        return array
    device_ints(values, name, dtype, ndim, shape, like, like_name)
    return host_view(values) if like.backend.name == "host" else None
