"""The HipBuffer contract, on every backend that answers."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.errors import BackendUnavailableError, BufferClosedError, OutOfMemoryError
from rocmforge_raw.runtime import get_backend

MiB = 1 << 20


@pytest.mark.parametrize("nbytes", [0, 1, 4095, MiB])
def test_round_trip_of_random_bytes(backend, rng, nbytes):
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, backend=backend) as buf:
        assert buf.nbytes == nbytes
        np.testing.assert_array_equal(buf.to_numpy(), data)


def test_round_trip_of_256_mib_on_gpu(gpu, rng):
    data = rng.integers(0, 1 << 62, 256 * MiB // 8, dtype=np.int64)
    with rf.HipBuffer.from_numpy(data, backend=gpu) as buf:
        np.testing.assert_array_equal(buf.to_numpy(np.int64), data)


def test_typed_round_trip_keeps_dtype_and_shape(backend, rng):
    data = rng.standard_normal((3, 5)).astype(np.float32)
    with rf.HipBuffer.from_numpy(data, backend=backend) as buf:
        np.testing.assert_array_equal(buf.to_numpy(np.float32, (3, 5)), data)
        np.testing.assert_array_equal(buf.typed(np.float32, (3, 5)).to_numpy(), data)


def test_view_reads_and_writes_its_window_only(backend, rng):
    data = rng.integers(0, 256, 1000, dtype=np.uint8)
    patch = rng.integers(0, 256, 100, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, backend=backend) as buf:
        view = buf.view(300, 100)
        np.testing.assert_array_equal(view.to_numpy(), data[300:400])
        view.copy_from_host(patch)
        expected = data.copy()
        expected[300:400] = patch
        np.testing.assert_array_equal(buf.to_numpy(), expected)
        assert view.ptr == buf.ptr + 300


def test_view_keeps_parent_alive_and_frees_nothing(backend, rng):
    data = rng.integers(0, 256, 64, dtype=np.uint8)
    buf = rf.HipBuffer.from_numpy(data, backend=backend)
    view = buf.view(16)
    live = rf.memory_stats()["live_buffers"]
    del buf
    gc.collect()
    assert rf.memory_stats()["live_buffers"] == live
    np.testing.assert_array_equal(view.to_numpy(), data[16:])
    view.close()
    assert rf.memory_stats()["live_buffers"] == live
    with pytest.raises(BufferClosedError):
        view.to_numpy()
    del view
    gc.collect()
    assert rf.memory_stats()["live_buffers"] == live - 1


def test_device_to_device_copy(backend, rng):
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, backend=backend) as src, \
            rf.HipBuffer(4096, backend=backend) as dst:
        dst.fill(0xAB)
        dst.copy_from(src, 1000, dst_offset=96, src_offset=3000)
        out = dst.to_numpy()
    assert (out[:96] == 0xAB).all() and (out[1096:] == 0xAB).all()
    np.testing.assert_array_equal(out[96:1096], data[3000:4000])


def test_fill_sets_bytes_in_range(backend):
    with rf.HipBuffer(256, backend=backend) as buf:
        buf.fill(7)
        buf.fill(9, offset=10, nbytes=20)
        out = buf.to_numpy()
    assert (out[10:30] == 9).all() and (out[:10] == 7).all() and (out[30:] == 7).all()


def test_async_copies_ordered_by_an_event(backend, rng):
    data = rng.standard_normal(1 << 18).astype(np.float32)
    with rf.Stream(backend=backend) as stream, \
            rf.HipBuffer(data.nbytes, backend=backend) as a, \
            rf.HipBuffer(data.nbytes, backend=backend) as b:
        start, done = rf.Event(backend=backend), rf.Event(backend=backend)
        start.record(stream)
        a.copy_from_host(data, stream=stream)
        b.copy_from(a, stream=stream)
        done.record(stream)
        done.synchronize()
        assert done.elapsed_ms_since(start) >= 0.0
        np.testing.assert_array_equal(b.to_numpy(np.float32), data)
        start.close()
        done.close()


def test_dropped_buffer_returns_its_bytes(backend):
    before = rf.memory_stats()
    buf = rf.HipBuffer(3 * MiB, backend=backend)
    assert rf.memory_stats()["live_bytes"] == before["live_bytes"] + 3 * MiB
    del buf
    gc.collect()
    after = rf.memory_stats()
    assert after["live_bytes"] == before["live_bytes"]
    assert after["num_frees"] == before["num_frees"] + 1


def test_dropped_buffer_returns_device_memory(gpu):
    size = 512 * MiB
    free_before, _ = gpu.mem_info(DEVICE)
    buf = rf.HipBuffer(size, backend=gpu)
    assert gpu.mem_info(DEVICE)[0] <= free_before - size
    del buf
    gc.collect()
    assert gpu.mem_info(DEVICE)[0] >= free_before - 64 * MiB


def test_ten_thousand_alloc_free_cycles_leave_nothing_live(backend):
    before = rf.memory_stats()
    for i in range(10_000):
        buf = rf.HipBuffer(1 + i % 4096, backend=backend)
        if i % 2:
            buf.close()
        del buf
    gc.collect()
    after = rf.memory_stats()
    assert after["live_buffers"] == before["live_buffers"]
    assert after["num_allocs"] - before["num_allocs"] == 10_000
    assert after["num_frees"] - before["num_frees"] == 10_000


def test_close_twice_is_fine_and_use_after_close_raises(backend):
    buf = rf.HipBuffer(64, backend=backend)
    view = buf.view(8, 8)
    buf.close()
    buf.close()
    assert buf.closed and view.closed
    for use in (lambda: buf.ptr, lambda: buf.to_numpy(), lambda: buf.fill(0),
                lambda: view.to_numpy(), lambda: buf.view(0, 1),
                lambda: buf.copy_from_host(np.zeros(1, np.uint8))):
        with pytest.raises(BufferClosedError):
            use()


def test_live_allocations_record_stacks_when_asked(backend):
    rf.track_stacks(True)
    try:
        with rf.HipBuffer(123, backend=backend):
            records = [r for r in rf.live_allocations() if r.nbytes == 123]
            assert records and any("test_buffer.py" in "".join(r.stack) for r in records)
    finally:
        rf.track_stacks(False)


def test_forked_child_frees_nothing_it_inherited(backend, rng):
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    bufs = [rf.HipBuffer.from_numpy(data, backend=backend) for _ in range(4)]
    pid = os.fork()
    if pid == 0:  # child: drop everything inherited, then leave without cleanup
        try:
            bufs.clear()
            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for buf in bufs:
        np.testing.assert_array_equal(buf.to_numpy(), data)
        buf.close()


def test_process_exiting_with_live_buffers_exits_cleanly(backend):
    script = textwrap.dedent(f"""
        import numpy as np, rocmforge_raw as rf
        keep = [rf.HipBuffer(1 << 20, backend={backend.name!r}) for _ in range(3)]
        view = keep[0].view(10, 10)
        typed = rf.HipBuffer.from_numpy(np.arange(8.0), backend={backend.name!r}).typed(float)
        pool = rf.MemoryPool(backend={backend.name!r})
        pooled = rf.HipBuffer(1000, pool=pool)
        rf.HipBuffer(5000, pool=pool).close()  # a cached block, given back only by the pool
        cycle = [rf.HipBuffer(64, pool=rf.MemoryPool(backend={backend.name!r}))]
        cycle.append(cycle)  # left to the collector at shutdown
        print("done")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


# --- bad input -------------------------------------------------------------------------------
def _unchanged(before):
    gc.collect()
    now = rf.memory_stats()
    assert now["live_buffers"] == before["live_buffers"]
    assert now["live_bytes"] == before["live_bytes"]


@pytest.mark.parametrize("size, error, words", [
    (-1, ValueError, "nbytes must be >= 0, got -1"),
    (2.5, TypeError, "nbytes must be an integer"),
    ("10", TypeError, "nbytes must be an integer"),
    (1 << 70, OutOfMemoryError, str(1 << 70)),
])
def test_bad_sizes_raise_and_leak_nothing(backend, size, error, words):
    before = rf.memory_stats()
    with pytest.raises(error, match=words):
        rf.HipBuffer(size, backend=backend)
    _unchanged(before)


def test_request_larger_than_the_device_names_the_numbers(backend):
    total = backend.properties(DEVICE).total_bytes
    before = rf.memory_stats()
    with pytest.raises(OutOfMemoryError) as info:
        rf.HipBuffer(total * 4, backend=backend)
    assert isinstance(info.value, MemoryError)
    assert info.value.requested == total * 4 and str(total * 4) in str(info.value)
    assert info.value.total > 0
    _unchanged(before)


@pytest.mark.parametrize("offset, nbytes, words", [
    (4000, 200, "copy of 200 bytes at offset 4000 overruns a 4096-byte buffer"),
    (1 << 64, 1, "overruns a 4096-byte buffer"),
    (-5, 1, "offset must be >= 0, got -5"),
])
def test_out_of_range_copies_raise_before_any_binding_call(backend, offset, nbytes, words):
    with rf.HipBuffer(4096, backend=backend) as buf:
        with pytest.raises(ValueError, match=words):
            buf.copy_from_host(np.zeros(nbytes, np.uint8), offset=offset)
        with pytest.raises(ValueError):
            buf.view(4000, 200)
        with pytest.raises(ValueError, match="overruns"):
            buf.fill(1, offset=4096, nbytes=1)


def test_device_copy_longer_than_source_raises(backend):
    with rf.HipBuffer(100, backend=backend) as a, rf.HipBuffer(1000, backend=backend) as b:
        with pytest.raises(ValueError, match="read of 500 bytes at offset 0 overruns a 100-byte"):
            b.copy_from(a, 500)
        with pytest.raises(ValueError, match="copy of 100 bytes at offset 950 overruns"):
            b.copy_from(a, dst_offset=950)


def test_to_numpy_rejects_wrong_dtype_or_shape(backend):
    with rf.HipBuffer(10, backend=backend) as buf:
        with pytest.raises(ValueError, match="10 bytes are not a whole number of float32"):
            buf.to_numpy(np.float32)
        with pytest.raises(ValueError, match=r"shape \(3, 4\) of uint8 needs 12 bytes but only 10"):
            buf.to_numpy(np.uint8, (3, 4))
        with pytest.raises(TypeError):
            buf.to_numpy("not-a-dtype")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="unknown backend 'opencl'"):
        rf.HipBuffer(16, backend="opencl")


def test_invalid_device_ordinal_is_a_clear_error(backend):
    count = backend.device_count()
    before = rf.memory_stats()
    with pytest.raises(BackendUnavailableError, match=f"device {count + 7}"):
        rf.HipBuffer(16, device=count + 7, backend=backend)
    _unchanged(before)


# --- interop ---------------------------------------------------------------------------------
def test_dlpack_into_numpy_is_zero_copy_both_ways(rng):
    data = rng.standard_normal((4, 6)).astype(np.float32)
    with rf.HipBuffer.from_numpy(data, backend="host") as buf:
        typed = buf.typed(np.float32, (4, 6))
        array = np.from_dlpack(typed)
        np.testing.assert_array_equal(array, data)
        array[1, 2] = 42.0
        assert buf.to_numpy(np.float32, (4, 6))[1, 2] == 42.0
        buf.copy_from_host(np.full((4, 6), -1.0, np.float32))
        assert (array == -1.0).all()
        assert typed.__dlpack_device__() == (1, 0)
        del array


def test_dlpack_into_torch_and_cupy_on_gpu(gpu, rng):
    data = rng.standard_normal(1024).astype(np.float32)
    with rf.HipBuffer.from_numpy(data, backend=gpu) as buf:
        typed = buf.typed(np.float32)
        seen = 0
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            t = torch.from_dlpack(typed)
            assert t.data_ptr() == buf.ptr
            np.testing.assert_array_equal(t.cpu().numpy(), data)
            t.mul_(2)
            torch.cuda.synchronize()
            np.testing.assert_array_equal(buf.to_numpy(np.float32), data * 2)
            seen += 1
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            c = cupy.asarray(typed)  # __cuda_array_interface__
            assert c.data.ptr == buf.ptr
            c += 1
            cupy.cuda.runtime.deviceSynchronize()
            assert np.allclose(buf.to_numpy(np.float32), data * (2 if seen else 1) + 1)
            d = cupy.from_dlpack(typed)
            assert d.data.ptr == buf.ptr
            seen += 1
        if not seen:
            pytest.skip("neither torch nor cupy is installed")


def test_cuda_array_interface_is_absent_on_host():
    with rf.HipBuffer(16, backend="host") as buf:
        assert not hasattr(buf.typed(np.float32), "__cuda_array_interface__")


# --- the hip backend against the real HIP runtime -------------------------------------------
def test_hip_backend_without_a_device_is_a_clear_error(hip_runtime_without_device):
    pytest.importorskip("hip")
    with pytest.raises(BackendUnavailableError, match="HIP"):
        get_backend("hip")
    from rocmforge_raw.errors import DeviceError
    from rocmforge_raw.runtime import hip as hip_backend

    with pytest.raises(DeviceError) as info:
        hip_backend.check("hipMalloc", hip_backend.hip.hipMalloc(16))
    assert info.value.api == "hipMalloc" and info.value.status != 0
    assert info.value.status_name.startswith("hipError")
