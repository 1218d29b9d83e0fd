"""Behaviours the mutation run of issue 44 (group B) found unpinned: sequence transfer
(``cache/transfer``), the transports, IPC's lifetimes, a graph's layout and uploads, and the
scheduler's abort and multi-turn paths. Each test names what a user would see change."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from test_atomicity import cache_state
from workers import export_and_wait, map_and_map_again, spawned, try_map

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.cache.step.graph_layout import (
    GraphShape,
    PinnedUploads,
    activations_of,
    padded_work,
)
from rocmforge_raw.cache.transfer.sequences import block_spans, fingerprint, layout
from rocmforge_raw.cache.transfer.transport import published
from rocmforge_raw.common import checks, procs
from rocmforge_raw.errors import IpcError
from rocmforge_raw.kernels.staging import Fence
from rocmforge_raw.memory import ipc
from rocmforge_raw.memory.array import DeviceArray
from rocmforge_raw.runtime import get_backend
from rocmforge_raw.transport import IpcTransport, PeerEndpoint, PeerTransport, peer

CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_q_heads=4)


def config(num_blocks=32, **changes):
    return CacheConfig(**{**CONFIG, "num_blocks": num_blocks, **changes})


def exported(src, link, num_tokens=40):
    link.publish(src.slab)
    src.add_sequence("s", tokens=np.arange(num_tokens))
    return src.export_sequence("s")


# --- sequences.py ----------------------------------------------------------------------------
def test_a_description_s_layout_names_its_dtypes_as_plain_strings():
    with KvCache(config(activation_dtype="float16")) as src, PeerTransport() as link:
        desc = exported(src, link)
        assert desc.layout == dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                                   dtype="float16", activation_dtype="float16",
                                   kv_scales=src.config.kv_scales)


def test_a_dtype_mismatch_names_both_dtypes():
    with KvCache(config()) as src, KvCache(config(dtype="bfloat16")) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)
        with pytest.raises(ValueError, match=re.escape(
                "dtype 'float16' (this cache: 'bfloat16'), activation_dtype 'float16' "
                "(this cache: 'bfloat16')")):
            dst.import_sequence(desc, link)


@pytest.mark.parametrize("field, value", [("prefix_hashes", "abc"),
                                          ("endpoints", [("peer", 1)])])
def test_a_malformed_container_is_shown_in_the_refusal(field, value):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), **{field: value})
        with pytest.raises(TypeError, match=re.escape(f"got {value!r}")):
            dst.import_sequence(desc, link)


def test_block_spans_of_no_blocks_are_an_empty_int64_table():
    spans = block_spans(np.zeros(0, np.int64), np.zeros(0, np.int32), 12, config())
    assert spans.shape == (0, 3) and spans.dtype == np.int64


def test_layouts_that_differ_have_different_fingerprints():
    fp8 = config(dtype="float8_e4m3fn", activation_dtype="float16",
                 kv_scales=[(0.02, 0.03)] * 2)
    prints = {fingerprint(layout(c)) for c in (config(), config(block_size=32), fp8)}
    assert len(prints) == 3


def test_a_layout_s_fingerprint_is_the_same_in_every_build():
    """A description crosses processes that may run another build of the package: the
    fingerprint of a layout is a fixed 16-byte digest of its fields, not of this build."""
    assert fingerprint(layout(config())) == "530d0cc6e43d9fb931bfca2ff6504e53"


def test_an_import_refuses_what_is_not_a_description_or_a_transport_showing_it():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = exported(src, link)
        with pytest.raises(TypeError, match=r"SequenceDescription \(from export_sequence\), "
                                            r"got \{'seq_id': 's'"):
            dst.import_sequence(dict(desc.__dict__), link)
        with pytest.raises(TypeError, match="must be a Transport, got 'peer'"):
            dst.import_sequence(desc, "peer")
        with pytest.raises(TypeError, match=re.escape("seq_id must be hashable, got [1]")):
            dst.import_sequence(desc, link, seq_id=[1])


def test_an_import_under_the_id_of_a_swapped_out_sequence_is_refused():
    with KvCache(config()) as src, KvCache(config(host_blocks=8)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)
        dst.add_sequence("s", num_tokens=20)
        dst.swap_out(["s"])
        before = dst.stats()
        with pytest.raises(ValueError, match="sequence 's' already exists"):
            dst.import_sequence(desc, link)
        assert dst.stats() == before


def test_an_endpoint_missing_for_the_transport_says_how_to_publish_it():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), endpoints={})
        with pytest.raises(ValueError, match=re.escape("PeerTransport.publish(slab)")):
            dst.import_sequence(desc, link)


def test_prefix_blocks_cached_free_at_the_receiver_count_as_blocks_an_import_takes():
    """3 blocks, 2 of them prefix blocks the receiver holds cached-free: reusing those takes
    them from the free blocks too, so 2 free blocks are too few and 3 are enough."""
    for resident_blocks, fits in ((5, False), (4, True)):
        with KvCache(config()) as src, KvCache(config(num_blocks=8)) as dst, \
                PeerTransport() as link:
            desc = exported(src, link)  # 40 tokens: 3 blocks, 2 full
            dst.import_sequence(desc, link, "held")
            dst.finish("held")  # 7 free blocks, 2 of them cached
            dst.add_sequence("resident", num_tokens=16 * resident_blocks)
            if fits:
                done = dst.import_sequence(desc, link)
                assert (done.blocks_shared, done.blocks_moved) == (2, 1)
                continue
            before = cache_state(dst)
            with pytest.raises(CacheFullError, match="needs 3 blocks but 2 are free"):
                dst.import_sequence(desc, link)
            assert cache_state(dst) == before


def test_prefix_blocks_the_receiver_holds_in_use_take_no_free_block():
    with KvCache(config()) as src, KvCache(config(num_blocks=8)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)  # 3 blocks, 2 full
        dst.import_sequence(desc, link, "held")
        dst.add_sequence("resident", num_tokens=16 * 3)  # 1 block left free
        done = dst.import_sequence(desc, link, "again")
        assert (done.blocks_shared, done.blocks_moved) == (2, 1)
        assert dst.stats()["free_blocks"] == 0


def test_a_full_receiver_says_an_import_never_preempts():
    with KvCache(config()) as src, KvCache(config(num_blocks=3)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)  # 3 blocks; the receiver has 2
        with pytest.raises(CacheFullError, match=r"^needs 3 blocks but 2 are free: an import "
                                                 r"never preempts$"):
            dst.import_sequence(desc, link)


def test_an_allocation_that_fails_raises_its_own_error_and_changes_nothing(monkeypatch):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = exported(src, link)
        before = cache_state(dst)

        def failing(*args):
            raise RuntimeError("no block today")

        monkeypatch.setattr(dst, "_allocate", failing)
        with pytest.raises(RuntimeError, match="no block today"):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before


def test_an_import_reports_the_sequence_its_tokens_and_a_duration():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        done = dst.import_sequence(exported(src, link), link, "copy")
        assert (done.seq_id, done.num_tokens, done.blocks_moved) == ("copy", 40, 3)
        assert isinstance(done.seconds, float) and 0 <= done.seconds < 60


def test_a_layout_that_is_not_a_dict_is_refused_naming_every_field():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), layout=None)
        with pytest.raises(ValueError, match=re.escape(
                "another layout: num_layers None (this cache: 2), num_kv_heads None")):
            dst.import_sequence(desc, link)


def test_a_layout_mismatch_shows_the_sender_s_value_beside_the_receiver_s():
    with KvCache(config()) as src, KvCache(config(num_kv_heads=4)) as dst, \
            PeerTransport() as link, pytest.raises(ValueError, match=re.escape(
            "another layout: num_kv_heads 2 (this cache: 4)")):
        dst.import_sequence(exported(src, link), link)


@pytest.mark.parametrize("field, value, message", [
    ("num_tokens", 0, "desc.num_tokens must be >= 1, got 0"),
    ("num_blocks", 1, "desc.num_blocks must be >= 2, got 1")])
def test_counts_below_their_least_are_refused_by_name(field, value, message):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), **{field: value})
        with pytest.raises(ValueError, match=re.escape(message)):
            dst.import_sequence(desc, link)


def test_a_sequence_of_one_token_moves():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        done = dst.import_sequence(exported(src, link, num_tokens=1), link)
        assert (done.num_tokens, done.blocks_moved) == (1, 1) and dst.seq_len("s") == 1


def test_a_block_id_one_past_the_sender_s_slab_is_refused():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), block_ids=(1, 2, 32))
        before = cache_state(dst)
        with pytest.raises(ValueError, match=re.escape("block ids [1, 2, 32] leave 1..31")):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before


@pytest.mark.parametrize("hashes, message", [
    ((b"x",), "of 16 bytes, got (b'x',)"),
    ((b"p" * 16, b"p" * 16), "prefix_hashes repeat a hash: (b'pppppppppppppppp', b'ppp")])
def test_bad_prefix_hashes_are_shown_in_the_refusal(hashes, message):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), prefix_hashes=hashes)
        with pytest.raises(ValueError, match=re.escape(message)):
            dst.import_sequence(desc, link)


# --- graph_layout.py: PinnedUploads on the host backend ------------------------------------
def _uploads_and_target(nbytes=4096, **kw):
    return PinnedUploads(0, get_backend("host"), **kw), rf.HipBuffer(nbytes, backend="host")


def test_an_upload_lays_each_array_at_its_offset_zero_padded_to_its_shape():
    uploads, target = _uploads_and_target()
    with target:
        rows = np.arange(6, dtype=np.int32).reshape(2, 3)
        lens = np.array([10, 11, 12], np.int64)
        uploads.upload([rows, lens], [(0, (2, 4)), (32, (5,))], target.ptr, None)
        assert target.to_numpy(np.int32, 8).tolist() == [0, 1, 2, 0, 3, 4, 5, 0]
        assert target.to_numpy(np.uint8, 72)[32:].view(np.int64).tolist() == [10, 11, 12, 0, 0]
        uploads.close()


def test_an_upload_past_the_pinned_buffer_grows_it_and_still_lands_whole():
    uploads, target = _uploads_and_target(1 << 16)
    with target:
        small = np.arange(4, dtype=np.int64)
        uploads.upload([small], [(0, (4,))], target.ptr, None)
        first = uploads.buffers[0][0]
        big = np.arange(5000, dtype=np.int64)
        uploads.upload([big], [(0, (5000,))], target.ptr, None)
        assert target.to_numpy(np.int64, 5000).tolist() == big.tolist()
        grown = uploads.buffers[0][0]
        assert grown is not first and grown.nbytes >= big.nbytes
        uploads.close()


def test_while_the_device_lags_uploads_take_new_buffers_up_to_max_depth(monkeypatch):
    monkeypatch.setattr(Fence, "passed", lambda self: False)  # the device never catches up
    monkeypatch.setattr(Fence, "wait", lambda self: None)
    uploads, target = _uploads_and_target()
    with target:
        for value in range(20):
            uploads.upload([np.full(4, value, np.int64)], [(0, (4,))], target.ptr, None)
            assert len(uploads.buffers) == min(value + 1, 16)
        assert target.to_numpy(np.int64, 4).tolist() == [19] * 4
        monkeypatch.undo()
        uploads.close()


# --- graph_layout.py: padded_work and GraphShape --------------------------------------------
def test_padded_work_takes_lengths_of_any_integer_dtype():
    lens = np.array([100, 20], np.int64)
    cum16, first_seq = padded_work(lens, 1, 192, 64, 3)
    assert cum16.tolist() == [0, 128, 192] and first_seq.tolist() == [0, 0, 1]


@pytest.mark.parametrize("lens, total, cum16", [
    ([100, 100], 320, [0, 128, 320]),  # whole pieces of 64, the last takes the rest
    ([100, 20], 192, [0, 128, 192]),  # whole pieces filling the total exactly
    ([100, 100], 288, [0, 144, 288])])  # 288 is no whole count of pieces: slack shared
def test_padded_work_gives_whole_pieces_where_the_total_is_whole_pieces(lens, total, cum16):
    got, _ = padded_work(np.array(lens, np.int32), 1, total, 64, -(-total // 64))
    assert got.tolist() == cum16


def test_a_shape_s_bound_refuses_lengths_within_the_total_but_past_the_bound():
    shape = GraphShape(("a", "b"), (), 4, 1, 320, 64, 5, bound=240)  # 224 fit, 256 do not
    assert shape.admits(("a", "b"), (), 4, np.array([100, 100], np.int32)) is not None
    assert shape.admits(("a", "b"), (), 4, np.array([100, 130], np.int32)) is None
    assert GraphShape(("a", "b"), (), 4, 1, 320, 64, 5).admits(
        ("a", "b"), (), 4, np.array([100, 130], np.int32)) is not None


# --- transport/peer.py ----------------------------------------------------------------------
def test_each_published_slab_has_its_own_endpoint():
    with KvCache(config()) as one, KvCache(config(num_blocks=20)) as two, \
            PeerTransport() as link:
        ends = link.publish(one.slab), link.publish(two.slab)
        assert ends[0] != ends[1]
        assert [link.endpoint_nbytes(end) for end in ends] == [one.slab.buffer.nbytes,
                                                               two.slab.buffer.nbytes]


def test_a_slab_collected_leaves_no_entry_behind():
    with PeerTransport() as link:
        buffer = rf.HipBuffer(1024, backend="host")
        number = link.publish(buffer).number
        assert number in peer._buffers
        del buffer
        gc.collect()
        assert number not in peer._buffers


def test_a_peer_read_refuses_what_is_no_peer_endpoint_or_names_no_live_slab():
    spans = np.zeros((0, 3), np.int64)
    with KvCache(config()) as dst, PeerTransport() as link:
        with pytest.raises(TypeError, match="a peer endpoint is a PeerEndpoint, got 'x'"):
            link.read("x", dst.slab.buffer, spans)
        with pytest.raises(ValueError, match=re.escape(
                "names memory of process 1, and peer copies stay in one process: use "
                "IpcTransport across processes")):
            link.read(PeerEndpoint(pid=1, number=1), dst.slab.buffer, spans)
        with pytest.raises(rf.BufferClosedError, match=r"^the sender's slab was closed$"):
            link.read(PeerEndpoint(os.getpid(), 10**9), dst.slab.buffer, spans)


# --- cache/transfer/transport.py, transport/ipc.py ------------------------------------------
def test_publishing_what_is_no_buffer_is_refused_showing_it():
    with PeerTransport() as link, pytest.raises(TypeError, match=re.escape(
            "buffer must be a HipBuffer or a DeviceArray, got 'slab'")):
        link.publish("slab")


def test_a_slab_published_nowhere_exports_no_endpoint():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        src.add_sequence("s", num_tokens=20)
        desc = src.export_sequence("s")
        assert desc.endpoints == {}
        with pytest.raises(ValueError, match="published through no transport"):
            dst.import_sequence(desc, link)


def test_an_ipc_transport_refuses_an_endpoint_that_is_no_handle_showing_it():
    with IpcTransport() as link, pytest.raises(
            TypeError, match="an ipc endpoint is an IpcHandle, got 'x'"):
        link.endpoint_nbytes("x")


def test_a_transport_cannot_be_pickled_and_says_what_to_send_instead():
    with PeerTransport() as link, pytest.raises(TypeError, match=re.escape(
            "a PeerTransport holds mappings or an engine and cannot be pickled: send its "
            "endpoints (they are plain values)")):
        pickle.dumps(link)


def test_activations_are_each_array_s_address_and_shape_in_order():
    arrays = [DeviceArray.empty((2, 8), np.float16, backend="host") for _ in range(3)]
    try:
        assert activations_of([(*arrays, "out")]) == (
            *((a.ptr, (2, 8)) for a in arrays), (None, None))
    finally:
        for array in arrays:
            array.buffer.close()


# --- memory/ipc.py: the leases go with their process ----------------------------------------
_EXPORTER = """
import pickle, sys
from rocmforge_raw import HipBuffer
from rocmforge_raw.memory import ipc
kept, closed = (HipBuffer(4096, backend="host", shareable=True) for _ in range(2))
print(pickle.dumps((kept.ipc_handle(), closed.ipc_handle())).hex(), flush=True)
sys.stdin.readline()  # the test maps `closed`
closed.close()  # its free is deferred: the test maps it
print(ipc.pending()["deferred"], flush=True)
"""  # then exits with `kept` open and `closed` deferred


def test_a_process_that_exits_takes_its_leases_with_it():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with subprocess.Popen([sys.executable, "-c", _EXPORTER], cwd=root, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        kept, closed = pickle.loads(bytes.fromhex(child.stdout.readline()))
        leases = [procs.shm_path(handle.lease) for handle in (kept, closed)]
        with rf.HipBuffer.from_ipc(closed):
            child.stdin.write("mapped\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "1"
            assert child.wait(60) == 0
            assert not any(os.path.exists(path) for path in leases)


def test_peer_copies_between_two_backends_are_refused_naming_both(gpu):
    with KvCache(config(), backend="host") as src, KvCache(config(), backend=gpu) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)
        with pytest.raises(ValueError, match=r"^the sender's slab is host memory, the "
                                             r"receiver's \w+: peer copies stay within one "
                                             r"backend$"):
            dst.import_sequence(desc, link)


def test_an_upload_that_fills_its_pinned_buffer_exactly_keeps_it():
    uploads, target = _uploads_and_target()
    with target:
        uploads.upload([np.arange(32, dtype=np.int64)], [(0, (32,))], target.ptr, None)
        first = uploads.buffers[0][0]
        assert first.nbytes == 256  # the least a pinned buffer holds
        uploads.upload([np.arange(32, dtype=np.int64)], [(0, (32,))], target.ptr, None)
        assert uploads.buffers[0][0] is first
        uploads.close()


def test_an_outgrown_pinned_buffer_is_replaced_by_one_twice_its_size_at_least():
    uploads, target = _uploads_and_target()
    with target:
        uploads.upload([np.arange(32, dtype=np.int64)], [(0, (32,))], target.ptr, None)
        uploads.upload([np.arange(40, dtype=np.int64)], [(0, (40,))], target.ptr, None)
        assert uploads.buffers[0][0].nbytes == 512  # 320 bytes asked, 2 x 256 given
        assert target.to_numpy(np.int64, 40).tolist() == list(range(40))
        uploads.close()


def test_while_the_device_lags_each_upload_takes_the_buffer_used_longest_ago(monkeypatch):
    monkeypatch.setattr(Fence, "passed", lambda self: False)
    taken, wait = [], Fence.wait
    monkeypatch.setattr(Fence, "wait", lambda self: (taken.append(self), wait(self)))
    uploads, target = _uploads_and_target(max_depth=4)
    with target:
        for value in range(12):
            uploads.upload([np.full(4, value, np.int64)], [(0, (4,))], target.ptr, None)
        assert len(set(taken)) == 4 and taken[4:] == taken[:4] * 2
        monkeypatch.undo()
        uploads.close()


def test_a_late_importer_of_closed_memory_is_told_the_free_waits_for_its_mappers():
    buf = rf.HipBuffer(4096, backend="host", shareable=True)
    handle = buf.ipc_handle()
    with spawned(map_and_map_again, handle) as holder:
        assert holder.receive() == "holding"
        buf.close()
        with spawned(try_map, handle) as late:
            answer = late.receive()
        holder.send("again")
        holder.receive()
    assert answer == ("IpcError", f"process {os.getpid()} closed the memory of this handle "
                                  "(it frees it once the processes that map it now let go)")
    assert ipc.collect() == 4096


def test_a_lease_its_exporter_retired_is_refused_as_freed():
    """The exporter marks a lease retired before it unlinks it: an importer that opened the
    file just before reads that mark (simulated here by writing it) and maps nothing."""
    with spawned(export_and_wait, "host") as exporter:
        try:
            handle = exporter.receive()
            with open(procs.shm_path(handle.lease), "r+b") as lease:
                lease.write(b"\x00")
            with pytest.raises(IpcError, match=re.escape(
                    f"process {handle.pid} has freed the memory of this handle")):
                rf.HipBuffer.from_ipc(handle)
        finally:
            exporter.kill()


def test_a_handle_whose_lease_is_gone_names_the_process_that_exported_it():
    with spawned(export_and_wait, "host") as exporter:
        try:
            handle = exporter.receive()
            gone = dataclasses.replace(handle, lease=handle.lease.replace(".lease", "x.lease"))
            with pytest.raises(IpcError, match=re.escape(
                    f"the memory of this handle is gone: process {handle.pid} freed it or "
                    f"exited (lease {gone.lease} not found)")):
                rf.HipBuffer.from_ipc(gone)
        finally:
            exporter.kill()


def test_publishing_a_slab_again_returns_the_same_endpoint():
    with KvCache(config()) as src, PeerTransport() as link, PeerTransport() as other:
        first = link.publish(src.slab)
        assert link.publish(src.slab) == first
        assert other.publish(src.slab) != first  # another transport: its own, the latest
        assert published(src.slab.buffer) == {"peer": other.publish(src.slab)}


def test_a_garbled_handle_is_refused_before_anything_is_mapped_saying_what_is_wrong():
    with rf.HipBuffer(4096, backend="host", shareable=True) as buf:
        handle = buf.ipc_handle()
        cases = [("x", TypeError, "(from HipBuffer.ipc_handle()), got 'x'"),
                 (dict(nbytes=0), ValueError, "handle.nbytes must be >= 1, got 0"),
                 (dict(nbytes=1), IpcError, "exported by this process"),
                 (dict(nbytes=checks.MAX_SIZE + 1), ValueError, "handle.nbytes must be <="),
                 (dict(key="k"), TypeError, f"got 'k' and {handle.lease!r}"),
                 (dict(lease=5), TypeError, "handle.lease a str, got b"),
                 (dict(boot_id="elsewhere"), IpcError,
                  "IPC maps memory of this host only; move bytes with a transfer engine")]
        for change, error, message in cases:
            wrong = change if isinstance(change, str) else dataclasses.replace(handle, **change)
            with pytest.raises(error, match=re.escape(message) + r"(\W|$)"):
                rf.HipBuffer.from_ipc(wrong)
        with pytest.raises(TypeError, match=r" and 5$"):
            rf.HipBuffer.from_ipc(dataclasses.replace(handle, lease=5))
