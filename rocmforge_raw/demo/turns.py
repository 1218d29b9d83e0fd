"""The demo's multi-turn part: conversations through the Scheduler on a cache with a host
tier, every step's attention through the cache (prefill chunks mixed with decodes).

Each conversation has several turns; a turn's prompt is the whole conversation so far (every
earlier prompt and answer) and a new question, given by token ids (``Request(tokens=...)``),
and the ids each step generates go back to the scheduler (``advance(plan, ids)``), so every
block the conversation fills is named by its prefix. A token's K and V are a fixed function
of its id (rows of two random tables), as a model's are a function of the prefix: a prefix
hit then holds exactly what prefilling would have written. The Scheduler runs chunked
prefill under a token budget (``max_batched_tokens``): a step is its decodes and the prompt
chunks that fit, planned with ``batch(seq_ids, query_lens=...)``, and each layer writes the
step's K/V and runs attention over every query token (a follow-up's uncached tail attends to
its cached history). The device cache is too small for the conversations in flight:
preempted requests are swapped out to the host tier and resumed, and freed prefix blocks are
demoted there and promoted back when a later turn asks for them. Attention is checked
against the NumPy reference every few steps, and always in the first step a resumed request
runs again. The summary: the prefill tokens computed and those the prefix cache served, the
time a prefix hit saved (measured: the longest conversation's last prompt prefilled whole,
then past its hit), the host tier's hits and the swap traffic.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cache import CacheConfig, KvCache, Request, Scheduler
from ..memory.array import DeviceArray
from ..memory.stream import Event
from ..runtime import Backend

VOCAB = 4096
STEP_TOKENS = 128  # the Scheduler's token budget a step (max_batched_tokens)


def multi_turn(backend: Backend, device: int, cfg: Any, dtype: Any, rng: np.random.Generator,
               conversations: int = 12, turns: int = 4, check: Any = None) -> dict[str, Any]:
    """Run the conversations (``cfg``: the demo's sizes; ``check(cache, meta, query, out,
    layer, index)`` the reference check of sequence ``index`` of the step) and return the
    summary."""
    q_heads = cfg.num_kv_heads * cfg.group
    blocks = conversations * 7 + 1  # under half of what the last turns hold
    config = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size,
                         blocks, dtype, num_q_heads=q_heads, host_blocks=4 * blocks)
    shape = (VOCAB, cfg.num_kv_heads, cfg.head_dim)
    tables = [rng.standard_normal(shape, np.float32).astype(dtype) for _ in range(2)]
    history = {c: np.zeros(0, np.int64) for c in range(conversations)}
    turn = dict.fromkeys(range(conversations), 0)
    asked: dict[Any, int] = {}  # request id -> its conversation
    stats = {"follow_up_prompt_tokens": 0, "follow_up_cached_tokens": 0, "checks": 0,
             "steps": 0, "resumed": 0, "prefill_tokens": 0, "cached_tokens": 0,
             "mixed_steps": 0}
    with KvCache(config, device, backend) as cache:
        sched = Scheduler(cache, max_running=conversations, max_batched_tokens=STEP_TOKENS)
        for c in range(conversations):
            asked[_ask(sched, c, history, turn, rng)] = c
        resumed: set[Any] = set()
        admitted: set[Any] = set()
        while not sched.idle:
            plan = sched.step()
            for chunk in plan.chunks:
                request = chunk.request
                stats["prefill_tokens"] += chunk.end - chunk.start
                if request.request_id not in admitted:
                    admitted.add(request.request_id)
                    stats["cached_tokens"] += request.num_cached_tokens
                    if turn[asked[request.request_id]] > 0:
                        stats["follow_up_prompt_tokens"] += request.prompt_tokens
                        stats["follow_up_cached_tokens"] += request.num_cached_tokens
            resumed.update(r.request_id for r in plan.resumed)
            stats["resumed"] += len(plan.resumed)
            stats["mixed_steps"] += bool(plan.decode and plan.chunks)
            if plan.seq_ids:
                ids = plan.seq_ids
                index = next((i for i, s in enumerate(ids) if s in resumed), None)
                checked = check is not None and (
                    index is not None or stats["steps"] % cfg.check_every == 0)
                _run_step(cache, tables, plan, q_heads, rng, check if checked else None,
                          index or 0)
                if checked:
                    stats["checks"] += 1
                    resumed.discard(ids[index or 0])
            for request in sched.advance(plan, rng.integers(0, VOCAB, len(plan.generating))):
                c = asked.pop(request.request_id)
                history[c] = _ids(request)
                turn[c] += 1
                if turn[c] < turns:
                    asked[_ask(sched, c, history, turn, rng)] = c
            stats["steps"] += 1
        cache.check_invariants()
        saving = _prefix_saving(cache, tables, max(history.values(), key=len), q_heads, rng)
        cache.check_invariants()
        cache_stats = cache.stats()
    prompt = stats["follow_up_prompt_tokens"]
    return {
        "turn_conversations": conversations, "turns": turns, "turn_steps": stats["steps"],
        "turn_mixed_steps": stats["mixed_steps"],
        "turn_prefill_tokens": stats["prefill_tokens"],
        "turn_cached_prompt_tokens": stats["cached_tokens"],
        "follow_up_cached_share": stats["follow_up_cached_tokens"] / prompt if prompt else 0.0,
        **saving,
        "turn_prefix_hit_rate": cache_stats["prefix_hit_rate"],
        "turn_host_hits": cache_stats["host_hits"],
        "turn_host_hit_rate": cache_stats["host_hit_rate"],
        "turn_preemptions": cache_stats["preemptions"], "turn_resumed": stats["resumed"],
        "turn_swapped_out_blocks": cache_stats["swapped_out_blocks"],
        "turn_swapped_in_blocks": cache_stats["swapped_in_blocks"],
        "turn_demoted_blocks": cache_stats["demoted_blocks"],
        "turn_promoted_blocks": cache_stats["promoted_blocks"],
        "turn_copied_bytes": cache_stats["copied_out_bytes"] + cache_stats["copied_in_bytes"],
        "turn_checks_passed": stats["checks"],
    }


def _run_step(cache: KvCache, tables: list[np.ndarray], plan: Any, q_heads: int,
              rng: np.random.Generator, check: Callable[..., None] | None, index: int) -> None:
    """One step of ``plan`` through the cache: ``batch(seq_ids, query_lens=...)``, then per
    layer the K/V of every query token (each decode's newest token, then the chunks' ids)
    written at their slots and attention with random queries; ``check`` (if given) on the
    last layer for sequence ``index``. A decode's newest token is the last of its computed
    context: its last output, or, where a budget left one prompt token over, that token."""
    tokens = [_ids(r)[r.num_computed_tokens - 1: r.num_computed_tokens] for r in plan.decode]
    tokens += [_ids(c.request)[c.start: c.end] for c in plan.chunks]
    meta = cache.batch(plan.seq_ids, query_lens=plan.query_lens)
    _attend(cache, tables, meta, np.concatenate(tokens), q_heads, rng, check, index)


def _attend(cache: KvCache, tables: list[np.ndarray], meta: Any, tokens: np.ndarray,
            q_heads: int, rng: np.random.Generator,
            check: Callable[..., None] | None = None, index: int = 0) -> None:
    """Every layer of the current plan ``meta``: write the K/V of ``tokens`` (one id per
    query row) and run attention; ``check`` the last layer's sequence ``index``."""
    c = cache.config
    k, v = (_rows(cache, t[tokens]) for t in tables)
    for layer in range(c.num_layers):
        query = _rows(cache, rng.standard_normal((len(tokens), q_heads, c.head_dim),
                                                 np.float32).astype(c.dtype))
        out = DeviceArray.empty(query.shape, c.dtype, cache.slab.device, cache.slab.backend)
        cache.write(layer, k, v, meta)
        cache.attention(layer, out, query, meta)
        if layer == c.num_layers - 1 and check is not None:
            check(cache, meta, query, out, layer, index)
        query.buffer.root.close()
        out.buffer.root.close()
    k.buffer.root.close()
    v.buffer.root.close()


def _prefix_saving(cache: KvCache, tables: list[np.ndarray], prompt: np.ndarray, q_heads: int,
                   rng: np.random.Generator, repeats: int = 3) -> dict[str, Any]:
    """What a prefix hit saves, measured on ``prompt`` (wall time of the prefill's steps,
    each waited for, median of ``repeats`` after one warm-up): prefilled whole (a sequence
    added by its length: no lookup) against prefilled past the hit the cache has for it now
    (added by its ids). Nothing of it stays in the cache but the prompt's cached blocks."""
    hits = []
    done = Event(cache.slab.device, cache.slab.backend)
    times: dict[bool, list[float]] = {False: [], True: []}
    for attempt in range(repeats + 1):
        for by_ids in (False, True):
            began = time.perf_counter()
            seq_id = ("demo-prefix-saving", attempt, by_ids)
            reservation = (cache.add_sequence(seq_id, tokens=prompt) if by_ids
                           else cache.add_sequence(seq_id, len(prompt)))
            try:
                rows = len(prompt) - reservation.num_cached_tokens
                if by_ids:
                    hits.append(reservation.num_cached_tokens)
                meta = cache.batch([seq_id], query_lens=[rows])
                _attend(cache, tables, meta, prompt[-rows:], q_heads, rng)
                done.record()
                done.synchronize()
            finally:
                cache.remove(seq_id)
            if attempt:
                times[by_ids].append(1e3 * (time.perf_counter() - began))
    done.close()
    whole, past_hit = (statistics.median(times[k]) for k in (False, True))
    return {"prefix_hit_prompt_tokens": len(prompt), "prefix_hit_cached_tokens": min(hits),
            "prefill_whole_ms": whole, "prefill_past_hit_ms": past_hit,
            "prefix_hit_saved_ms": whole - past_hit}


def _ask(sched: Scheduler, c: int, history: dict[int, np.ndarray], turn: dict[int, int],
         rng: np.random.Generator) -> tuple[int, int]:
    """Submit conversation ``c``'s next turn (its history and a new question); its id."""
    question = rng.integers(0, VOCAB, int(rng.integers(16, 65)))
    request_id = (c, turn[c])
    sched.submit(Request(request_id, tokens=np.concatenate([history[c], question]),
                         max_new_tokens=int(rng.integers(8, 33))))
    return request_id


def _ids(request: Request) -> np.ndarray:
    """The ids of ``request``'s context: all known, since every step's ids are given."""
    ids = request.context_ids()
    assert ids is not None
    return ids


def _rows(cache: KvCache, array: np.ndarray) -> DeviceArray:
    return DeviceArray.from_numpy(np.ascontiguousarray(array), cache.slab.device,
                                  cache.slab.backend)
