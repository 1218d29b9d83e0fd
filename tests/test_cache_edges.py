"""Edges of the cache and the scheduler that mutation testing (``make mutate``) found
unguarded: each test pins a behaviour that a surviving mutant changed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, FinishedRequest, KvCache, Request, Scheduler
from rocmforge_raw.memory.array import DeviceArray


class FakeClock:
    def __init__(self, now=50.0):
        self.now = now

    def __call__(self):
        return self.now


def small_cache(num_blocks=9, **kw):
    return KvCache(CacheConfig(1, 1, 64, 8, num_blocks, "float32", num_q_heads=2),
                   backend="host", **kw)


# --- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.dtype("float32"), ml_dtypes.bfloat16,
                                   "bfloat16"])
def test_dtypes_are_accepted_as_names_types_or_dtypes(dtype):
    assert CacheConfig(1, 1, 64, 8, 2, dtype).dtype == np.dtype(dtype)


def test_counts_are_normalised_to_int_and_errors_name_them():
    config = CacheConfig(np.int64(1), 1, 64, 8, 2, num_q_heads=np.int32(4))
    assert type(config.num_layers) is int and type(config.num_q_heads) is int
    with pytest.raises(TypeError, match=r"num_layers must be an integer, got 1.0 \(float\)"):
        CacheConfig(1.0, 1, 64, 8, 2)
    with pytest.raises(ValueError, match="num_q_heads must be >= 1, got 0"):
        CacheConfig(1, 1, 64, 8, 2, num_q_heads=0)


# --- cache -------------------------------------------------------------------------------------
def test_stats_count_tokens_slots_and_fragmentation():
    with small_cache() as cache:
        cache.add_sequence("a", 3)
        cache.add_sequence("b", 9)
        stats = cache.stats()
        assert stats["tokens"] == 12 and stats["used_blocks"] == 3
        assert stats["fragmentation"] == (3 * 8 - 12) / (3 * 8)


def test_a_forked_child_has_no_reserved_slot_until_it_appends():
    with small_cache() as cache:
        cache.add_sequence("p", 5)
        cache.fork("p", "c")
        assert cache.batch(["c"]).slot_mapping.tolist() == [-1]
        with pytest.raises(ValueError, match="sequence 'p' already exists"):
            cache.fork("c", "p")


def test_batch_takes_any_iterable_refuses_repeats_and_pads_to_one_block():
    with small_cache() as cache:
        cache.add_sequence("a", 3)
        cache.add_sequence("b", 4)
        assert cache.batch(iter(["b", "a"])).seq_lens.tolist() == [4, 3]
        assert cache.batch(("a",)).block_tables.shape == (1, 1)
        assert cache.batch([]).block_tables.shape == (0, 1)
        with pytest.raises(ValueError, match="batch lists sequence 'a' twice"):
            cache.batch(["a", "a"])


def test_plans_carry_the_stream_they_run_on():
    cache_stream, other = rf.Stream(backend="host"), rf.Stream(backend="host")
    with small_cache(stream=cache_stream) as cache:
        cache.add_sequence("a", 3)
        meta = cache.batch(["a"])
        assert meta.stream is cache_stream
        c = cache.config
        key = DeviceArray.from_numpy(np.ones((1, 1, c.head_dim), np.float32), backend="host")
        query = DeviceArray.from_numpy(np.ones((1, 2, c.head_dim), np.float32), backend="host")
        out = DeviceArray.empty((1, 2, c.head_dim), np.float32, backend="host")
        cache.write(0, key, key, meta)  # no stream named: the plan's
        cache.attention(0, out, query, meta)
        for call in (lambda: cache.write(0, key, key, meta, stream=other),
                     lambda: cache.attention(0, out, query, meta, stream=other)):
            with pytest.raises(ValueError, match="stream differs from the one the batch"):
                call()
        with pytest.raises(TypeError, match=r"metadata from this cache's batch\(\), got 'plan'"):
            cache.attention(0, out, query, "plan")
        assert cache.batch(["a"], stream=other).stream is other
        for array in (key, query, out):
            array.buffer.close()


# --- scheduler ---------------------------------------------------------------------------------
def make(num_blocks=20, **kw):
    cache = small_cache(num_blocks=num_blocks, clock=kw.pop("cache_clock", FakeClock()))
    return cache, Scheduler(cache, **kw)


def test_a_finished_record_keeps_its_request_s_numbers():
    clock = FakeClock(7.0)
    cache, sched = make(clock=clock)
    sched.submit(Request("r", 10, 2))
    sched.advance(sched.step())
    clock.now = 9.0
    sched.advance(sched.step())
    assert sched.finished() == {"r": FinishedRequest("r", 9.0, 10, 2, 0)}
    cache.close()


def test_decode_slots_are_the_slots_the_cache_reserved():
    cache, sched = make()
    sched.submit(Request("r", 10, 3))
    prefill = sched.step()
    sched.advance(prefill)
    plan = sched.step()
    assert plan.decode_slots.tolist() == [prefill.prefill[0][1][-1] + 1]
    assert cache.batch(["r"]).slot_mapping.tolist() == plan.decode_slots.tolist()
    cache.close()


def test_max_running_caps_the_admissions():
    cache, sched = make(max_running=1)
    for name in "ab":
        sched.submit(Request(name, 4, 2))
    assert [r.request_id for r, _ in sched.step().prefill] == ["a"]
    cache.close()


def test_a_small_request_behind_a_blocked_one_is_admitted_when_it_fits():
    cache, sched = make(num_blocks=4)  # 3 usable blocks
    sched.submit(Request("big", 15, 2))  # two blocks, its next token too
    sched.advance(sched.step())
    sched.submit(Request("head", 16, 1))  # two blocks: one is free
    sched.submit(Request("small", 5, 1))
    assert [r.request_id for r, _ in sched.step().prefill] == ["small"]
    cache.close()


def test_overtaken_counts_only_the_admissions_after_a_request():
    cache, sched = make(num_blocks=11, max_overtakes=1)
    sched.submit(Request("big", 48, 10))  # six of ten blocks
    sched.advance(sched.step())
    for name, prompt in [("s0", 8), ("head", 40), ("s1", 8), ("s2", 8)]:
        sched.submit(Request(name, prompt, 1))
    assert [r.request_id for r, _ in sched.step().prefill] == ["s0", "s1"]
    assert {r.request_id: r.overtaken for r in sched.waiting} == {"head": 1, "s2": 0}
    cache.close()


def test_preempted_requests_are_counted_requeued_and_still_known():
    cache, sched = make(num_blocks=3)  # 2 usable blocks
    sched.submit(Request("a", 8, 4))
    sched.submit(Request("b", 8, 4))
    sched.advance(sched.step())
    plan = sched.step()  # both need a second block; one is preempted
    assert [r.request_id for r in plan.preempted] == ["a"]
    assert sched.num_preemptions == 1 and plan.preempted[0].preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["a"]
    with pytest.raises(ValueError, match="'a' is already queued or running"):
        sched.submit(Request("a", 1, 1))
    cache.close()


def test_a_foreign_sequence_preempted_by_a_step_is_no_concern_of_the_scheduler():
    cache, sched = make(num_blocks=3)
    cache.add_sequence("foreign", 8)  # least recently used
    sched.submit(Request("r", 8, 3))
    sched.advance(sched.step())
    plan = sched.step()  # r needs a block: the foreign sequence goes
    assert plan.preempted == [] and "foreign" not in cache and list(sched.running) == ["r"]
    cache.close()


def test_requests_preempted_by_an_admission_go_back_to_the_queue():
    cache, sched = make(num_blocks=3)
    sched.submit(Request("old", 8, 4))
    sched.advance(sched.step())
    cache.can_allocate = lambda n: True  # another thread took the room meanwhile
    sched.submit(Request("new", 16, 1))
    plan = sched.step()
    assert [r.request_id for r in plan.preempted] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["old"] and "new" in sched.running
    cache.close()


def test_advance_refuses_when_a_finishing_sequence_left_the_cache():
    cache, sched = make()
    sched.submit(Request("r", 4, 1))
    plan = sched.step()
    cache.remove("r")
    with pytest.raises(KeyError, match="'r' is running but its sequence left the cache"):
        sched.advance(plan)
    assert list(sched.running) == ["r"] and sched.running["r"].generated == 0
    cache.close()


def test_a_negative_generated_count_is_refused():
    cache, sched = make()
    with pytest.raises(ValueError, match="'r': generated must be >= 0, got -1"):
        sched.submit(Request("r", 3, 2, generated=-1))
    cache.close()


# --- rows and blocks ---------------------------------------------------------------------------
def test_freed_rows_are_reused_and_the_row_arrays_stay_bounded():
    """1,000 sequences added and finished or removed, up to ten at once: the rows keep their
    first 16 and every one is free again at the end (a row not given back grew them to
    1,024)."""
    with small_cache(num_blocks=40) as cache:
        rows = cache._rows
        for i in range(1000):
            cache.add_sequence(i, 1 + i % 9)
            if i >= 9:
                (cache.finish if i % 2 else cache.remove)(i - 9)
        for i in range(991, 1000):
            cache.remove(i)
        assert rows.lens.size == rows.tables.shape[0] == rows.recency.size == 16
        assert sorted(rows.free) == list(range(16)) and not rows.index
        cache.check_invariants()


def test_many_long_sequences_grow_the_rows_and_tables_and_stay_int32():
    with small_cache(num_blocks=400) as cache:  # rows start at 16, tables 8 blocks wide
        for i in range(40):
            cache.add_sequence(i, 1 + i)
        cache.add_sequence("long", 64)  # exactly 8 blocks: the next token widens the table
        cache.append(["long"])
        cache.check_invariants()
        assert [cache.seq_len(i) for i in range(40)] == list(range(1, 41))
        meta = cache.batch([*range(40), "long"])
        assert meta.block_tables.dtype == np.int32 and meta.block_tables.shape == (41, 9)
        assert meta.seq_lens.tolist() == [*range(1, 41), 65]


def test_the_row_memo_never_answers_for_a_changed_index():
    from rocmforge_raw.cache.blocks.rows import SequenceRows

    rows = SequenceRows()
    rows.add("a", 1)
    rows.add("x", 1)
    x = rows.rows(["x"]).tolist()
    rows.release("a")
    assert rows.rows(["x"]).tolist() == x
    rows.release("x")
    with pytest.raises(KeyError, match="no sequence 'x'"):
        rows.rows(["x"])
    rows.add("y", 1)
    with pytest.raises(KeyError, match="no sequence 'x'"):
        rows.rows(["x"])


def test_appending_to_a_child_whose_shared_last_block_is_full_copies_nothing():
    with small_cache() as cache:
        cache.add_sequence("p", 16)  # two full blocks
        cache.fork("p", "c")
        used = cache.stats()["used_blocks"]
        cache.append(["c"])
        assert cache.stats()["cow_copies"] == 0 and cache.stats()["used_blocks"] == used + 1


def test_when_every_holder_of_a_shared_block_appends_one_keeps_it():
    with small_cache() as cache:
        cache.add_sequence("p", 5)
        cache.fork("p", "c")
        cache.append(["p", "c"])
        assert cache.stats()["cow_copies"] == 1 and cache.stats()["used_blocks"] == 2
        cache.fork("p", "d")
        cache.append(["d"])
        cache.append(["c"])
        assert cache.stats()["cow_copies"] == 2  # counted across appends
        cache.check_invariants()


def test_block_pool_bounds_and_dtypes():
    from rocmforge_raw.cache import BlockPool

    pool = BlockPool(2)  # the smallest: one usable block
    assert pool.num_free == 1 and pool.ref_cnt.dtype == np.int32
    assert pool.free_ids().dtype == np.int32 and pool.free(np.array([], np.int64)) == 0
    with pytest.raises(ValueError, match=r"at least 2 blocks \(one is null\), got 1"):
        BlockPool(1)
    with pytest.raises(ValueError, match="cannot allocate -1 blocks"):
        pool.allocate(-1)
    ids = pool.allocate(1)
    assert ids.dtype == np.int32 and pool.free(ids) == 1
    assert pool.free_ids().dtype == np.int32


def test_cache_errors_name_the_bad_values():
    with small_cache(num_blocks=3) as cache:
        cache.add_sequence("a", 3)
        for call, error, text in [
            (lambda: cache.add_sequence("b", True), TypeError, r"got True \(bool\)"),
            (lambda: cache.add_sequence("b", 1.5), TypeError, "got 1.5"),
            (lambda: cache.add_sequence("b", 0), ValueError, ">= 1, got 0"),
            (lambda: cache.add_sequence("a", 1), ValueError, "sequence 'a' already exists"),
            (lambda: cache.add_sequence("b", 17), rf.errors.CacheFullError,
             "needs 3 blocks but 1 are free: a 17-token prompt exceeds the whole cache"),
            (lambda: cache.append("ab"), TypeError, r"got 'ab' \(str\)"),
            (lambda: cache.append(["a", "a"]), ValueError, "append lists sequence 'a' twice"),
            (lambda: cache.append([["a"]]), TypeError, r"sequence id \['a'\] is not hashable"),
            (lambda: cache.append(["a"], stream=5), TypeError, "Stream or None, got 5"),
            (lambda: KvCache(cache.config, backend="host", stream=5), TypeError,
             "Stream or None, got 5"),
        ]:
            with pytest.raises(error, match=text):
                call()
        cache.check_invariants()


def test_an_append_needing_exactly_the_free_blocks_preempts_nothing():
    with small_cache(num_blocks=3) as cache:  # 2 usable blocks
        cache.add_sequence("a", 8)
        assert cache.append(iter(["a"])).preempted == [] and cache.seq_len("a") == 9


def test_stats_report_usage_and_the_peak():
    with small_cache(num_blocks=5) as cache:  # 4 usable blocks
        cache.add_sequence("a", 20)
        cache.remove("a")
        cache.add_sequence("b", 1)
        stats = cache.stats()
        assert stats["num_blocks"] == 4 and stats["usage"] == 0.25
        assert stats["peak_used_blocks"] == 3


def test_preemptions_of_one_request_add_up():
    cache, sched = make(num_blocks=5)  # 4 usable blocks, four requests of up to 3 each
    for i in range(4):
        sched.submit(Request(i, 7, 17))
    seen, preempted = {}, 0
    while not sched.idle:
        plan = sched.step()
        seen.update({r.request_id: r for r, _ in plan.prefill})
        preempted += len(plan.preempted)
        sched.advance(plan)
    assert sorted(r.preemptions for r in seen.values()) == [0, 1, 1, 2]
    assert sched.num_preemptions == preempted == 4
    cache.close()


def test_for_memory_fits_the_budget_in_the_config_s_dtype():
    block = CacheConfig(2, 2, 64, 8, 2, "float32").block_bytes
    config = CacheConfig.for_memory(2, 2, 64, 8, "float32", num_q_heads=4,
                                    budget_bytes=10 * block + block // 2)
    assert (config.num_blocks, config.dtype, config.num_q_heads) == (10, np.float32, 4)
    for kw, text in [({}, "give exactly one of budget_bytes and fraction"),
                     ({"budget_bytes": 1, "fraction": 0.5}, "give exactly one"),
                     ({"fraction": 0}, r"fraction must be in \(0, 1\], got 0"),
                     ({"budget_bytes": block}, f"a budget of {block} bytes holds 1 blocks of "
                                               f"{block} bytes; at least 2 are needed")]:
        with pytest.raises(ValueError, match=text):
            CacheConfig.for_memory(2, 2, 64, 8, "float32", **kw)


def test_layers_are_checked_and_numpy_integers_work():
    with small_cache() as cache:
        assert cache.k_cache(np.int64(0)).ptr == cache.k_cache(0).ptr
        assert cache.v_cache(0).ptr - cache.k_cache(0).ptr == cache.k_cache(0).nbytes
        with pytest.raises(TypeError, match=r"layer must be an integer, got 1\.5"):
            cache.k_cache(1.5)
        with pytest.raises(TypeError, match="layer must be an integer, got True"):
            cache.k_cache(True)
        with pytest.raises(IndexError, match=r"layer 1 outside \[0, 1\)"):
            cache.k_cache(1)
        with pytest.raises(IndexError, match=r"layer -1 outside"):
            cache.k_cache(-1)
