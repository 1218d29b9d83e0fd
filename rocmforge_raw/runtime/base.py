"""The backend interface: the few calls every runtime (HIP, CUDA, host) provides.

Everything above ``runtime/`` talks to devices only through this interface. Device pointers are
plain ``int`` addresses, sizes are bytes, and stream/event/module/function handles are opaque
objects owned by the backend that created them. A stream argument of ``None`` means the default
(null) stream. Backends do no argument validation beyond what the binding does: callers
(``HipBuffer``, ``module``) check sizes and bounds first.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, TypeVar

from ..common import checks
from ..errors import BackendUnavailableError
from ._alloc import Allocator, BackendAllocator
from ._launch import DriverCalls, LaunchApi

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceProperties:
    """What a device is: ``arch`` is ``gfx942``/``sm_90``/``host``; memory in bytes."""

    backend: str
    index: int
    name: str
    arch: str
    total_bytes: int
    multiprocessors: int
    warp_size: int


#: The largest row pitch (bytes) callers give ``memcpy_2d``: the limit CUDA documents
#: (CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2**31 - 1 on its GPUs); HIP is held to the same.
MAX_PITCH = (1 << 31) - 1


_T = TypeVar("_T")


class Backend(ABC):
    """One runtime. Implementations are short: each method is one or two binding calls."""

    name: ClassVar[str]
    #: DLPack device type (kDLCPU=1, kDLCUDA=2, kDLROCM=10).
    dlpack_device_type: ClassVar[int]

    # devices
    @abstractmethod
    def device_count(self) -> int: ...
    @abstractmethod
    def properties(self, device: int) -> DeviceProperties: ...
    @abstractmethod
    def set_device(self, device: int) -> None:
        """Make ``device`` this thread's device: what ``device=None`` means here from now."""
    @abstractmethod
    def get_device(self) -> int:
        """This thread's device (``set_device``; 0 in a thread that never set one)."""
    def activate(self, device: int) -> None:
        """Make ``device`` the one the binding's implicit calls (its default stream, its C
        entry points) address in this thread, leaving ``get_device()`` as it is. Each method
        that takes a device does this itself."""
        return None

    def restoring(self, device: int, call: Callable[[], _T]) -> _T:
        """``call()`` with ``device`` active, then the thread's earlier active device again
        (``activate``): what finalizers call leaves the calling thread as it found it."""
        self.activate(device)
        return call()

    def forget_active(self) -> None:
        """The binding's current device may have been changed behind this backend's back
        (another library in this thread): the next ``activate`` sets it, whatever it was."""
        return None

    @abstractmethod
    def peer_access(self, device: int, peer: int) -> bool:
        """Let ``device`` reach ``peer``'s memory directly (peer copies over NVLink, xGMI or
        PCIe instead of through host memory) where the two allow it, once per pair: True
        if that access is on, False where they have none (``memcpy_peer`` still works:
        the runtime stages it through host memory). True for ``device == peer``."""
    @abstractmethod
    def mem_info(self, device: int) -> tuple[int, int]:
        """(free bytes, total bytes) of ``device``."""
    @abstractmethod
    def synchronize(self, device: int) -> None: ...

    # memory
    @abstractmethod
    def malloc(self, nbytes: int, device: int) -> int:
        """Allocate ``nbytes`` > 0 on ``device``; raises ``OutOfMemoryError`` when it cannot."""
    @abstractmethod
    def free(self, ptr: int, device: int) -> None: ...
    @abstractmethod
    def host_alloc(self, nbytes: int, device: int) -> int:
        """Page-locked host memory (``nbytes`` > 0) the device copies from asynchronously."""
    @abstractmethod
    def host_free(self, ptr: int, device: int) -> None: ...
    @abstractmethod
    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any = None) -> None: ...
    @abstractmethod
    def upload(self, dst: int, src_pinned: int, nbytes: int, stream: Any = None) -> None:
        """Asynchronous host-to-device copy queued on ``stream`` (None: the default stream,
        still asynchronous). ``src_pinned`` is page-locked (``host_alloc``) and must stay
        unchanged until the stream has passed the copy."""
    @abstractmethod
    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    @abstractmethod
    def download(self, dst_pinned: int, src: int, nbytes: int, stream: Any = None) -> None:
        """Asynchronous device-to-host copy queued on ``stream`` (None: the default stream,
        still asynchronous) into page-locked ``dst_pinned``, which holds the bytes only once
        the stream has passed the copy."""
    @abstractmethod
    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, to_host: bool, stream: Any = None) -> None:
        """Asynchronous copy of ``height`` rows of ``width`` bytes, rows ``src_pitch`` apart
        at ``src`` and ``dst_pitch`` apart at ``dst``, queued on ``stream``: device to
        page-locked host memory (``to_host``) or back. Pitches are at most ``MAX_PITCH``."""
    @abstractmethod
    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    @abstractmethod
    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None: ...

    @abstractmethod
    def memcpy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                    stream: Any = None) -> None:
        """Copy between two devices of this backend (or within one), queued on ``stream``
        (a stream of ``dst_device``); the runtime stages through host memory where the two
        devices have no peer access."""

    # memory shared with other processes (``rocmforge_raw.memory.ipc`` holds the lifetime protocol)
    def malloc_shareable(self, nbytes: int, device: int) -> int:
        """``nbytes`` > 0 that ``ipc_handle`` can name for another process. GPU allocations
        all are; the host backend makes a POSIX shared memory segment."""
        return self.malloc(nbytes, device)

    def free_shareable(self, ptr: int, nbytes: int, device: int) -> None:
        """Free what ``malloc_shareable`` returned (no other process maps it any more)."""
        self.free(ptr, device)

    @abstractmethod
    def ipc_handle(self, ptr: int, device: int) -> bytes:
        """The bytes that name the shareable allocation at ``ptr`` in other processes
        (hipIpcGetMemHandle/cuIpcGetMemHandle: 64 opaque bytes; host: a segment's name)."""
    @abstractmethod
    def ipc_open(self, handle: bytes, nbytes: int, device: int) -> int:
        """Map the allocation of another process named by ``handle`` (at least ``nbytes``)
        on ``device``; returns its address in this process."""
    @abstractmethod
    def ipc_close(self, ptr: int, nbytes: int, device: int) -> None:
        """Unmap what ``ipc_open`` mapped at ``ptr``; the exporter's memory stays allocated."""

    # streams and events
    @abstractmethod
    def stream_create(self, device: int) -> Any: ...
    @abstractmethod
    def stream_destroy(self, stream: Any, device: int) -> None: ...
    @abstractmethod
    def stream_synchronize(self, stream: Any) -> None: ...
    @abstractmethod
    def event_create(self, device: int) -> Any: ...
    @abstractmethod
    def event_destroy(self, event: Any, device: int) -> None: ...
    @abstractmethod
    def event_record(self, event: Any, stream: Any = None) -> None: ...
    @abstractmethod
    def event_synchronize(self, event: Any) -> None: ...
    @abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` after this call waits until the device has passed
        ``event`` (its latest record); the host does not wait."""
    @abstractmethod
    def event_query(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (True for an event never recorded)."""
    @abstractmethod
    def event_elapsed_ms(self, start: Any, end: Any) -> float: ...

    # code objects
    @abstractmethod
    def module_load(self, image: bytes, device: int) -> Any: ...
    @abstractmethod
    def module_unload(self, module: Any, device: int) -> None: ...
    @abstractmethod
    def module_function(self, module: Any, name: str) -> Any: ...
    @abstractmethod
    def launch(
        self, function: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
        shared_bytes: int, stream: Any, params_addr: int,
    ) -> None:
        """Launch with ``params_addr`` the address of a ``void*[]`` of argument addresses."""

    # graphs: a stream's launches captured once, replayed as one launch
    def graph_begin(self, stream: Any) -> None:
        """Start capturing ``stream`` (not the default stream): launches queued on it in
        this thread are recorded into a graph instead of run, until ``graph_end``."""
        raise self.no_graphs()

    def graph_end(self, stream: Any) -> Any:
        """Stop capturing ``stream``; returns the graph of what was recorded."""
        raise self.no_graphs()

    def graph_instantiate(self, graph: Any, device: int) -> Any:
        """An executable of ``graph`` on ``device`` (its launches' arguments fixed as
        recorded)."""
        raise self.no_graphs()

    def graph_launch(self, executable: Any, stream: Any) -> None:
        """Queue every launch of ``executable`` on ``stream`` (None: the default stream),
        a stream of the device it was instantiated on, which is active (``activate``)."""
        raise self.no_graphs()

    def graph_destroy(self, graph: Any, executable: Any, device: int) -> None:
        """Destroy an executable (None: there is none) and its graph, of ``device`` (work
        already queued still runs), leaving the thread's active device as it was."""
        raise self.no_graphs()

    def no_graphs(self) -> Exception:
        """The error of a graph call on a backend without graphs."""
        return NotImplementedError(f"the {self.name} backend cannot capture or replay graphs")

    def allow_shared(self, function: Any, shared_bytes: int) -> None:
        """Let ``function`` use ``shared_bytes`` of dynamic shared memory (a backend whose
        launches need an opt-in past some size does it here); done before C launches."""
        return None

    @cached_property
    def launch_api(self) -> LaunchApi | None:
        """The binding's C launch entry (``runtime._launch``), or None where there is none."""
        return self.make_launch_api()

    def make_launch_api(self) -> LaunchApi | None:
        return None

    @cached_property
    def driver_calls(self) -> DriverCalls | None:
        """The binding's C entries for event record/query and uploads (``runtime._launch``),
        or None where there are none: the backend's Python calls then serve alone."""
        return self.make_driver_calls()

    def make_driver_calls(self) -> DriverCalls | None:
        return None

    @cached_property
    def allocator(self) -> Allocator:
        """What raw (unpooled) HipBuffers allocate through: ``make_allocator()``, made once."""
        return self.make_allocator()

    def make_allocator(self) -> Allocator:
        """This backend's malloc/free for C callers: a subclass returns its C fast path; this
        one calls ``malloc``/``free``."""
        return BackendAllocator(self)

    @cached_property
    def num_devices(self) -> int:
        """``device_count()``, asked once (devices do not come and go under a process)."""
        return self.device_count()

    def resolve_device(self, device: Any) -> int:
        """``device`` checked as an ordinal of this backend; None: the current device.
        ``TypeError``/``ValueError`` for a non-integer or negative value,
        ``BackendUnavailableError`` for a device that does not exist."""
        if device is None:
            return self.get_device()
        number = checks.integer(device, "device", 0)
        if number >= self.num_devices:
            raise BackendUnavailableError(
                f"device {number} does not exist: the {self.name} backend has "
                f"{self.num_devices} device(s)")
        return number

    def dlpack_device(self, device: int) -> tuple[int, int]:
        """DLPack's ``(device_type, device_id)`` of memory on ``device``."""
        return self.dlpack_device_type, device

    def cached_properties(self, device: int) -> DeviceProperties:
        """``properties(device)``, asked once per device (they do not change)."""
        cache: dict[int, DeviceProperties] = self.__dict__.setdefault("_properties", {})
        if device not in cache:
            cache[device] = self.properties(device)
        return cache[device]

    def capacity(self, device: int) -> int:
        """Total bytes of ``device``: no allocation larger than this can succeed."""
        return self.cached_properties(device).total_bytes

    @abstractmethod
    def max_active_blocks(self, function: Any, threads: int, shared_bytes: int) -> int:
        """How many blocks of ``threads`` fit on one multiprocessor at once (occupancy)."""

    def compile_source(self, source: str, name: str, arch: str, options: list[str]) -> bytes:
        """Compile kernel source at run time (hiprtc/NVRTC) to a loadable image."""
        raise NotImplementedError(f"the {self.name} backend cannot compile kernels at run time")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class ThreadDevices:
    """The per-thread device state of a backend, as CUDA and HIP keep it: the device a
    thread chose (``set_device``; 0 until it chooses), which ``device=None`` means, and the
    device the binding's implicit calls address now (``activate``), which work on another
    device switches without touching the choice. So a finalizer that frees another
    device's memory, or an operation on another device, never moves where a thread's next
    ``HipBuffer(n)`` lands. A subclass provides ``_make_current`` (the binding's call) and
    sets ``self._local = threading.local()``."""

    _local: threading.local

    def _make_current(self, device: int) -> None:
        raise NotImplementedError

    def activate(self, device: int) -> None:
        local = self._local
        if getattr(local, "device", None) != device:
            local.device = device  # first: a finalizer run in between gives this one back
            try:
                self._make_current(device)
            except BaseException:
                local.device = None  # unknown: the next activation sets it again
                raise

    def forget_active(self) -> None:
        self._local.device = None

    def set_device(self, device: int) -> None:
        self.activate(device)
        self._local.chosen = device

    def get_device(self) -> int:
        chosen: int = getattr(self._local, "chosen", 0)
        return chosen

    def restoring(self, device: int, call: Callable[[], _T]) -> _T:
        """``call()`` with ``device`` active, then the thread's earlier active device again:
        what finalizers call (frees, destroys, unloads, unmaps) leaves the calling thread
        as it found it, whatever device the memory or handle was on."""
        before = getattr(self._local, "device", None)
        self.activate(device)
        try:
            return call()
        finally:
            if before is not None and before != device:
                self.activate(before)


def address(handle: Any) -> int:
    """A binding's handle (stream, event; None: the null handle) as the integer its C
    functions take."""
    return 0 if handle is None else int(handle)


def unwrap(api: str, result: Any, success: Any, describe: Any) -> Any:
    """Turn a binding's ``(status, *values)`` result into its values, or raise ``DeviceError``.

    ``describe(status)`` returns ``(status_name, message)``. Returns ``None`` for no values, the
    value itself for one, and a tuple for several. This is the one ``check()`` of each backend.
    """
    if not isinstance(result, tuple):
        result = (result,)
    status = result[0]
    if status != success:
        status_name, message = describe(status)
        from ..errors import DeviceError

        raise DeviceError(api, int(status), status_name, message)
    values = result[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def as_text(value: Any) -> str:
    """A binding's C string (bytes, str or None) as ``str``."""
    if isinstance(value, tuple):
        value = value[-1]
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return "" if value is None else str(value)


def peer_enabled(api: str, status: Any, on: tuple[Any, Any], describe: Any, device: int,
                 peer: int) -> bool:
    """Whether ``device`` reaches ``peer`` directly after the binding's enable call ``api``
    returned ``status``: True for one of ``on`` (success, or on already); else False,
    logged as a warning (too many peers, say): ``memcpy_peer`` then stages through host
    memory, and the pair is not asked again."""
    if status in on:
        return True
    status_name, message = describe(status)
    _log.warning("%s(%d -> %d) failed: %s (%s); copies between them go through host memory",
                 api, device, peer, status_name, message)
    return False
