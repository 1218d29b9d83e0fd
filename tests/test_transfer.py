"""Sequences moving between KV caches (``export_sequence``/``import_sequence``) through each
transport: peer copies within a process, IPC between processes, Mooncake's Transfer Engine
(TCP on loopback) between processes. A decode side attends over the blocks it received and
must equal the reference computed from the K/V the prefill side wrote."""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import re
import weakref

import numpy as np
import pytest
from conftest import DEVICE
from test_atomicity import cache_state
from workers import kv, prefill, spawned

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.cache.transfer.sequences import block_spans
from rocmforge_raw.errors import TransferError
from rocmforge_raw.kernels import reference
from rocmforge_raw.memory.array import DeviceArray
from rocmforge_raw.transport import MooncakeTransport, PeerEndpoint, PeerTransport

CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_q_heads=4)
FP8 = dict(dtype="float8_e4m3fn", activation_dtype="float16", kv_scales=[(0.02, 0.03)] * 2)


def config(num_blocks=32, **changes):
    return CacheConfig(**{**CONFIG, "num_blocks": num_blocks, **changes})


def write_prompt(cache, seq_id, tokens, seed, stream=None):
    """Prefill: the K/V of ``kv(seed + layer)`` written at the prompt's slots, each layer
    (on ``stream``: None, the cache's)."""
    slots = cache.add_sequence(seq_id, tokens=tokens).slot_mapping
    backend, device = cache.slab.backend, cache.slab.device
    for layer in range(cache.config.num_layers):
        k, v = (DeviceArray.from_numpy(x, device, backend)
                for x in kv(seed + layer, len(tokens), cache.config))
        cache.write(layer, k, v, slots, stream=stream)
        k.buffer.close()
        v.buffer.close()


def decode_and_check(cache, seq_id, num_tokens, seed, stream=None):
    """One decode step of ``seq_id`` on ``cache`` (a new token, then attention in every
    layer, planned on ``stream``), each layer's output checked against the reference over
    the prompt's K/V (from ``kv``) and the new token's."""
    c, rng = cache.config, np.random.default_rng(seed + 99)
    backend, device = cache.slab.backend, cache.slab.device
    new = rng.standard_normal((1, c.num_kv_heads, c.head_dim), np.float32)
    new = new.astype(c.activation_dtype)
    q = rng.standard_normal((1, c.num_q_heads, c.head_dim), np.float32).astype(
        c.activation_dtype)
    dq, dnew = (DeviceArray.from_numpy(x, device, backend) for x in (q, new))
    out = DeviceArray.empty(q.shape, c.activation_dtype, device, backend)
    cache.append([seq_id])
    plan = cache.batch([seq_id], stream=stream)
    for layer in range(c.num_layers):
        cache.write(layer, dnew, dnew, plan)
        cache.attention(layer, out, dq, plan)
        k, v = (np.concatenate([x, new]) for x in kv(seed + layer, num_tokens, c))
        want = _reference(q, k, v, c, layer)
        got = out.to_numpy(stream=stream).astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, layer
    for array in (dq, dnew, out):
        array.buffer.close()


def _reference(q, k, v, c, layer):
    """Attention over tokens ``k``/``v`` ([tokens, heads, dim]), as one sequence of blocks."""
    blocks = -(-len(k) // c.block_size)
    k_scale, v_scale = c.kv_scales[layer]

    def paged(x, scale):
        x = np.concatenate([x, np.zeros((blocks * c.block_size - len(x), *x.shape[1:]),
                                        x.dtype)])
        if c.is_fp8:
            x = reference.quantize(x, scale, c.dtype)
        return x.reshape(blocks, c.block_size, c.num_kv_heads, c.head_dim).transpose(0, 2, 1, 3)

    return reference.paged_attention(
        q, paged(k, k_scale), paged(v, v_scale), np.arange(blocks)[None].astype(np.int32),
        np.array([len(k)], np.int32), 1 / math.sqrt(c.head_dim), np.float64, k_scale, v_scale)


def test_block_spans_copy_each_block_to_its_place_in_every_plane(rng):
    src_cfg, dst_cfg = config(num_blocks=12), config(num_blocks=9)
    src = rng.integers(0, 255, (2, 2, 12, 2, 16, 64)).astype(np.float16)
    dst = np.zeros((2, 2, 9, 2, 16, 64), np.float16)
    src_ids, dst_ids = np.array([3, 4, 5, 9, 10, 2]), np.array([1, 2, 3, 4, 7, 8])
    spans = block_spans(src_ids, dst_ids, 12, dst_cfg)
    assert len(spans) == 4 * 4  # runs 3-5/1-3, 9/4, 10/7 (dst breaks), 2-8: 4 runs x 4 planes
    src_bytes, dst_bytes = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for s, d, n in spans:
        dst_bytes[d : d + n] = src_bytes[s : s + n]
    assert np.array_equal(dst[:, :, dst_ids], src[:, :, src_ids])
    assert not dst[:, :, [0, 5, 6]].any()
    assert src_cfg.block_bytes == dst_cfg.block_bytes == spans[:, 2].sum() // 6


@pytest.mark.parametrize("fp8", [False, True], ids=["float16", "fp8"])
def test_a_sequence_moves_between_caches_and_decodes_like_the_reference(backend, fp8):
    extra = FP8 if fp8 else {}
    with KvCache(config(**extra), backend=backend) as src, \
            KvCache(config(num_blocks=20, **extra), backend=backend) as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        src.add_sequence("other", num_tokens=40)  # the blocks' ids differ on the two sides
        write_prompt(src, "prompt", np.arange(70), seed=5)
        dst.add_sequence("resident", num_tokens=17)
        desc = src.export_sequence("prompt")
        assert pickle.loads(pickle.dumps(desc)) == desc
        assert (desc.num_tokens, len(desc.block_ids), len(desc.prefix_hashes)) == (70, 5, 4)
        done = dst.import_sequence(desc, link)
        assert (done.blocks_moved, done.blocks_shared) == (5, 0)
        assert done.nbytes == 5 * src.config.block_bytes
        assert dst.seq_len("prompt") == 70 and "resident" in dst
        dst.check_invariants()
        decode_and_check(dst, "prompt", 70, seed=5)
        decode_and_check(src, "prompt", 70, seed=5)  # both caches decode on alike


def test_prefix_blocks_the_receiver_holds_are_shared_not_moved(backend):
    with KvCache(config(), backend=backend) as src, KvCache(config(), backend=backend) as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        write_prompt(src, "a", np.arange(50), seed=1)
        dst.import_sequence(src.export_sequence("a"), link)
        write_prompt(src, "b", np.concatenate([np.arange(32), [7] * 30]), seed=1)
        done = dst.import_sequence(src.export_sequence("b"), link)
        assert (done.blocks_shared, done.blocks_moved) == (2, 2)  # 32 shared tokens: 2 blocks
        assert list(dst.block_ids("b")[:2]) == list(dst.block_ids("a")[:2])
        dst.check_invariants()
        assert dst.stats()["used_blocks"] == 4 + 2


def test_a_sequence_the_receiver_holds_whole_reads_nothing(backend):
    """Every block a prefix hit: nothing moves, so the transport is not asked (no mapping,
    no wait for the stream), and the sender's slab may be gone already."""
    with KvCache(config(), backend=backend) as dst, PeerTransport() as link:
        with KvCache(config(), backend=backend) as src:
            link.publish(src.slab)
            write_prompt(src, "s", np.arange(32), seed=0)  # two full blocks
            desc = src.export_sequence("s")
            dst.import_sequence(desc, link)
        done = dst.import_sequence(desc, link, "again")  # the sender's slab is closed
        assert (done.blocks_shared, done.blocks_moved, done.nbytes) == (2, 0, 0)
        assert list(dst.block_ids("again")) == list(dst.block_ids("s"))
        dst.check_invariants()
        # its last block is shared with "s": a step's write without a new slot (as after
        # fork) must not land there
        before = dst.slab.buffer.to_numpy()
        plan = dst.batch(["again"])
        c = dst.config
        rows = DeviceArray.from_numpy(np.ones((1, c.num_kv_heads, c.head_dim), c.dtype),
                                      backend=dst.slab.backend)
        for layer in range(c.num_layers):
            dst.write(layer, rows, rows, plan)
        np.testing.assert_array_equal(dst.slab.buffer.to_numpy(), before)
        rows.buffer.close()


@pytest.mark.parametrize("change", [dict(block_size=32), dict(num_kv_heads=4),
                                    dict(dtype="bfloat16"), dict(num_layers=3),
                                    dict(FP8, kv_scales=[(0.02, 0.5)] * 2)],
                         ids=["block_size", "heads", "dtype", "layers", "scales"])
def test_a_layout_mismatch_is_refused_before_anything_is_allocated(change):
    base = FP8 if "kv_scales" in change else {}
    with KvCache(config(**base)) as src, KvCache(config(**change)) as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        write_prompt(src, "s", np.arange(20), seed=0)
        before = cache_state(dst)
        field = next(iter(change)) if "kv_scales" not in change else "kv_scales"
        with pytest.raises(ValueError, match=f"another layout: {field} "):
            dst.import_sequence(src.export_sequence("s"), link)
        assert cache_state(dst) == before


def test_altered_or_inconsistent_descriptions_are_refused():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        link.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        desc = src.export_sequence("s")
        before = cache_state(dst)
        bad = [(dataclasses.replace(desc, fingerprint="0" * 32), "was altered"),
               (dataclasses.replace(desc, num_tokens=70), "3 blocks cannot hold 70 tokens"),
               (dataclasses.replace(desc, block_ids=(1, 2, 40)), r"leave 1\.\.31"),
               (dataclasses.replace(desc, prefix_hashes=(b"x",)), r"full block\) of 16 bytes"),
               (dataclasses.replace(desc, prefix_hashes=(*desc.prefix_hashes, b"p" * 16)),
                "at most 2 hashes"),  # 40 tokens: the third block is partial
               (dataclasses.replace(desc, endpoints={}), "published through no transport"),
               # a smaller count reads other blocks at the planes' strides, still inside
               # the sender's slab: checked against the size the endpoint names
               (dataclasses.replace(desc, num_blocks=16), "desc.num_blocks 16 makes a slab of "
                                                          r"\d+ bytes, but the endpoint names"),
               (dataclasses.replace(desc, num_blocks=64), "desc.num_blocks 64")]
        for wrong, message in bad:
            with pytest.raises(ValueError, match=message):
                dst.import_sequence(wrong, link)
        with pytest.raises(TypeError, match="SequenceDescription"):
            dst.import_sequence(dict(desc.__dict__), link)
        for field, value in (("block_ids", (1.9, 2.2, 3.7)), ("block_ids", ("a", "b", "c")),
                             ("prefix_hashes", None), ("endpoints", None)):
            shown = re.escape(repr(value)[:5])
            with pytest.raises(TypeError, match=rf"desc\.{field} must be .*{shown}"):
                dst.import_sequence(dataclasses.replace(desc, **{field: value}), link)
        with pytest.raises(TypeError, match="Transport"):
            dst.import_sequence(desc, "peer")
        assert cache_state(dst) == before
        dst.add_sequence("s", num_tokens=1)
        before = cache_state(dst)
        with pytest.raises(ValueError, match="already exists"):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before


def test_a_description_repeating_a_prefix_hash_is_refused_and_changes_nothing():
    """Two hashes alike would take one block of the receiver twice: refused, whether that
    block is held or cached-free there, with the receiver as it was."""
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        link.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        desc = src.export_sequence("s")
        twice = dataclasses.replace(desc, prefix_hashes=desc.prefix_hashes[:1] * 2)
        dst.import_sequence(desc, link, "held")
        for state in ("held", "cached-free"):
            if state == "cached-free":
                dst.finish("held")
            before = cache_state(dst)
            with pytest.raises(ValueError, match="repeat"):
                dst.import_sequence(twice, link)
            assert cache_state(dst) == before, state
            dst.check_invariants()


def test_an_import_never_preempts(backend):
    with KvCache(config(), backend=backend) as src, \
            KvCache(config(num_blocks=6), backend=backend) as dst, PeerTransport() as link:
        link.publish(src.slab)
        write_prompt(src, "s", np.arange(50), seed=0)  # 4 blocks
        dst.add_sequence("resident", num_tokens=30)  # 2 of 5 blocks
        before = cache_state(dst)
        with pytest.raises(CacheFullError, match="needs 4 blocks but 3 are free"):
            dst.import_sequence(src.export_sequence("s"), link)
        assert cache_state(dst) == before


def test_a_read_that_fails_leaves_the_cache_exactly_as_before(backend):
    with KvCache(config(), backend=backend) as dst, PeerTransport() as link:
        with KvCache(config(), backend=backend) as src:
            link.publish(src.slab)
            write_prompt(src, "s", np.arange(50), seed=0)
            desc = src.export_sequence("s")
        write_prompt(dst, "resident", np.arange(20), seed=3)
        before = cache_state(dst)
        with pytest.raises(rf.BufferClosedError, match="slab was closed"):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before


def test_a_read_that_fails_forgets_the_prefix_blocks_it_may_have_written(backend):
    with KvCache(config(), backend=backend) as dst, PeerTransport() as link:
        with KvCache(config(), backend=backend) as src:
            link.publish(src.slab)
            write_prompt(src, "s", np.arange(20), seed=0)
            desc = src.export_sequence("s")
        write_prompt(dst, "old", np.arange(100, 100 + 16 * 30), seed=3)  # 30 blocks
        dst.finish("old")  # cached-free prefix blocks; the free stack holds one block
        before = cache_state(dst)
        with pytest.raises(rf.BufferClosedError):
            dst.import_sequence(desc, link)  # 2 blocks: one of them a cached prefix block
        after = cache_state(dst)
        assert len(after["cached"]) == len(before["cached"]) - 1
        gone = set(before["cached"]) - set(after["cached"])
        assert gone and gone <= set(after["free"])
        assert not gone & {block for block, _ in after["index"]}
        dst.check_invariants()


def test_a_peer_endpoint_stays_in_its_process():
    with KvCache(config()) as dst, PeerTransport() as link:
        spans = np.zeros((0, 3), np.int64)
        with pytest.raises(ValueError, match="stay in one process"):
            link.read(PeerEndpoint(pid=1, number=1), dst.slab.buffer, spans)


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_a_prefill_process_hands_a_sequence_to_a_decode_process(backend, transport):
    """Prefill in a spawned process, decode here: the transferred blocks attend like the
    reference, and the prefill side frees them once told the import is done."""
    if transport == "mooncake":
        link = _mooncake_or_skip(backend)
    else:
        from rocmforge_raw.transport import IpcTransport

        link = IpcTransport()
    cfg = config(dtype="bfloat16")
    with link, KvCache(cfg, backend=backend) as cache, \
            spawned(prefill, backend.name, DEVICE, transport, cfg, 90, 11) as worker:
        desc = worker.receive()
        assert desc.block_ids[0] == 4  # after the prefill side's 3 warm-up blocks
        done = cache.import_sequence(desc, link)
        assert done.blocks_moved == 6 and done.nbytes == 6 * cfg.block_bytes
        worker.send("done")
        assert worker.receive() == 3  # the sender's blocks went back
        decode_and_check(cache, "prompt", 90, seed=11)
        cache.check_invariants()


def _mooncake_or_skip(backend):
    """A Mooncake transport on loopback, or a skip naming why (the engine's wheel absent, or
    a build that cannot reach this backend's memory)."""
    try:
        link = MooncakeTransport("127.0.0.1")
    except rf.BackendUnavailableError as exc:
        pytest.skip(str(exc))
    if not link.reaches(backend.name):
        link.close()
        pytest.skip(f"the installed Mooncake build cannot reach {backend.name} memory")
    return link


def test_a_mooncake_read_that_fails_half_way_leaves_the_receiver_as_before(backend):
    """A real engine failure: the description asks for a block past what the sender
    registered, so the engine refuses that span after the others may have arrived."""
    sender = _mooncake_or_skip(backend)
    with sender, MooncakeTransport("127.0.0.1") as receiver, \
            KvCache(config(num_blocks=8), backend=backend) as src, \
            KvCache(config(), backend=backend) as dst:
        endpoint = sender.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        desc = src.export_sequence("s")
        grown = dataclasses.replace(endpoint, nbytes=endpoint.nbytes * 2)
        bad = dataclasses.replace(desc, block_ids=(1, 2, 12), num_blocks=16,
                                  endpoints={"mooncake": grown})
        write_prompt(dst, "resident", np.arange(100, 120), seed=3)
        before = cache_state(dst)
        with pytest.raises(TransferError, match="failed"):
            dst.import_sequence(bad, receiver)
        assert {k: v for k, v in cache_state(dst).items() if k != "slab"} == \
            {k: v for k, v in before.items() if k != "slab"}
        dst.check_invariants()


def test_a_slab_registered_with_the_engine_outlives_its_cache_until_the_engine_closes(backend):
    link = _mooncake_or_skip(backend)
    live = rf.memory_stats()["live_buffers"]
    cache = KvCache(config(), backend=backend)
    link.publish(cache.slab)
    cache.close()
    assert cache.closed
    assert rf.memory_stats()["live_buffers"] == live + 1  # the engine may still read it
    link.close()
    assert rf.memory_stats()["live_buffers"] == live
    assert rf.transport.published(cache.slab.buffer) == {}


def test_a_mooncake_transport_dropped_unclosed_lets_go_of_its_engine_and_slabs(backend):
    """Garbage collection closes a transport nobody closed: the slab it registered (of a
    closed cache still referenced) is freed, and the engine with its port goes."""
    link = _mooncake_or_skip(backend)
    live = rf.memory_stats()["live_buffers"]
    cache = KvCache(config(), backend=backend)
    link.publish(cache.slab)
    cache.close()
    dropped = weakref.ref(link)
    del link
    gc.collect()
    assert dropped() is None
    assert rf.memory_stats()["live_buffers"] == live and cache.slab.buffer.closed


@pytest.mark.parametrize("kind", ["peer", "ipc", "mooncake"])
def test_a_closed_transport_publishes_and_reads_no_more(backend, kind):
    """close() ends a transport: publish and read raise naming it, and the endpoints it
    published leave ``published()`` (a description would carry dead ones)."""
    from rocmforge_raw.transport import IpcTransport

    link = (_mooncake_or_skip(backend) if kind == "mooncake" else
            PeerTransport() if kind == "peer" else IpcTransport())
    with KvCache(config(), backend=backend, shareable=kind == "ipc") as cache, \
            KvCache(config(), backend=backend) as receiver:
        endpoint = link.publish(cache.slab)
        assert rf.transport.published(cache.slab.buffer) == {link.name: endpoint}
        link.close()
        assert link.closed and rf.transport.published(cache.slab.buffer) == {}
        name = type(link).__name__
        with pytest.raises(TransferError, match=f"this {name} was closed"):
            link.publish(cache.slab)
        with pytest.raises(TransferError, match=f"this {name} was closed"):
            link.read(endpoint, receiver.slab.buffer, np.array([[0, 0, 16]], np.int64))
        link.close()  # idempotent


def test_peer_copies_work_within_one_device(backend, rng):
    """memcpy_peer with the same device on both ends (what one GPU can test of a copy
    between two), on the default stream and on a stream."""
    data = rng.integers(0, 255, 1 << 16, np.uint8)
    with rf.HipBuffer.from_numpy(data, backend=backend) as src, \
            rf.HipBuffer(1 << 16, backend=backend) as dst, rf.Stream(backend=backend) as stream:
        backend.memcpy_peer(dst.ptr, dst.device, src.ptr, src.device, 1 << 15)
        backend.memcpy_peer(dst.ptr + (1 << 15), dst.device, src.ptr + (1 << 15), src.device,
                            1 << 15, stream.handle)
        stream.synchronize()
        assert np.array_equal(dst.to_numpy(), data)


def test_the_installed_mooncake_build_says_which_memory_it_reaches():
    pytest.importorskip("mooncake.engine", reason="the transfer extra is not installed")
    import importlib.metadata

    reaches = {"mooncake-transfer-engine-non-cuda": (True, False, False),
               "mooncake-transfer-engine": (True, True, False),
               "mooncake-transfer-engine-cuda13": (True, True, False),
               "mooncake-transfer-engine-rocm": (True, False, True)}
    dist = importlib.metadata.packages_distributions()["mooncake"][0]
    if dist not in reaches:
        pytest.skip(f"{dist} is a build this test does not know")
    got = tuple(MooncakeTransport.reaches(name) for name in ("host", "cuda", "hip"))
    assert got == reaches[dist]


@pytest.mark.parametrize("fp8", [False, True], ids=["float16", "fp8"])
@pytest.mark.parametrize("sender, receiver", [(0, 1), (1, 0)], ids=["0to1", "1to0"])
def test_a_sequence_moves_between_caches_on_two_devices(two_devices, sender, receiver, fp8):
    """Peer copies between two devices, on the receiving cache's own stream (direct where
    the devices have peer access, staged through host memory by the runtime where not):
    the receiver decodes like the reference, the sender too, and a second prompt sharing
    the first's prefix moves only what the receiver lacks."""
    backend, extra = two_devices, FP8 if fp8 else {}
    with rf.Stream(receiver, backend) as stream, \
            KvCache(config(**extra), sender, backend) as src, \
            KvCache(config(num_blocks=20, **extra), receiver, backend, stream=stream) as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        src.add_sequence("other", num_tokens=40)  # the blocks' ids differ on the two sides
        write_prompt(src, "prompt", np.arange(70), seed=2)
        done = dst.import_sequence(src.export_sequence("prompt"), link)
        assert (done.blocks_moved, done.nbytes) == (5, 5 * src.config.block_bytes)
        assert isinstance(backend.peer_access(receiver, sender), bool)
        decode_and_check(dst, "prompt", 70, seed=2)
        decode_and_check(src, "prompt", 70, seed=2)
        src.add_sequence("again", tokens=np.concatenate([np.arange(48), [9] * 10]))
        done = dst.import_sequence(src.export_sequence("again"), link)
        assert (done.blocks_shared, done.blocks_moved) == (3, 1)  # 48 shared tokens
        dst.check_invariants()
        assert (src.slab.device, dst.slab.device) == (sender, receiver)


@pytest.mark.parametrize("sender, receiver", [(0, 1), (1, 0)], ids=["0to1", "1to0"])
def test_a_prefill_process_on_one_device_hands_a_sequence_to_a_decoder_on_another(
        two_devices, sender, receiver):
    """IPC between two processes on two devices: the decoder maps the prefill side's slab
    (on its device) and peer-copies the blocks into its own; they attend like the
    reference."""
    from rocmforge_raw.transport import IpcTransport

    backend, cfg = two_devices, config(dtype="bfloat16")
    with IpcTransport() as link, KvCache(cfg, receiver, backend) as cache, \
            spawned(prefill, backend.name, sender, "ipc", cfg, 90, 11) as worker:
        desc = worker.receive()
        assert desc.endpoints["ipc"].device == sender
        done = cache.import_sequence(desc, link)
        assert done.blocks_moved == 6
        worker.send("done")
        assert worker.receive() == 3
        decode_and_check(cache, "prompt", 90, seed=11)
        cache.check_invariants()


def test_peer_access_is_asked_once_per_pair_and_is_true_within_a_device(two_devices):
    backend = two_devices
    for device in (0, 1):
        assert backend.peer_access(device, device) is True
    first = backend.peer_access(0, 1)
    assert backend.peer_access(0, 1) is first and isinstance(first, bool)
    with pytest.raises(rf.BackendUnavailableError, match="device 64"):
        backend.peer_access(0, 64)


def test_closing_an_ipc_transport_unmaps_what_it_mapped(backend):
    from workers import export_and_wait

    from rocmforge_raw.memory import ipc
    from rocmforge_raw.transport import IpcTransport

    with spawned(export_and_wait, backend.name) as worker:
        try:
            handle = worker.receive()
            link = IpcTransport()
            mapped = link.mapping(handle)
            assert link.mapping(handle) is mapped and ipc.pending()["imported"] == 1
            link.close()
            assert mapped.closed and ipc.pending()["imported"] == 0
        finally:
            worker.kill()


def test_endpoints_of_a_collected_transport_are_not_listed(backend):
    with KvCache(config(), backend=backend) as cache:
        link = PeerTransport()
        link.publish(cache.slab)
        assert set(rf.transport.published(cache.slab.buffer)) == {"peer"}
        del link
        gc.collect()
        assert rf.transport.published(cache.slab.buffer) == {}


def test_an_import_into_plain_free_blocks_snapshots_nothing_and_a_failed_one_changes_nothing(
        monkeypatch):
    """Its host work grows with the sequence, not the cache: where the free stack holds
    every fresh block, the read goes into the blocks the allocation then takes, with no
    snapshot of the cache (``_save``); a read that fails there leaves the cache as it was.
    Where cached-free blocks must be reused, the import snapshots to undo."""
    config = CacheConfig(**CONFIG, num_blocks=40, dtype=np.float16)
    with KvCache(config, backend="host") as src, KvCache(config, backend="host") as dst, \
            PeerTransport() as link:
        link.publish(src.slab)
        src.slab.buffer.copy_from_host(np.random.default_rng(3).integers(
            0, 256, src.slab.buffer.nbytes, np.uint8))
        src.add_sequence("s", tokens=np.arange(100))
        desc = src.export_sequence("s")
        dst.add_sequence("resident", tokens=np.arange(500, 540))
        saves = []
        real_save = dst._save
        monkeypatch.setattr(dst, "_save", lambda: saves.append(1) or real_save())
        before = cache_state(dst)
        real_read = link.read

        def failing(*args, **kwargs):
            raise TransferError("the wire broke")

        monkeypatch.setattr(link, "read", failing)
        with pytest.raises(TransferError, match="the wire broke"):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before and not saves
        monkeypatch.setattr(link, "read", real_read)
        imported = dst.import_sequence(desc, link)
        assert imported.blocks_moved == 7 and not saves
        held = dst.batch(["s"]).block_tables[0][:7]
        for layer in range(config.num_layers):
            np.testing.assert_array_equal(dst.k_cache(layer).to_numpy()[held],
                                          src.k_cache(layer).to_numpy()[list(desc.block_ids)])
        dst.remove("s")  # its 6 full blocks stay cached-free
        dst.add_sequence("filler", num_tokens=16 * (dst.pool.num_plain_free - 4))
        src.add_sequence("t", tokens=np.arange(1000, 1100))  # 7 blocks, none cached there
        dst.import_sequence(src.export_sequence("t"), link)
        assert saves, "an import that reuses cached blocks snapshots to undo"
