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
from rocmforge_raw.cache import (
    BlockPool,
    BlockRemoved,
    CacheConfig,
    CacheFullError,
    KvCache,
    Request,
    Scheduler,
    StepPlan,
)
from rocmforge_raw.errors import BufferClosedError, DeviceError, RocmforgeError
from rocmforge_raw.kernels import ops
from rocmforge_raw.kernels.ops import host_view
from rocmforge_raw.memory.array import DeviceArray

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


def unchanged_by(snapshot, call, errors) -> bool:
    """Run ``call``; if it raises one of ``errors``, ``snapshot()`` must read exactly as
    before it. Whether it raised. No garbage collection runs in between: a collection of
    unrelated garbage would change the registry's counts."""
    gc.disable()
    try:
        before = snapshot()
        try:
            call()
        except errors:
            after = snapshot()
        else:
            return False
    finally:
        gc.enable()
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"a failed call changed {changed}: " + "; ".join(
        f"{k}: {str(before[k])[:160]} -> {str(after[k])[:160]}" for k in changed)
    return True


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
        "plan": cache._steps.current, "slab": hashlib.sha1(slab_bytes(cache.slab)).digest(),
    }


def slab_bytes(slab: DeviceArray) -> np.ndarray:
    """The slab's contents: a view of host memory, a synchronizing copy of a GPU's."""
    return host_view(slab) if slab.backend.name == "host" else slab.to_numpy()


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


def registry_counts() -> dict:
    """The buffer registry's counts a failed call must leave as they were."""
    stats = rf.memory_stats()
    return {k: stats[k] for k in ("live_buffers", "live_bytes", "num_allocs", "num_frees")}


class NamingMachine(RuleBasedStateMachine):
    """A state machine that names new sequences and requests 1, 2, 3..."""

    next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id


class AtomicMachine(NamingMachine):
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

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
            for array in (self.key1, self.key2):
                array.buffer.root.close()
            self.mempool.free_all()

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            **cache_state(self.cache),
            "blocks": (self.blocks.ref_cnt.tolist(), self.blocks.free_ids().tolist()),
            "mempool": self.mempool.stats(), "registry": registry_counts(),
        }

    def unchanged_by_failure(self, call, errors=EXPECTED) -> bool:
        """Run ``call``; if it raises, the state must be exactly as before. Whether it
        raised."""
        if unchanged_by(self.snapshot, call, errors):
            AtomicMachine.calls += 1
            return True
        return False

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
        evicting = preempting == "evicting"
        if evicting:  # 9 cached-free blocks: the copies evict two of them
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
        if evicting:  # the copies' two blocks may have been written: they forget their
            _expect_forgotten(cache, before, 2)  # prefixes, and nothing else changed
        else:
            assert cache_state(cache) == before  # the free stack in its order too
        monkeypatch.undo()
        reservation = cache.append(["a", "b"])
        assert reservation.preempted == (["x"] if preempting else [])
        assert cache.stats()["cow_copies"] == 2
        cache.check_invariants()


def _expect_forgotten(cache: KvCache, before: dict, count: int) -> None:
    """The cache is as ``before`` but for the ``count`` least recently freed cached-free
    blocks, which forgot their prefixes (announced) and went to the free stack."""
    after, gone = cache_state(cache), before["cached"][:count]
    assert after["cached"] == before["cached"][count:]
    assert sorted(after["free"]) == sorted(before["free"])  # (cached-free ones included)
    assert after["index"] == [(h, b) for h, b in before["index"] if b not in gone]
    removed = [e for e in cache.events() if isinstance(e, BlockRemoved)]
    assert sorted(e.block_hash for e in removed) == sorted(
        h for h, b in before["index"] if b in gone)
    for key in set(before) - {"cached", "free", "index", "stats"}:
        assert after[key] == before[key], key


def test_a_copy_on_write_copy_that_wrote_before_failing_leaves_no_stale_prefix(monkeypatch):
    """A copy that ran (into reused cached-free blocks) and then raised: those blocks forget
    their prefixes, so a prompt repeating them is not served the copied bytes."""
    with KvCache(CONFIG, backend="host") as cache:
        cache.add_sequence("parent", 12)
        cache.fork("parent", "a")
        cache.fork("parent", "b")
        prompt = np.arange(72)
        cache.add_sequence("w", tokens=prompt)
        cache.finish("w")
        cache.batch(["parent"])
        copy = ops.copy_blocks

        def copy_then_fail(*args, **kwargs):
            copy(*args, **kwargs)
            _failing_copy()

        monkeypatch.setattr(ops, "copy_blocks", copy_then_fail)
        with pytest.raises(DeviceError, match="injected"):
            cache.append(["a", "b"])
        monkeypatch.undo()
        found = cache.add_sequence("again", tokens=prompt).num_cached_tokens
        assert found == 56  # of 71 before the append: its two overwritten blocks miss
        cache.check_invariants()


# --- the Scheduler over its cache, and a stream-ordered MemoryPool ---------------------------
class BadClock(Clock):
    """A Clock whose next read can also answer nonsense (``bad_next``: NaN, a string...)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad_next: object = None

    def __call__(self) -> float:
        if self.bad_next is not None:
            bad, self.bad_next = self.bad_next, None
            return bad  # type: ignore[return-value]
        return super().__call__()


def request_fields(request: Request, sched: Scheduler) -> tuple:
    return (request.request_id, request.prompt_tokens, request.max_new_tokens,
            request.generated, request.preemptions, request.overtaken,
            request.__dict__.get("_owner") is sched)


def scheduler_state(sched: Scheduler) -> dict:
    """The queue in order, the running requests, every request's fields and owner, the
    finished records with their times, the counters and the pending plan's requests."""
    return {
        "waiting": [request_fields(r, sched) for r in sched.waiting],
        "running": [(k, request_fields(r, sched)) for k, r in sched.running.items()],
        "queued": list(sched._queued), "finished": list(sched._finished._records.items()),
        "counters": (sched.num_preemptions, sched._step, sched._pending),
        "pending": [id(r) for r in sched._pending_ran],
    }


def pool_state(pool: rf.MemoryPool) -> dict:
    """Counters, each lane's cached blocks in order with its events, the blocks lent."""
    return {"stats": pool.stats(), "lanes": pool.lane_states(), "lent": pool.lent_blocks(),
            "closed": pool.closed}


SCHED_CONFIG = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, block_size=8,
                           num_blocks=10, dtype="float32")
N = 4096  # a pool size class


class SchedulerPoolMachine(NamingMachine):
    """A Scheduler over a small cache (clocks that fail or answer nonsense, sequences that
    leave the cache behind its back, requests mutated after submit) and a MemoryPool over a
    host backend whose streams can be held busy (blocks freed there wait for their events),
    with a stream it saw and that was closed since, and one of another backend object."""

    calls = 0

    @initialize(strict=st.booleans(), max_overtakes=st.integers(0, 3))
    def start(self, strict: bool, max_overtakes: int) -> None:
        from test_pool_streams import HeldHost

        self.cache_clock, self.clock = BadClock(), BadClock()
        self.cache = KvCache(SCHED_CONFIG, backend="host", strict=strict,
                             clock=self.cache_clock)
        self.sched = Scheduler(self.cache, max_running=4, max_waiting=5,
                               max_overtakes=max_overtakes, max_finished=4, clock=self.clock)
        self.plan = self.old_plan = None
        self.held = HeldHost()
        self.pool = rf.MemoryPool(backend=self.held, limit=16 * N)
        self.streams = [None, rf.Stream(backend=self.held), rf.Stream(backend=self.held)]
        self.closed = rf.Stream(backend=self.held)
        self.pool.free(self.pool.allocate(N, stream=self.closed))  # the pool knows it
        self.closed.close()
        self.foreign = rf.Stream(backend="host")  # another backend object
        self.buffers: list[rf.HipBuffer] = []

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            for buf in self.buffers:
                buf.close()
            for ptr in self.pool.lent_blocks():
                self.pool.free(ptr)
            for stream in self.streams[1:]:
                self.held.let_go(stream)
            self.pool.close()
            assert self.pool.stats()["reserved_bytes"] == 0
            self.cache.close()

    def snapshot(self) -> dict:
        return {**scheduler_state(self.sched), "cache": cache_state(self.cache),
                "pool": pool_state(self.pool), "registry": registry_counts()}

    def unchanged_by_failure(self, call, errors=(*EXPECTED, AttributeError)) -> bool:
        """As ``AtomicMachine.unchanged_by_failure``, over the scheduler, its cache, the
        pool and the registry; the clocks' faults are disarmed whatever happens."""

        def disarmed() -> None:
            try:
                call()
            finally:
                self.cache_clock.fail_next = self.clock.fail_next = False
                self.cache_clock.bad_next = self.clock.bad_next = None

        if unchanged_by(self.snapshot, disarmed, errors):
            SchedulerPoolMachine.calls += 1
            return True
        return False

    def held_ids(self) -> list:
        return [*self.sched.running, *self.sched._queued]

    # --- the scheduler: valid operations (a full queue or a strict cache may refuse) -------
    @rule(prompt=st.integers(1, 30), new=st.integers(1, 12))
    def submit(self, prompt: int, new: int) -> None:
        self.unchanged_by_failure(
            lambda: self.sched.submit(Request(self.new_id(), prompt, new)))

    @rule()
    def step(self) -> None:
        done = []
        self.unchanged_by_failure(lambda: done.append(self.sched.step()))
        if done:
            self.old_plan, self.plan = self.plan, done[0]

    @precondition(lambda self: self.plan is not None)
    @rule()
    def advance(self) -> None:
        if self.unchanged_by_failure(lambda: self.sched.advance(self.plan)):
            return  # advanced already, stale, or its sequence left the cache
        self.plan = None

    @precondition(lambda self: self.held_ids())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.held_ids()))
        record = self.sched.abort(request_id)
        assert record.reason == "aborted" and request_id not in self.cache
        assert request_id not in self.held_ids()

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish_outside_the_scheduler(self, data: st.DataObject) -> None:
        """The caller finishes a running request's sequence on the cache: every step then
        refuses, naming it, until it is aborted."""
        request_id = data.draw(st.sampled_from(sorted(self.sched.running)))
        if request_id in self.cache:
            self.cache.finish(request_id)
        assert self.unchanged_by_failure(self.sched.step)
        self.sched.abort(request_id)

    # --- the scheduler: bad calls -------------------------------------------------------------
    @rule(kind=st.sampled_from(["preemptions", "overtaken", "generated", "prompt_tokens",
                                "max_new_tokens"]),
          value=st.sampled_from([-4, -50, "x", 2.5, None, True]))
    def submit_malformed(self, kind: str, value: object) -> None:
        request = Request(self.new_id(), 3, 3)
        object.__setattr__(request, kind, value)
        assert self.unchanged_by_failure(lambda: self.sched.submit(request))

    @rule()
    def submit_too_large_or_twice(self) -> None:
        assert self.unchanged_by_failure(lambda: self.sched.submit(
            Request(self.new_id(), SCHED_CONFIG.num_slots, 2)))
        if self.held_ids():
            held = next(iter(self.sched._queued.values()), None) or next(
                iter(self.sched.running.values()))
            assert self.unchanged_by_failure(lambda: self.sched.submit(held))
            assert self.unchanged_by_failure(
                lambda: self.sched.submit(Request(held.request_id, 1, 1)))

    @precondition(lambda self: self.held_ids())
    @rule(data=st.data(), name=st.sampled_from(["prompt_tokens", "max_new_tokens",
                                                "generated", "overtaken", "request_id"]))
    def mutate_a_submitted_request(self, data: st.DataObject, name: str) -> None:
        request_id = data.draw(st.sampled_from(self.held_ids()))
        request = self.sched.running.get(request_id) or self.sched._queued[request_id]
        assert self.unchanged_by_failure(lambda: setattr(request, name, 10**9))
        assert self.unchanged_by_failure(lambda: delattr(request, name))

    @rule(which=st.sampled_from(["cache", "scheduler"]),
          fault=st.sampled_from(["raise", float("nan"), "noon", float("inf")]),
          call=st.sampled_from(["step", "advance", "abort"]))
    def clock_fails(self, which: str, fault: object, call: str) -> None:
        """Every operation reads its clocks before its first change: a step, an advance
        of a fresh plan (requests of one new token finish in it) or an abort."""
        clock = self.cache_clock if which == "cache" else self.clock

        def armed(operation):
            def run() -> None:
                if fault == "raise":
                    clock.fail_next = True
                else:
                    clock.bad_next = fault
                operation()
            return run

        if call == "step":
            self.unchanged_by_failure(armed(self.sched.step))
            return
        if call == "abort":
            if self.held_ids():
                self.unchanged_by_failure(armed(lambda: self.sched.abort(self.held_ids()[0])))
            return
        self.unchanged_by_failure(lambda: self.sched.submit(Request(self.new_id(), 2, 1)))
        plans = []
        if not self.unchanged_by_failure(lambda: plans.append(self.sched.step())):
            self.old_plan, self.plan = self.plan, plans[0]
            if not self.unchanged_by_failure(armed(lambda: self.sched.advance(self.plan))):
                self.plan = None

    @rule(bad=st.sampled_from(["twice", "stale", "foreign", "list", "abort unknown",
                               "abort unhashable", "submit a tuple"]))
    def bad_scheduler_call(self, bad: str) -> None:
        calls = {
            "foreign": lambda: self.sched.advance(StepPlan(step=self.sched._step)),
            "list": lambda: self.sched.advance([]),
            "abort unknown": lambda: self.sched.abort("nobody"),
            "abort unhashable": lambda: self.sched.abort(["x"]),
            "submit a tuple": lambda: self.sched.submit(("r", 3, 3)),
        }
        if self.old_plan is not None:
            calls["stale"] = lambda: self.sched.advance(self.old_plan)
        if self.plan is not None and self.sched._pending is None:
            calls["twice"] = lambda: self.sched.advance(self.plan)
        if bad in calls:
            assert self.unchanged_by_failure(calls[bad]), f"{bad} succeeded"

    # --- the pool: valid operations --------------------------------------------------------
    @rule(which=st.integers(0, 2), size=st.sampled_from([100, N, 3 * N]), raw=st.booleans())
    def pool_allocate(self, which: int, size: int, raw: bool) -> None:
        stream = self.streams[which]
        if raw:
            self.unchanged_by_failure(lambda: self.pool.allocate(size, stream=stream))
        else:
            self.unchanged_by_failure(lambda: self.buffers.append(
                rf.HipBuffer(size, pool=self.pool.on(stream))))

    @precondition(lambda self: self.pool.lent_blocks() or self.buffers)
    @rule(data=st.data(), which=st.integers(0, 3))
    def pool_free(self, data: st.DataObject, which: int) -> None:
        lent = sorted(self.pool.lent_blocks())
        if lent and (not self.buffers or data.draw(st.booleans())):
            ptr = data.draw(st.sampled_from(lent))
            if which == 3:
                self.pool.free(ptr)  # on the stream it was allocated for
            else:
                self.pool.free(ptr, stream=self.streams[which])
        else:
            self.buffers.pop(data.draw(st.integers(0, len(self.buffers) - 1))).close()

    @rule(which=st.integers(1, 2), hold=st.booleans())
    def pool_stream_busy(self, which: int, hold: bool) -> None:
        (self.held.hold if hold else self.held.let_go)(self.streams[which])

    @rule()
    def pool_free_all(self) -> None:
        self.pool.free_all()

    @precondition(lambda self: not self.pool.lent_blocks() and not self.buffers)
    @rule()
    def pool_close_and_replace(self) -> None:
        self.pool.close()
        self.pool.close()  # idempotent
        assert self.pool.closed and self.pool.stats()["reserved_bytes"] == 0
        for call in (lambda: self.pool.allocate(N), lambda: rf.HipBuffer(N, pool=self.pool),
                     lambda: self.pool.on(self.streams[1]),
                     lambda: rf.set_allocator(self.pool)):
            assert self.unchanged_by_failure(call)
        self.pool = rf.MemoryPool(backend=self.held, limit=16 * N)

    # --- the pool: bad calls -------------------------------------------------------------------
    @rule(bad=st.sampled_from(["free stream 5", "free a string", "free unknown",
                               "free other device", "free closed stream",
                               "free foreign stream", "allocate closed stream",
                               "allocate foreign stream", "allocate over the limit",
                               "allocate zero", "allocate float", "on 5", "on closed",
                               "close in use", "buffer on a closed stream"]))
    def bad_pool_call(self, bad: str) -> None:
        pool, lent = self.pool, sorted(self.pool.lent_blocks())
        ptr = lent[0] if lent else None
        calls = {
            "free a string": lambda: pool.free("abc"),
            "free unknown": lambda: pool.free(12345),
            "allocate closed stream": lambda: pool.allocate(N, stream=self.closed),
            "allocate foreign stream": lambda: pool.allocate(N, stream=self.foreign),
            "allocate over the limit": lambda: pool.allocate(17 * N, stream=self.streams[1]),
            "allocate zero": lambda: pool.allocate(0),
            "allocate float": lambda: pool.allocate(1.5),
            "on 5": lambda: pool.on(5),
            "on closed": lambda: pool.on(self.closed),
        }
        if ptr is not None:
            calls.update({
                "free stream 5": lambda: pool.free(ptr, stream=5),
                "free other device": lambda: pool.free(ptr, device=3),
                "free closed stream": lambda: pool.free(ptr, stream=self.closed),
                "free foreign stream": lambda: pool.free(ptr, stream=self.foreign)})
        if ptr is not None or self.buffers:
            calls["close in use"] = pool.close
        if bad in calls:
            assert self.unchanged_by_failure(calls[bad]), f"{bad} succeeded"

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            sched = self.sched
            assert not set(sched._queued) & set(sched.running)
            assert [r.request_id for r in sched.waiting] == list(sched._queued)
            assert all(r.__dict__.get("_owner") is sched
                       for r in [*sched.waiting, *sched.running.values()])
            stats = self.pool.stats()
            assert stats["reserved_bytes"] == stats["in_use_bytes"] + stats["cached_bytes"]


def test_failed_scheduler_and_pool_calls_leave_every_state_exactly_as_before():
    SchedulerPoolMachine.calls = 0
    run_state_machine_as_test(SchedulerPoolMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None))
    assert SchedulerPoolMachine.calls >= 500, (
        f"only {SchedulerPoolMachine.calls} failing calls compared")
