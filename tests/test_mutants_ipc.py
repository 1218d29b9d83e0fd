"""IPC, pinned down by survivors of mutation testing (issue 44, item 4): IpcTransport's
refusals (a read into a buffer of another backend, a slab whose exporter exited after this
transport mapped it) and the stream it copies on; the lease file's permissions; the exact
words of export refusals. The exporter is a spawned worker (workers.py)."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import stat

import numpy as np
import pytest
from workers import export_and_wait, spawned

import rocmforge_raw as rf
from rocmforge_raw.common import procs
from rocmforge_raw.errors import IpcError
from rocmforge_raw.memory import ipc
from rocmforge_raw.runtime.host import HostBackend
from rocmforge_raw.transport import IpcTransport


class Elsewhere(HostBackend):
    """Host memory under another backend: a buffer of it is no buffer of ``host``'s."""

    name = "elsewhere"


def test_a_read_into_a_buffer_of_another_backend_is_refused_naming_both(backend):
    with spawned(export_and_wait, backend.name) as worker:
        try:
            handle = worker.receive()
            with IpcTransport() as link, rf.HipBuffer(4096, backend=Elsewhere()) as dst:
                dst.copy_from_host(np.zeros(1024, np.int32))
                with pytest.raises(ValueError, match=f"^the sender's slab is {backend.name} "
                                   "memory, the receiver's elsewhere: IPC copies within one "
                                   "backend$"):
                    link.read(handle, dst, np.array([[0, 0, 4096]], np.int64))
                assert not dst.to_numpy(np.int32).any()  # nothing copied
        finally:
            worker.kill()


def test_a_mapping_whose_exporter_exited_is_closed_dropped_and_named(backend):
    """The transport's mapping of a slab whose exporter was killed is refused, naming the
    process; the mapping is closed and forgotten (a later call is refused as a fresh import
    would be), and nothing stays imported."""
    with spawned(export_and_wait, backend.name) as worker:
        handle = worker.receive()
        link = IpcTransport()
        mapped = link.mapping(handle)
        worker.kill()
    exited = f"^process {handle.pid}, which exported this handle, has exited$"
    with pytest.raises(IpcError, match=exited):  # the cached mapping's exporter checked
        link.mapping(handle)
    assert mapped.closed and ipc.pending()["imported"] == 0
    with pytest.raises(IpcError, match=exited):  # as a fresh import: nothing mapped is left
        link.mapping(handle)
    link.close()


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
def test_a_read_copies_on_the_stream_it_is_given(backend, monkeypatch):
    """The spans are copied on the receiver's stream (ordered after what it queued into
    the destination), not on the default stream, and the bytes arrive."""
    from rocmforge_raw.kernels import ops

    streams = []
    copy = ops.copy_spans

    def spy(dst, src, spans, stream=None):
        streams.append(stream)
        copy(dst, src, spans, stream=stream)

    monkeypatch.setattr(ops, "copy_spans", spy)
    with spawned(export_and_wait, backend.name) as worker:
        try:
            handle = worker.receive()
            with IpcTransport() as link, rf.Stream(backend=backend) as stream, \
                    rf.HipBuffer(4096, backend=backend) as dst:
                link.read(handle, dst, np.array([[64, 0, 256]], np.int64), stream)
                assert streams == [stream]
                assert dst.to_numpy(np.int32, 64).tolist() == list(range(16, 80))
        finally:
            worker.kill()


def test_a_lease_file_is_readable_and_writable_by_its_owner_only(backend):
    """Another user who could open the lease could take a shared lock on it and so keep the
    exporter from ever freeing the memory: the file is created 0600, even under umask 0."""
    umask = os.umask(0)
    try:
        buf = rf.HipBuffer(4096, backend=backend, shareable=True)
        lease = os.path.join(procs.SHM_DIR, buf.ipc_handle().lease)
    finally:
        os.umask(umask)
    with buf:
        assert stat.S_IMODE(os.stat(lease).st_mode) == 0o600


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def test_export_refusals_say_exactly_why_and_what_to_do(backend):
    with rf.HipBuffer(64, backend=backend, shareable=True) as buf, \
            pytest.raises(ValueError, match=exactly(
                "a view cannot be exported: export its root buffer (buf.root) and take the "
                "view in the importing process")):
        buf.view(0, 32).ipc_handle()
    with rf.HipBuffer(0, backend=backend, shareable=True) as empty, \
            pytest.raises(ValueError, match=exactly("a 0-byte buffer has no memory to share")):
        empty.ipc_handle()
    with rf.HipBuffer(64, backend=backend) as plain, pytest.raises(ValueError, match=exactly(
            f"{plain!r} is not shareable: only memory allocated with HipBuffer(nbytes, "
            "shareable=True) can be exported (a pool reuses its memory after close(), and "
            "plain host memory has no name)")):
        plain.ipc_handle()



def test_a_live_shareable_buffer_is_listed_with_its_backend(backend):
    nbytes = 3 * 4096 + 16  # a size no other live buffer of the suite has
    with rf.HipBuffer(nbytes, backend=backend, shareable=True) as buf:
        listed = [(a.nbytes, a.device, a.backend) for a in rf.live_allocations()]
        assert (nbytes, buf.device, backend.name) in listed


def test_a_freed_shareable_buffer_is_shareable_no_more(backend):
    """Its address leaves the registry of shareable allocations: a plain buffer that lands
    there later is refused an IPC handle as not shareable, not inside the runtime."""
    buf = rf.HipBuffer(4096, backend=backend, shareable=True)
    key = (backend.name, buf.device, buf.ptr)
    assert key in ipc._shareable
    buf.close()
    rf.free_waiting()
    assert key not in ipc._shareable


def test_an_imported_buffer_is_listed_with_its_backend(backend):
    with spawned(export_and_wait, backend.name) as worker:
        try:
            with rf.HipBuffer.from_ipc(worker.receive()) as imported:
                listed = [(a.nbytes, a.device, a.backend) for a in rf.live_allocations()]
                assert (4096, imported.device, backend.name) in listed
        finally:
            worker.kill()


def test_a_lease_name_of_no_lease_file_is_refused_as_altered(backend):
    with rf.HipBuffer(64, backend=backend, shareable=True) as buf:
        handle = dataclasses.replace(buf.ipc_handle(), pid=1, lease="x")  # "another process"
        with pytest.raises(IpcError, match=exactly(
                "handle.lease 'x' names no lease file of this package: the handle was altered")):
            rf.HipBuffer.from_ipc(handle)


def test_the_last_importers_close_unmaps_the_host_segment():
    """The importing process's mapping of a host segment goes with its last buffer: its
    address range is no longer mapped here (``/proc/self/maps``)."""
    with spawned(export_and_wait, "host") as worker:
        try:
            handle = worker.receive()
            buf = rf.HipBuffer.from_ipc(handle)
            start = buf.ptr
            assert _mapped_here(start)
            buf.close()
            assert not _mapped_here(start)
        finally:
            worker.kill()


def _mapped_here(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


class FreeLog(HostBackend):
    """Host memory whose shareable frees are logged as (bytes, device)."""

    name = "freelog"

    def __init__(self) -> None:
        super().__init__()
        self.freed: list[tuple[int, int]] = []

    def free_shareable(self, ptr: int, nbytes: int, device: int) -> None:
        self.freed.append((nbytes, device))
        super().free_shareable(ptr, nbytes, device)


def test_a_shareable_buffer_is_freed_on_its_own_device():
    """A GPU backend frees on the device it is told (it makes it current first): the free
    names the buffer's device, not none."""
    backend = FreeLog()
    buf = rf.HipBuffer(4096, backend=backend, shareable=True)
    buf.ipc_handle()  # exported, never mapped: freed at once on close
    buf.close()
    assert backend.freed == [(4096, buf.device)]


def test_a_freed_lease_reads_retired_to_whoever_opened_it_before_the_unlink(backend):
    """The exporter's free marks the state byte retired (its seal untouched) before it
    unlinks the file: an importer that opened the lease just before reads that mark."""
    buf = rf.HipBuffer(4096, backend=backend, shareable=True)
    path = procs.shm_path(buf.ipc_handle().lease)
    fd = os.open(path, os.O_RDONLY)
    try:
        live = os.pread(fd, 64, 0)
        buf.close()  # nobody maps it: freed at once
        assert os.pread(fd, 64, 0) == b"\x00" + live[1:] and live[:1] == b"\x01"
        assert not os.path.exists(path)
    finally:
        os.close(fd)


def test_an_own_handle_and_one_naming_a_missing_device_are_refused_before_mapping(backend):
    with rf.HipBuffer(64, backend=backend, shareable=True) as buf:
        handle = buf.ipc_handle()
        with pytest.raises(IpcError, match=exactly(
                "the handle was exported by this process: use the buffer itself")):
            rf.HipBuffer.from_ipc(handle)
        elsewhere = dataclasses.replace(handle, pid=1, device=64)  # a device this host lacks
        with pytest.raises(rf.BackendUnavailableError, match=r"^device 64 does not exist"):
            rf.HipBuffer.from_ipc(elsewhere)


def test_a_lease_locked_by_its_exporters_free_is_refused_naming_the_process(backend):
    """The exporter holds the lease exclusively while it frees (simulated here by a lock
    of this process's own): an import then says so and maps nothing."""
    import fcntl

    with spawned(export_and_wait, backend.name) as worker:
        try:
            handle = worker.receive()
            fd = os.open(procs.shm_path(handle.lease), os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with pytest.raises(IpcError, match=exactly(
                        f"process {handle.pid} is freeing the memory of this handle")):
                    rf.HipBuffer.from_ipc(handle)
            finally:
                os.close(fd)
            assert ipc.pending()["imported"] == 0
        finally:
            worker.kill()


def test_a_lease_that_cannot_be_opened_is_refused_saying_why(backend):
    with rf.HipBuffer(64, backend=backend, shareable=True) as buf:
        lease = f"{procs.PREFIX}loop-{os.getpid()}.lease"
        os.symlink(lease, procs.shm_path(lease))  # a link to itself: ELOOP
        try:
            handle = dataclasses.replace(buf.ipc_handle(), pid=1, lease=lease)
            with pytest.raises(IpcError, match=exactly(
                    f"the lease {lease!r} of this handle cannot be opened: "
                    f"{os.strerror(errno.ELOOP)}")):
                rf.HipBuffer.from_ipc(handle)
        finally:
            os.unlink(procs.shm_path(lease))


def test_a_deferred_free_is_made_on_the_buffers_device_once_the_mapper_lets_go():
    """While another holder keeps the lease (simulated by a shared lock of this process's
    own), the free waits; ``collect()`` then frees, naming the size and the device."""
    import fcntl

    backend = FreeLog()
    buf = rf.HipBuffer(4096, backend=backend, shareable=True)
    fd = os.open(procs.shm_path(buf.ipc_handle().lease), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        buf.close()
        assert backend.freed == [] and ipc.pending()["deferred"] == 1
    finally:
        os.close(fd)  # lets go of the lock
    assert ipc.collect() == 4096
    assert backend.freed == [(4096, buf.device)]
