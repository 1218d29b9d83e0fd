"""rocmforge_raw: torch-free GPU memory and a paged KV cache from Python.

Backends: ``hip`` (AMD, hip-python), ``cuda`` (NVIDIA, cuda-python) and ``host`` (CPU, cffi);
the default is chosen at first use (hip, then cuda, then host) or forced by ``RF_BACKEND``.
"""

from ._version import version as _version
from .errors import (
    BackendUnavailableError,
    BufferClosedError,
    DeviceError,
    KernelNotAvailableError,
    OutOfMemoryError,
    RocmforgeError,
)
from .kernels.module import Kernel, LaunchConfig, Module, load_kernels
from .memory.array import DeviceArray
from .memory.buffer import (
    HipBuffer,
    live_allocations,
    memory_stats,
    reset_peak,
    set_allocator,
    track_stacks,
)
from .memory.pool import MemoryPool
from .memory.stream import Event, Stream
from .memory.waiting import free_waiting
from .runtime import available_backends, default_backend, devices, get_backend

__version__ = _version()  # pyproject.toml's, through the installed metadata

__all__ = [
    "BackendUnavailableError", "BufferClosedError", "DeviceArray", "DeviceError", "Event",
    "HipBuffer", "Kernel", "KernelNotAvailableError", "LaunchConfig", "MemoryPool", "Module",
    "OutOfMemoryError", "RocmforgeError", "Stream", "available_backends", "default_backend",
    "devices", "free_waiting", "get_backend", "live_allocations", "load_kernels", "memory_stats",
    "reset_peak", "set_allocator", "track_stacks",
]
