"""ops.copy_spans: many spans of bytes in one launch (``rf_copy_pieces``) where the device
reaches the source and everything is 16-byte aligned, runtime copies otherwise; checked
against NumPy copies of the same spans, and its refusals leave the destination untouched."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.kernels import ops

KiB = 1024


def expected(dst: np.ndarray, src: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """``dst`` after copying ``spans`` of ``src`` one by one."""
    want = dst.copy()
    for s, d, n in spans.tolist():
        want[d : d + n] = src[s : s + n]
    return want


def scattered_spans(rng, nbytes: int) -> np.ndarray:
    """Block-sized spans in shuffled order, one past ``PIECE_BYTES`` with a tail of one
    vector, one of a single vector and one empty: 16-byte aligned, destinations disjoint."""
    chunk = 32 * KiB
    slots = rng.permutation(nbytes // chunk - 8)[:40]
    spans = [[int(rng.integers(0, nbytes // chunk)) * chunk, int(s) * chunk, chunk]
             for s in slots]
    top = (nbytes // chunk - 8) * chunk  # the last 8 chunks of dst: the odd sizes
    spans += [[16, top, ops.PIECE_BYTES * 3 + 16], [4 * KiB, top + 3 * ops.PIECE_BYTES + 32, 16],
              [0, top + 3 * ops.PIECE_BYTES + 64, 0]]
    return np.array(spans, np.int64)[rng.permutation(len(spans))]


class CountedCalls:
    """A backend's ``driver_calls`` that names each batched copy in ``calls`` (its copies'
    count too) and answers ``status`` instead of queueing it where that is given."""

    def __init__(self, real, calls: list, status: int | None = None) -> None:
        self.real, self.calls, self.status = real, calls, status

    def __getattr__(self, name):
        return getattr(self.real, name)

    def copy_batch(self, dsts, srcs, sizes, *args):
        self.calls.append(("copy_batch", len(sizes)))
        if self.status is not None:
            return self.status
        return self.real.copy_batch(dsts, srcs, sizes, *args)


def batches(backend) -> bool:
    """Whether ``backend``'s binding has a batched copy (``cuMemcpyBatchAsync``)."""
    return backend.driver_calls is not None and backend.driver_calls.batches


def counting(backend, monkeypatch, batch_status: int | None = None) -> list:
    """Names of the runtime copies ``backend`` makes from now on (a batched copy as
    ``("copy_batch", copies)``; ``batch_status``: what the batch answers, not queueing)."""
    calls: list = []
    for name in ("memcpy_dtod", "memcpy_peer"):
        method = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _m=method, _n=name, **k: (
            calls.append(_n), _m(*a, **k))[1])
    if batches(backend):
        monkeypatch.setattr(backend, "driver_calls",
                            CountedCalls(backend.driver_calls, calls, batch_status))
    return calls


def test_scattered_aligned_spans_move_in_one_launch(backend, rng, monkeypatch):
    nbytes = 2 * 1024 * KiB
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    spans = scattered_spans(rng, nbytes)
    with rf.HipBuffer.from_numpy(data, DEVICE, backend) as src, \
            rf.HipBuffer.from_numpy(np.zeros(nbytes, np.uint8), DEVICE, backend) as dst, \
            rf.Stream(DEVICE, backend) as stream:
        calls = counting(backend, monkeypatch)
        ops.copy_spans(dst, src, spans, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(dst.to_numpy(), expected(np.zeros_like(data), data,
                                                               spans))
    if backend.name == "host":
        assert calls.count("memcpy_dtod") == np.count_nonzero(spans[:, 2])
    else:
        assert calls == []  # the kernel moved every span


UNALIGNED = np.array([[3, 100, 1000], [5000, 7, 33], [20000, 40000, 16 * KiB + 1]], np.int64)


@pytest.mark.parametrize("on_stream", [False, True])
def test_unaligned_spans_are_one_batched_copy_or_copied_one_by_one(backend, rng, monkeypatch,
                                                                   on_stream):
    """One ``cuMemcpyBatchAsync`` where the binding has it (on the thread's default stream
    for the default stream, which the batch refuses), a runtime copy a span where not."""
    nbytes = 64 * KiB
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, DEVICE, backend) as src, \
            rf.HipBuffer.from_numpy(np.zeros(nbytes, np.uint8), DEVICE, backend) as dst, \
            rf.Stream(DEVICE, backend) as stream:
        calls = counting(backend, monkeypatch)
        ops.copy_spans(dst, src, UNALIGNED, stream=stream if on_stream else None)
        stream.synchronize()
        np.testing.assert_array_equal(dst.to_numpy(), expected(np.zeros_like(data), data,
                                                               UNALIGNED))
    if batches(backend):
        assert calls == [("copy_batch", len(UNALIGNED))]
    else:
        assert calls == ["memcpy_dtod"] * len(UNALIGNED)


def test_a_batch_the_driver_refuses_is_copied_one_by_one(gpu, rng, monkeypatch):
    if not batches(gpu):
        pytest.skip(f"the {gpu.name} binding has no batched copy")
    data = rng.integers(0, 256, 64 * KiB, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, DEVICE, gpu) as src, \
            rf.HipBuffer.from_numpy(np.zeros_like(data), DEVICE, gpu) as dst:
        calls = counting(gpu, monkeypatch, batch_status=1)  # (CUDA_ERROR_INVALID_VALUE)
        ops.copy_spans(dst, src, UNALIGNED)
        np.testing.assert_array_equal(dst.to_numpy(), expected(np.zeros_like(data), data,
                                                               UNALIGNED))
    assert calls == [("copy_batch", len(UNALIGNED))] + ["memcpy_dtod"] * len(UNALIGNED)


def test_a_batch_on_the_default_stream_follows_its_earlier_work_and_precedes_its_later(
        gpu, rng):
    """The batch goes on the thread's default stream: what the legacy default stream queued
    before (a long fill) lands first, what it queues after (a copy back) sees the batch."""
    nbytes = 256 * 1024 * KiB
    spans = np.array([[nbytes - 4099, 1, 4099], [nbytes // 2 + 1, 8 * KiB + 3, 999]], np.int64)
    with rf.HipBuffer(nbytes, DEVICE, gpu) as src, \
            rf.HipBuffer.from_numpy(np.zeros(16 * KiB, np.uint8), DEVICE, gpu) as dst, \
            rf.HipBuffer(16 * KiB, DEVICE, gpu) as back:
        for value in (7, 200):
            src.fill(value)  # (the default stream: the whole 256 MiB before the batch)
            ops.copy_spans(dst, src, spans)
            gpu.memcpy_dtod(back.ptr, dst.ptr, back.nbytes)  # the default stream, after
            got = back.to_numpy()
            assert (got[1:4100] == value).all()
            assert (got[8 * KiB + 3 : 8 * KiB + 1002] == value).all()


def test_spans_within_one_buffer_and_views_of_it(backend, rng):
    nbytes = 512 * KiB
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, DEVICE, backend) as buf:
        low, high = buf.view(0, nbytes // 2), buf.view(nbytes // 2, nbytes // 2)
        spans = np.array([[0, 64 * KiB, 64 * KiB], [160 * KiB, 0, 48 * KiB],
                          [144 * KiB, 128 * KiB, 16]], np.int64)
        ops.copy_spans(high, low, spans)  # a view's offsets: the view's own bytes
        want = data.copy()
        want[nbytes // 2 :] = expected(data[nbytes // 2 :], data[: nbytes // 2], spans)
        np.testing.assert_array_equal(buf.to_numpy(), want)
        ops.copy_spans(buf, buf, np.array([[0, 256 * KiB, 128 * KiB]], np.int64))
        want[256 * KiB : 384 * KiB] = want[: 128 * KiB]
        np.testing.assert_array_equal(buf.to_numpy(), want)


@pytest.mark.parametrize("spans, words", [
    ([[0, 0, 64], [64, 32, 64]], "overlap in the destination: bytes 0..64 and 32"),
    ([[0, 0, 4 * KiB + 1]], "has a span outside the 4096-byte source"),
    ([[-16, 0, 16]], "has a span outside"),
    ([[0, 0]], r"integers shaped \[n, 3\]"),
    ([[0.0, 0.0, 16.0]], r"integers shaped \[n, 3\]"),
    (np.array([[2**63, 0, 16]], np.uint64), "past a signed 64-bit size"),
    ([[2**63 - 16, 2**63 - 16, 32]], "has a span outside"),  # offset + size wraps past 2**63
    ([[16, 16, 2**63 - 8]], "has a span outside"),
    ([[64, 32, 64], [0, 0, 64]], "overlap in the destination: bytes 0..64 and 32"),  # unsorted
])
def test_bad_spans_are_refused_before_anything_moves(backend, spans, words):
    with rf.HipBuffer.from_numpy(np.arange(4 * KiB, dtype=np.uint32).view(np.uint8)[: 4 * KiB],
                                 DEVICE, backend) as src, \
            rf.HipBuffer.from_numpy(np.zeros(8 * KiB, np.uint8), DEVICE, backend) as dst:
        with pytest.raises(ValueError, match=words):
            ops.copy_spans(dst, src, spans)
        assert not dst.to_numpy().any()


def test_no_spans_copy_nothing_but_a_closed_buffer_is_refused(backend):
    with rf.HipBuffer.from_numpy(np.arange(64, dtype=np.uint8), DEVICE, backend) as src, \
            rf.HipBuffer.from_numpy(np.zeros(64, np.uint8), DEVICE, backend) as dst:
        for spans in ([], np.zeros((0, 3), np.int64), [[0, 8, 0]], [[0, 0, 64], [0, 8, 0]]):
            ops.copy_spans(dst, src, spans)  # a zero-length span lands nowhere
        assert dst.to_numpy().tolist() == list(range(64))
        src.close()
        with pytest.raises(rf.BufferClosedError):
            ops.copy_spans(dst, src, [])


def test_a_piece_table_of_the_wrong_form_is_refused(backend):
    good = np.array([[0, 4096, 64]], np.int64)
    for bad in (good.astype(np.int32), good[:, :2], good + np.array([0, 0, 8]), good * [1, 1, 0],
                good * [1, 1, 2048]):
        with pytest.raises(ValueError, match="pieces must be int64"):
            ops.copy_pieces(backend, DEVICE, bad, None)


def test_a_source_overlapping_a_destination_of_one_buffer_is_refused(backend):
    data = np.arange(4 * KiB, dtype=np.uint8)
    with rf.HipBuffer.from_numpy(data, DEVICE, backend) as buf:
        for spans in ([[0, 1 * KiB, 2 * KiB]], [[1 * KiB, 0, 2 * KiB]],
                      [[0, 2 * KiB, 64], [2 * KiB + 32, 3 * KiB, 64]]):
            with pytest.raises(ValueError, match="read bytes another span writes"):
                ops.copy_spans(buf, buf, np.array(spans, np.int64))
            np.testing.assert_array_equal(buf.to_numpy(), data)
        # views of one allocation are one memory too, the source before or after the
        # destination (the source's place is measured from the destination's start)
        for dst, src, span in ((buf.view(64, 1024), buf.view(0, 1024), [0, 0, 128]),
                               (buf.view(0, 1024), buf.view(512, 512), [0, 512, 64])):
            with pytest.raises(ValueError, match="read bytes another span writes"):
                ops.copy_spans(dst, src, np.array([span], np.int64))
            np.testing.assert_array_equal(buf.to_numpy(), data)


def test_spans_that_only_touch_in_one_buffer_copy(backend):
    """A destination ending exactly where a source starts (and the other way round) shares
    no byte with it: accepted, and copied."""
    data = np.arange(4 * KiB, dtype=np.uint32).view(np.uint8)[: 4 * KiB]
    with rf.HipBuffer.from_numpy(data, DEVICE, backend) as buf:
        spans = np.array([[0, 64, 64], [256, 192, 64]], np.int64)  # dst 64..128 after src
        ops.copy_spans(buf, buf, spans)  # 0..64; dst 192..256 before src 256..320
        want = data.copy()
        want[64:128], want[192:256] = data[0:64], data[256:320]
        np.testing.assert_array_equal(buf.to_numpy(), want)


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
def test_two_imports_of_one_handle_are_one_memory_to_the_overlap_check(backend):
    """Two HipBuffers imported from one handle are two roots at one address: a span that
    reads what another writes is refused as within one buffer."""
    from workers import export_and_wait, spawned

    with spawned(export_and_wait, backend.name) as worker:
        try:
            handle = worker.receive()
            with rf.HipBuffer.from_ipc(handle) as a, rf.HipBuffer.from_ipc(handle) as b:
                assert a.ptr == b.ptr and a.root is not b.root
                before = a.to_numpy()
                with pytest.raises(ValueError, match="read bytes another span writes"):
                    ops.copy_spans(a, b, np.array([[0, 1 * KiB, 2 * KiB]], np.int64))
                np.testing.assert_array_equal(a.to_numpy(), before)
        finally:
            worker.kill()


def test_buffers_of_two_backends_or_no_buffer_are_refused(backend):
    with rf.HipBuffer(64, DEVICE, backend) as buf:
        with pytest.raises(TypeError, match="src must be a HipBuffer, got 'x'"):
            ops.copy_spans(buf, "x", [[0, 0, 16]])
        with pytest.raises(TypeError, match="dst must be a HipBuffer"):
            ops.copy_spans(np.zeros(64, np.uint8), buf, [[0, 0, 16]])
        if backend.name != "host":
            with rf.HipBuffer(64, 0, "host") as host, \
                    pytest.raises(ValueError, match="within one backend"):
                ops.copy_spans(buf, host, [[0, 0, 16]])


def test_spans_from_another_device_move_in_one_launch_where_it_reaches_them(two_devices, rng,
                                                                           monkeypatch):
    backend, nbytes = two_devices, 1024 * KiB
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    spans = scattered_spans(rng, nbytes)
    with rf.HipBuffer.from_numpy(data, 1, backend) as src, \
            rf.HipBuffer.from_numpy(np.zeros(nbytes, np.uint8), 0, backend) as dst:
        reaches = backend.peer_access(0, 1)
        calls = counting(backend, monkeypatch)
        ops.copy_spans(dst, src, spans)
        np.testing.assert_array_equal(dst.to_numpy(), expected(np.zeros_like(data), data,
                                                               spans))
    if backend.name != "host" and reaches:
        assert calls == []
    elif batches(backend):
        assert calls == [("copy_batch", np.count_nonzero(spans[:, 2]))]
    else:
        assert calls == ["memcpy_peer"] * np.count_nonzero(spans[:, 2])


def test_pieces_past_one_launch_go_in_several(gpu, rng, monkeypatch):
    """More pieces than one launch takes: the table is launched in slices (each from its own
    row), every byte lands."""
    monkeypatch.setattr(ops, "MAX_PIECES", 3)
    data = rng.integers(0, 256, 640 * KiB, dtype=np.uint8)
    spans = np.array([[0, 0, 10 * ops.PIECE_BYTES]], np.int64)
    with rf.HipBuffer.from_numpy(data, DEVICE, gpu) as src, \
            rf.HipBuffer.from_numpy(np.zeros_like(data), DEVICE, gpu) as dst:
        ops.copy_spans(dst, src, spans)
        np.testing.assert_array_equal(dst.to_numpy(), data)
