"""Chunked prefill in the Scheduler (``max_batched_tokens``): decodes first, then the next
chunk of each request still prefilling, then admissions, within the budget; a prefix hit
prefilled only past the hit; preempted requests resume with what remains."""

from __future__ import annotations

import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig, KvCache, Request, Scheduler


def cache_of(backend, blocks=64, host_blocks=0):
    return KvCache(CacheConfig(1, 1, 64, 16, blocks, np.float16, host_blocks=host_blocks),
                   backend=backend)


def run(scheduler, steps=1000):
    """Step and advance (unknown ids) until idle; returns the plans."""
    plans = []
    for _ in range(steps):
        if scheduler.idle:
            return plans
        plan = scheduler.step()
        plans.append(plan)
        scheduler.advance(plan, [7] * len(plan.generating))
    raise AssertionError("not idle after many steps")


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget(backend):
    with cache_of(backend) as cache:
        scheduler = Scheduler(cache, max_batched_tokens=32)
        scheduler.submit(Request("long", prompt_tokens=100, max_new_tokens=3))
        plans = run(scheduler)
        chunks = [c for p in plans for c in p.chunks]
        assert [(c.start, c.end) for c in chunks] == [(0, 32), (32, 64), (64, 96), (96, 100)]
        assert [c.last for c in chunks] == [False, False, False, True]
        assert [len(p.generating) for p in plans] == [0, 0, 0, 1, 1, 1]
        assert all(int(p.query_lens.sum()) <= 32 for p in plans)


def test_decodes_come_first_and_share_the_budget(backend):
    with cache_of(backend) as cache:
        scheduler = Scheduler(cache, max_batched_tokens=20)
        scheduler.submit(Request("a", prompt_tokens=10, max_new_tokens=20))
        plan = scheduler.step()
        scheduler.advance(plan, [1])
        scheduler.submit(Request("b", prompt_tokens=50, max_new_tokens=2))
        plan = scheduler.step()
        assert plan.seq_ids == ["a", "b"] and plan.query_lens.tolist() == [1, 19]
        assert plan.generating == [plan.decode[0]]
        scheduler.advance(plan, [1])
        plan = scheduler.step()
        assert plan.seq_ids == ["a", "b"] and plan.query_lens.tolist() == [1, 19]


def test_a_prefix_hit_is_prefilled_only_past_the_hit(backend):
    with cache_of(backend) as cache:
        scheduler = Scheduler(cache, max_batched_tokens=24)
        prompt = np.arange(60)
        scheduler.submit(Request("first", tokens=prompt, max_new_tokens=1))
        run(scheduler)
        scheduler.submit(Request("second", tokens=np.concatenate([prompt[:50], [999] * 7]),
                                 max_new_tokens=1))
        plans = run(scheduler)
        chunks = [c for p in plans for c in p.chunks]
        assert chunks[0].request.num_cached_tokens == 48 and chunks[0].start == 48
        assert sum(c.end - c.start for c in chunks) == 57 - 48


def test_a_dropped_request_recomputes_and_a_swapped_one_resumes(backend):
    """Decodes preempt the least recently used request still prefilling: dropped (no host
    tier) it starts over; swapped to the host tier it continues where it was."""
    for host_blocks in (0, 8):
        with cache_of(backend, blocks=7, host_blocks=host_blocks) as cache:
            scheduler = Scheduler(cache, max_batched_tokens=16)
            scheduler.submit(Request("decoder", prompt_tokens=16, max_new_tokens=60))
            scheduler.advance(scheduler.step(), [1])
            scheduler.submit(Request("prefill", prompt_tokens=80, max_new_tokens=1))
            prefill = scheduler.waiting[0]
            computed, resumed_at = None, None
            for _ in range(300):
                if scheduler.idle:
                    break
                before = prefill.num_computed_tokens
                plan = scheduler.step()
                if prefill in plan.preempted and computed is None:
                    computed = before
                if computed is not None and resumed_at is None:  # (this step's admissions too)
                    resumed_at = next((c.start for c in plan.chunks if c.request is prefill),
                                      None)
                scheduler.advance(plan, [1] * len(plan.generating))
            assert scheduler.idle and computed is not None and computed > 0
            assert resumed_at == (computed if host_blocks else 0), (host_blocks, computed)
            cache.check_invariants()


@pytest.mark.parametrize("seed", range(12))
def test_every_request_finishes_whatever_the_budget_and_room(backend, seed):
    """Random prompts, budgets and caches barely larger than the longest request: every
    request finishes (none waits for ever for room), the invariants hold throughout, and
    no step passes its budget."""
    rng = np.random.default_rng(seed)
    host_blocks = int(rng.choice([0, 12]))
    with cache_of(backend, blocks=int(rng.integers(9, 14)), host_blocks=host_blocks) as cache:
        budget = int(rng.integers(8, 70))
        scheduler = Scheduler(cache, max_batched_tokens=budget)
        names = []
        for i in range(int(rng.integers(2, 7))):
            names.append(f"r{i}")
            scheduler.submit(Request(f"r{i}", prompt_tokens=int(rng.integers(1, 90)),
                                     max_new_tokens=int(rng.integers(1, 30))))
        for _ in range(3000):
            if scheduler.idle:
                break
            plan = scheduler.step()
            assert int(plan.query_lens.sum()) <= budget
            scheduler.advance(plan, [1] * len(plan.generating))
            cache.check_invariants()
        assert scheduler.idle, f"{len(scheduler.running)} running, {len(scheduler.waiting)} wait"
        assert set(scheduler.finished()) == set(names)


@pytest.mark.parametrize("value", [0, -3, 1.5, "8"])
def test_a_bad_budget_is_refused_naming_it(value):
    with cache_of("host") as cache, pytest.raises((TypeError, ValueError),
                                                  match="max_batched_tokens"):
        Scheduler(cache, max_batched_tokens=value)
