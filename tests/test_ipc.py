"""Memory shared between processes: handles, mapping in another process, and the lifetimes
(DESIGN.md, IPC). Each test runs on the host backend (POSIX shared memory) and on each GPU
backend that answers (hipIpc*/cuIpc*); the other process is a spawned worker (workers.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
import pytest
from workers import (
    export_and_wait,
    map_and_ask,
    map_and_map_again,
    map_and_write,
    map_then_close_when_told,
    map_twice,
    share_once,
    spawned,
    try_map,
    try_map_each,
    try_map_while_mapping,
)

import rocmforge_raw as rf
from rocmforge_raw.common import procs
from rocmforge_raw.errors import DeviceError, IpcError
from rocmforge_raw.memory import ipc
from rocmforge_raw.runtime import get_backend


def _shared(backend, values=1024):
    buf = rf.HipBuffer(values * 4, backend=backend, shareable=True)
    buf.copy_from_host(np.arange(values, dtype=np.int32))
    return buf


def _files():
    return {n for n in os.listdir(procs.SHM_DIR) if n.startswith(f"{procs.PREFIX}{os.getpid()}-")}


def test_a_handle_is_a_plain_picklable_value(backend):
    with _shared(backend) as buf:
        handle = buf.ipc_handle()
        assert pickle.loads(pickle.dumps(handle)) == handle
        assert (handle.backend, handle.device, handle.nbytes) == (backend.name, buf.device, 4096)
        assert (handle.pid, handle.boot_id) == (os.getpid(), procs.boot_id())
        assert buf.ipc_handle() == handle  # one export per allocation
        assert handle.exporter_alive()


def test_another_process_reads_and_writes_the_memory(backend):
    with _shared(backend) as buf, spawned(map_and_write, buf.ipc_handle(), False) as worker:
        assert worker.receive() == list(range(8))
        assert worker.receive() == "closed"
        assert buf.to_numpy(np.int32, 4).tolist() == [7, 7, 2, 3]
        worker.send("exit")


def test_a_process_maps_one_handle_once_however_often_it_imports_it(backend):
    with _shared(backend) as buf, spawned(map_twice, buf.ipc_handle()) as worker:
        (first, second), data, mappings = worker.receive()
        assert first == second and mappings == 1 and data == [0, 1, 2, 3]
        assert worker.receive() == 0


def test_a_process_knows_which_addresses_it_mapped_from_another(backend):
    """ipc.mapped (what ops.copy_spans asks before it lets a kernel of another device read a
    source) covers exactly an imported mapping while it is open."""
    with _shared(backend) as buf, spawned(map_and_ask, buf.ipc_handle()) as worker:
        assert worker.receive() == [True, True, False, False]
        assert worker.receive() is False


def test_close_while_another_process_maps_it_defers_the_free(backend):
    buf = _shared(backend)
    with spawned(map_and_write, buf.ipc_handle(), True) as worker:
        assert worker.receive() == list(range(8))
        assert worker.receive() == "holding"
        files = _files()
        buf.close()
        assert buf.closed
        assert ipc.pending()["deferred_bytes"] == 4096
        assert ipc.collect() == 0  # still mapped there
        if backend.name == "host":
            assert _files() == files  # the segment and its lease are still there
        worker.send("exit")
    assert ipc.collect() == 4096  # the importer unmapped: now it is freed
    assert ipc.pending()["deferred"] == 0
    assert not _files()


def test_the_last_importer_letting_go_lets_the_exporter_free_while_it_lives(backend):
    """The importer's close (not its exit) releases the lease: the exporter's deferred
    free completes while the importing process still runs."""
    buf = _shared(backend)
    with spawned(map_then_close_when_told, buf.ipc_handle()) as worker:
        assert worker.receive() == "holding"
        buf.close()
        assert ipc.collect() == 0  # still mapped there
        worker.send("close")
        assert worker.receive() == "closed"
        try:
            assert ipc.collect() == 4096 and ipc.pending()["deferred"] == 0
            assert not _files()
        finally:
            worker.send("exit")


def test_memory_its_exporter_closed_is_not_mapped_anew(backend):
    """After close() (the free deferred while a process maps the memory) neither another
    process nor the one mapping it may map it again: importers one after another never keep
    closed memory alive."""
    buf = _shared(backend)
    handle = buf.ipc_handle()
    with spawned(map_and_map_again, handle) as holder:
        assert holder.receive() == "holding"
        buf.close()
        with spawned(try_map, handle) as late:
            answers = [late.receive()]
        holder.send("again")
        answers.append(holder.receive())
    for kind, message in answers:
        assert kind == "IpcError" and "closed" in message, message
    assert ipc.collect() == 4096 and not _files()


def test_a_killed_importer_does_not_keep_the_memory(backend):
    buf = _shared(backend)
    with spawned(map_and_write, buf.ipc_handle(), True) as worker:
        assert worker.receive() == list(range(8))
        assert worker.receive() == "holding"
        worker.kill()  # no unmapping, no unlocking: the kernel drops its lock
        buf.close()
    assert ipc.pending()["deferred"] == 0
    assert not _files()


def test_memory_its_exporter_freed_cannot_be_mapped(backend):
    with _shared(backend) as buf:
        handle = buf.ipc_handle()
    with spawned(try_map, handle) as worker:
        kind, message = worker.receive()
    assert kind == "IpcError" and "gone" in message


def test_a_handle_of_a_killed_exporter_is_refused_and_its_files_swept(backend):
    with spawned(export_and_wait, backend.name) as worker:
        handle = worker.receive()
        worker.kill()
    assert not handle.exporter_alive()
    with pytest.raises(IpcError, match="has exited"):
        rf.HipBuffer.from_ipc(handle)
    with spawned(share_once, backend.name) as worker:  # a fresh process sweeps first
        names = worker.receive()
    assert not [n for n in names if n.startswith(f"{procs.PREFIX}{handle.pid}-")]


def test_a_handle_mapped_here_is_not_imported_anew_once_its_exporter_exited(backend):
    """The mapping this process keeps does not make a killed exporter's handle importable:
    a new import is refused as in a process that never mapped it; the buffer imported
    before stays this process's to close."""
    with spawned(export_and_wait, backend.name) as worker:
        handle = worker.receive()
        first = rf.HipBuffer.from_ipc(handle)
        worker.kill()
    with pytest.raises(IpcError, match="has exited"):
        rf.HipBuffer.from_ipc(handle)
    first.close()
    assert ipc.pending()["imported"] == 0


def test_a_handle_whose_lease_names_no_file_is_refused(backend):
    with _shared(backend) as buf:
        handle = buf.ipc_handle()
        for lease in ("", ".", "..", procs.PREFIX):
            with spawned(try_map, dataclasses.replace(handle, lease=lease)) as worker:
                kind, message = worker.receive()
            assert kind == "IpcError" and f"handle.lease {lease!r} names no lease" in message


def test_foreign_garbled_and_own_handles_get_clear_errors(backend):
    with _shared(backend) as buf:
        handle = buf.ipc_handle()
        with pytest.raises(IpcError, match="exported by this process"):
            rf.HipBuffer.from_ipc(handle)
        with pytest.raises(IpcError, match="another host"):
            rf.HipBuffer.from_ipc(dataclasses.replace(handle, boot_id="0" * 36))
        with pytest.raises(TypeError, match="IpcHandle"):
            rf.HipBuffer.from_ipc(handle.key)
        with pytest.raises(rf.BackendUnavailableError, match="unknown backend"):
            rf.HipBuffer.from_ipc(dataclasses.replace(handle, pid=1, backend="nope"))
        garbled = dataclasses.replace(handle, lease=procs.PREFIX + "0-0-0.lease")
        with spawned(try_map, garbled) as worker:
            kind, message = worker.receive()
        assert kind == "IpcError" and f"lease {garbled.lease} not found" in message


def test_a_handle_altered_to_name_other_memory_is_refused_before_mapping(backend):
    """The lease seals its handle's backend, device, size and key: a handle whose key names
    another export's memory, or that claims another size (which no GPU runtime checks), is
    refused before anything is mapped."""
    with _shared(backend) as first, _shared(backend) as second:
        handle = first.ipc_handle()
        altered = [dataclasses.replace(handle, key=second.ipc_handle().key),
                   dataclasses.replace(handle, nbytes=handle.nbytes // 2),
                   dataclasses.replace(handle, nbytes=handle.nbytes * 2)]
        with spawned(try_map_each, altered) as worker:
            answers = [worker.receive() for _ in altered]
    for kind, message in answers:
        assert kind == "IpcError" and "altered" in message, message


def test_a_mapped_handle_imported_again_altered_is_refused(backend):
    """A process that maps a handle already serves a second import from that mapping only
    for the very same handle: one that claims more bytes would overrun the mapping."""
    with _shared(backend) as buf:
        handle = buf.ipc_handle()
        grown = dataclasses.replace(handle, nbytes=handle.nbytes * 1024)
        with spawned(try_map_while_mapping, handle, grown) as worker:
            kind, message = worker.receive()
    assert kind == "IpcError" and "does not match" in message, message


def test_only_shareable_root_buffers_export(backend):
    with rf.HipBuffer(64, backend=backend) as plain, \
            pytest.raises(ValueError, match=r"not shareable: only memory allocated with"):
        plain.ipc_handle()
    pool = rf.MemoryPool(backend=backend)
    with pytest.raises(ValueError, match="pooled memory cannot be shared"):
        rf.HipBuffer(64, backend=backend, pool=pool, shareable=True)
    with pytest.raises(TypeError, match="shareable"):
        rf.HipBuffer(64, backend=backend, shareable="yes")
    with rf.HipBuffer(64, backend=backend, shareable=True) as buf:
        with pytest.raises(ValueError, match="a view cannot be exported"):
            buf.view(0, 32).ipc_handle()
        with rf.HipBuffer(0, backend=backend, shareable=True) as empty, \
                pytest.raises(ValueError, match="0-byte"):
            empty.ipc_handle()
    with pytest.raises(rf.BufferClosedError):
        buf.ipc_handle()
    assert ipc.pending() == {"exported": 0, "deferred": 0, "deferred_bytes": 0, "imported": 0}


def test_a_host_segment_that_cannot_be_mapped_leaves_no_file(monkeypatch):
    """A failure after the segment was made (mmap refused: address space or map count
    exhausted) removes it, and with it the /dev/shm space it reserved."""
    host = get_backend("host")
    files = _files()

    def refuse(fd, nbytes, name):
        raise DeviceError("mmap", 12, "Cannot allocate memory", f"mapping {name.decode()}")

    monkeypatch.setattr(type(host), "_map", staticmethod(refuse))
    with pytest.raises(DeviceError, match="mmap"):
        rf.HipBuffer(1 << 20, backend=host, shareable=True)
    assert _files() == files


def test_shareable_memory_is_counted_and_freed_like_any_buffer(backend):
    before = rf.memory_stats()
    buf = rf.HipBuffer(1 << 16, backend=backend, shareable=True)
    assert rf.memory_stats()["live_bytes"] == before["live_bytes"] + (1 << 16)
    if backend.name == "host":
        assert not buf.to_numpy().any()  # a fresh segment reads as zeros
    buf.ipc_handle()
    del buf  # the finalizer frees it (no importer)
    assert rf.memory_stats()["live_bytes"] == before["live_bytes"]
    assert ipc.pending()["exported"] == 0
    assert not _files()


def test_the_last_importer_waits_for_the_device_before_it_unmaps_and_lets_go():
    # The importer's queued work may still use the memory: only after the device has passed
    # it may the exporter (which frees once the lease is free) free it.
    calls = []

    class Recording:  # stands for a GPU backend (none answers here): records the order
        def restoring(self, device, call):  # the thread's active device is given back after
            calls.append(("restoring", device))
            call()
            calls.append(("restored", device))

        def synchronize(self, device):
            calls.append(("synchronize", device))

        def ipc_close(self, ptr, nbytes, device):
            calls.append(("ipc_close", device))

    handle = dataclasses.make_dataclass("Handle", ["backend", "key", "nbytes", "device"])(
        "cuda", b"k", 256, 1)
    mapping = object.__new__(ipc._Mapping)
    mapping.backend, mapping.handle, mapping.refs = Recording(), handle, 1
    mapping.fd, mapping.ptr = os.open(os.devnull, os.O_RDONLY), 4096
    mapping.exporter = procs.Exit(*procs.identity())  # (closed with the mapping)
    mapping.device = 0  # mapped on the importer's device, not the exporter's (1)
    ipc._imports[("cuda", b"k")] = mapping
    mapping.release(4096, 256, 0)
    assert calls == [("restoring", 0), ("synchronize", 0), ("ipc_close", 0), ("restored", 0)]
    assert ("cuda", b"k") not in ipc._imports


@pytest.mark.parametrize("by_driver", [False, True], ids=["span-kernel", "driver-batch"])
def test_a_mapping_made_on_the_importers_device_is_read_there(two_devices, monkeypatch,
                                                               by_driver):
    """An importer maps another device's export on its own device (GPUs: peer access, which
    the open enables): the buffer is that device's, ``ipc.remote_device`` names the
    exporter's, and spans of it arrive whole in memory of the importer's device, short ones
    through the span kernel over the link, long ones (here: every span, by a lowered bar)
    as one batched driver copy (or one runtime copy a span where there is none)."""
    from rocmforge_raw.kernels import ops

    backend = two_devices
    if by_driver:
        monkeypatch.setattr(ops, "LINK_SPAN_BYTES", 16)
    with spawned(export_and_wait, backend.name, 1) as worker:
        handle = worker.receive()
        mapped = rf.HipBuffer.from_ipc(handle, device=0)
        try:
            assert (mapped.device, handle.device, ipc.remote_device(mapped.ptr)) == (0, 1, 1)
            with rf.HipBuffer.from_ipc(handle, device=1) as again:
                assert again.device == 0  # (it shares the mapping)
            with rf.HipBuffer(4096, 0, backend) as dst:
                dst.fill(0)
                spans = np.array([[0, 2048, 1024], [1024, 0, 16], [3072, 1040, 1008]])
                ops.copy_spans(dst, mapped, spans)
                got = dst.to_numpy(np.int32)
            want = np.zeros(1024, np.int32)
            for src_at, dst_at, nbytes in spans // 4:
                want[dst_at:dst_at + nbytes] = np.arange(src_at, src_at + nbytes)
            np.testing.assert_array_equal(got, want)
        finally:
            mapped.close()
            worker.kill()
