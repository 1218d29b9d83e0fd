"""Multi-turn prefix caching: blocks filled by appended tokens are named by their prefix, so
the next turn of a conversation finds all of it; the Scheduler admits by token ids, prefills
only what the cache lacks, and resumes requests the cache swapped out."""

from __future__ import annotations

import numpy as np
import pytest
from tier_helpers import read, write

from rocmforge_raw.cache import CacheConfig, KvCache, Request, Scheduler

BS = 8


def cache_of(num_blocks: int = 24, host_blocks: int = 0, **kw) -> KvCache:
    return KvCache(CacheConfig(1, 1, 64, BS, num_blocks, "float32", host_blocks=host_blocks),
                   backend="host", **kw)


def prompt(cache: KvCache, seq_id, tokens) -> int:
    tokens = np.asarray(tokens)
    reservation = cache.add_sequence(seq_id, tokens=tokens)
    n = reservation.num_cached_tokens
    write(cache, reservation.slot_mapping[n:], tokens[n:])
    return n


def decode(cache: KvCache, seq_id, tokens) -> None:
    """Append ``tokens`` one by one, K = V = the id, as a decode loop does."""
    for token in tokens:
        write(cache, cache.append([seq_id], tokens=[token]).slot_mapping, [token])


def test_a_follow_up_prompt_hits_every_full_block_of_the_conversation():
    question, answer = np.arange(100, 113), np.arange(500, 521)  # 13 + 21 = 34 tokens
    with cache_of() as cache:
        prompt(cache, "turn1", question)
        decode(cache, "turn1", answer)
        cache.finish("turn1")
        follow_up = np.concatenate([question, answer, np.arange(900, 905)])
        assert prompt(cache, "turn2", follow_up) == 4 * BS  # 34 tokens: 4 full blocks
        np.testing.assert_array_equal(read(cache, "turn2"), follow_up)
        assert cache.stats()["prefix_hits"] == 4
        cache.check_invariants()


def test_appending_without_ids_ends_the_chain():
    with cache_of() as cache:
        prompt(cache, "a", np.arange(BS + 2))
        decode(cache, "a", np.arange(50, 50 + BS))  # fills block 1: named
        cache.append(["a"])  # no id: block 2 and later are never named
        write(cache, [cache.batch(["a"]).slot_mapping[0]], [7.0])
        decode(cache, "a", np.arange(60, 60 + BS))
        cache.finish("a")
        whole = np.concatenate([np.arange(BS + 2), np.arange(50, 50 + BS), [7],
                                np.arange(60, 60 + BS)])
        assert prompt(cache, "b", whole) == 2 * BS


def test_an_unknown_id_ends_that_sequence_s_chain_only():
    with cache_of() as cache:
        prompt(cache, "a", np.arange(BS - 1))
        prompt(cache, "b", np.arange(100, 100 + BS - 1))
        cache.append(["a", "b"], tokens=[-1, 107])
        assert prompt(cache, "b2", np.arange(100, 100 + BS)) == BS - 1  # found (all cached)
        assert prompt(cache, "a2", np.concatenate([np.arange(BS - 1), [0]])) == 0


def test_a_fork_keeps_its_parent_s_chain_and_goes_its_own_way():
    with cache_of() as cache:
        prompt(cache, "a", np.arange(BS - 2))
        cache.fork("a", "b")
        decode(cache, "a", [1, 2])
        decode(cache, "b", [3, 4])
        for seq_id, tail in (("a", [1, 2]), ("b", [3, 4])):
            tokens = np.concatenate([np.arange(BS - 2), tail, [9]])
            assert prompt(cache, f"{seq_id}2", tokens) == BS


def test_a_chain_survives_a_swap():
    with cache_of(host_blocks=8) as cache:
        prompt(cache, "a", np.arange(BS - 1))
        cache.swap_out(["a"])
        cache.swap_in(["a"])
        decode(cache, "a", [42])
        assert prompt(cache, "b", np.concatenate([np.arange(BS - 1), [42, 1]])) == BS


def test_append_checks_its_ids():
    with cache_of() as cache:
        prompt(cache, "a", np.arange(3))
        with pytest.raises(ValueError, match="tokens holds 2 ids for 1 sequences"):
            cache.append(["a"], tokens=[1, 2])
        with pytest.raises(TypeError, match=r"tokens\[0\] must be an integer, got 1.5"):
            cache.append(["a"], tokens=[1.5])
        with pytest.raises(ValueError, match="tokens must be token ids >= -1, got -2"):
            cache.append(["a"], tokens=[-2])
        assert cache.seq_len("a") == 3


def test_can_allocate_counts_the_blocks_the_prefix_cache_holds():
    with cache_of(num_blocks=5) as cache:
        prompt(cache, "a", np.arange(3 * BS))
        assert not cache.can_allocate(4 * BS)
        assert cache.can_allocate(tokens=np.arange(4 * BS))  # 3 found + 1 free
        assert not cache.can_allocate(tokens=np.arange(100, 100 + 4 * BS))


def run(sched: Scheduler, cache: KvCache, next_id=lambda r: 1000 + r.generated) -> list:
    """Step the scheduler to idle, writing K = V = token id; returns every plan."""
    plans = []
    while not sched.idle:
        plan = sched.step()
        plans.append(plan)
        for request, slots in plan.prefill:
            write(cache, slots, request.context_ids()[-len(slots):])
        if plan.decode:
            write(cache, plan.decode_slots, [r.output_tokens[-1] for r in plan.decode])
        for request in sched.running.values():  # every token reads back, swaps or not
            held = read(cache, request.request_id)  # resumed: the newest id comes next step
            np.testing.assert_array_equal(held, request.context_ids()[: held.size])
        ran = [r for r, _ in plan.prefill] + plan.decode
        sched.advance(plan, [next_id(r) for r in ran])
    return plans


def test_the_scheduler_admits_by_ids_and_prefills_only_the_uncached_part():
    system = np.arange(2 * BS)
    with cache_of() as cache:
        sched = Scheduler(cache)
        sched.submit(Request("a", tokens=np.concatenate([system, [1, 2, 3]]), max_new_tokens=4))
        plan = sched.step()
        write(cache, plan.prefill[0][1], plan.prefill[0][0].context_ids())
        sched.advance(plan, [50])
        sched.submit(Request("b", tokens=np.concatenate([system, [7]]), max_new_tokens=2))
        plan = sched.step()
        (request, slots), = plan.prefill
        assert request.num_cached_tokens == 2 * BS and len(slots) == 1
        assert request.prompt_tokens == 2 * BS + 1


def test_a_follow_up_request_hits_the_whole_conversation_so_far():
    question = np.arange(100, 111)
    with cache_of() as cache:
        sched = Scheduler(cache)
        first = Request("turn1", tokens=question, max_new_tokens=14)
        sched.submit(first)
        run(sched, cache)
        conversation = first.context_ids()  # 11 + 14 tokens, the last never written
        assert conversation.size == 25 and conversation[11] == 1000
        sched.submit(Request("turn2", tokens=np.concatenate([conversation, [5, 6]]),
                             max_new_tokens=2))
        plans = run(sched, cache)
        request, slots = plans[0].prefill[0]
        assert request.num_cached_tokens == 3 * BS  # 24 of the 25 were written and named
        assert len(slots) == conversation.size + 2 - 3 * BS


def test_a_preempted_request_is_swapped_out_and_resumed_without_prefill():
    with cache_of(num_blocks=6, host_blocks=8) as cache:
        sched = Scheduler(cache)
        for start, name in enumerate("ab"):  # 3 blocks each at their longest, 5 in all
            sched.submit(Request(name, tokens=np.arange(2 * BS - 1) + 100 * start,
                                 max_new_tokens=10))
        plans = run(sched, cache)
        preempted = [r.request_id for p in plans for r in p.preempted]
        resumed = [r.request_id for p in plans for r in p.resumed]
        assert preempted and resumed == preempted
        assert sorted(r.request_id for p in plans for r, _ in p.prefill) == ["a", "b"]
        assert cache.stats()["swapped_in_blocks"] > 0
        assert {f.request_id for f in sched.finished().values()} == {"a", "b"}
        assert all(f.generated == 10 for f in sched.finished().values())
        cache.check_invariants()


def test_requests_check_their_ids():
    with cache_of() as cache:
        sched = Scheduler(cache)
        with pytest.raises(ValueError, match="prompt_tokens 5 differs from its 3 token ids"):
            sched.submit(Request("a", 5, 2, tokens=[1, 2, 3]))
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
            sched.submit(Request("a", tokens=[1, 2, 3]))
        sched.submit(Request("a", tokens=[1, 2, 3], max_new_tokens=3))
        plan = sched.step()
        with pytest.raises(ValueError, match="token_ids must be 1 integer ids"):
            sched.advance(plan, [1, 2])
        sched.advance(plan, None)  # unknown: the conversation is not named further
        assert sched.running["a"].output_tokens == [-1]


def test_aborting_a_swapped_out_request_frees_its_host_blocks():
    with cache_of(num_blocks=6, host_blocks=8) as cache:
        sched = Scheduler(cache)
        for start, name in enumerate("ab"):
            sched.submit(Request(name, tokens=np.arange(2 * BS - 1) + 100 * start,
                                 max_new_tokens=10))
        while not cache.swapped_ids():
            plan = sched.step()
            for request, slots in plan.prefill:
                write(cache, slots, request.context_ids()[-len(slots):])
            ran = [r for r, _ in plan.prefill] + plan.decode
            sched.advance(plan, [1000 + r.generated for r in ran])
        (swapped,) = cache.swapped_ids()
        assert sched.abort(swapped).reason == "aborted"
        assert swapped not in cache and cache.stats()["host_used_blocks"] == 0
        cache.check_invariants()
