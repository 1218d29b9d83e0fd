"""IpcTransport: caches in processes of one host, through IPC handles
(``rocmforge_raw.memory.ipc``).

The sender's slab must be shareable (``KvCache(..., shareable=True)``); its endpoint is the
slab's ``IpcHandle``. The receiver maps the sender's slab once (kept until ``close()``) and
copies each span with the runtime's copy engine on the receiving cache's stream (a peer copy
when the two caches are on two devices), then waits for the copies. While a receiver maps it,
the sender's slab is not freed (a closed sender cache frees it when the last mapping goes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache.transfer.transport import Transport, copy_spans
from ..common import checks
from ..errors import IpcError
from ..memory.buffer import HipBuffer
from ..memory.ipc import IpcHandle
from ..memory.stream import Stream


class IpcTransport(Transport):
    """Reads spans of a slab another process of this host exported."""

    name = "ipc"

    def __init__(self) -> None:
        self._mapped: dict[bytes, HipBuffer] = {}

    def _publish(self, buffer: HipBuffer) -> IpcHandle:
        return buffer.ipc_handle()  # raises unless the buffer is shareable

    def endpoint_nbytes(self, endpoint: Any) -> int:
        # (the handle's size is sealed in its lease: mapping refuses an altered one)
        return self._handle(endpoint).nbytes

    def read(self, endpoint: Any, dst: HipBuffer, spans: np.ndarray,
             stream: Stream | None = None) -> None:
        self._check_open()
        src = self.mapping(self._handle(endpoint))
        if src.backend is not dst.backend:
            raise ValueError(f"the sender's slab is {src.backend.name} memory, the receiver's "
                             f"{dst.backend.name}: IPC copies within one backend")
        copy_spans(dst, src, spans, stream)

    @staticmethod
    def _handle(endpoint: Any) -> IpcHandle:
        if not isinstance(endpoint, IpcHandle):
            raise TypeError(f"an ipc endpoint is an IpcHandle, got {checks.show(endpoint)}")
        return endpoint

    def mapping(self, handle: IpcHandle) -> HipBuffer:
        """The buffer ``handle`` names, mapped here once (until ``close()``); a mapping whose
        exporter exited is dropped."""
        self._check_open()
        src = self._mapped.get(handle.key)
        if src is not None and not handle.exporter_alive():
            self._mapped.pop(handle.key).close()
            raise IpcError(f"process {handle.pid}, which exported this slab, has exited")
        if src is None:
            src = self._mapped[handle.key] = HipBuffer.from_ipc(handle)
        return src

    def close(self) -> None:
        """Unmap every slab this transport mapped (their exporters may then free them)."""
        super().close()
        while self._mapped:
            self._mapped.popitem()[1].close()
