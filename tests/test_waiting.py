"""Memory waiting on the device: handed over (``release_after``, ``defer_free``), counted apart
from live memory in ``memory_stats()``, freed by ``free_waiting()``, by its owner's
``close()`` and at interpreter exit, each after the device has passed it (issue 44)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.errors import BufferClosedError
from rocmforge_raw.kernels import oneoff
from rocmforge_raw.kernels.staging import PinnedBuffer, Staging, Workspace
from rocmforge_raw.memory.waiting import defer_free

MiB = 1 << 20


def _moved(before: dict[str, int]) -> dict[str, int]:
    """How each counter of ``memory_stats()`` moved since ``before`` (zeros left out)."""
    now = rf.memory_stats()
    assert now["num_allocs"] - now["num_frees"] == now["live_buffers"] + now["waiting_buffers"]
    return {key: now[key] - before[key] for key in now
            if key != "peak_bytes" and now[key] != before[key]}


class FakeEvent:
    """An event-like object whose ``synchronize`` the test sees (or makes fail)."""

    def __init__(self, log: list, fail: bool = False, closed: bool = False) -> None:
        self.log, self.fail, self.closed = log, fail, closed
        self.device = DEVICE
        self.backend = SimpleNamespace(synchronize=lambda device: log.append(("device", device)))

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("the device went away")
        self.log.append("event")


# --- buffers -----------------------------------------------------------------------------------
def test_a_released_buffer_counts_as_waiting_not_live_until_free_waiting(backend):
    before = rf.memory_stats()
    buf = rf.HipBuffer(4096, DEVICE, backend)
    buf.release_after()
    assert _moved(before) == {"num_allocs": 1, "waiting_buffers": 1, "waiting_bytes": 4096}
    assert rf.free_waiting() == 4096
    assert _moved(before) == {"num_allocs": 1, "num_frees": 1}
    assert rf.free_waiting() == 0


def test_using_a_released_buffer_or_a_view_of_it_raises(backend):
    buf = rf.HipBuffer(64, DEVICE, backend)
    view = buf.view(8, 8)
    buf.release_after()
    assert buf.closed and view.closed
    for use in (lambda: buf.ptr, lambda: view.ptr, lambda: buf.fill(0), buf.to_numpy,
                lambda: buf.view(0, 8), lambda: buf.copy_from_host(np.zeros(8, np.uint8))):
        with pytest.raises(BufferClosedError, match="was closed"):
            use()
    buf.release_after()  # nothing more happens to a closed buffer
    buf.close()


def test_close_of_a_released_buffer_frees_it_then(backend):
    before = rf.memory_stats()
    buf = rf.HipBuffer(100, DEVICE, backend)
    buf.release_after()
    buf.close()
    assert _moved(before) == {"num_allocs": 1, "num_frees": 1}
    buf.close()
    assert rf.free_waiting() == 0 and _moved(before) == {"num_allocs": 1, "num_frees": 1}


def test_a_buffer_released_after_an_event_or_on_a_stream_waits(backend):
    before = rf.memory_stats()
    stream = rf.Stream(DEVICE, backend)
    on_stream, after_event = rf.HipBuffer(10, DEVICE, backend), rf.HipBuffer(20, DEVICE, backend)
    on_stream.fill(1, stream=stream)
    on_stream.release_after(stream)
    after_event.release_after(rf.Event(DEVICE, backend).record(stream))
    assert _moved(before) == {"num_allocs": 2, "waiting_buffers": 2, "waiting_bytes": 30}
    assert rf.free_waiting() == 30
    stream.close()


def test_release_after_refuses_a_view_an_unrecorded_event_and_other_things(backend):
    buf = rf.HipBuffer(64, DEVICE, backend)
    with pytest.raises(ValueError, match="is a view, which frees nothing"):
        buf.view(0, 8).release_after()
    with pytest.raises(ValueError, match="never recorded"):
        buf.release_after(rf.Event(DEVICE, backend))
    with pytest.raises(TypeError, match="after must be an Event, a Stream or None, got 5"):
        buf.release_after(5)
    assert not buf.closed
    buf.close()


def test_release_after_refuses_an_event_of_another_backend(gpu):
    buf = rf.HipBuffer(64, DEVICE, gpu)
    with pytest.raises(ValueError, match="the event is on host"):
        buf.release_after(rf.Event(DEVICE, "host").record())
    buf.close()


def test_a_buffer_released_while_exported_waits_once_its_last_consumer_lets_go(backend):
    before = rf.memory_stats()
    buf = rf.HipBuffer(256, DEVICE, backend)
    end = buf._export()
    buf.release_after()
    assert buf.closed and _moved(before) == {"num_allocs": 1, "live_buffers": 1,
                                             "live_bytes": 256}
    end()
    assert _moved(before) == {"num_allocs": 1, "waiting_buffers": 1, "waiting_bytes": 256}
    rf.free_waiting()


def test_peak_bytes_counts_waiting_memory(backend):
    buf = rf.HipBuffer(MiB, DEVICE, backend)
    buf.release_after()
    rf.reset_peak()
    stats = rf.memory_stats()
    assert stats["peak_bytes"] == stats["live_bytes"] + stats["waiting_bytes"] >= MiB
    rf.free_waiting()


# --- other memory and the waits ------------------------------------------------------------------
def test_free_waiting_waits_for_each_event_before_its_free():
    log: list = []
    defer_free(lambda: log.append("free"), 7, FakeEvent(log))
    assert rf.memory_stats()["waiting_other_bytes"] == 7
    assert rf.free_waiting() == 7
    assert log == ["event", "free"]
    assert rf.memory_stats()["waiting_other"] == 0


def test_memory_whose_event_was_closed_waits_for_its_device():
    log: list = []
    defer_free(lambda: log.append("free"), 1, FakeEvent(log, closed=True))
    rf.free_waiting()
    assert log == [("device", DEVICE), "free"]


def test_a_failed_wait_raises_and_leaves_the_memory_waiting():
    log: list = []
    event = FakeEvent(log, fail=True)
    defer_free(lambda: log.append("free"), 3, event)
    with pytest.raises(RuntimeError, match="the device went away"):
        rf.free_waiting()
    assert rf.memory_stats()["waiting_other_bytes"] == 3 and log == []
    event.fail = False
    assert rf.free_waiting() == 3 and log == ["event", "free"]


def test_a_released_pinned_buffer_waits_as_other_memory(backend):
    before = rf.memory_stats()
    pinned = PinnedBuffer(4096, DEVICE, backend)
    pinned.release_after()
    assert _moved(before) == {"waiting_other": 1, "waiting_other_bytes": 4096}
    with pytest.raises(ValueError, match="or it was closed"):
        pinned.array(np.uint8, 1)
    pinned.close()  # its owner's close frees it now
    assert _moved(before) == {}
    assert rf.free_waiting() == 0


# --- the library's own waiting memory ------------------------------------------------------------
def test_free_waiting_gives_back_the_one_off_ops_staging(backend):
    before = rf.memory_stats()
    with oneoff.staging(oneoff.Place(backend, DEVICE), None) as slot:
        slot.put([np.arange(100, dtype=np.int32)], None)
    assert _moved(before)["live_buffers"] == 1  # the slot's device copy, kept for reuse
    rf.free_waiting()
    assert _moved(before) == {"num_allocs": 1, "num_frees": 1}


def test_an_outgrown_workspace_buffer_waits_until_free_waiting(backend):
    like = rf.HipBuffer(16, DEVICE, backend)
    before = rf.memory_stats()
    workspace = Workspace()
    workspace.get(100, 1, like)
    workspace.used(None)
    partials, _ = workspace.get(1000, 1, like)  # the 100-byte partials are outgrown
    assert _moved(before) == {"num_allocs": 3, "live_buffers": 2, "live_bytes": 1004,
                              "waiting_buffers": 1, "waiting_bytes": 100}
    assert rf.free_waiting() == 100
    assert not partials.closed
    workspace.close()
    like.close()


def test_closing_a_workspace_frees_its_outgrown_buffers(backend):
    like = rf.HipBuffer(16, DEVICE, backend)
    before = rf.memory_stats()
    workspace = Workspace()
    workspace.get(100, 1, like)
    workspace.get(1000, 2, like)
    workspace.close()
    assert _moved(before) == {"num_allocs": 4, "num_frees": 4}
    like.close()


def test_outgrown_staging_memory_is_handed_over_at_the_fence_s_next_mark(backend):
    slot = Staging(DEVICE, backend)
    slot.put([np.arange(4, dtype=np.int32)], None)
    before = rf.memory_stats()
    slot.put([np.arange(10_000, dtype=np.int32)], None, append=True)  # outgrows the slot
    # launches of the first put may still read the old memory: live until the next mark
    assert _moved(before) == {"num_allocs": 1, "live_buffers": 1,
                              "live_bytes": slot.buffer.nbytes}
    slot.fence.mark(None)
    moved = _moved(before)
    assert (moved["waiting_buffers"], moved["waiting_other"]) == (1, 1)
    assert moved["waiting_bytes"] == moved["waiting_other_bytes"] == 256
    assert rf.free_waiting() == 512
    slot.close()


# --- interpreter exit ----------------------------------------------------------------------------
EXIT_SCRIPT = """
    import atexit, json, sys

    def report():  # registered first, so it runs after the package's own exit hook
        import rocmforge_raw as rf
        stats = rf.memory_stats()
        stats["free_bytes"] = rf.get_backend(BACKEND).mem_info(DEVICE)[0]
        print(json.dumps(stats))

    atexit.register(report)
    import numpy as np
    import rocmforge_raw as rf
    from rocmforge_raw.kernels import oneoff
    kept = rf.HipBuffer(4096, DEVICE, BACKEND)  # live at exit: the process frees it
    rf.HipBuffer(NBYTES, DEVICE, BACKEND).release_after()
    with oneoff.staging(oneoff.Place(rf.get_backend(BACKEND), DEVICE), None) as slot:
        slot.put([np.arange(100, dtype=np.int32)], None)
    stats = rf.memory_stats()
    stats["free_bytes"] = rf.get_backend(BACKEND).mem_info(DEVICE)[0]
    print(json.dumps(stats))
"""


def _exit_run(backend, nbytes: int) -> tuple[dict, dict, str]:
    script = textwrap.dedent(EXIT_SCRIPT).replace("BACKEND", repr(backend.name)).replace(
        "DEVICE", str(DEVICE)).replace("NBYTES", str(nbytes))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    before_exit, after_exit = (json.loads(line) for line in result.stdout.splitlines())
    return before_exit, after_exit, result.stderr


def test_memory_waiting_at_exit_is_freed_after_the_device_passed_it(backend):
    before_exit, after_exit, stderr = _exit_run(backend, MiB)
    assert (before_exit["live_buffers"], before_exit["waiting_buffers"]) == (2, 1)
    assert (after_exit["live_buffers"], after_exit["waiting_buffers"]) == (1, 0)
    assert after_exit["num_frees"] == before_exit["num_frees"] + 2  # the staging's too
    assert stderr == ""


def test_memory_waiting_at_exit_goes_back_to_the_device(gpu):
    before_exit, after_exit, _ = _exit_run(gpu, 256 * MiB)
    assert after_exit["free_bytes"] - before_exit["free_bytes"] >= 200 * MiB


def test_a_failed_free_at_exit_is_one_line_on_stderr():
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from rocmforge_raw.memory.waiting import defer_free
        def fail():
            raise RuntimeError("the device went away")
        defer_free(print, 5, SimpleNamespace(closed=False, synchronize=fail))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "rocmforge_raw: at exit, 1 free(s) of memory waiting on the device failed (5 bytes "
        "left to the process's end): RuntimeError: the device went away"]
