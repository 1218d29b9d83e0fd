"""Request lifecycle: continuous batching frees KV on completion; records stay bounded."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig, KvCache, QueueFullError, Request, Scheduler
from rocmforge_raw.errors import BufferClosedError, CacheFullError


def make(num_blocks=20, strict=False, **kw):
    cache = KvCache(CacheConfig(1, 1, 64, 8, num_blocks, "float32"), backend="host",
                    strict=strict)
    return cache, Scheduler(cache, **kw)


def snapshot(cache, sched):
    """Everything a failed call must leave as it was."""
    def fields(r):
        return (r.request_id, r.prompt_tokens, r.max_new_tokens, r.generated, r.preemptions,
                r.overtaken)
    return ([fields(r) for r in sched.waiting], [fields(r) for r in sched.running.values()],
            sched._pending, sched.num_preemptions, cache.stats(),
            {s: (cache.seq_len(s), cache.block_ids(s).tolist()) for s in cache.seq_ids()})


def test_finished_request_frees_its_kv_at_once():
    cache, sched = make()
    sched.submit(Request("r", prompt_tokens=10, max_new_tokens=3))
    for _ in range(3):
        plan = sched.step()
        cache.check_invariants()
        done = sched.advance(plan)
    assert [r.request_id for r in done] == ["r"]
    assert "r" not in cache and cache.stats()["used_blocks"] == 0
    assert sched.finished()["r"].generated == 3 and sched.idle
    cache.close()


def test_pressure_preempts_and_requeues_then_everything_finishes():
    cache, sched = make(num_blocks=7)  # 6 usable blocks of 8 tokens
    for i in range(6):
        sched.submit(Request(i, prompt_tokens=7, max_new_tokens=12))
    finished, preempted = set(), 0
    for _ in range(400):
        plan = sched.step()
        preempted += len(plan.preempted)
        cache.check_invariants()
        finished |= {r.request_id for r in sched.advance(plan)}
        if sched.idle:
            break
    assert finished == set(range(6)) and preempted > 0
    assert cache.stats()["used_blocks"] == 0 and cache.stats()["preemptions"] == preempted
    cache.close()


def test_finished_records_are_bounded():
    cache, sched = make(max_finished=3)
    for i in range(10):
        sched.submit(Request(i, 1, 1))
    while not sched.idle:
        sched.advance(sched.step())
    assert sorted(sched.finished()) == [7, 8, 9]
    cache.close()


def test_malformed_requests_are_refused_at_submit_naming_the_value():
    cache, sched = make()
    for request, error, text in [
        (Request("r", 2.5, 5), TypeError, "prompt_tokens must be an integer, got 2.5"),
        (Request("r", np.float64(3.0), 5), TypeError, "got np.float64.3.0."),
        (Request("r", 3, True), TypeError, "max_new_tokens must be an integer, got True"),
        (Request("r", 0, 5), ValueError, "prompt_tokens must be >= 1, got 0"),
        (Request("r", 3, 0), ValueError, "max_new_tokens must be >= 1, got 0"),
        (Request("r", 3, 2, generated=2), ValueError, "generated 2 of 2 new tokens"),
        (Request(["r"], 3, 2), TypeError, r"request_id must be hashable, got \['r'\] \(list"),
        (("r", 3, 2), TypeError, "submit takes a Request, not tuple"),
    ]:
        with pytest.raises(error, match=text):
            sched.submit(request)
    assert sched.idle  # nothing queued...
    assert sched.step().prefill == [] and len(cache) == 0  # ...and nothing vanishes later
    cache.close()


def test_numpy_counts_are_accepted_as_ints():
    cache, sched = make()
    request = Request("r", np.int64(3), np.int32(2))
    sched.submit(request)
    assert type(request.prompt_tokens) is int and type(request.max_new_tokens) is int
    assert [r.request_id for r, _ in sched.step().prefill] == ["r"]
    cache.close()


def test_a_request_larger_than_the_whole_cache_is_refused_at_submit():
    cache, sched = make(num_blocks=20)  # 19 usable blocks of 8 tokens: 152 tokens
    sched.submit(Request("fits", 149, 4))  # at most 149 + 3 = 152 tokens
    with pytest.raises(ValueError, match=r"'big': 150 prompt \+ 4 new tokens need 20 blocks "
                                         "of 8 tokens at their longest, but the whole cache "
                                         "has 19"):
        sched.submit(Request("big", 150, 4))
    assert [r.request_id for r in sched.waiting] == ["fits"]
    while not sched.idle:
        sched.advance(sched.step())
    assert sched.finished()["fits"].generated == 4
    cache.close()


def test_duplicate_ids_are_refused_queued_running_or_in_the_cache():
    cache, sched = make()
    sched.submit(Request("y", 1, 2))
    with pytest.raises(ValueError, match="'y' is already queued or running"):
        sched.submit(Request("y", 2, 2))
    sched.step()
    with pytest.raises(ValueError, match="'y' is already queued or running"):
        sched.submit(Request("y", 2, 2))
    cache.add_sequence("z", 4)
    with pytest.raises(ValueError, match="'z' has the id of a sequence the cache"):
        sched.submit(Request("z", 2, 2))
    assert [r.request_id for r in sched.waiting] == [] and list(sched.running) == ["y"]
    cache.close()


@pytest.mark.parametrize("kw, text", [
    ({"max_running": 0}, "max_running must be >= 1, got 0"),
    ({"max_running": 2.0}, "max_running must be an integer, got 2.0"),
    ({"max_waiting": 0}, "max_waiting must be >= 1, got 0"),
    ({"max_overtakes": -1}, "max_overtakes must be >= 0, got -1"),
    ({"max_finished": 0}, "max_finished must be >= 1, got 0"),
])
def test_bad_limits_are_refused(kw, text):
    cache = KvCache(CacheConfig(1, 1, 64, 8, 4, "float32"), backend="host")
    with pytest.raises((TypeError, ValueError), match=text):
        Scheduler(cache, **kw)
    with pytest.raises(TypeError, match="cache must be a KvCache, not str"):
        Scheduler("cache")
    cache.close()


def test_a_full_queue_refuses_submit_and_try_submit_returns_false():
    cache, sched = make(max_waiting=2)
    sched.submit(Request("a", 1, 1))
    assert sched.try_submit(Request("b", 1, 1)) is True
    with pytest.raises(QueueFullError, match="'c' refused: 2 requests are waiting"):
        sched.submit(Request("c", 1, 1))
    assert sched.try_submit(Request("c", 1, 1)) is False
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    sched.step()  # both admitted: room again
    assert sched.try_submit(Request("c", 1, 1)) is True
    cache.close()


def blocked_head(max_overtakes):
    """A cache of 10 usable blocks with 'big' running on 6 of them, then 'head' (5 blocks:
    does not fit) and three 1-block requests behind it."""
    cache, sched = make(num_blocks=11, max_overtakes=max_overtakes)
    sched.submit(Request("big", 48, 10))
    sched.advance(sched.step())
    sched.submit(Request("head", 40, 1))
    for i in range(3):
        sched.submit(Request(f"s{i}", 8, 1))
    return cache, sched


def test_a_blocked_head_is_overtaken_at_most_max_overtakes_times():
    cache, sched = blocked_head(max_overtakes=2)
    plan = sched.step()
    assert [r.request_id for r, _ in plan.prefill] == ["s0", "s1"]
    assert sched.waiting[0].request_id == "head" and sched.waiting[0].overtaken == 2
    sched.advance(plan)
    order = []
    while not sched.idle:
        plan = sched.step()
        order += [r.request_id for r, _ in plan.prefill]
        sched.advance(plan)
    assert order == ["head", "s2"] and sched.finished()["head"].generated == 1
    cache.close()


def test_max_overtakes_zero_is_first_come_first_served():
    cache, sched = blocked_head(max_overtakes=0)
    order = []
    while not sched.idle:
        plan = sched.step()
        order += [r.request_id for r, _ in plan.prefill]
        sched.advance(plan)
    assert order == ["head", "s0", "s1", "s2"]
    cache.close()


def test_a_stream_of_small_requests_cannot_starve_a_large_one():
    # 10 usable blocks; 'large' needs all of them; small requests (1 block, 3 steps) arrive
    # two per step, so some always run: without the bound 'large' would wait forever
    cache, sched = make(num_blocks=11, max_overtakes=4)
    sched.submit(Request("small-0", 8, 3))
    sched.advance(sched.step())
    sched.submit(Request("large", 72, 9))
    admitted_at = None
    for step in range(1, 60):
        for i in range(2):
            sched.submit(Request(f"small-{step}-{i}", 8, 3))
        plan = sched.step()
        if any(r.request_id == "large" for r, _ in plan.prefill):
            admitted_at = step
            break
        sched.advance(plan)
    assert admitted_at is not None and admitted_at <= 6
    assert sched.running["large"].overtaken == 4
    cache.close()


def test_advance_refuses_a_plan_twice_a_stale_plan_and_a_foreign_one():
    cache, sched = make()
    other_cache, other = make()
    sched.submit(Request("r", 4, 5))
    plan = sched.step()
    sched.advance(plan)
    before = snapshot(cache, sched)
    with pytest.raises(ValueError, match="plan of step 1 was advanced already"):
        sched.advance(plan)
    assert snapshot(cache, sched) == before
    stale = sched.step()
    foreign = other.step()
    for bad, text in [
        (plan, "plan of step 1 is stale: step 2 came after it"),
        (foreign, "plan must come from this scheduler's step"),
        ([], "plan must come from this scheduler's step.., not list"),
    ]:
        before = snapshot(cache, sched)
        with pytest.raises(ValueError, match=text):
            sched.advance(bad)
        assert snapshot(cache, sched) == before
    current = sched.step()
    with pytest.raises(ValueError, match="plan of step 2 is stale: step 3 came after it"):
        sched.advance(stale)
    sched.advance(current)
    assert sched.running["r"].generated == 2  # one token per advanced plan
    cache.close()
    other_cache.close()


def test_a_failed_step_changes_nothing():
    cache, sched = make(num_blocks=3, strict=True)  # 2 usable blocks of 8 tokens
    sched.submit(Request("a", 8, 4))
    sched.submit(Request("b", 8, 4))
    sched.advance(sched.step())  # both hold one full block: the next token needs two more
    sched.submit(Request("c", 1, 1))
    before = snapshot(cache, sched)
    with pytest.raises(CacheFullError, match="strict"):
        sched.step()
    assert snapshot(cache, sched) == before
    cache.close()
    with pytest.raises(BufferClosedError):
        sched.step()
    assert [r.request_id for r in sched.waiting] == ["c"] and sorted(sched.running) == ["a", "b"]


def test_a_step_refuses_a_waiting_id_the_cache_took_meanwhile():
    cache, sched = make()
    sched.submit(Request("a", 4, 2))
    sched.advance(sched.step())
    sched.submit(Request("x", 4, 2))
    cache.add_sequence("x", 3)
    before = snapshot(cache, sched)
    with pytest.raises(ValueError, match="'x' is waiting but the cache already holds"):
        sched.step()
    assert snapshot(cache, sched) == before
    cache.close()


# --- abort, ownership and clocks ------------------------------------------------------------
def test_abort_drops_a_request_in_any_state_frees_its_kv_once_and_records_why():
    cache, sched = make(num_blocks=3)  # 2 usable blocks of 8 tokens
    for name in ("a", "b", "w"):
        sched.submit(Request(name, 8, 4))
    sched.advance(sched.step())  # a and b run, w waits
    plan = sched.step()  # both need a second block: a is preempted (waiting again)
    assert [r.request_id for r in plan.preempted] == ["a"] and "a" in sched._queued
    # the preempted request is at the front of the queue, and so in the index by id
    assert [r.request_id for r in sched.waiting] == list(sched._queued) == ["a", "w"]
    used = cache.stats()["used_blocks"]
    records = {}
    for name in ("b", "a", "w"):  # running, preempted, never admitted
        records[name] = sched.abort(name)
        assert name not in sched.running and name not in sched._queued and name not in cache
        with pytest.raises(KeyError, match=f"'{name}' is neither waiting nor running"):
            sched.abort(name)  # once
    assert used == 2 and cache.stats()["used_blocks"] == 0 and sched.idle
    assert {k: (r.reason, r.generated, r.preemptions) for k, r in records.items()} == {
        "b": ("aborted", 1, 0), "a": ("aborted", 1, 1), "w": ("aborted", 0, 0)}
    assert sched.finished() == records
    assert sched.advance(plan) == []  # the aborted requests' plan counts nothing
    cache.check_invariants()
    cache.close()


def test_a_request_finished_outside_the_scheduler_is_named_then_aborted():
    cache, sched = make()
    sched.submit(Request("r", 4, 5))
    sched.submit(Request("s", 4, 5))
    sched.advance(sched.step())
    cache.finish("r")  # behind the scheduler's back
    before = snapshot(cache, sched)
    for _ in range(2):  # every step refuses, changing nothing, until it is aborted
        with pytest.raises(KeyError, match=r"'r' is running but its sequence left the cache "
                                           r"outside the scheduler: abort\('r'\) drops it"):
            sched.step()
        assert snapshot(cache, sched) == before
    assert sched.abort("r").reason == "aborted"
    assert [r.request_id for r in sched.step().decode] == ["s"]
    cache.close()


def test_a_submitted_request_is_read_only_until_it_finishes_or_is_aborted():
    cache, sched = make()
    request = Request("r", 4, 2)
    sched.submit(request)
    for name, value in (("prompt_tokens", 10**9), ("generated", 1), ("overtaken", -50),
                        ("request_id", "other")):
        with pytest.raises(AttributeError, match=f"request 'r' belongs to a Scheduler .* its "
                                                 f"{name} cannot change"):
            setattr(request, name, value)
    with pytest.raises(ValueError, match="'r' was submitted already"):
        sched.submit(request)
    twin = copy.copy(request)  # a copy is not submitted: it may change and be submitted
    twin.request_id = "twin"
    sched.submit(twin)
    plan = sched.step()
    assert [r.request_id for r, _ in plan.prefill] == ["r", "twin"]
    sched.advance(plan)
    sched.abort("twin")
    twin.max_new_tokens = 9  # its own again
    while not sched.idle:
        sched.advance(sched.step())
    assert request.generated == 2 and sched.finished()["r"].reason == "done"
    request.generated = 0  # finished: the caller's again
    cache.close()


@pytest.mark.parametrize("field, value, error", [
    ("preemptions", -4, ValueError), ("overtaken", -50, ValueError),
    ("overtaken", "x", TypeError), ("generated", 1.0, TypeError),
])
def test_every_count_of_a_request_is_checked_at_submit(field, value, error):
    cache, sched = make()
    with pytest.raises(error, match=f"request 'r': {field} must be"):
        sched.submit(Request("r", 3, 3, **{field: value}))
    assert sched.idle
    cache.close()


@pytest.mark.parametrize("kw, error, text", [
    ({"clock": 5}, TypeError, "clock must be a callable returning seconds, got 5"),
    ({"finished_ttl_s": -5}, ValueError, "finished_ttl_s must be >= 0.0, got -5"),
    ({"finished_ttl_s": float("nan")}, ValueError, "finished_ttl_s must be a finite number"),
    ({"finished_ttl_s": "x"}, TypeError, "finished_ttl_s must be a number, got 'x'"),
])
def test_bad_clocks_and_ages_are_refused_at_construction(kw, error, text):
    cache = KvCache(CacheConfig(1, 1, 64, 8, 4, "float32"), backend="host")
    with pytest.raises(error, match=text):
        Scheduler(cache, **kw)
    cache.close()


@pytest.mark.parametrize("answer", [lambda: "noon", lambda: float("nan"), lambda: 1 / 0])
def test_an_advance_whose_clock_fails_changes_nothing(answer):
    cache = KvCache(CacheConfig(1, 1, 64, 8, 20, "float32"), backend="host")
    sched = Scheduler(cache, clock=answer)
    sched.submit(Request("r", 4, 1))
    plan = sched.step()
    before = snapshot(cache, sched)
    with pytest.raises((TypeError, ValueError, ZeroDivisionError)):
        sched.advance(plan)
    assert snapshot(cache, sched) == before and "r" in cache and sched._pending == plan.step
    sched.clock = lambda: 1.0
    assert [r.request_id for r in sched.advance(plan)] == ["r"]
    cache.close()


def test_a_submitted_prompt_is_the_schedulers_own_copy():
    """Changing the caller's array after submit changes nothing the scheduler admits."""
    cache, sched = make(num_blocks=32)
    buf = np.arange(40)
    sched.submit(Request("a", tokens=buf, max_new_tokens=3))
    buf[:] = 7
    plan = sched.step()
    ((request, _),) = plan.prefill
    np.testing.assert_array_equal(request.tokens, np.arange(40))
    assert not request.tokens.flags.writeable
    assert cache.cached_tokens(np.arange(40)) == 39  # its blocks: named by the submitted ids
    assert cache.cached_tokens(np.full(40, 7)) == 0


@pytest.mark.parametrize("ids", [[-5], np.array([2**63 + 1], np.uint64), [-2]])
def test_advance_refuses_ids_that_no_later_step_could_take(ids):
    """An id below -1 (unknown) or past int64 is refused, naming it, and the plan stays the
    one to advance: the request is not wedged."""
    cache, sched = make(num_blocks=32)
    sched.submit(Request("a", tokens=np.arange(20), max_new_tokens=3))
    plan = sched.step()
    before = snapshot(cache, sched)
    with pytest.raises(ValueError, match="token_ids"):
        sched.advance(plan, ids)
    assert snapshot(cache, sched) == before
    sched.advance(plan, [5])
    assert [r.request_id for r in sched.step().decode] == ["a"]


def _run_to_the_end(cache, sched, steps=400):
    for _ in range(steps):
        plan = sched.step()
        sched.advance(plan, np.zeros(len(plan.generating), np.int64))
        if sched.idle:
            break
    cache.check_invariants()
    return {k: v.generated for k, v in sched.finished().items()}


@pytest.mark.parametrize("outside", ["swap_in", "remove"])
def test_a_swapped_out_request_whose_sequence_was_moved_outside_still_finishes(outside):
    """A request the cache swapped out, then swapped back in (it resumes as it is) or
    removed (it computes its context again) by a call outside the scheduler, is admitted
    again and finishes: never left waiting for a swap-in that cannot come."""
    cache = KvCache(CacheConfig(1, 1, 64, 16, 8, "float32", host_blocks=16), backend="host")
    sched = Scheduler(cache, max_running=4)
    sched.submit(Request("a", tokens=np.arange(40), max_new_tokens=60))
    sched.submit(Request("b", tokens=np.arange(100, 140), max_new_tokens=60))
    moved = None
    for _ in range(400):
        plan = sched.step()
        sched.advance(plan, np.zeros(len(plan.generating), np.int64))
        swapped = cache.swapped_ids()
        if moved is None and swapped and (outside == "remove" or cache.can_swap_in(swapped)):
            moved = swapped[0]
            getattr(cache, outside)(moved if outside == "remove" else [moved])
            waiting = next(r for r in sched.waiting if r.request_id == moved)
            assert waiting.swapped  # as the scheduler left it
        if sched.idle:
            break
    assert moved is not None
    cache.check_invariants()
    assert {k: v.generated for k, v in sched.finished().items()} == {"a": 60, "b": 60}
    cache.close()


def test_a_running_request_swapped_out_outside_waits_to_be_swapped_back_in():
    cache = KvCache(CacheConfig(1, 1, 64, 16, 16, "float32", host_blocks=16), backend="host")
    sched = Scheduler(cache, max_running=4)
    sched.submit(Request("a", tokens=np.arange(40), max_new_tokens=20))
    sched.advance(sched.step(), [1])
    cache.swap_out(["a"])
    plan = sched.step()  # a swap-in, not an error from the cache about a swapped sequence
    assert [r.request_id for r in plan.resumed] == ["a"] and not plan.seq_ids
    sched.advance(plan, [])
    assert _run_to_the_end(cache, sched) == {"a": 20}
    cache.close()
