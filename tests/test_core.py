"""The compiled core: the allocators' C fast paths and their fallbacks, and the registry and
pool under threads and under finalizers that run in the middle of their operations."""

from __future__ import annotations

import copy
import ctypes
import gc
import pickle
import threading

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.runtime._alloc import CudaAllocator, HipAllocator

FAST_PATHS = {"host": "HostAllocator", "cuda": "CudaAllocator", "hip": "HipAllocator"}


def test_raw_buffers_use_the_backends_c_allocator(backend):
    allocator = backend.allocator
    assert type(allocator).__name__ == FAST_PATHS[backend.name]
    device = backend.get_device()
    rf.HipBuffer(4096, device, backend).close()  # makes the device current in this thread
    fallbacks, before = allocator.fallbacks, rf.memory_stats()
    for nbytes in (1, 4096, 1 << 20):
        allocator.round_trip(nbytes, device)
        rf.HipBuffer(nbytes, device, backend).close()
    assert allocator.fallbacks == fallbacks  # all served in C
    assert rf.memory_stats()["num_allocs"] == before["num_allocs"] + 3  # round trips: unregistered


def test_allocator_of_a_binding_without_the_c_function_is_refused():
    with pytest.raises(ImportError, match="cuCtxGetCurrent is None"):
        CudaAllocator(object(), 1, {})


_NAMES: list = []  # capsule names must outlive their capsules


def _capsule(signature: str) -> object:
    """A capsule named like a binding's C function (pointing at its own name: never called)."""
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    _NAMES.append(ctypes.create_string_buffer(signature.encode()))
    return new_capsule(ctypes.addressof(_NAMES[-1]), _NAMES[-1], None)


def test_allocator_of_a_binding_with_another_signature_is_refused():
    with pytest.raises(ImportError, match=r"hipGetDevice is 'int \(void\)'.*enum hipError_t"):
        HipAllocator(object(), 1, {"hipGetDevice": _capsule("int (void)")})


def test_allocator_accepts_the_older_hip_python_spelling_of_size_t():
    # hip-python 6.x (module hip.chip) declares hipMalloc with "unsigned long" for size_t
    capi = {"hipGetDevice": _capsule("enum hipError_t (int *)"),
            "hipMalloc": _capsule("enum hipError_t (void **, unsigned long)"),
            "hipFree": _capsule("enum hipError_t (void *)")}
    assert HipAllocator(object(), 1, capi).fallbacks == 0


class _Recorder:
    """Stands in for the hip backend, whose hardware is absent here: records the Python
    fallback calls the allocator makes when its C fast path declines."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def forget_active(self) -> None:
        self.calls.append(("forget_active",))

    def malloc(self, nbytes: int, device: int) -> int:
        self.calls.append(("malloc", nbytes, device))
        return 0x7000

    def free(self, ptr: int, device: int) -> None:
        self.calls.append(("free", ptr, device))


def test_hip_fast_path_against_libamdhip64_without_a_device_falls_back(
        hip_runtime_without_device):
    cyhip = pytest.importorskip("rocm.bindings.cyhip")
    recorder = _Recorder()
    allocator = HipAllocator(recorder, 1, cyhip.__pyx_capi__)  # hip-python's real C layer
    allocator.round_trip(256, 0)  # hipGetDevice fails here: both calls go to Python
    # the allocation first forgets where the backend last left the binding (it is not there)
    assert recorder.calls == [("forget_active",), ("malloc", 256, 0), ("free", 0x7000, 0)]
    assert allocator.fallbacks == 2


def test_cuda_allocation_in_a_thread_with_no_current_context(gpu):
    # a new thread has no current context: the fast path declines, the backend activates
    result = {}

    def work() -> None:
        fallbacks = gpu.allocator.fallbacks
        with rf.HipBuffer.from_numpy(np.arange(1000, dtype=np.int32), DEVICE, gpu) as buf:
            result["data"] = buf.to_numpy(np.int32)
        result["first"] = gpu.allocator.fallbacks - fallbacks
        gpu.allocator.round_trip(1 << 20, DEVICE)  # now current: served in C
        result["then"] = gpu.allocator.fallbacks - fallbacks

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert np.array_equal(result["data"], np.arange(1000))
    assert result["first"] == 1 and result["then"] == 1  # only the first allocation fell back


def _assert_pool_consistent(pool: rf.MemoryPool, allocations: int) -> None:
    stats = pool.stats()
    assert stats["in_use_blocks"] == 0 and stats["in_use_bytes"] == 0
    assert stats["reserved_bytes"] == stats["cached_bytes"]
    assert stats["hits"] + stats["misses"] == allocations


def test_pool_under_threads_never_hands_out_a_block_twice(backend):
    pool = rf.MemoryPool(backend=backend)
    live: dict[int, int] = {}  # pointer -> thread that holds it
    guard = threading.Lock()
    clashes = []
    per_thread, threads = 1500, 8

    def work(seed: int) -> None:
        sizes = np.random.default_rng(seed).integers(1, 20000, per_thread)
        held = []
        for i, size in enumerate(sizes):
            buf = rf.HipBuffer(int(size), pool=pool)
            with guard:
                if buf.ptr in live:
                    clashes.append((buf.ptr, live[buf.ptr], seed))
                live[buf.ptr] = seed
            held.append(buf)
            if len(held) > 4 or i == per_thread - 1:
                for old in held:
                    with guard:
                        del live[old.ptr]
                    old.close()
                held.clear()

    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert clashes == []
    _assert_pool_consistent(pool, per_thread * threads)
    pool.free_all()
    assert pool.stats()["reserved_bytes"] == 0


def test_finalizers_running_inside_pool_and_registry_operations_keep_them_consistent(
        backend, rng):
    # Buffers in reference cycles are freed by the cyclic GC, which a threshold of 1 runs at
    # almost every allocation of a tracked object: inside HipBuffer's constructor, the
    # registry's bookkeeping and the pool's, so their weakref callbacks re-enter both.
    pool = rf.MemoryPool(backend=backend)
    start = rf.memory_stats()
    allocations = 3000
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for size in rng.integers(1, 50000, allocations):
            buf = rf.HipBuffer(int(size), pool=pool)
            cycle: list = [buf]
            cycle.append(cycle)  # garbage only the cyclic GC frees
        del buf, cycle
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    end = rf.memory_stats()
    assert end["live_buffers"] == start["live_buffers"]
    assert end["num_allocs"] - start["num_allocs"] == allocations
    assert end["num_frees"] - start["num_frees"] == allocations
    assert end["live_bytes"] == start["live_bytes"]
    _assert_pool_consistent(pool, allocations)
    pool.free_all()


def test_pool_limit_must_be_a_byte_count(backend):
    with pytest.raises(ValueError, match=r"pool limit must be between 0 and \d+ bytes, got -1"):
        rf.MemoryPool(backend=backend, limit=-1)


def test_pool_allocate_of_nothing_is_an_error(backend):
    with pytest.raises(ValueError, match="nbytes > 0, got 0"):
        rf.MemoryPool(backend=backend).allocate(0)


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, pickle.dumps])
def test_owners_of_device_memory_cannot_be_duplicated(backend, duplicate):
    pool = rf.MemoryPool(backend=backend)
    with rf.HipBuffer(64, backend=backend) as buf:
        with pytest.raises(TypeError, match="HipBuffer owns its device memory"):
            duplicate(buf)
        with pytest.raises(TypeError, match="MemoryPool owns device memory"):
            duplicate(pool)


# --- the step's other driver calls from C (runtime._launch.DriverCalls) ----------------------
def test_both_gpu_backends_find_their_bindings_c_driver_calls():
    """The signatures named in cuda.py and hip.py match the installed bindings: a mismatch
    would silently leave every event record, query and upload on the slower Python path."""
    from rocmforge_raw.runtime.cuda import CudaBackend
    from rocmforge_raw.runtime.hip import HipBackend

    for backend_type in (CudaBackend, HipBackend):
        calls = object.__new__(backend_type).make_driver_calls()
        assert calls is not None and calls.batches  # (CUDA 13's batch; HIP's with fail index)


#: HIP's event record and query and its pinned upload: name and C signature.
_HIP_CALLS = {"hipEventRecord": "enum hipError_t (hipEvent_t, hipStream_t)",
              "hipEventQuery": "enum hipError_t (hipEvent_t)",
              "hipMemcpyHtoDAsync": "enum hipError_t (void *, void const *, size_t, hipStream_t)"}


def test_a_binding_without_a_batched_copy_of_a_known_signature_has_none():
    """Another signature (or none) leaves the batch out, never bound to the wrong C type:
    copies then go one by one."""
    from rocmforge_raw.runtime._launch import DriverCalls

    capi = {name: _capsule(signature) for name, signature in _HIP_CALLS.items()}
    capi["hipMemcpyBatchAsync"] = _capsule("enum hipError_t (void **, size_t)")
    calls = DriverCalls(capi, *_HIP_CALLS.items(), 600,
                        ("hipMemcpyBatchAsync", "", "enum hipError_t (void **, void **)"))
    assert not calls.batches
    one = np.ones(1, np.uint64)
    assert calls.copy_batch(one, one, one, 0, 0, 2) == -1
    with pytest.raises(ValueError, match="1 destinations, 1 sources and 2 sizes"):
        calls.copy_batch(one, one, np.ones(2, np.uint64), 0, 0, 2)


def test_driver_calls_of_a_binding_with_another_signature_are_refused():
    from rocmforge_raw.runtime._launch import DriverCalls

    capi = {"hipEventRecord": _capsule("enum hipError_t (hipEvent_t, hipStream_t)"),
            "hipEventQuery": _capsule("int (void)"),
            "hipMemcpyHtoDAsync": _capsule("enum hipError_t (void *)")}
    with pytest.raises(ImportError, match=r"hipEventQuery is 'int \(void\)'"):
        DriverCalls(capi, ("hipEventRecord", "enum hipError_t (hipEvent_t, hipStream_t)"),
                    ("hipEventQuery", "enum hipError_t (hipEvent_t)"),
                    ("hipMemcpyHtoDAsync", "enum hipError_t (void *, void const *, size_t, "
                                           "hipStream_t)"), 600)


def test_hip_driver_calls_reach_debians_runtime_and_fall_back_to_report_its_status(
        hip_runtime_without_device):
    """With no device, libamdhip64's answers are failures: the C calls say so (False,
    None) and the backend's methods then raise DeviceError naming the call, as before."""
    from rocmforge_raw.errors import DeviceError
    from rocmforge_raw.runtime.hip import HipBackend

    hip = object.__new__(HipBackend)  # its __init__ refuses: no device answers here
    calls = hip.driver_calls
    assert calls is not None
    assert calls.record(0, 0) is False and calls.query(0) is None
    assert calls.upload(0, 0, 16, 0) is False
    one = np.ones(1, np.uint64)
    assert calls.copy_batch(one, one, one * 16, 0, 0, 2) != 0  # (a status: nothing queued)
    for api, call in (("hipEventRecord", lambda: hip.event_record(None)),
                      ("hipEventQuery", lambda: hip.event_query(None)),
                      ("hipMemcpyAsync", lambda: hip.upload(0, 0, 16))):
        with pytest.raises(DeviceError, match=api):
            call()


def test_driver_calls_record_query_and_upload_on_the_device(gpu):
    """On a real device the C calls succeed: an upload from pinned memory lands, and an
    event recorded after it is found complete once the stream is done."""
    from rocmforge_raw.kernels.staging import PinnedBuffer
    from rocmforge_raw.memory.stream import Event, Stream

    calls = gpu.driver_calls
    assert calls is not None
    device = gpu.get_device()
    stream, event = Stream(device, gpu), Event(device, gpu)
    pinned = PinnedBuffer(4096, device, gpu)
    data = np.random.default_rng(3).integers(0, 255, 4096).astype(np.uint8)
    pinned.array(np.uint8, 4096)[:] = data
    with rf.HipBuffer(4096, device, gpu) as buf:
        assert calls.upload(buf.ptr, pinned.ptr, 4096, int(stream.handle))
        assert calls.record(int(event.handle), int(stream.handle))
        stream.synchronize()
        assert calls.query(int(event.handle)) is True
        np.testing.assert_array_equal(buf.to_numpy(np.uint8, (4096,)), data)
    pinned.close()
    event.close()
    stream.close()
