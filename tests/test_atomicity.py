"""Every operation completes or raises with the state exactly as before.

A hypothesis state machine drives a small KV cache (strict or preempting, usually near full)
with random valid operations (add, append, fork, finish, remove, plan + write + attend,
prefill writes) interleaved with random bad ones: malformed arguments, unknown or repeated
ids, a stream that is not a Stream or is closed, stale plans, a clock that fails mid-call,
and bad calls on a BlockPool, HipBuffers and a MemoryPool. Around every call that raises, it
compares full snapshots: each sequence's blocks, length, last slot, times and recency, the
ref counts and the free stack in order, counters, the current plan, finished records, the
slab's bytes, the pool's stats and the buffer registry's counts.
"""

from __future__ import annotations

import gc
import hashlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import rocmforge_raw as rf
from rocmforge_raw import ops
from rocmforge_raw.array import DeviceArray
from rocmforge_raw.cache import BlockPool, CacheConfig, CacheFullError, KvCache
from rocmforge_raw.errors import BufferClosedError, DeviceError, RocmforgeError
from rocmforge_raw.ops import host_view

CONFIG = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=64, block_size=8, num_blocks=12,
                     dtype="float32", num_q_heads=2)
EXPECTED = (TypeError, ValueError, KeyError, IndexError, RocmforgeError, RuntimeError)


class Clock:
    """Seconds that advance on every read; ``fail_next`` makes the next read raise."""

    def __init__(self) -> None:
        self.now, self.fail_next = 1000.0, False

    def __call__(self) -> float:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("clock failed")
        self.now += 0.5
        return self.now


def keys(n: int, value: float = 1.0) -> DeviceArray:
    return DeviceArray.from_numpy(np.full((n, 1, 64), value, np.float32), backend="host")


def cache_state(cache: KvCache) -> dict:
    """Everything a cache holds: per sequence its blocks, length, times, last slot and
    recency; ref counts and the free stack in order; counters, the current plan, finished
    records, the prefix index with the cached-free blocks in order, and the slab's bytes."""
    rows, seqs = cache._rows, {}
    for seq_id in cache.seq_ids():
        row = rows.index[seq_id]
        seqs[seq_id] = (tuple(cache.block_ids(seq_id)), cache.seq_len(seq_id),
                        cache.times(seq_id), int(rows.last_slot[row]), int(rows.recency[row]))
    return {
        "order": cache.seq_ids(), "seqs": seqs, "tick": rows.tick,
        "ref_cnt": cache.pool.ref_cnt.tolist(), "free": cache.pool.free_ids().tolist(),
        "cached": cache.pool.cached_ids().tolist(), "index": sorted(cache.pool.index.items()),
        "stats": cache.stats(), "finished": cache.finished(), "epoch": cache._epoch,
        "plan": cache._steps.current, "slab": hashlib.sha1(host_view(cache.slab)).digest(),
    }


#: Prompts that share leading blocks (block size 8): the prefix cache hits between them.
PROMPTS = [np.arange(20), np.arange(17), np.concatenate([np.arange(16), [99] * 9]),
           np.arange(100, 116)]


# Bad calls: (name, call(machine)). Each must raise one of EXPECTED and change nothing.
def _some(m):
    return m.cache.seq_ids()[:1] or ["none"]


BAD_CALLS = {
    "add float tokens": lambda m: m.cache.add_sequence(m.new_id(), 2.0),
    "add numpy float tokens": lambda m: m.cache.add_sequence(m.new_id(), np.float64(3.0)),
    "add bool tokens": lambda m: m.cache.add_sequence(m.new_id(), True),
    "add zero tokens": lambda m: m.cache.add_sequence(m.new_id(), 0),
    "add unhashable id": lambda m: m.cache.add_sequence(["x"], 3),
    "add past the cache": lambda m: m.cache.add_sequence(m.new_id(), CONFIG.num_slots + 1),
    "add float token ids": lambda m: m.cache.add_sequence(m.new_id(), tokens=np.arange(4.0)),
    "add 2-D token ids": lambda m: m.cache.add_sequence(m.new_id(), tokens=[[1, 2], [3, 4]]),
    "add a count and tokens": lambda m: m.cache.add_sequence(m.new_id(), 2, tokens=[1, 2]),
    "add tokens past the cache": lambda m: m.cache.add_sequence(
        m.new_id(), tokens=np.arange(CONFIG.num_slots + 1)),
    "append a string": lambda m: m.cache.append("abc"),
    "append a number": lambda m: m.cache.append(5),
    "append twice": lambda m: m.cache.append(_some(m) * 2),
    "append unknown": lambda m: m.cache.append([*m.cache.seq_ids(), "missing"]),
    "append unhashable": lambda m: m.cache.append([*m.cache.seq_ids(), ["x"]]),
    "append bad stream": lambda m: m.cache.append(m.cache.seq_ids(), stream=5),
    "append closed stream": lambda m: m.cache.append(m.cache.seq_ids(), stream=m.closed),
    "fork unknown": lambda m: m.cache.fork("missing", m.new_id()),
    "fork unhashable": lambda m: m.cache.fork(_some(m)[0], {"x": 1}),
    "finish unknown": lambda m: m.cache.finish("missing"),
    "remove unhashable": lambda m: m.cache.remove(["x"]),
    "batch twice": lambda m: m.cache.batch(_some(m) * 2),
    "batch a string": lambda m: m.cache.batch("ab"),
    "batch bad stream": lambda m: m.cache.batch(m.cache.seq_ids(), stream="s"),
    "write bad layer": lambda m: m.cache.write(2, m.key1, m.key1, np.zeros(1, np.int64)),
    "write float layer": lambda m: m.cache.write(0.5, m.key1, m.key1, np.zeros(1, np.int64)),
    "write slot out of range": lambda m: m.cache.write(
        0, m.key1, m.key1, np.array([CONFIG.num_blocks * CONFIG.block_size], np.int64)),
    "write slot twice": lambda m: m.cache.write(0, m.key2, m.key2, np.array([9, 9])),
    "write float slots": lambda m: m.cache.write(0, m.key1, m.key1, np.array([9.0])),
    "attend with no plan": lambda m: m.cache.attention(0, m.key1, m.key1, {"seq_ids": []}),
    "can_allocate text": lambda m: m.cache.can_allocate("3"),
    "k_cache negative": lambda m: m.cache.k_cache(-1),
    "block pool free unheld": lambda m: m.blocks.free([m.blocks.num_blocks - 1] * 9),
    "block pool share unheld": lambda m: m.blocks.share([1, 2, 3, 4, 5, 6]),
    "block pool float ids": lambda m: m.blocks.free([1.5]),
    "block pool past the end": lambda m: m.blocks.free([m.blocks.num_blocks]),
    "block pool bool count": lambda m: m.blocks.allocate(True),
    "buffer of bool size": lambda m: rf.HipBuffer(True, backend="host"),
    "buffer on no device": lambda m: rf.HipBuffer(0, device=7, backend="host"),
    "buffer of objects": lambda m: rf.HipBuffer.from_numpy(np.array([object()]),
                                                           backend="host"),
    "array of objects": lambda m: DeviceArray.empty(4, object, backend="host"),
    "array of 2**63": lambda m: DeviceArray.empty(1 << 63, np.float32, backend="host"),
    "pool float allocate": lambda m: m.mempool.allocate(1.5),
    "pool bool allocate": lambda m: m.mempool.allocate(True),
}
BAD_WITH_SEQUENCES = {
    "add existing id": lambda m: m.cache.add_sequence(_some(m)[0], 3),
    "add existing id with tokens": lambda m: m.cache.add_sequence(_some(m)[0],
                                                                  tokens=PROMPTS[0]),
    "fork onto existing": lambda m: m.cache.fork(_some(m)[0], m.cache.seq_ids()[-1]),
    "append twice": lambda m: m.cache.append(m.cache.seq_ids() + _some(m)),
    "batch twice": lambda m: m.cache.batch(m.cache.seq_ids() + _some(m)),
}
CLOCKED = {
    "add": lambda m: m.cache.add_sequence(m.new_id(), 5),
    "add tokens": lambda m: m.cache.add_sequence(m.new_id(), tokens=PROMPTS[1]),
    "append": lambda m: m.cache.append(m.cache.seq_ids()),
    "fork": lambda m: m.cache.fork(_some(m)[0], m.new_id()),
    "finish": lambda m: m.cache.finish(_some(m)[0]),
    "batch": lambda m: m.cache.batch(m.cache.seq_ids()),
}


class AtomicMachine(RuleBasedStateMachine):
    calls = 0  # failing calls compared, over the whole run

    @initialize(strict=st.booleans())
    def start(self, strict: bool) -> None:
        self.clock = Clock()
        self.cache = KvCache(CONFIG, backend="host", strict=strict, clock=self.clock,
                             max_finished=4)
        self.cache.slab.buffer.fill(0)  # attention reads slots appended but never written
        self.blocks = BlockPool(8)
        self.blocks.allocate(3)
        self.mempool = rf.MemoryPool(backend="host")
        self.closed = rf.Stream(backend="host")
        self.closed.close()
        self.key1, self.key2 = keys(1), keys(2)
        self.meta = self.stale = None
        self.next_id = 0

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
            for array in (self.key1, self.key2):
                array.buffer.root.close()
            self.mempool.free_all()

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        stats = rf.memory_stats()
        return {
            **cache_state(self.cache),
            "blocks": (self.blocks.ref_cnt.tolist(), self.blocks.free_ids().tolist()),
            "mempool": self.mempool.stats(),
            "registry": {k: stats[k] for k in ("live_buffers", "live_bytes", "num_allocs",
                                               "num_frees")},
        }

    def unchanged_by_failure(self, call, errors=EXPECTED) -> bool:
        """Run ``call``; if it raises, the state must be exactly as before. Whether it
        raised. No garbage collection runs in between: a collection of unrelated garbage
        would change the registry's counts."""
        gc.disable()
        try:
            before = self.snapshot()
            try:
                call()
            except errors:
                after = self.snapshot()
            else:
                return False
        finally:
            gc.enable()
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, f"a failed call changed {changed}: " + "; ".join(
            f"{k}: {str(before[k])[:120]} -> {str(after[k])[:120]}" for k in changed)
        AtomicMachine.calls += 1
        return True

    # --- valid operations (some may fail: strict mode raises CacheFullError) -------------
    @rule(tokens=st.integers(1, 40), value=st.floats(-4, 4, width=32))
    def add_and_prefill(self, tokens: int, value: float) -> None:
        seq_id, done = self.new_id(), []
        self.unchanged_by_failure(
            lambda: done.append(self.cache.add_sequence(seq_id, tokens)), CacheFullError)
        if done:
            kv = keys(tokens, value)
            for layer in range(CONFIG.num_layers):
                self.cache.write(layer, kv, kv, done[0].slot_mapping)
            kv.buffer.root.close()

    @rule(prompt=st.sampled_from(range(len(PROMPTS))), value=st.floats(-4, 4, width=32))
    def add_prompt_and_prefill(self, prompt: int, value: float) -> None:
        """A prompt given by its tokens: it may hit blocks held or cached-free."""
        seq_id, done = self.new_id(), []
        self.unchanged_by_failure(lambda: done.append(
            self.cache.add_sequence(seq_id, tokens=PROMPTS[prompt])), CacheFullError)
        if done:
            slots = done[0].slot_mapping[done[0].num_cached_tokens :]
            kv = keys(slots.size, value)
            for layer in range(CONFIG.num_layers):
                self.cache.write(layer, kv, kv, slots)
            kv.buffer.root.close()

    @rule()
    def fill_to_the_brim(self) -> None:
        """Whole blocks until none is free: the next append of these must preempt."""
        while self.cache.stats()["free_blocks"]:
            free = self.cache.stats()["free_blocks"]
            self.cache.add_sequence(self.new_id(), CONFIG.block_size * min(free, 2))

    @precondition(lambda self: len(self.cache) > 0)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.cache.seq_ids()), min_size=1,
                                 unique=True))
        self.unchanged_by_failure(lambda: self.cache.append(ids), CacheFullError)

    @precondition(lambda self: len(self.cache) > 0)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self.cache.fork(data.draw(st.sampled_from(self.cache.seq_ids())), self.new_id())

    @precondition(lambda self: len(self.cache) > 0)
    @rule(data=st.data(), finish=st.booleans())
    def finish_or_remove(self, data: st.DataObject, finish: bool) -> None:
        seq_id = data.draw(st.sampled_from(self.cache.seq_ids()))
        (self.cache.finish if finish else self.cache.remove)(seq_id)

    @precondition(lambda self: len(self.cache) > 0)
    @rule(value=st.floats(-4, 4, width=32))
    def plan_write_attend(self, value: float) -> None:
        ids = self.cache.seq_ids()
        if self.meta is not None:
            self.stale = self.meta
        self.meta = self.cache.batch(ids)
        kv = keys(len(ids), value)
        query = DeviceArray.from_numpy(np.full((len(ids), 2, 64), value, np.float32),
                                       backend="host")
        out = DeviceArray.empty(query.shape, np.float32, backend="host")
        for layer in range(CONFIG.num_layers):
            self.cache.write(layer, kv, kv, self.meta)
            self.cache.attention(layer, out, query, self.meta)
        for array in (kv, query, out):
            array.buffer.root.close()

    @precondition(lambda self: self.stale is not None)
    @rule()
    def attend_with_a_stale_plan(self) -> None:
        n = len(self.stale.seq_ids)
        query = DeviceArray.empty((n, 2, 64), np.float32, backend="host")
        assert self.unchanged_by_failure(
            lambda: self.cache.attention(0, query, query, self.stale))
        query.buffer.root.close()

    # --- bad operations --------------------------------------------------------------------
    @rule(name=st.sampled_from(sorted(BAD_CALLS)))
    def bad_call(self, name: str) -> None:
        assert self.unchanged_by_failure(lambda: BAD_CALLS[name](self)), f"{name} succeeded"

    @precondition(lambda self: len(self.cache) > 0)
    @rule(name=st.sampled_from(sorted(BAD_WITH_SEQUENCES)))
    def bad_call_on_sequences(self, name: str) -> None:
        assert self.unchanged_by_failure(lambda: BAD_WITH_SEQUENCES[name](self)), (
            f"{name} succeeded")

    @precondition(lambda self: len(self.cache) > 0)
    @rule(name=st.sampled_from(sorted(CLOCKED)))
    def clock_fails(self, name: str) -> None:
        def call() -> None:
            self.clock.fail_next = True
            try:
                CLOCKED[name](self)
            finally:
                self.clock.fail_next = False

        self.unchanged_by_failure(call)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()


def test_failed_calls_leave_every_state_exactly_as_before():
    AtomicMachine.calls = 0
    run_state_machine_as_test(AtomicMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None))
    assert AtomicMachine.calls >= 500, f"only {AtomicMachine.calls} failing calls compared"


@pytest.mark.parametrize("strict", [False, True])
def test_an_append_that_must_preempt_and_names_a_bad_stream_preempts_nobody(strict):
    with KvCache(CONFIG, backend="host", strict=strict) as cache:
        for seq_id in "abc":
            cache.add_sequence(seq_id, 24)  # 3 blocks each: 9 of 11 used
        cache.add_sequence("d", 16)  # 11 of 11
        before = cache.seq_ids(), cache.pool.free_ids().tolist()
        with pytest.raises(TypeError, match="stream must be a Stream or None, got 5"):
            cache.append(["d"], stream=5)  # needs a block: would preempt "a"
        assert (cache.seq_ids(), cache.pool.free_ids().tolist()) == before
        cache.check_invariants()


def test_a_closed_stream_is_refused_before_preempting():
    with KvCache(CONFIG, backend="host") as cache, rf.Stream(backend="host") as stream:
        for seq_id, n in (("a", 40), ("b", 40), ("c", 8)):
            cache.add_sequence(seq_id, n)
        stream.close()
        with pytest.raises(BufferClosedError):
            cache.append(["c"], stream=stream)
        assert cache.seq_ids() == ["a", "b", "c"]


# --- a device failure in the copy-on-write copy (the one step that can fail late) -------------
def _failing_copy(*args, **kwargs):
    raise DeviceError("cuLaunchKernel", 719, "CUDA_ERROR_LAUNCH_FAILED", "injected")


@pytest.mark.parametrize("preempting", [False, True, "evicting"],
                         ids=["free-blocks", "must-preempt", "evicting-cached-blocks"])
def test_a_failed_copy_on_write_copy_undoes_the_whole_append(monkeypatch, preempting):
    with KvCache(CONFIG, backend="host") as cache:
        cache.add_sequence("parent", 12)  # 2 blocks, the second shared by both forks
        cache.fork("parent", "a")
        cache.fork("parent", "b")
        if preempting is True:
            for seq_id in ("x", "y", "z"):
                cache.add_sequence(seq_id, 24)  # 9 more blocks: none left
        if preempting == "evicting":  # 9 cached-free blocks: the copies evict two of them
            cache.add_sequence("w", tokens=np.arange(72))
            cache.finish("w")
            preempting = False
            assert cache.stats()["cached_free_blocks"] == 9
        cache.batch(["parent"])  # the parent is the most recently used: "x" goes first
        assert cache.stats()["free_blocks"] == (0 if preempting else 9)
        before = cache_state(cache)
        monkeypatch.setattr(ops, "copy_blocks", _failing_copy)
        with pytest.raises(DeviceError, match="injected"):
            cache.append(["a", "b"])  # two private copies: two blocks allocated
        assert cache_state(cache) == before  # the free stack in its order too
        monkeypatch.undo()
        reservation = cache.append(["a", "b"])
        assert reservation.preempted == (["x"] if preempting else [])
        assert cache.stats()["cow_copies"] == 2
        cache.check_invariants()
