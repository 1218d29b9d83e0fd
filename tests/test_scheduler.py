"""Request lifecycle: continuous batching frees KV on completion; records stay bounded."""

from __future__ import annotations

from rocmforge_raw.cache import CacheConfig, KvCache, Request, Scheduler


def make(num_blocks=20, **kw):
    cache = KvCache(CacheConfig(1, 1, 64, 8, num_blocks, "float32"), backend="host")
    return cache, Scheduler(cache, **kw)


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


def test_bad_requests_are_refused():
    import pytest

    cache, sched = make()
    with pytest.raises(ValueError, match="needs >= 1 prompt token"):
        sched.submit(Request("x", 0, 5))
    sched.submit(Request("y", 1, 1))
    with pytest.raises(ValueError, match="already queued"):
        sched.submit(Request("y", 2, 2))
    cache.close()
