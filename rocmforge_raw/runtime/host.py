"""Host backend: CPU memory through cffi and libc. The default where no GPU answers.

There is one device (0). Copies and memsets are synchronous libc calls, so streams and events
are bookkeeping only: an event records the host clock when it is recorded. Kernels do not run
here; the operations in ``ops`` use their NumPy implementation on this backend instead.
"""

from __future__ import annotations

import itertools
import os
import platform
import time
from typing import Any

from cffi import FFI

from ..errors import BackendUnavailableError, DeviceError, OutOfMemoryError
from ._alloc import Allocator, HostAllocator
from .base import Backend, DeviceProperties

_ffi = FFI()
_ffi.cdef("""
    int posix_memalign(void **memptr, size_t alignment, size_t size);
    void free(void *ptr);
    void *memcpy(void *dest, const void *src, size_t n);
    void *memset(void *s, int c, size_t n);
""")
_libc = _ffi.dlopen(None)

#: Allocations are aligned like device allocations, so views and typed arrays behave the same.
ALIGNMENT = 256


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


class HostBackend(Backend):
    name = "host"
    dlpack_device_type = 1  # kDLCPU

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def _check_device(self, device: int) -> None:
        if device != 0:
            raise BackendUnavailableError(f"host backend has one device (0), not device {device}")

    def device_count(self) -> int:
        return 1

    def properties(self, device: int) -> DeviceProperties:
        self._check_device(device)
        return DeviceProperties(
            backend=self.name, index=0, name=platform.processor() or platform.machine(),
            arch="host", total_bytes=_meminfo()[1], multiprocessors=os.cpu_count() or 1,
            warp_size=1,
        )

    def set_device(self, device: int) -> None:
        self._check_device(device)

    def get_device(self) -> int:
        return 0

    def mem_info(self, device: int) -> tuple[int, int]:
        self._check_device(device)
        return _meminfo()

    def synchronize(self, device: int) -> None:
        self._check_device(device)

    def malloc(self, nbytes: int, device: int) -> int:
        self._check_device(device)
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
        return HostAllocator(self, ALIGNMENT)

    def host_alloc(self, nbytes: int, device: int) -> int:
        return self.malloc(nbytes, device)

    def host_free(self, ptr: int, device: int) -> None:
        self.free(ptr, device)

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any = None) -> None:
        _libc.memcpy(_void(dst), _void(src_host), nbytes)

    upload = memcpy_dtoh = memcpy_htod
    memcpy_dtod = memcpy_htod

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        _libc.memset(_void(ptr), value, nbytes)

    def stream_create(self, device: int) -> int:
        self._check_device(device)
        return next(self._ids)

    def stream_destroy(self, stream: Any, device: int) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def event_create(self, device: int) -> list[int]:
        self._check_device(device)
        return [0]

    def event_destroy(self, event: Any, device: int) -> None:
        pass

    def event_record(self, event: Any, stream: Any = None) -> None:
        event[0] = time.perf_counter_ns()

    def event_synchronize(self, event: Any) -> None:
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

    def launch(self, function, grid, block, shared_bytes, stream, params_addr) -> None:
        raise DeviceError("launch", 1, "not supported", "the host backend launches no kernels")


def bare_alloc_free(nbytes: int) -> None:
    """posix_memalign + free with no checks: the baseline ``bench --alloc`` compares to."""
    out = _ffi.new("void **")
    _libc.posix_memalign(out, ALIGNMENT, nbytes)
    _libc.free(out[0])
