"""Host backend: CPU memory through cffi and libc. The default where no GPU answers.

Copies and memsets are synchronous libc calls, so streams and events are bookkeeping only: an
event records the host clock when it is recorded. Kernels do not run here; the operations in
``ops`` use their NumPy implementation on this backend instead.

It has one device (0), or ``RF_HOST_DEVICES=N`` logical devices (at most ``MAX_DEVICES``), as
XLA's ``--xla_force_host_platform_device_count`` gives JAX several CPU devices: what the
package does with several devices (the per-thread device, memory, streams, events, pools,
caches and plans of one device refusing another's, peer copies) then runs without a GPU.
They are one memory, the process's: each reports all of it (``mem_info``, ``properties``),
any of them can read the others' (``peer_access`` is True, ``memcpy_peer`` a memcpy), and
a device's pointer is not checked against the device it is used on, which only the bounds
and device checks above the backend do, as on a GPU.

Shareable memory is a POSIX shared memory segment (``shm_open``, space reserved with
``posix_fallocate`` so a full ``/dev/shm`` is an error here, not a SIGBUS later, then
``mmap``): its name is its IPC handle. The process that made a segment unlinks its name when
it frees it, and at exit; mappings in other processes outlive the name.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import platform
import threading
import time
from typing import Any

from cffi import FFI

from ..common import procs
from ..errors import BackendUnavailableError, DeviceError, OutOfMemoryError
from ._alloc import Allocator, HostAllocator
from .base import Backend, DeviceProperties, ThreadDevices

_ffi = FFI()
_ffi.cdef("""
    int posix_memalign(void **memptr, size_t alignment, size_t size);
    void free(void *ptr);
    void *memcpy(void *dest, const void *src, size_t n);
    void *memset(void *s, int c, size_t n);
    int shm_open(const char *name, int oflag, unsigned int mode);
    int shm_unlink(const char *name);
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int munmap(void *addr, size_t length);
""")
_libc = _ffi.dlopen(None)
try:  # glibc keeps shm_open in libc since 2.34, in librt before
    _libc.shm_open  # noqa: B018
    _librt = _libc
except AttributeError:  # pragma: no cover - older glibc
    _librt = _ffi.dlopen("librt.so.1")
_MAP_FAILED = (1 << 64) - 1

#: Allocations are aligned like device allocations, so views and typed arrays behave the same.
ALIGNMENT = 256


#: The most logical devices ``RF_HOST_DEVICES`` may ask for.
MAX_DEVICES = 64


def host_devices() -> int:
    """The logical device count ``RF_HOST_DEVICES`` asks for (1 when unset); a value that is
    not an integer in [1, ``MAX_DEVICES``] makes the backend unavailable, naming it."""
    value = os.environ.get("RF_HOST_DEVICES", "").strip() or "1"
    if not value.isdecimal() or not 1 <= int(value) <= MAX_DEVICES:  # "²" is a digit
        raise BackendUnavailableError(f"RF_HOST_DEVICES must be an integer in [1, "
                                      f"{MAX_DEVICES}], got {value!r}")
    return int(value)


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes of system memory from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]


def _void(ptr: int) -> Any:
    return _ffi.cast("void *", ptr)


class HostBackend(ThreadDevices, Backend):
    name = "host"
    dlpack_device_type = 1  # kDLCPU

    def __init__(self) -> None:
        self._count = host_devices()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._segments: dict[int, tuple[bytes, int, int]] = {}  # ptr -> (name, bytes, pid)
        self._segments_lock = threading.Lock()
        atexit.register(self._unlink_segments)

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self._count:
            more = "" if self._count > 1 else " (RF_HOST_DEVICES=N gives it N)"
            raise BackendUnavailableError(f"host backend has {self._count} device(s), not "
                                          f"device {device}{more}")

    # No binding state: the device is the thread's alone. The methods that take a device
    # activate it where cuda's and hip's do, so that tests on logical devices see a path
    # (a finalizer) that leaves another device active.
    _make_current = _check_device

    def device_count(self) -> int:
        return self._count

    def properties(self, device: int) -> DeviceProperties:
        self._check_device(device)
        return DeviceProperties(
            backend=self.name, index=device, name=platform.processor() or platform.machine(),
            arch="host", total_bytes=_meminfo()[1], multiprocessors=os.cpu_count() or 1,
            warp_size=1,
        )

    def dlpack_device(self, device: int) -> tuple[int, int]:
        return self.dlpack_device_type, 0  # CPU memory is device 0 to DLPack

    def peer_access(self, device: int, peer: int) -> bool:
        self._check_device(device)
        self._check_device(peer)
        return True

    def mem_info(self, device: int) -> tuple[int, int]:
        self.activate(device)
        return _meminfo()

    def synchronize(self, device: int) -> None:
        self.activate(device)

    def malloc(self, nbytes: int, device: int) -> int:
        self.activate(device)
        out = _ffi.new("void **")
        status = _libc.posix_memalign(out, ALIGNMENT, nbytes)
        if status != 0:
            free, total = _meminfo()
            raise OutOfMemoryError("posix_memalign", nbytes, free, total, status,
                                   os.strerror(status))
        return int(_ffi.cast("uintptr_t", out[0]))

    def free(self, ptr: int, device: int) -> None:
        _libc.free(_void(ptr))

    def make_allocator(self) -> Allocator:
        return HostAllocator(self, ALIGNMENT, self._count)

    def malloc_shareable(self, nbytes: int, device: int) -> int:
        self._check_device(device)
        procs.sweep()
        name = ("/" + procs.unique_name("seg")).encode()
        fd = _librt.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if fd < 0:
            code = _ffi.errno
            raise DeviceError("shm_open", code, os.strerror(code), f"creating {name.decode()}")
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                shm = os.statvfs(procs.SHM_DIR)
                raise OutOfMemoryError("posix_fallocate", nbytes, shm.f_bavail * shm.f_frsize,
                                       shm.f_blocks * shm.f_frsize, exc.errno,
                                       f"/dev/shm: {exc.strerror}") from None
            ptr = self._map(fd, nbytes, name)
        except BaseException:
            _librt.shm_unlink(name)  # the name and the space it reserved go
            raise
        finally:
            os.close(fd)
        with self._segments_lock:
            self._segments[ptr] = (name, nbytes, os.getpid())
        return ptr

    def free_shareable(self, ptr: int, nbytes: int, device: int) -> None:
        with self._segments_lock:
            name, size, _ = self._segments.pop(ptr)
        _librt.shm_unlink(name)
        _libc.munmap(_void(ptr), size)

    def ipc_handle(self, ptr: int, device: int) -> bytes:
        self.activate(device)
        with self._segments_lock:
            found = self._segments.get(ptr)
        if found is None:
            raise ValueError(f"host memory at {ptr:#x} is not a shared memory segment: "
                             "allocate it shareable to share it")
        return found[0]

    def ipc_open(self, handle: bytes, nbytes: int, device: int) -> int:
        self.activate(device)
        fd = _librt.shm_open(handle, os.O_RDWR, 0)
        if fd < 0:
            code = _ffi.errno
            raise DeviceError("shm_open", code, os.strerror(code),
                              f"opening {handle.decode(errors='replace')}")
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory segment {handle.decode()} holds {size} bytes, "
                                 f"not the {nbytes} its handle says")
            return self._map(fd, nbytes, handle)
        finally:
            os.close(fd)

    def ipc_close(self, ptr: int, nbytes: int, device: int) -> None:
        _libc.munmap(_void(ptr), nbytes)

    @staticmethod
    def _map(fd: int, nbytes: int, name: bytes) -> int:
        ptr = int(_ffi.cast("uintptr_t", _libc.mmap(
            _ffi.NULL, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)))
        if ptr == _MAP_FAILED:
            code = _ffi.errno
            raise DeviceError("mmap", code, os.strerror(code), f"mapping {name.decode()}")
        return ptr

    def _unlink_segments(self) -> None:
        """At exit: the names of this process's segments go (their memory goes with the
        last mapping); a forked child leaves its parent's alone."""
        with self._segments_lock:
            for name, _, pid in self._segments.values():
                if pid == os.getpid():
                    _librt.shm_unlink(name)

    def host_alloc(self, nbytes: int, device: int) -> int:
        return self.malloc(nbytes, device)

    def host_free(self, ptr: int, device: int) -> None:
        self.free(ptr, device)

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any = None) -> None:
        _libc.memcpy(_void(dst), _void(src_host), nbytes)

    upload = download = memcpy_dtoh = memcpy_htod
    memcpy_dtod = memcpy_htod

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, to_host: bool, stream: Any = None) -> None:
        for row in range(height):
            _libc.memcpy(_void(dst + row * dst_pitch), _void(src + row * src_pitch), width)

    def memcpy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                    stream: Any = None) -> None:
        self._check_device(dst_device)
        self._check_device(src_device)
        _libc.memcpy(_void(dst), _void(src), nbytes)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        _libc.memset(_void(ptr), value, nbytes)

    def stream_create(self, device: int) -> int:
        self.activate(device)
        return next(self._ids)

    def stream_destroy(self, stream: Any, device: int) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def event_create(self, device: int) -> list[int]:
        self.activate(device)
        return [0]

    def event_destroy(self, event: Any, device: int) -> None:
        pass

    def event_record(self, event: Any, stream: Any = None) -> None:
        event[0] = time.perf_counter_ns()

    def event_synchronize(self, event: Any) -> None:
        pass

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        pass

    def event_query(self, event: Any) -> bool:
        return True

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return (end[0] - start[0]) / 1e6

    def module_load(self, image: bytes, device: int) -> Any:
        raise DeviceError(
            "module_load", 1, "not supported",
            "the host backend runs no code objects; ops run their NumPy implementation",
        )

    def module_unload(self, module: Any, device: int) -> None:
        pass

    def module_function(self, module: Any, name: str) -> Any:
        raise DeviceError("module_function", 1, "not supported", "the host backend has no modules")

    def max_active_blocks(self, function: Any, threads: int, shared_bytes: int) -> int:
        return 1

    def no_graphs(self) -> Exception:
        return NotImplementedError(
            "the host backend has no graphs: graph capture and replay are a GPU feature "
            "(CUDA/HIP graphs); on the host, run the step's write and attention calls")

    def launch(self, function, grid, block, shared_bytes, stream, params_addr) -> None:
        raise DeviceError("launch", 1, "not supported", "the host backend launches no kernels")


def bare_alloc_free(nbytes: int) -> None:
    """posix_memalign + free with no checks: the baseline ``bench --alloc`` compares to."""
    out = _ffi.new("void **")
    _libc.posix_memalign(out, ALIGNMENT, nbytes)
    _libc.free(out[0])
