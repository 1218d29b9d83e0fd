"""Two devices of one backend in one process. Each keeps its own memory, streams, pools,
caches and plans (mixing them is refused, naming both devices, with nothing changed); a
thread's device stays its own whatever runs on the other (work queued there, finalizers of
its memory); and a soak of 16 threads, 8 per device, each with a cache on its device and one
on the other, its own streams, the device's shared pool and peer transfers between its two
caches, ends with no buffer live and neither device's memory grown.

Runs on every backend with two devices or more (``two_devices``): the host backend's two
logical devices on any machine (one memory: what is checked is the package's bookkeeping),
and the GPUs of a machine with two, where the memory is the driver's (``mem_info``).
``RF_TWO_DEVICE_MINUTES`` sets the soak's length (default 0.05: 3 s).
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import threading
import time
import traceback

import numpy as np
import pytest
from test_atomicity import cache_state
from test_transfer import config, decode_and_check, write_prompt
from workers import export_and_wait, spawned

import rocmforge_raw as rf
from rocmforge_raw import bench
from rocmforge_raw.cache import KvCache
from rocmforge_raw.cache.transfer.transport import copy_spans
from rocmforge_raw.kernels import ops
from rocmforge_raw.kernels.staging import PinnedBuffer
from rocmforge_raw.memory.array import DeviceArray
from rocmforge_raw.runtime.host import host_devices
from rocmforge_raw.transport import PeerTransport

MiB = 1 << 20
#: The soak's minutes (``RF_TWO_DEVICE_MINUTES``), threads per device and drift limit.
MINUTES = float(os.environ.get("RF_TWO_DEVICE_MINUTES") or 0.05)
THREADS_PER_DEVICE = 8
MAX_DRIFT_BYTES = 1 * MiB


def test_a_thread_starts_on_device_0_and_keeps_the_device_it_sets(two_devices):
    backend, seen = two_devices, {}

    def work():
        seen["start"] = backend.get_device()
        with rf.HipBuffer(64, backend=backend) as buf:
            seen["buffer"] = buf.device

    backend.set_device(1)
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == {"start": 0, "buffer": 0}
    assert backend.get_device() == 1
    with rf.HipBuffer(64, backend=backend) as buf, rf.Stream(backend=backend) as stream:
        assert (buf.device, stream.device) == (1, 1)


def test_work_on_the_other_device_leaves_the_threads_device_as_it_was(two_devices, rng):
    backend = two_devices
    backend.set_device(1)
    data = rng.integers(0, 255, 4096, np.uint8)
    backend.properties(0)
    backend.mem_info(0)
    with rf.Stream(0, backend) as stream, rf.Event(0, backend) as event, \
            rf.HipBuffer.from_numpy(data, 0, backend) as there:
        there.fill(7, 0, 16)
        event.record(stream)
        backend.synchronize(0)
        assert there.to_numpy()[:17].tolist() == [7] * 16 + [data[16]]
    assert backend.get_device() == 1
    with rf.HipBuffer(64, backend=backend) as here:
        assert here.device == 1


def test_finalizers_of_one_devices_memory_run_while_the_other_is_current(two_devices):
    """A buffer, a pooled block, a pinned buffer, a stream and an event of device 0, dropped
    while device 1 is current: each is freed (on device 0), and device 1 stays both the
    thread's device and the binding's (the next allocation there is served from C)."""
    backend = two_devices
    live = rf.memory_stats()["live_buffers"]
    pool = rf.MemoryPool(0, backend)
    lane = rf.Stream(0, backend)  # a pooled block freed on it is fenced by a new event
    doomed = [rf.HipBuffer(MiB, 0, backend), rf.HipBuffer(4096, pool=pool),
              rf.HipBuffer(4096, pool=pool.on(lane)), PinnedBuffer(4096, 0, backend),
              rf.Stream(0, backend), rf.Event(0, backend)]
    backend.set_device(1)
    assert rf.memory_stats()["live_buffers"] == live + 3  # the pool's blocks: its memory
    del doomed  # every finalizer runs here and now, in this thread
    assert rf.memory_stats()["live_buffers"] == live
    assert backend.get_device() == 1
    assert backend._local.device == 1  # the binding's active device: as it was
    fallbacks = backend.allocator.fallbacks
    with rf.HipBuffer(MiB, backend=backend) as buf:
        assert buf.device == 1
    assert backend.allocator.fallbacks == fallbacks
    assert pool.stats()["cached_bytes"] == 2 * 4096 and pool.stats()["in_use_bytes"] == 0
    pool.close()
    lane.close()


def test_the_last_import_of_another_devices_memory_unmaps_with_the_threads_device_kept(
        two_devices):
    """An imported buffer of device 1 dropped while device 0 is active: the importer's
    wait and unmap run on device 1, and device 0 stays active in the thread."""
    backend = two_devices
    with spawned(export_and_wait, backend.name, 1) as worker:
        handle = worker.receive()
        assert handle.device == 1
        backend.set_device(0)
        imported = rf.HipBuffer.from_ipc(handle)
        assert imported.device == 1
        assert imported.to_numpy().view(np.int32).tolist() == list(range(1024))
        backend.activate(0)
        del imported  # the registry's finalizer unmaps, here and now
        assert backend._local.device == 0 and backend.get_device() == 0


def test_work_ordered_on_a_stream_runs_with_the_streams_device_active(two_devices, rng):
    """An event recorded, a copy and a fill queued on device 0's stream while device 1 is
    the thread's device: each runs with device 0 active (a CUDA stream is its context's),
    and the thread's device stays 1."""
    backend = two_devices
    data = rng.integers(0, 255, 4096, np.uint8)
    with rf.Stream(0, backend) as stream, rf.Event(0, backend) as event, \
            rf.HipBuffer(4096, 0, backend) as buf:
        for work in (lambda: event.record(stream),
                     lambda: buf.copy_from_host(data, stream=stream),
                     lambda: buf.fill(3, 0, 8, stream=stream)):
            backend.set_device(1)
            work()
            assert (backend._local.device, backend.get_device()) == (0, 1)
        stream.synchronize()
        assert buf.to_numpy().tolist() == [3] * 8 + data[8:].tolist()


def test_a_pool_serves_its_own_device_only(two_devices):
    backend = two_devices
    pool = rf.MemoryPool(0, backend)
    with rf.Stream(1, backend) as there, rf.HipBuffer(64, 1, backend) as other:
        with pytest.raises(ValueError,
                           match=r"MemoryPool \w+:0 .*cannot allocate on backend .* device 1"):
            rf.HipBuffer(64, 1, backend, pool=pool)
        with pytest.raises(ValueError, match=r"stream is on \w+:1, this pool on \w+:0"):
            pool.on(there)
        with pytest.raises(ValueError, match="device 1 is not this pool's device 0"):
            pool.free(other.ptr, 1)
        rf.set_allocator(pool)
        try:
            backend.set_device(1)
            with rf.HipBuffer(4096, backend=backend) as buf:  # not the pool's device: raw
                assert buf.device == 1
            backend.set_device(0)
            with rf.HipBuffer(4096, backend=backend) as buf:
                assert buf.device == 0
        finally:
            rf.set_allocator(None)
        assert pool.stats()["cached_bytes"] == 4096  # only device 0's buffer came from it
    pool.close()


def test_a_pool_fences_its_default_stream_on_its_own_device(two_devices):
    """A block device 0's pool lent on the default stream and freed is handed to a stream
    of device 0 while device 1 is the thread's and the binding's device: the fence on
    device 0's default stream is recorded there, and device 1 stays active."""
    backend = two_devices
    pool = rf.MemoryPool(0, backend)
    with rf.Stream(0, backend) as stream:
        rf.HipBuffer(4096, pool=pool).close()  # freed on the default stream: not fenced yet
        backend.set_device(1)
        with rf.HipBuffer(4096, pool=pool.on(stream)) as buf:
            assert buf.device == 0
        assert backend.get_device() == 1
        with rf.HipBuffer(64, backend=backend) as buf, rf.Stream(backend=backend) as other:
            assert (buf.device, other.device) == (1, 1)  # the thread's device: still 1
        assert pool.stats()["hits"] + pool.stats()["misses"] == 2
    pool.close()


def test_caches_plans_and_streams_never_cross_devices(two_devices):
    """Each mix of two devices is refused, naming them, and neither cache changes."""
    backend, cfg = two_devices, config(num_blocks=8)
    with KvCache(cfg, 0, backend) as zero, KvCache(cfg, 1, backend) as one, \
            rf.Stream(1, backend) as stream_one:
        slots = one.add_sequence("a", num_tokens=20).slot_mapping
        zero.add_sequence("a", num_tokens=20)
        plan_zero, plan_one = zero.batch(["a"]), one.batch(["a"])
        kv_on = {d: DeviceArray.empty((1, 2, 64), np.float16, d, backend) for d in (0, 1)}
        q_on = {d: DeviceArray.empty((1, 4, 64), np.float16, d, backend) for d in (0, 1)}
        out = DeviceArray.empty((1, 4, 64), np.float16, 1, backend)
        prompt = DeviceArray.empty((20, 2, 64), np.float16, 0, backend)
        before = cache_state(zero), cache_state(one)
        mixes = [
            (lambda: one.write(0, kv_on[1], kv_on[1], plan_zero), "another cache's"),
            (lambda: one.write(0, kv_on[0], kv_on[0], plan_one), r"key is on \w+:0, the cache"),
            (lambda: one.attention(0, out, q_on[0], plan_one), r"query is on \w+:0"),
            (lambda: one.write(0, prompt, prompt, slots), r"on \w+:1, key on \w+:0"),
            (lambda: zero.batch(["a"], stream=stream_one), r"stream is on \w+:1"),
            (lambda: zero.write(0, prompt, prompt, slots, stream=stream_one),
             r"stream is on \w+:1"),
            (lambda: KvCache(cfg, 0, backend, stream=stream_one), r"stream is on \w+:1"),
        ]
        for call, words in mixes:
            with pytest.raises(ValueError, match=words):
                call()
        assert (cache_state(zero), cache_state(one)) == before
        one.attention(0, out, q_on[1], plan_one)  # the plans are still good
        zero.attention(0, DeviceArray.empty((1, 4, 64), np.float16, 0, backend), q_on[0],
                       plan_zero)
        for array in (*kv_on.values(), *q_on.values(), out, prompt):
            array.buffer.close()


def test_device_metadata_of_another_device_is_refused_before_anything_runs(two_devices, rng):
    """Block tables, lengths and slot mappings given as device arrays must be on the op's
    device: another device's are refused, naming the argument and both devices, and the
    output and cache are as they were; the same metadata on the op's device runs."""
    backend = two_devices

    def on(device, array):
        return DeviceArray.from_numpy(array, device, backend)

    q, out, k_cache, v_cache = (on(0, rng.standard_normal(shape).astype(np.float16))
                                for shape in ((1, 4, 64), (1, 4, 64), *[(4, 2, 16, 64)] * 2))
    key = on(0, rng.standard_normal((1, 2, 64)).astype(np.float16))
    tables, lens, slots = (np.array([[1]], np.int32), np.array([5], np.int32),
                           np.array([17], np.int64))
    before = out.to_numpy(), k_cache.to_numpy()
    refusals = [
        (lambda: ops.paged_attention(out, q, k_cache, v_cache, on(1, tables), lens),
         r"block_tables is on \w+:1, query on \w+:0"),
        (lambda: ops.paged_attention(out, q, k_cache, v_cache, tables, on(1, lens)),
         r"seq_lens is on \w+:1, query on \w+:0"),
        (lambda: ops.reshape_and_cache(key, key, k_cache, v_cache, on(1, slots)),
         r"slot_mapping is on \w+:1, key on \w+:0"),
    ]
    for call, words in refusals:
        with pytest.raises(ValueError, match=words):
            call()
    assert all(np.array_equal(a, b) for a, b in zip((out.to_numpy(), k_cache.to_numpy()),
                                                     before))
    ops.paged_attention(out, q, k_cache, v_cache, on(0, tables), on(0, lens))
    ops.reshape_and_cache(key, key, k_cache, v_cache, on(0, slots))
    backend.synchronize(0)
    assert not np.array_equal(out.to_numpy(), before[0])
    assert np.array_equal(k_cache.to_numpy()[1, :, 1], key.to_numpy()[0])  # slot 17


def test_a_workspace_serves_the_device_it_was_first_used_on(two_devices):
    """After a use on device 0, a workspace refuses device 1 (even for more than it holds)
    and hands device 0 the same buffers; once closed, it may serve device 1."""
    backend = two_devices
    on = {d: DeviceArray.empty((64,), np.float16, d, backend) for d in (0, 1)}
    workspace = ops.Workspace()
    partials, counters = workspace.get(4096, 16, on[0])
    for nbytes in (4096, 1 << 20):
        with pytest.raises(ValueError, match=r"workspace is on \w+:0, like on \w+:1"):
            workspace.get(nbytes, 16, on[1])
    assert workspace.get(4096, 16, on[0]) == (partials, counters)
    assert (partials.device, counters.device) == (0, 0)
    workspace.close()
    partials, counters = workspace.get(4096, 16, on[1])
    assert (partials.device, counters.device) == (1, 1)
    workspace.close()


def test_an_op_refuses_another_devices_workspace_before_queuing_anything(two_devices, rng):
    """paged_attention on device 1 with a workspace bound to device 0 is refused up front
    (not after the launch, when the workspace would mark its use), and changes nothing."""
    backend = two_devices
    workspace = ops.Workspace()
    held = workspace.get(4096, 16, DeviceArray.empty((64,), np.float16, 0, backend))
    q, out, k_cache, v_cache = (
        DeviceArray.from_numpy(rng.standard_normal(shape).astype(np.float16), 1, backend)
        for shape in ((1, 4, 64), (1, 4, 64), *[(4, 2, 16, 64)] * 2))
    before = out.to_numpy()
    with rf.Stream(1, backend) as stream, pytest.raises(
            ValueError, match=r"workspace is on \w+:0, the op's arrays on \w+:1"):
        ops.paged_attention(out, q, k_cache, v_cache, np.array([[1]], np.int32),
                            np.array([5], np.int32), num_partitions=2, stream=stream,
                            workspace=workspace)
    assert np.array_equal(out.to_numpy(), before)
    assert workspace.get(4096, 16, held[0]) == held
    workspace.close()


def test_a_kernel_is_launched_on_its_own_devices_streams_only(two_devices):
    if two_devices.name == "host":
        pytest.skip("the host backend runs no kernels (ops run as NumPy)")
    backend = two_devices
    kernel = rf.load_kernels("basic", 0, backend).function("rf_fill_f32")
    with rf.Stream(1, backend) as there, rf.HipBuffer(4096, 0, backend) as buf:
        with pytest.raises(ValueError, match=r"stream is on \w+:1, the work .* on \w+:0"):
            kernel.launch(4, 256, buf, 2.5, np.uint64(1024), stream=there)
        backend.set_device(1)
        kernel.launch(4, 256, buf, 2.5, np.uint64(1024))  # device 0's default stream
        assert np.all(buf.to_numpy(np.float32) == 2.5)
        assert backend.get_device() == 1


@pytest.mark.parametrize("on_stream", [False, True], ids=["default-stream", "stream"])
def test_peer_copies_are_exact_both_ways(two_devices, rng, on_stream):
    backend = two_devices
    data = rng.integers(0, 255, 3 * MiB, np.uint8)
    for src_device, dst_device in ((0, 1), (1, 0)):
        with rf.HipBuffer.from_numpy(data, src_device, backend) as src, \
                rf.HipBuffer(3 * MiB, dst_device, backend) as dst, \
                rf.Stream(dst_device, backend) as stream:
            dst.fill(0)
            backend.peer_access(dst_device, src_device)
            backend.memcpy_peer(dst.ptr + 1, dst_device, src.ptr + 1, src_device, 2 * MiB,
                                stream.handle if on_stream else None)
            stream.synchronize()
            backend.synchronize(dst_device)
            got = dst.to_numpy()
            assert np.array_equal(got[1 : 2 * MiB + 1], data[1 : 2 * MiB + 1])
            assert got[0] == 0 and not got[2 * MiB + 1 :].any()


def test_a_peer_copy_refuses_a_bad_stream_before_any_peer_access(two_devices, monkeypatch):
    """copy_spans checks its stream before it turns peer access on (state a refused copy
    must not leave behind): no pair is asked, and the copy then runs."""
    backend, asked = two_devices, []
    ask = backend.peer_access
    monkeypatch.setattr(backend, "peer_access", lambda *pair: asked.append(pair) or ask(*pair))
    spans = np.array([[0, 0, 64]], np.int64)
    with rf.HipBuffer.from_numpy(np.arange(64, dtype=np.uint8), 0, backend) as src, \
            rf.HipBuffer(64, 1, backend) as dst, rf.Stream(0, backend) as stream:
        for bad, error in ((stream, ValueError), ("stream", TypeError)):
            with pytest.raises(error, match="stream"):
                copy_spans(dst, src, spans, bad)
            assert asked == []
        copy_spans(dst, src, spans, None)
        assert sorted(asked) == [(0, 1), (1, 0)]
        assert dst.to_numpy().tolist() == list(range(64))


def test_bench_alloc_leaves_the_callers_device(two_devices):
    """bench --alloc on device 1 from a thread whose device is 0: the thread's device
    stays 0 (the bench activates device 1 for its bare calls, it does not choose it)."""
    backend, seen = two_devices, {}

    def run():
        rows = bench.bench_alloc(backend, 1, iters=20)
        seen["rows"], seen["device"] = len(rows), backend.get_device()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == {"rows": 3, "device": 0}


def test_rf_host_devices_must_be_ascii_decimal_digits(monkeypatch):
    """A superscript digit passes ``str.isdigit`` but not ``int``: it is refused as any
    other bad value, naming the variable and the value."""
    for value in ("\u00b2", "2.0", "-1", "0"):
        monkeypatch.setenv("RF_HOST_DEVICES", value)
        with pytest.raises(rf.BackendUnavailableError,
                           match=rf"RF_HOST_DEVICES must be an integer in \[1, \d+\], got "
                                 rf"'{re.escape(value)}'"):
            host_devices()


# --- the soak ----------------------------------------------------------------------------------
def _worker(backend, device, pool, deadline, seed, done, errors):
    """One thread of the soak, its device ``device``: until ``deadline``, a prompt written
    into its cache there, moved to its cache on the other device through peer copies, a
    decode step on each checked against the reference, pooled scratch memory on its
    stream, and memory of the other device dropped while this one is active."""
    other = 1 - device
    try:
        backend.set_device(device)
        rng = np.random.default_rng(seed)
        num_tokens = 33 + seed % 24
        with rf.Stream(device, backend) as home_stream, rf.Stream(other, backend) as away_stream, \
                KvCache(config(num_blocks=12), device, backend, stream=home_stream) as home, \
                KvCache(config(num_blocks=12), other, backend, stream=away_stream) as away, \
                PeerTransport() as link:
            link.publish(home.slab)
            steps = 0
            while steps == 0 or time.monotonic() < deadline:
                seq = f"s{steps}"
                write_prompt(home, seq, np.arange(num_tokens) + 10_000 * steps, seed)
                moved = away.import_sequence(home.export_sequence(seq), link)
                assert moved.blocks_moved == -(-num_tokens // 16)
                decode_and_check(away, seq, num_tokens, seed)
                decode_and_check(home, seq, num_tokens, seed)
                away.finish(seq)
                home.finish(seq)
                scratch = rng.integers(0, 255, int(rng.integers(1, 1 << 16)), np.uint8)
                with rf.HipBuffer(len(scratch), backend=backend,
                                  pool=pool.on(home_stream)) as buf:
                    buf.copy_from_host(scratch, stream=home_stream)
                    assert np.array_equal(buf.to_numpy(stream=home_stream), scratch)
                orphan = rf.HipBuffer(1 << 16, other, backend)
                backend.activate(device)
                del orphan  # freed on the other device, here, with this one active
                assert backend.get_device() == device
                steps += 1
        done.append((device, steps))
    except BaseException:
        errors.append(traceback.format_exc())


def _soak(backend, pools, threads_per_device, seconds):
    """Run the workers; the (device, steps) of each, or the first worker's error raised."""
    done, errors = [], []
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=_worker, args=(backend, device, pools[device], deadline,
                                                      10 * i + device, done, errors))
               for i in range(threads_per_device) for device in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 300)
    assert not errors, errors[0]
    assert len(done) == len(threads), "a worker thread did not finish in time"
    return done


def _settled(backend):
    """Free everything the package keeps between runs, then each device's (library bytes
    live, device bytes used): the driver's, as the median of five reads, on a GPU."""
    gc.collect()
    ops.release_staging()
    state = {}
    for device in (0, 1):
        backend.synchronize(device)
        mine = sum(r.nbytes for r in rf.live_allocations()
                   if r.backend == backend.name and r.device == device)
        used = None
        if backend.name != "host":  # the host's memory is every process's: not judged
            reads = []
            for _ in range(5):
                free, total = backend.mem_info(device)
                reads.append(total - free)
                time.sleep(0.01)
            used = statistics.median(reads)
        state[device] = (mine, used)
    return state


def test_sixteen_threads_on_two_devices_leave_nothing_behind(two_devices, record_property):
    backend = two_devices
    pools = {device: rf.MemoryPool(device, backend) for device in (0, 1)}
    live = rf.memory_stats()["live_buffers"]
    start = _settled(backend)
    # warm-up at full concurrency: kernels, contexts, peer access, staging, and what the
    # driver sizes for 16 threads at once (its growth is recorded, not judged)
    _soak(backend, pools, THREADS_PER_DEVICE, min(10.0, MINUTES * 60 / 4))
    for pool in pools.values():
        pool.free_all()
    before = _settled(backend)
    for device in (0, 1):
        if before[device][1] is not None:
            record_property(f"device_{device}_warmup_growth_bytes",
                            before[device][1] - start[device][1])
    done = _soak(backend, pools, THREADS_PER_DEVICE, MINUTES * 60)
    for pool in pools.values():
        assert pool.stats()["in_use_bytes"] == 0
        pool.close()
    after = _settled(backend)
    assert rf.memory_stats()["live_buffers"] == live
    for device in (0, 1):
        steps = sum(n for d, n in done if d == device)
        record_property(f"device_{device}_steps", steps)
        assert after[device][0] == before[device][0], f"device {device}: library bytes live"
        if after[device][1] is not None:
            drift = after[device][1] - before[device][1]
            record_property(f"device_{device}_drift_bytes", drift)
            assert drift <= MAX_DRIFT_BYTES, f"device {device} grew by {drift} bytes"
    record_property("seconds", MINUTES * 60)


# --- the hip backend's two-device calls against the real HIP runtime ---------------------------
def test_hip_peer_calls_reach_debians_runtime_and_change_nothing_on_failure(
        hip_runtime_without_device):
    """hip.py's peer access, peer copies and device switches go through hip-python into
    libamdhip64; with no device each returns a failing status, which is raised as
    ``DeviceError`` naming the API, and nothing is remembered: no pair's peer access, no
    active device (the next call tries again)."""
    from rocmforge_raw.errors import DeviceError
    from rocmforge_raw.runtime.hip import HipBackend

    hip = object.__new__(HipBackend)  # its __init__ refuses: no device answers here
    hip._count, hip._peers, hip._local = 2, {}, threading.local()  # as if two answered
    assert hip.peer_access(1, 1) is True  # within one device: no runtime call
    with pytest.raises(DeviceError, match="hipDeviceCanAccessPeer"):
        hip.peer_access(0, 1)
    assert hip._peers == {(1, 1): True}
    with pytest.raises(rf.BackendUnavailableError, match="HIP device 2 does not exist"):
        hip.peer_access(0, 2)
    for stream in (None, 0):
        with pytest.raises(DeviceError, match="hipSetDevice"):
            hip.memcpy_peer(1 << 20, 1, 2 << 20, 0, 64, stream)
        assert getattr(hip._local, "device", None) is None
    with pytest.raises(DeviceError, match="hipSetDevice"):
        hip.set_device(1)
    assert hip.get_device() == 0  # the choice is made only once the runtime took it
    hip._local.device = 1  # as if device 1 were active: the copy itself reaches the runtime
    for stream, api in ((None, "hipMemcpyPeer"), (0, "hipMemcpyPeerAsync")):
        with pytest.raises(DeviceError, match=api):
            hip.memcpy_peer(1 << 20, 1, 2 << 20, 0, 64, stream)
