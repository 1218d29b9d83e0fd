"""The demo's multi-turn part: conversations through the Scheduler on a cache with a host
tier.

Each conversation has several turns; a turn's prompt is the whole conversation so far (every
earlier prompt and answer) and a new question, given by token ids (``Request(tokens=...)``),
and the ids each step generates go back to the scheduler (``advance(plan, ids)``), so every
block the conversation fills is named by its prefix. A token's K and V are a fixed function
of its id (rows of two random tables), as a model's are a function of the prefix: a prefix
hit then holds exactly what prefilling would have written. The device cache is too small
for the conversations in flight: preempted requests are swapped out to the host tier and
resumed, and freed prefix blocks are demoted there and promoted back when a later turn asks
for them. Attention is checked against the NumPy reference every few steps, and always
in the first step a resumed request decodes again. The summary: the share of follow-up
prompt tokens found in the cache, the host tier's hits and the swap traffic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache import CacheConfig, KvCache, Request, Scheduler
from ..memory.array import DeviceArray
from ..runtime import Backend

VOCAB = 4096


def multi_turn(backend: Backend, device: int, cfg: Any, dtype: Any, rng: np.random.Generator,
               conversations: int = 12, turns: int = 4, check: Any = None) -> dict[str, Any]:
    """Run the conversations (``cfg``: the demo's sizes; ``check(cache, meta, query, out,
    layer, index)`` the reference check) and return the summary."""
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
             "steps": 0, "resumed": 0}
    with KvCache(config, device, backend) as cache:
        sched = Scheduler(cache, max_running=conversations)
        for c in range(conversations):
            asked[_ask(sched, c, history, turn, rng)] = c
        resumed: set[Any] = set()
        while not sched.idle:
            plan = sched.step()
            for request, slots in plan.prefill:
                _write(cache, tables, _ids(request)[-len(slots):], slots)
                if turn[asked[request.request_id]] > 0:
                    stats["follow_up_prompt_tokens"] += request.prompt_tokens
                    stats["follow_up_cached_tokens"] += request.num_cached_tokens
            resumed.update(r.request_id for r in plan.resumed)
            stats["resumed"] += len(plan.resumed)
            if plan.decode:
                ids = [r.request_id for r in plan.decode]
                meta = cache.batch(ids)
                last = np.array([r.output_tokens[-1] for r in plan.decode])
                index = next((i for i, s in enumerate(ids) if s in resumed), None)
                for layer in range(cfg.num_layers):
                    k, v = (_rows(cache, t[last]) for t in tables)
                    query = _rows(cache, rng.standard_normal(
                        (len(ids), q_heads, cfg.head_dim), np.float32).astype(dtype))
                    out = DeviceArray.empty(query.shape, dtype, device, backend)
                    cache.write(layer, k, v, meta)
                    cache.attention(layer, out, query, meta)
                    if layer == cfg.num_layers - 1 and check is not None and (
                            index is not None or stats["steps"] % cfg.check_every == 0):
                        check(cache, meta, query, out, layer, index or 0)
                        stats["checks"] += 1
                        resumed.discard(ids[index or 0])
                    for array in (k, v, query, out):
                        array.buffer.root.close()
            ran = len(plan.prefill) + len(plan.decode)
            for request in sched.advance(plan, rng.integers(0, VOCAB, ran)):
                c = asked.pop(request.request_id)
                history[c] = _ids(request)
                turn[c] += 1
                if turn[c] < turns:
                    asked[_ask(sched, c, history, turn, rng)] = c
            stats["steps"] += 1
        cache.check_invariants()
        cache_stats = cache.stats()
    prompt = stats["follow_up_prompt_tokens"]
    return {
        "turn_conversations": conversations, "turns": turns, "turn_steps": stats["steps"],
        "follow_up_cached_share": stats["follow_up_cached_tokens"] / prompt if prompt else 0.0,
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


def _write(cache: KvCache, tables: list[np.ndarray], tokens: np.ndarray,
           slots: np.ndarray) -> None:
    """Prefill: the K/V of ``tokens`` (rows of ``tables``) at ``slots``, every layer."""
    k, v = (_rows(cache, t[tokens]) for t in tables)
    for layer in range(cache.config.num_layers):
        cache.write(layer, k, v, slots)
    k.buffer.root.close()
    v.buffer.root.close()
