"""The Scheduler's abort and multi-turn paths: behaviours the mutation run of issue 44 (group
B) found unpinned. Each test names what a user would see change."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig, KvCache, Request, Scheduler


class Clock:
    """A clock that counts its reads and answers ``now``."""

    def __init__(self, now: float = 42.0) -> None:
        self.now, self.reads = now, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def make(num_blocks=20, cache_clock=None, **kw):
    extra = {} if cache_clock is None else {"clock": cache_clock}
    cache = KvCache(CacheConfig(1, 1, 64, 8, num_blocks, "float32"), backend="host", **extra)
    return cache, Scheduler(cache, **kw)


# --- abort -----------------------------------------------------------------------------------
def test_abort_refuses_an_id_that_cannot_be_one_naming_it():
    cache, sched = make()
    with cache, pytest.raises(TypeError, match=re.escape("request_id must be hashable, got [1]")):
        sched.abort([1])


def test_aborting_a_waiting_request_keeps_the_others_waiting_in_order():
    cache, sched = make()
    with cache:
        for name in "abc":
            sched.submit(Request(name, prompt_tokens=4, max_new_tokens=2))
        sched.abort("b")
        assert [r.request_id for r in sched.waiting] == ["a", "c"]


def test_an_abort_records_its_time_and_counts_reading_the_clock_once():
    clock = Clock()
    cache, sched = make(clock=clock)
    with cache:
        sched.submit(Request("r", prompt_tokens=10, max_new_tokens=4))
        sched.advance(sched.step())
        reads = clock.reads
        record = sched.abort("r")
        assert clock.reads == reads + 1
        assert (record.finished_at, record.prompt_tokens, record.generated) == (42.0, 10, 1)
        assert sched.finished()["r"] == record


def test_aborting_a_waiting_request_leaves_a_sequence_of_its_id_added_outside():
    cache, sched = make()
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=2))
        cache.add_sequence("r", num_tokens=5)  # outside the scheduler, after the submit
        sched.abort("r")
        assert cache.seq_len("r") == 5


def test_a_request_finishing_records_the_scheduler_s_time_read_once():
    clock = Clock()
    cache, sched = make(clock=clock)
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=1))
        plan = sched.step()
        reads = clock.reads
        (done,) = sched.advance(plan)
        assert clock.reads == reads + 1
        assert sched.finished()["r"].finished_at == 42.0 and done.request_id == "r"


def test_a_request_finishing_reads_the_cache_s_clock_once():
    clock = Clock(7.0)
    cache, sched = make(cache_clock=clock)
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=1))
        plan = sched.step()
        reads = clock.reads
        sched.advance(plan)
        assert clock.reads == reads + 1


# --- advance ---------------------------------------------------------------------------------
def test_a_plan_advanced_twice_says_to_advance_each_plan_once():
    cache, sched = make()
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=3))
        plan = sched.step()
        sched.advance(plan)
        with pytest.raises(ValueError, match=re.escape(
                "was advanced already; advance each plan once, before the next step()")):
            sched.advance(plan)


def test_a_finishing_request_whose_sequence_left_the_cache_is_refused_by_name():
    cache, sched = make()
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=1))
        plan = sched.step()
        cache.remove("r")
        with pytest.raises(KeyError, match=re.escape(
                "request 'r' is running but its sequence left the cache outside the "
                "scheduler")):
            sched.advance(plan)


def test_unknown_generated_ids_are_taken_and_bad_ones_refused_by_name():
    cache, sched = make()
    with cache:
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=3))
        plan = sched.step()
        with pytest.raises(ValueError, match=re.escape("token_ids must be token ids >= -1")):
            sched.advance(plan, [-5])
        sched.advance(plan, [-1])
        assert sched.running["r"].output_tokens == [-1]


# --- submit (multi-turn: requests by token ids) ----------------------------------------------
def test_a_request_another_scheduler_holds_is_refused():
    cache, sched = make()
    other_cache, other = make()
    with cache, other_cache:
        request = Request("r", prompt_tokens=4, max_new_tokens=2)
        sched.submit(request)
        with pytest.raises(ValueError, match=re.escape(
                "request 'r' was submitted already and has not finished")):
            other.submit(request)


def test_bad_token_ids_are_refused_naming_the_request():
    cache, sched = make()
    with cache, pytest.raises(ValueError, match=re.escape(
            "request 'r': tokens must be token ids >= 0")):
        sched.submit(Request("r", tokens=np.array([3, -5]), max_new_tokens=2))


def test_a_request_with_nothing_left_to_generate_says_so():
    cache, sched = make()
    with cache, pytest.raises(ValueError, match=re.escape(
            "request 'r': generated 3 of 3 new tokens already: nothing is left to do")):
        sched.submit(Request("r", prompt_tokens=4, max_new_tokens=3, generated=3))


def test_an_id_aborted_while_swapped_out_clashes_like_any_other_when_submitted_again():
    bs = 8
    with KvCache(CacheConfig(1, 1, 64, bs, 6, "float32", host_blocks=8),
                 backend="host") as cache:
        sched = Scheduler(cache)
        for start, name in enumerate("ab"):
            sched.submit(Request(name, tokens=np.arange(2 * bs - 1) + 100 * start,
                                 max_new_tokens=10))
        while not cache.swapped_ids():
            plan = sched.step()
            ran = [r for r, _ in plan.prefill] + plan.decode
            sched.advance(plan, [1000 + r.generated for r in ran])
        (swapped,) = cache.swapped_ids()
        sched.abort(swapped)
        sched.submit(Request(swapped, prompt_tokens=4, max_new_tokens=2))
        cache.add_sequence(swapped, num_tokens=3)  # outside the scheduler
        with pytest.raises(ValueError, match="is waiting but the cache already holds"):
            sched.step()
