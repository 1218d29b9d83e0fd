"""What a runtime-copy read reports and reuses: ``last_read`` (host work and waiting, in
seconds) and the one event per thread and device that every ``wait`` re-records."""

from __future__ import annotations

import threading

import numpy as np
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.cache.transfer import transport
from rocmforge_raw.cache.transfer.transport import ReadTime
from rocmforge_raw.transport import PeerTransport


def test_a_read_says_how_long_the_host_worked_and_waited(backend):
    values = np.arange(1024, dtype=np.int32)
    with PeerTransport() as link, rf.HipBuffer.from_numpy(values, DEVICE, backend) as src, \
            rf.HipBuffer(4096, DEVICE, backend) as dst:
        assert link.last_read is None
        link.read(link.publish(src), dst, np.array([[0, 0, 4096]], np.int64))
        times = link.last_read
        assert isinstance(times, ReadTime) and times.host_s > 0 and times.wait_s >= 0
        np.testing.assert_array_equal(dst.to_numpy(np.int32), values)  # (src written: initcheck)


def test_waits_of_one_thread_reuse_one_event_and_other_threads_their_own(backend):
    created = []
    real = transport.Event

    def counted(*args, **kwargs):
        created.append(threading.get_ident())
        return real(*args, **kwargs)

    transport._forget_events()  # (this thread's event may be made already)
    try:
        transport.Event = counted
        with rf.HipBuffer(64, DEVICE, backend) as dst:
            for _ in range(3):
                assert transport.wait(dst, None) >= 0
            other = threading.Thread(target=transport.wait, args=(dst, None))
            other.start()
            other.join()
        assert len(created) == 2 and created[0] != created[1]
    finally:
        transport.Event = real
