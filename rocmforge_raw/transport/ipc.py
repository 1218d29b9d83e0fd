"""IpcTransport: caches in processes of one host, through IPC handles
(``rocmforge_raw.memory.ipc``).

The sender's slab must be shareable (``KvCache(..., shareable=True)``); its endpoint is the
slab's ``IpcHandle``. The receiver maps the sender's slab once (kept until ``close()``) and
copies each span with the runtime's copy engine on the receiving cache's stream (a peer copy
when the two caches are on two devices), then waits for the copies. While a receiver maps it,
the sender's slab is not freed (a closed sender cache frees it when the last mapping goes).

A mapping is only as good as its exporter: every read first lets go of the mappings whose
exporter exited or closed its slab (so a closed sender's deferred free is not held up), and
checks the source again once the copies arrived: a sender that exited or closed its slab
during the read fails it (``IpcError``; the import is undone), its bytes undefined. Each
check is a read of the slab's lease and a poll of the sender's pidfd (``procs.Exit``).
``last_read`` says how much of the last read was host work and how much waiting.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from ..cache.transfer.transport import ReadTime, Transport, copy_spans, read_timeout
from ..common import checks
from ..errors import IpcError
from ..memory import ipc
from ..memory.buffer import HipBuffer
from ..memory.ipc import IpcHandle
from ..memory.stream import Stream


class IpcTransport(Transport):
    """Reads spans of a slab another process of this host exported."""

    name = "ipc"
    #: Where the last read's time went (host work, waiting for the device).
    last_read: ReadTime | None = None

    def __init__(self) -> None:
        self._mapped: dict[bytes, HipBuffer] = {}
        self._handles: dict[bytes, IpcHandle] = {}  # what each mapping was mapped by

    def _publish(self, buffer: HipBuffer) -> IpcHandle:
        return buffer.ipc_handle()  # raises unless the buffer is shareable

    def endpoint_nbytes(self, endpoint: Any) -> int:
        # (the handle's size is sealed in its lease: mapping refuses an altered one)
        return self._handle(endpoint).nbytes

    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None, *, timeout: float | None = None) -> None:
        start = time.perf_counter()
        self._check_open()
        timeout = read_timeout(timeout)
        handle = self._handle(endpoint)
        src = self.mapping(handle, dst.device)
        if src.backend is not dst.backend:
            raise ValueError(f"the sender's slab is {src.backend.name} memory, the receiver's "
                             f"{dst.backend.name}: IPC copies within one backend")
        waited = copy_spans(dst, src, spans, stream, timeout)
        self._check_source(handle)  # a sender gone during the copies: what arrived is undefined
        self.last_read = ReadTime(time.perf_counter() - start - waited, waited)

    @staticmethod
    def _handle(endpoint: Any) -> IpcHandle:
        if not isinstance(endpoint, IpcHandle):
            raise TypeError(f"an ipc endpoint is an IpcHandle, got {checks.show(endpoint)}")
        return endpoint

    def mapping(self, handle: IpcHandle, device: int | None = None) -> HipBuffer:
        """The buffer ``handle`` names, mapped here once (until ``close()``), on ``device``
        the first time (None: the exporter's; a receiver maps it on its own, so the span
        kernel reads it over the link). Mappings whose exporter exited or closed its slab
        are dropped first (``IpcError`` if this is one)."""
        self._check_open()
        self._let_go_of_gone(handle.key)
        if handle.key in self._mapped:
            self._check_source(handle)
        else:
            self._mapped[handle.key] = HipBuffer.from_ipc(handle, device)
            self._handles[handle.key] = handle
        return self._mapped[handle.key]

    def _check_source(self, handle: IpcHandle) -> None:
        """``ipc.check_exporter`` for the mapping of ``handle``; on ``IpcError`` the mapping
        is dropped (its exporter may then free) before the error goes on."""
        try:
            ipc.check_exporter(handle)
        except IpcError:
            self._unmap(handle.key)
            raise

    def _let_go_of_gone(self, keep: bytes) -> None:
        """Drop the mappings but ``keep``'s whose exporter exited or closed its slab."""
        for key in [key for key in self._mapped if key != keep]:
            with contextlib.suppress(IpcError):  # (dropped)
                self._check_source(self._handles[key])

    def _unmap(self, key: bytes) -> None:
        self._handles.pop(key, None)
        self._mapped.pop(key).close()

    def close(self) -> None:
        """Unmap every slab this transport mapped (their exporters may then free them)."""
        super().close()
        self._handles.clear()
        while self._mapped:
            self._mapped.popitem()[1].close()
