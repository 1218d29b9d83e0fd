"""Exceptions raised by rocmforge_raw. Every message names the numbers involved."""

from __future__ import annotations


class RocmforgeError(Exception):
    """Base class of every error this package raises on purpose."""


class BackendUnavailableError(RocmforgeError):
    """A backend was asked for that cannot be used here (no library, no device, unknown name)."""


class DeviceError(RocmforgeError):
    """A runtime binding call returned a failure status.

    Carries the API name (``hipMalloc``), the numeric status, its symbolic name and its
    description as the runtime gives them.
    """

    def __init__(self, api: str, status: int, status_name: str, message: str) -> None:
        self.api = api
        self.status = int(status)
        self.status_name = status_name
        self.message = message
        # some runtimes (ROCm 5.2's) describe a status by its name again: said once
        said = "" if message in ("", status_name) else f": {message}"
        super().__init__(f"{api} failed: {status_name} ({self.status}){said}")


class OutOfMemoryError(DeviceError, MemoryError):
    """An allocation could not be met. Sizes are in bytes."""

    def __init__(
        self, api: str, requested: int, free: int, total: int, status: int = 2,
        status_name: str = "out of memory",
    ) -> None:
        self.requested = requested
        self.free = free
        self.total = total
        DeviceError.__init__(
            self, api, status, status_name,
            f"requested {requested} bytes with {free} of {total} bytes free",
        )


class BufferClosedError(RocmforgeError, ValueError):
    """A buffer or view was used after its memory was released, or a stream, event or cache
    after it was closed."""


class KernelNotAvailableError(RocmforgeError):
    """No code object fits the device and none could be compiled at run time."""


class CacheFullError(RocmforgeError, MemoryError):
    """The KV cache cannot meet a request (strict mode, or nothing left to preempt)."""

    def __init__(self, needed_blocks: int, free_blocks: int, detail: str = "") -> None:
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        super().__init__(f"needs {needed_blocks} blocks but {free_blocks} are free"
                         + (f": {detail}" if detail else ""))


class QueueFullError(RocmforgeError):
    """A Scheduler's waiting queue holds ``max_waiting`` requests: submit again later."""


class IpcError(RocmforgeError, ValueError):
    """Memory shared between processes cannot be mapped: a handle from another host or from
    this very process, or one whose exporter has freed the memory or exited."""


class TransferError(RocmforgeError):
    """Bytes of a transfer between caches did not arrive (a transport or engine failure);
    the receiving cache is as it was before the transfer."""
