"""Faults of a sequence moving between caches (issue 45, item 4): the sender dies before or
during the read, the read does not complete in time, the receiver has too few free blocks,
the exporter closes its slab while the receiver keeps it mapped. Each time the receiver gets
an error naming what went wrong, its cache is as before (blocks, sequences, counters), and
neither side keeps memory: the receiver maps nothing more, the sender frees its slab. On
every backend, within one device and across two (the host backend's two logical devices)."""

from __future__ import annotations

import pytest
from conftest import DEVICE
from test_atomicity import cache_state
from workers import prefill, prefill_then_close, spawned

from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.errors import IpcError, TransferError
from rocmforge_raw.memory import ipc
from rocmforge_raw.transport import IpcTransport, PeerTransport

CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_q_heads=4)
SIDES = pytest.mark.parametrize("across", [False, True], ids=["one-device", "two-devices"])


def config(num_blocks=32):
    return CacheConfig(**CONFIG, num_blocks=num_blocks)


def devices(backend, across):
    """(the sender's device, the receiver's): the suite's device for both, or two."""
    if not across:
        return DEVICE, DEVICE
    if backend.num_devices < 2:
        pytest.skip(f"the {backend.name} backend has one device here")
    return 1 - min(DEVICE, 1), min(DEVICE, 1)


def but_slab(state):
    """A cache's state but its slab's bytes (a failed read may have written free blocks)."""
    return {key: value for key, value in state.items() if key != "slab"}


@SIDES
@pytest.mark.parametrize("mapped", [False, True], ids=["unmapped", "mapped"])
def test_a_sender_killed_before_the_import_is_refused(backend, across, mapped):
    sender, receiver = devices(backend, across)
    with IpcTransport() as link, KvCache(config(), receiver, backend) as cache, \
            spawned(prefill, backend.name, sender, "ipc", config(), 40, 1) as worker:
        desc = worker.receive()
        if mapped:  # as after an earlier transfer from the same sender
            link.mapping(desc.endpoints["ipc"])
        cache.add_sequence("resident", num_tokens=20)
        before = cache_state(cache)
        worker.kill()
        # (its lease found: "has exited"; already cleaned away: "freed it or exited")
        with pytest.raises(IpcError, match=f"process {worker.process.pid}.* (has exited|"
                                           "freed it or exited)"):
            cache.import_sequence(desc, link)
        assert cache_state(cache) == before
        assert ipc.pending()["imported"] == 0


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
@SIDES
def test_a_sender_killed_during_the_read_fails_it(backend, across, monkeypatch):
    """The sender dies between two of the read's copies: what arrived is undefined (a GPU
    frees the memory of a process that exits), so the import fails and is undone."""
    import rocmforge_raw.transport.ipc as transport_ipc

    sender, receiver = devices(backend, across)
    copy = transport_ipc.copy_spans
    with IpcTransport() as link, KvCache(config(), receiver, backend) as cache, \
            spawned(prefill, backend.name, sender, "ipc", config(), 40, 1) as worker:
        desc = worker.receive()

        def dying(dst, src, spans, *args):
            copy(dst, src, spans[:1], *args)
            worker.kill()
            copy(dst, src, spans[1:], *args)

        monkeypatch.setattr(transport_ipc, "copy_spans", dying)
        cache.add_sequence("resident", num_tokens=20)
        before = cache_state(cache)
        with pytest.raises(IpcError, match=f"process {worker.process.pid}.* has exited"):
            cache.import_sequence(desc, link)
        assert but_slab(cache_state(cache)) == but_slab(before)
        assert ipc.pending()["imported"] == 0
        cache.check_invariants()


@SIDES
def test_a_full_receiver_refuses_before_it_maps_anything(backend, across):
    sender, receiver = devices(backend, across)
    with IpcTransport() as link, KvCache(config(num_blocks=6), receiver, backend) as cache, \
            spawned(prefill, backend.name, sender, "ipc", config(), 90, 1) as worker:
        desc = worker.receive()  # 6 blocks
        cache.add_sequence("resident", num_tokens=20)  # 2 of 5
        before = cache_state(cache)
        with pytest.raises(CacheFullError, match="needs 6 blocks but 3 are free"):
            cache.import_sequence(desc, link)
        assert cache_state(cache) == before
        assert ipc.pending()["imported"] == 0
        worker.send("done")
        assert worker.receive() == 3  # the sender's blocks went back


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
@SIDES
def test_a_slab_its_exporter_closed_is_refused_and_let_go(backend, across):
    """The receiver keeps the sender's slab mapped after a transfer; the sender then closes
    its cache (its free waits for the mapping): the next import from it is refused, and the
    mapping goes, so the sender frees its slab."""
    sender, receiver = devices(backend, across)
    with IpcTransport() as link, KvCache(config(), receiver, backend) as cache, \
            spawned(prefill_then_close, backend.name, sender, config(), 40) as worker:
        desc = worker.receive()
        cache.import_sequence(desc, link)
        cache.remove("prompt")
        worker.send("close")
        assert worker.receive()["deferred"] == 1  # mapped here
        before = cache_state(cache)
        with pytest.raises(IpcError, match=f"process {worker.process.pid} closed the memory"):
            cache.import_sequence(desc, link)
        assert cache_state(cache) == before
        assert ipc.pending()["imported"] == 0
        worker.send("collect")
        live, pending = worker.receive()
        assert (live, pending["deferred"], pending["exported"]) == (0, 0, 0)
        worker.send("exit")


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
@SIDES
def test_a_read_lets_go_of_the_slabs_their_exporters_closed(backend, across):
    """A mapping of a closed slab goes at the next read through the transport, whichever
    sender it reads from: a closed sender is not kept waiting for its free."""
    sender, receiver = devices(backend, across)
    with IpcTransport() as link, KvCache(config(), receiver, backend) as cache, \
            spawned(prefill_then_close, backend.name, sender, config(), 40) as closing, \
            spawned(prefill, backend.name, sender, "ipc", config(), 40, 1) as other:
        cache.import_sequence(closing.receive(), link, seq_id="first")
        closing.send("close")
        assert closing.receive()["deferred"] == 1
        cache.import_sequence(other.receive(), link, seq_id="second")
        assert ipc.pending()["imported"] == 1  # the other sender's slab only
        closing.send("collect")
        assert closing.receive()[0] == 0
        closing.send("exit")
        other.send("done")
        assert other.receive() == 3


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
@SIDES
def test_a_read_that_does_not_complete_in_time_fails_and_can_be_retried(backend, across,
                                                                         monkeypatch):
    """The device never says the copies passed (a hung one): the import gives up after
    ``timeout`` seconds, undone; the same import succeeds once the device answers."""
    sender, receiver = devices(backend, across)
    with IpcTransport() as link, KvCache(config(), receiver, backend) as cache, \
            spawned(prefill, backend.name, sender, "ipc", config(), 40, 1) as worker:
        desc = worker.receive()
        cache.add_sequence("resident", num_tokens=20)
        before = cache_state(cache)
        with monkeypatch.context() as patch:
            patch.setattr(backend, "event_query", lambda event: False)
            with pytest.raises(TransferError, match=r"did not complete within timeout=0.05 s"):
                cache.import_sequence(desc, link, timeout=0.05)
        assert but_slab(cache_state(cache)) == but_slab(before)
        assert cache.import_sequence(desc, link, timeout=60).blocks_moved == 3
        worker.send("done")
        assert worker.receive() == 3


@SIDES
def test_a_peer_read_that_does_not_complete_in_time_fails(backend, across, monkeypatch):
    sender, receiver = devices(backend, across)
    with KvCache(config(), sender, backend) as src, KvCache(config(), receiver, backend) as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        src.add_sequence("s", num_tokens=40)
        desc = src.export_sequence("s")
        before = cache_state(dst)
        monkeypatch.setattr(backend, "event_query", lambda event: False)
        with pytest.raises(TransferError, match=r"did not complete within timeout=0.01 s"):
            dst.import_sequence(desc, link, timeout=0.01)
        monkeypatch.undo()
        assert but_slab(cache_state(dst)) == but_slab(before)


@pytest.mark.parametrize("timeout, error", [(0, ValueError), (-1.0, ValueError),
                                            (float("nan"), ValueError), ("1", TypeError)])
def test_a_timeout_must_be_a_positive_number_of_seconds(timeout, error):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        link.publish(src.slab)
        src.add_sequence("s", num_tokens=40)
        before = cache_state(dst)
        with pytest.raises(error, match="timeout must be a"):
            dst.import_sequence(src.export_sequence("s"), link, timeout=timeout)
        assert cache_state(dst) == before
