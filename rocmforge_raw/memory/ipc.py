"""Memory shared between processes: IPC handles and the protocol that keeps them safe.

``HipBuffer(n, shareable=True)`` allocates memory another process can map (any GPU
allocation; on the host backend a POSIX shared memory segment). ``buf.ipc_handle()`` returns an
``IpcHandle``, a plain picklable value; ``HipBuffer.from_ipc(handle)`` in another process of
the same host maps it (hipIpcOpenMemHandle / cuIpcOpenMemHandle / mmap) and its ``close()``
only unmaps. Pooled and plain (``malloc``) buffers are not shareable: a pool hands memory to
the next buffer after ``close()``, and a plain host allocation has no name another process
can open; ``ipc_handle()`` refuses both, saying so.

Lifetimes (DESIGN.md, IPC): whoever allocated memory frees it, and never while another process
maps it. Each exported allocation has a *lease*, a small file in ``/dev/shm`` (a state byte and
the handle's seal, a digest of its backend, device, size and key, so that an altered handle is
refused before anything is mapped): every importer holds a shared ``flock`` on it for as long
as it maps the memory, and the exporter frees only once it gets the exclusive lock
(non-blocking): until then the free is deferred, and retried by every later shareable free,
export or import of the process, and by ``collect()``. The kernel drops the locks of a process
that dies, so a dead importer never keeps the exporter's memory. Closing marks the lease
closed, so no process maps the memory anew, and freeing marks it retired and unlinks it first:
a late importer is refused, never handed freed memory. An exporter that exits while others map
its memory frees it with the process (GPU memory: the importers' mappings are then undefined;
``IpcHandle.exporter_alive()`` and every import detect the exit; host segments stay valid until
the last mapping goes). A process never imports its own handle (the runtimes refuse), and one
imported twice in a process is mapped once, counted. Imported buffers count in
``memory_stats()`` like any root buffer (their bytes are mapped here, not allocated).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..common import checks, procs
from ..errors import IpcError
from ..runtime import Backend, get_backend
from ..runtime._alloc import HookAllocator

_LIVE, _CLOSED, _RETIRED = b"\x01", b"\x02", b"\x00"  # the lease's state byte
_SEAL_BYTES = 16


@dataclass(frozen=True)
class IpcHandle:
    """What another process needs to map an exported allocation: where it lives (``backend``,
    ``device``, ``nbytes``), the runtime's own handle (``key``: 64 opaque bytes, or a host
    segment's name), the lease file's name, and who exported it (``pid`` and its start time,
    on the host with ``boot_id``)."""

    backend: str
    device: int
    nbytes: int
    key: bytes
    lease: str
    pid: int
    pid_start: int
    boot_id: str

    def exporter_alive(self) -> bool:
        """Whether the exporting process still runs (on this host)."""
        return self.boot_id == procs.boot_id() and procs.alive(self.pid, self.pid_start)

    def seal(self) -> bytes:
        """A digest of what the importer maps by (backend, device, size, key): the lease
        holds the exporter's, so an altered handle is refused before anything is mapped."""
        text = repr((self.backend, self.device, self.nbytes, self.key))
        return hashlib.blake2b(text.encode(), digest_size=_SEAL_BYTES).digest()


class _Export:
    """The exporter's side of one exported allocation: its handle and lease."""

    def __init__(self, backend: Backend, ptr: int, nbytes: int, device: int) -> None:
        procs.sweep()
        key = backend.ipc_handle(ptr, device)
        self.path = procs.shm_path(procs.unique_name("lease"))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        pid, start = procs.identity()
        self.handle = IpcHandle(backend.name, device, nbytes, key,
                                os.path.basename(self.path), pid, start, procs.boot_id())
        os.write(self.fd, _LIVE + self.handle.seal())

    def close(self) -> None:
        """The exporter closed its buffer: no process maps the memory anew (the free waits
        for those that map it now)."""
        os.pwrite(self.fd, _CLOSED, 0)

    def retire(self) -> bool:
        """Take the lease back if no other process holds it: mark it retired, unlink it and
        return True; False while an importer still maps the memory."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.pwrite(self.fd, _RETIRED, 0)
        os.unlink(self.path)
        os.close(self.fd)
        return True


class _Mapping:
    """The importer's side: one mapping of another process's allocation, shared by every
    buffer this process imported it as, the shared lock on its lease and the watch on its
    exporter's exit (``exporter``, a ``procs.Exit``, which it closes). It is made on
    ``device``: the exporter's, or another of this process that reaches it (peer access,
    which the open enables), whose kernels then address the memory directly."""

    def __init__(self, backend: Backend, handle: IpcHandle, fd: int,
                 exporter: procs.Exit, device: int) -> None:
        self.backend, self.handle, self.fd, self.refs = backend, handle, fd, 0
        self.exporter, self.device = exporter, device
        self.ptr = backend.ipc_open(handle.key, handle.nbytes, device)

    def release(self, ptr: int, nbytes: int, device: int) -> None:
        """One importing buffer fewer; the last waits for the device's queued work (which
        may still use the memory, as cuMemFree/hipFree wait), unmaps and lets go of the
        lease: only then may the exporter free."""
        with _lock:
            self.refs -= 1
            if self.refs:
                return
            del _imports[(self.handle.backend, self.handle.key)]
            backend, device = self.backend, self.device

            def unmap() -> None:
                backend.synchronize(device)
                backend.ipc_close(self.ptr, self.handle.nbytes, device)

            try:  # often a finalizer's work: the calling thread's active device stays
                backend.restoring(device, unmap)
            finally:
                self.exporter.close()
                os.close(self.fd)  # releases the shared lock: the exporter may free


_lock = threading.RLock()
_allocators: dict[Backend, HookAllocator] = {}
_shareable: set[tuple[str, int, int]] = set()  # (backend, device, ptr) of live allocations
_exports: dict[tuple[str, int, int], _Export] = {}
_deferred: dict[tuple[str, int, int], tuple[Backend, int, _Export, int]] = {}
_imports: dict[tuple[str, bytes], _Mapping] = {}


def shareable_allocator(backend: Backend) -> HookAllocator:
    """The allocator of ``HipBuffer(n, shareable=True)`` on ``backend`` (one per backend)."""
    with _lock:
        if backend not in _allocators:
            _allocators[backend] = HookAllocator(
                backend, lambda n, d: _allocate(backend, n, d),
                lambda p, n, d: _free(backend, p, n, d))
        return _allocators[backend]


def _allocate(backend: Backend, nbytes: int, device: int) -> int:
    ptr = backend.malloc_shareable(nbytes, device)
    with _lock:
        _shareable.add((backend.name, device, ptr))
    collect()
    return ptr


def _free(backend: Backend, ptr: int, nbytes: int, device: int) -> None:
    """Free a shareable allocation now, or once no other process maps it (deferred)."""
    key = (backend.name, device, ptr)
    with _lock:
        _shareable.discard(key)
        export = _exports.pop(key, None)
        if export is not None and not export.retire():
            export.close()
            _deferred[key] = (backend, nbytes, export, os.getpid())
            return
    backend.free_shareable(ptr, nbytes, device)
    collect()


def collect() -> int:
    """Free the deferred allocations no other process maps any more; returns their bytes.
    Runs by itself on every shareable free, export and import of this process."""
    freed = 0
    with _lock:
        ready = [(key, entry) for key, entry in _deferred.items()
                 if entry[3] == os.getpid() and entry[2].retire()]
        for key, _ in ready:
            del _deferred[key]
    for (_, device, ptr), (backend, nbytes, _, _) in ready:
        backend.free_shareable(ptr, nbytes, device)
        freed += nbytes
    return freed


def pending() -> dict[str, int]:
    """Counts of this process's shared memory: ``exported`` allocations, ``deferred`` frees
    (and their ``deferred_bytes``: closed here, still mapped elsewhere) and ``imported``
    mappings of other processes' memory."""
    with _lock:
        mine = [entry for entry in _deferred.values() if entry[3] == os.getpid()]
        return {"exported": len(_exports), "deferred": len(mine),
                "deferred_bytes": sum(entry[1] for entry in mine), "imported": len(_imports)}


def mapped(ptr: int) -> bool:
    """Whether address ``ptr`` lies in memory this process mapped from another process's
    export (``HipBuffer.from_ipc``). Such a mapping belongs to the device it was made on
    here: another device's kernels do not reach it through peer access (only copies do)."""
    with _lock:
        return any(m.ptr <= ptr < m.ptr + m.handle.nbytes for m in _imports.values())


def remote_device(ptr: int) -> int | None:
    """The exporter's device of the mapping holding ``ptr`` where it was made on another
    device of this process (its bytes cross the link between the two), else None."""
    if not _imports:  # (the common case, without the lock)
        return None
    with _lock:
        for m in _imports.values():
            if m.ptr <= ptr < m.ptr + m.handle.nbytes:
                return m.handle.device if m.device != m.handle.device else None
    return None


def check_exporter(handle: IpcHandle) -> None:
    """Raise ``IpcError`` unless the process that exported ``handle`` (mapped here) still
    runs and holds the memory open: what an importer that keeps a mapping checks before and
    after each use. Memory of an exporter that exited is undefined on a GPU; memory it closed
    no longer holds what it shared (the free only waits for the mappings). A lease read
    and a poll of the exporter's pidfd (``procs.Exit``): a few microseconds."""
    with _lock:
        mapping = _imports.get((handle.backend, handle.key))
        if mapping is None:
            raise IpcError(f"the memory of this handle (process {handle.pid}) is not mapped "
                           "here")
        _check_state(os.pread(mapping.fd, 1, 0), handle)
        _check_alive(handle, mapping.exporter)


def export_handle(buffer: Any) -> IpcHandle:
    """``buffer.ipc_handle()``: the handle of an open, shareable root buffer."""
    if buffer.root is not buffer:
        raise ValueError("a view cannot be exported: export its root buffer (buf.root) and "
                         "take the view in the importing process")
    ptr = buffer.ptr  # raises BufferClosedError once closed
    if buffer.nbytes == 0:
        raise ValueError("a 0-byte buffer has no memory to share")
    key = (buffer.backend.name, buffer.device, ptr)
    with _lock:
        if key not in _shareable:
            raise ValueError(f"{buffer!r} is not shareable: only memory allocated with "
                             "HipBuffer(nbytes, shareable=True) can be exported (a pool reuses "
                             "its memory after close(), and plain host memory has no name)")
        if key not in _exports:
            _exports[key] = _Export(buffer.backend, ptr, buffer.nbytes, buffer.device)
        handle = _exports[key].handle
    collect()
    return handle


def import_handle(handle: Any, device: int | None = None
                  ) -> tuple[Backend, int, HookAllocator, int]:
    """Map ``handle`` for ``HipBuffer.from_ipc``: (backend, address, allocator whose free
    unmaps, the device the mapping is on). The first import of a handle makes its mapping
    on ``device`` (None: the exporter's); later ones share it, wherever it is. Raises
    ``TypeError`` for anything but an ``IpcHandle``, ``IpcError`` for a handle of another
    host, of this process, of memory freed, of an exporter gone, or altered."""
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"handle must be an IpcHandle (from HipBuffer.ipc_handle()), got "
                        f"{checks.show(handle)}")
    checks.integer(handle.nbytes, "handle.nbytes", 1, checks.MAX_SIZE)
    if not isinstance(handle.key, bytes) or not isinstance(handle.lease, str):
        raise TypeError(f"handle.key must be bytes and handle.lease a str, got "
                        f"{checks.show(handle.key)} and {checks.show(handle.lease)}")
    if handle.boot_id != procs.boot_id():
        raise IpcError(f"the handle comes from another host (boot id {handle.boot_id}): IPC "
                       "maps memory of this host only; move bytes with a transfer engine")
    if (handle.pid, handle.pid_start) == procs.identity():
        raise IpcError("the handle was exported by this process: use the buffer itself")
    backend = get_backend(handle.backend)
    backend.resolve_device(handle.device)  # a device of this host
    device = handle.device if device is None else backend.resolve_device(device)
    with _lock:
        mapping = _imports.get((handle.backend, handle.key))
        if mapping is None:
            mapping = _map(backend, handle, device)
            _imports[(handle.backend, handle.key)] = mapping
        elif mapping.handle != handle:  # a buffer of other bytes would overrun the mapping
            raise IpcError(f"the handle does not match the one its memory is mapped with here "
                           f"(size {handle.nbytes} vs {mapping.handle.nbytes}, device "
                           f"{handle.device} vs {mapping.handle.device}): it was altered")
        else:  # mapped here already: imported anew only while its exporter holds it
            _check_state(os.pread(mapping.fd, 1, 0), handle)
            _check_alive(handle, mapping.exporter)
        mapping.refs += 1
    collect()
    return backend, mapping.ptr, HookAllocator(backend, None, mapping.release), mapping.device


def _map(backend: Backend, handle: IpcHandle, device: int) -> _Mapping:
    """Take a shared lock on the handle's lease, check it is live, then map."""
    owner = f"process {handle.pid}"
    name = os.path.basename(handle.lease)
    if not (name.startswith(procs.PREFIX) and name.endswith(".lease")):
        raise IpcError(f"handle.lease {handle.lease!r} names no lease file of this package: "
                       "the handle was altered")
    try:
        fd = os.open(procs.shm_path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise IpcError(f"the memory of this handle is gone: {owner} freed it or exited (lease "
                       f"{handle.lease} not found)") from None
    except OSError as exc:
        raise IpcError(f"the lease {handle.lease!r} of this handle cannot be opened: "
                       f"{exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IpcError(f"{owner} is freeing the memory of this handle") from None
        lease = os.pread(fd, 1 + _SEAL_BYTES, 0)
        _check_state(lease[:1], handle)
        if lease[1:] != handle.seal():
            raise IpcError(f"the handle does not match the memory {owner} exported under lease "
                           f"{handle.lease}: its backend, device, size or key was altered")
        exporter = procs.Exit(handle.pid, handle.pid_start)
        try:
            _check_alive(handle, exporter)
            return _Mapping(backend, handle, fd, exporter, device)
        except BaseException:
            exporter.close()
            raise
    except BaseException:
        os.close(fd)
        raise


def _check_alive(handle: IpcHandle, exporter: procs.Exit) -> None:
    """Refuse memory of an exporter that has exited (its lease may still read live)."""
    if not exporter.alive():
        raise IpcError(f"process {handle.pid}, which exported this handle, has exited")


def _check_state(state: bytes, handle: IpcHandle) -> None:
    """Refuse to map memory anew once its exporter closed or freed it."""
    if state == _CLOSED:
        raise IpcError(f"process {handle.pid} closed the memory of this handle (it frees it "
                       "once the processes that map it now let go)")
    if state != _LIVE:
        raise IpcError(f"process {handle.pid} has freed the memory of this handle")


def _at_exit() -> None:
    """The leases of this process go with it (importers keep what they map)."""
    for export in list(_exports.values()) + [entry[2] for entry in _deferred.values()]:
        try:
            if export.handle.pid == os.getpid():
                os.unlink(export.path)
        except OSError:
            pass


atexit.register(_at_exit)
