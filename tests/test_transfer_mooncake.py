"""Mooncake's batch as ``MooncakeTransport`` drives it (issue 45, item 2): each buffer is
registered with the engine once per transport, however many transfers read it; a transfer
is one batch of the engine, its spans merged where they continue one another on both sides.
The engine is the installed one (host memory, TCP on loopback), its calls recorded."""

from __future__ import annotations

import numpy as np
import pytest
from test_transfer import _mooncake_or_skip, config, write_prompt

from rocmforge_raw.cache import KvCache
from rocmforge_raw.cache.transfer.transport import merged_spans
from rocmforge_raw.transport import MooncakeTransport


class Recording:
    """An engine whose calls are recorded as (name, args), then made."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        method = getattr(self.engine, name)

        def call(*args):
            self.calls.append((name, args))
            return method(*args)

        return call

    def named(self, name):
        return [args for called, args in self.calls if called == name]


def _recorded(link):
    link._engine = Recording(link._engine)
    return link._engine


def test_each_slab_is_registered_once_however_many_imports_read_it(backend):
    sender = _mooncake_or_skip(backend)
    with sender, MooncakeTransport("127.0.0.1") as receiver, \
            KvCache(config(), backend=backend) as src, KvCache(config(), backend=backend) as dst:
        sent, got = _recorded(sender), _recorded(receiver)
        sender.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        desc = src.export_sequence("s")
        for _ in range(3):
            dst.import_sequence(desc, receiver, "copy")
            dst.remove("copy")
        sender.publish(src.slab)  # again: the same endpoint, no second registration
        assert [args[0] for args in sent.named("register_memory")] == [src.slab.buffer.ptr]
        assert [args[0] for args in got.named("register_memory")] == [dst.slab.buffer.ptr]
        assert receiver.registration_s > 0


def test_an_import_is_one_batch_of_the_engine_one_descriptor_per_run_and_plane(backend):
    """3 consecutive blocks, 2 layers: 4 planes, so 4 descriptors in one batch call."""
    sender = _mooncake_or_skip(backend)
    with sender, MooncakeTransport("127.0.0.1") as receiver, \
            KvCache(config(), backend=backend) as src, KvCache(config(), backend=backend) as dst:
        sender.publish(src.slab)
        write_prompt(src, "s", np.arange(40), seed=0)
        desc = src.export_sequence("s")
        got = _recorded(receiver)
        done = dst.import_sequence(desc, receiver)
        (batch,) = got.named("batch_transfer_async_read")
        assert [name for name, _ in got.calls if "transfer" in name] == [
            "batch_transfer_async_read", "get_batch_transfer_status"]
        assert batch[3] == [3 * dst.config.block_bytes // 4] * 4
        assert sum(batch[3]) == done.nbytes
        times = receiver.last_read
        assert len(times.runs) == 4 and times.post_s > 0 and times.wire_s > 0


def test_spans_that_continue_one_another_are_posted_as_one_descriptor(backend):
    """Four spans of 4 KiB given one by one, the first three contiguous on both sides: two
    descriptors, and every byte where the four spans say."""
    sender = _mooncake_or_skip(backend)
    with sender, MooncakeTransport("127.0.0.1") as receiver, \
            KvCache(config(), backend=backend) as src, KvCache(config(), backend=backend) as dst:
        endpoint = sender.publish(src.slab)
        data = np.random.default_rng(1).integers(0, 255, src.slab.buffer.nbytes, np.uint8)
        src.slab.buffer.copy_from_host(data)
        page = 4096
        spans = np.array([[0, page, page], [page, 2 * page, page], [2 * page, 3 * page, page],
                          [8 * page, 0, page]], np.int64)
        got = _recorded(receiver)
        receiver.read(endpoint, dst.slab.buffer, spans)
        (batch,) = got.named("batch_transfer_async_read")
        assert batch[3] == [3 * page, page]
        out = dst.slab.buffer.to_numpy()
        assert np.array_equal(out[page : 4 * page], data[: 3 * page])
        assert np.array_equal(out[:page], data[8 * page : 9 * page])


@pytest.mark.parametrize("spans, expected", [
    ([[0, 0, 8], [8, 8, 8], [16, 32, 8]], [[0, 0, 16], [16, 32, 8]]),
    ([[8, 8, 8], [0, 0, 8]], [[0, 0, 16]]),  # in source order, whatever order given
    ([[0, 0, 8], [8, 16, 8]], [[0, 0, 8], [8, 16, 8]]),  # continues on one side only
    ([[0, 0, 8], [8, 8, 0], [8, 8, 4]], [[0, 0, 12]]),  # an empty span is dropped
    ([], []),
])
def test_merged_spans_joins_runs_that_continue_on_both_sides(spans, expected):
    got = merged_spans(np.array(spans, np.int64).reshape(-1, 3))
    assert got.tolist() == expected and got.dtype == np.int64
