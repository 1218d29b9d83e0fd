"""StreamOrder, the order of a cache's copies between tiers and its other device work, pinned
down by the survivors of mutation testing (issue 44): which stream waits for what, on the
device, and when the device is synchronized instead. ``Log`` is the host backend with a log of
those calls and an event that the device has not passed until ``passed`` says so; ``Active``
also logs the device active at each wait (the default stream is the active device's)."""

from __future__ import annotations

from typing import Any

import rocmforge_raw as rf
from rocmforge_raw.cache.tiers.order import MAX_STREAMS, StreamOrder
from rocmforge_raw.runtime.host import HostBackend


class Log(HostBackend):
    name = "host"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, ...]] = []
        self.passed = False

    def synchronize(self, device: int) -> None:
        self.log.append(("synchronize", device))
        super().synchronize(device)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream))

    def event_query(self, event: Any) -> bool:
        self.log.append(("query",))
        return self.passed

    def event_synchronize(self, event: Any) -> None:
        self.log.append(("event synchronize",))


class Active(Log):
    def __init__(self) -> None:
        super().__init__()
        self.active: int | None = None

    def activate(self, device: int) -> None:
        self.active = device
        super().activate(device)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream, self.active))


def copied_on(backend: Log, stream: Any) -> StreamOrder:
    order = StreamOrder(backend, 0)
    order.before_copies(stream)
    order.after_copies(stream)
    backend.log.clear()
    return order


def test_nothing_waits_before_any_copies():
    backend = Log()
    with rf.Stream(backend=backend) as s1:
        order = StreamOrder(backend, 0)
        order.used(s1)
        order.used(None)
        assert backend.log == []


def test_each_other_stream_waits_for_the_copies_on_the_device_once():
    backend = Log()
    with rf.Stream(backend=backend) as s1, rf.Stream(backend=backend) as s2:
        order = copied_on(backend, s1)
        order.used(s1)  # the copies' own stream
        order.used(s2)
        order.used(s2)
        order.used(None)  # the default stream is another stream
        assert backend.log == [("query",), ("wait", s2.handle), ("query",), ("wait", None)]


def test_once_the_device_has_passed_the_copies_no_stream_waits_or_asks_again():
    backend = Log()
    with rf.Stream(backend=backend) as s1, rf.Stream(backend=backend) as s2:
        order = copied_on(backend, s1)
        backend.passed = True
        order.used(s2)
        order.used(None)
        assert backend.log == [("query",)]


def test_past_max_streams_the_device_is_synchronized_once_and_nothing_waits():
    backend = Log()
    streams = [rf.Stream(backend=backend) for _ in range(MAX_STREAMS + 1)]
    try:
        order = copied_on(backend, streams[0])
        for stream in streams[1:MAX_STREAMS]:  # MAX_STREAMS streams remembered
            order.used(stream)
        assert ("synchronize", 0) not in backend.log
        backend.log.clear()
        order.used(streams[MAX_STREAMS])
        assert backend.log == [("synchronize", 0)]
        assert repr(order) == "<StreamOrder 1 streams, copies pending False>"
    finally:
        for stream in streams:
            stream.close()


def test_copies_wait_for_every_other_stream_and_synchronize_for_a_closed_one():
    backend = Log()
    with rf.Stream(backend=backend) as s2, rf.Stream(backend=backend) as s3:
        s1 = rf.Stream(backend=backend)
        order = StreamOrder(backend, 0)
        for stream in (None, s1, s2):
            order.used(stream)
        s1.close()
        order.before_copies(s3)
        assert backend.log == [("wait", s3.handle), ("synchronize", 0), ("wait", s3.handle)]


def test_the_repr_says_how_many_streams_are_remembered_and_whether_copies_are_pending():
    backend = Log()
    with rf.Stream(backend=backend) as s1, rf.Stream(backend=backend) as s2:
        order = StreamOrder(backend, 0)
        assert repr(order) == "<StreamOrder 0 streams, copies pending False>"
        order.before_copies(s1)
        order.after_copies(s1)
        assert repr(order) == "<StreamOrder 1 streams, copies pending True>"
        backend.passed = True
        order.used(s2)  # finds the device past the copies
        assert repr(order) == "<StreamOrder 2 streams, copies pending False>"
        order.after_copies(s1)
        order.wait()
        assert repr(order) == "<StreamOrder 1 streams, copies pending False>"


def test_an_order_of_another_device_than_the_threads_marks_and_joins_that_devices_streams():
    backend = Log()
    device = 1 - backend.get_device()  # the host backend has two devices here
    with rf.Stream(device, backend) as s1, rf.Stream(device, backend) as s2:
        order = StreamOrder(backend, device)
        order.used(s2)
        order.before_copies(s1)  # an event recorded on s2, for s1 to wait for
        order.after_copies(s1)  # an event recorded on s1, for the others
        order.used(s2)
        assert backend.log == [("wait", s1.handle), ("query",), ("wait", s2.handle)]


def test_the_default_stream_waits_for_the_copies_with_the_orders_device_active():
    backend = Active()
    device = 1 - backend.get_device()
    with rf.Stream(device, backend) as stream:
        order = StreamOrder(backend, device)
        order.before_copies(stream)
        order.after_copies(stream)
        backend.activate(1 - device)  # the thread's own work on its device meanwhile
        backend.log.clear()
        order.used(None)
        assert backend.log == [("query",), ("wait", None, device)]


def test_waiting_for_the_copies_synchronizes_them_once():
    backend = Log()
    with rf.Stream(backend=backend) as s1:
        order = copied_on(backend, s1)
        order.wait()
        order.wait()
        assert backend.log == [("event synchronize",)]


def test_a_caches_swap_waits_for_its_default_stream_work_and_that_work_for_the_swap():
    from rocmforge_raw.cache import CacheConfig, KvCache

    backend = Log()
    config = CacheConfig(1, 1, 64, 8, 8, "float32", host_blocks=8)
    with KvCache(config, backend=backend) as cache, rf.Stream(backend=backend) as s:
        cache.add_sequence("a", 9)
        cache.fork("a", "b")
        cache.append(["b"])  # a copy-on-write copy on the default stream
        backend.log.clear()
        cache.swap_out(["a"], stream=s)
        assert backend.log == [("wait", s.handle)]
        backend.log.clear()
        cache.fork("b", "c")
        cache.append(["c"])  # the default stream's next copy waits for the swap's
        assert backend.log == [("query",), ("wait", None)]
