"""A read's ``timeout`` (``Transport.read(..., timeout=)``, ``import_sequence(..., timeout=)``)
is checked before the read maps, registers, copies or waits for anything, on every transport:
a number of seconds > 0, or None for no limit. Anything else (0, a negative, NaN, infinity, a
bool, a string, an int past the float range) is refused naming it, the destination's bytes
untouched and nothing mapped or registered."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from test_transfer import _mooncake_or_skip, config, write_prompt
from workers import prefill, spawned

from rocmforge_raw.cache import KvCache
from rocmforge_raw.errors import TransferError
from rocmforge_raw.runtime import get_backend
from rocmforge_raw.transport import IpcTransport, MooncakeTransport, PeerTransport

BAD = [(0, ValueError), (-1.0, ValueError), (-0.0, ValueError), (math.nan, ValueError),
       (math.inf, ValueError), (True, TypeError), (np.bool_(False), TypeError),
       ("1", TypeError), (1j, TypeError), (10**400, ValueError)]
SPANS = np.array([[0, 0, 4096]], np.int64)


def _refused(link, endpoint, dst, timeout, error):
    before = dst.slab.buffer.to_numpy(np.uint8).copy()
    with pytest.raises(error, match="timeout must be a"):
        link.read(endpoint, dst.slab.buffer, SPANS, dst.stream, timeout=timeout)
    assert np.array_equal(dst.slab.buffer.to_numpy(np.uint8), before)


@pytest.mark.parametrize("timeout, error", BAD)
def test_a_peer_read_refuses_a_bad_timeout_before_it_copies(timeout, error):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        endpoint = link.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        _refused(link, endpoint, dst, timeout, error)


def test_an_ipc_read_refuses_a_bad_timeout_before_it_maps_or_copies():
    with IpcTransport() as link, KvCache(config()) as dst, \
            spawned(prefill, "host", 0, "ipc", config(), 40, 1) as worker:
        endpoint = worker.receive().endpoints["ipc"]
        for timeout, error in BAD:
            _refused(link, endpoint, dst, timeout, error)
            assert not link._mapped, timeout
        worker.send("done")
        assert worker.receive() == 3


def test_a_mooncake_read_refuses_a_bad_timeout_before_it_registers_or_reads():
    """Before, a timeout of 0 or below read the bytes and then failed the read."""
    sender = _mooncake_or_skip(get_backend("host"))
    with sender, MooncakeTransport("127.0.0.1") as receiver, KvCache(config()) as src, \
            KvCache(config()) as dst:
        endpoint = sender.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        for timeout, error in BAD:
            _refused(receiver, endpoint, dst, timeout, error)
            assert not receiver._registered, timeout


def test_a_nan_timeout_never_hangs_a_read_the_device_has_not_finished(monkeypatch):
    """A NaN deadline is never reached: the read would wait for ever on a hung device."""
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        endpoint = link.publish(src.slab)
        looks = []

        def hung(event):
            looks.append(event)
            assert len(looks) < 2000, "the read kept waiting past its timeout"
            return False

        monkeypatch.setattr(dst.slab.backend, "event_query", hung)
        with pytest.raises(ValueError, match="timeout must be a finite number, got nan"):
            link.read(endpoint, dst.slab.buffer, SPANS, dst.stream, timeout=math.nan)


def test_a_timeout_is_seconds_as_a_float():
    from rocmforge_raw.cache.transfer.transport import read_timeout

    assert read_timeout(None) is None
    assert read_timeout(np.float32(0.5)) == 0.5 and type(read_timeout(np.int64(2))) is float


def test_a_mooncake_read_s_timeout_holds_for_the_wait_and_the_batch_together(monkeypatch):
    """The receiving stream's work takes 0.6 s of a 1 s limit, the engine's batch 0.6 s
    more: the read took 1.2 s, and fails (before, each part alone was within the limit)."""
    sender = _mooncake_or_skip(get_backend("host"))
    with sender, MooncakeTransport("127.0.0.1") as receiver, KvCache(config()) as src, \
            KvCache(config()) as dst:
        endpoint = sender.publish(src.slab)
        backend, engine = dst.slab.backend, receiver._engine
        busy_until = []

        def busy(event):  # the stream's work passes 0.6 s after the first look
            busy_until.append(busy_until[0] if busy_until else time.monotonic() + 0.6)
            return time.monotonic() >= busy_until[0]

        class Slow:
            def __getattr__(self, name):
                return getattr(engine, name)

            def get_batch_transfer_status(self, batches):
                time.sleep(0.6)
                return engine.get_batch_transfer_status(batches)

        monkeypatch.setattr(backend, "event_query", busy)
        monkeypatch.setattr(receiver, "_engine", Slow())
        with pytest.raises(TransferError, match=r"the read took [\d.]+ s, more than timeout=1 s"):
            receiver.read(endpoint, dst.slab.buffer, SPANS, dst.stream, timeout=1)
