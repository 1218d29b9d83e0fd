"""The demo: a continuous-batching serving simulation on one backend.

Requests with random prompt and output lengths arrive over time. Admission writes random K/V
for the whole prompt through ``reshape_and_cache``; every decode step writes each running
sequence's new K/V and runs paged attention over the batch, layer by layer; finished requests
free their KV at once; when the pool fills, the least-recently-used sequences are preempted
and re-queued. The loop plans ahead as a serving loop should (README): each step's
bookkeeping (the scheduler's appends and admissions, ``batch``) is done while the device
still runs the step before, whose result is waited for only then. Every ``check_every``
steps one sequence's attention is checked against the NumPy reference. Then requests that
share a system prompt run on an fp8 (e4m3) cache with per-layer K/V scales: their prompts
are given by token ids, so the prefix cache serves the shared blocks (hit rate in the
summary) and only the rest is prefilled; a few decode steps follow, and attention is
checked against the reference over the dequantized codes. Last, multi-turn conversations
run on a cache with a host tier (``demo.turns``), prefilled in chunks through the
multi-token attention mixed with decodes: the prefill tokens computed and those the prefix
cache served, the time a prefix hit saved (measured), host-tier hits and swap traffic. The
summary ends with the live buffers left after teardown (must be 0); ``failures`` says what
the run required and did not get, the verdict the CLI prints. One seed gives one run: two
runs of a seed report the same figures but the wall-clock ones (``TIMINGS``).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..cache import CacheConfig, KvCache, Request, Scheduler
from ..common import progress
from ..kernels import ops, reference
from ..memory.array import DeviceArray
from ..memory.buffer import memory_stats
from ..memory.stream import Event
from ..runtime import Backend
from .turns import multi_turn


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the simulation; ``for_backend`` picks ones that finish within a minute."""

    requests: int
    prompt: tuple[int, int]  # tokens, inclusive range
    output: tuple[int, int]
    arrivals_per_step: float
    num_layers: int = 2
    num_kv_heads: int = 4
    group: int = 4  # query heads per kv head
    head_dim: int = 128
    block_size: int = 16
    pool_fraction: float = 0.6  # of max_running average requests: small enough to preempt
    check_every: int = 25
    max_running: int = 64

    @classmethod
    def for_backend(cls, backend: Backend, scale: float = 1.0) -> DemoConfig:
        if backend.name == "host":
            return cls(requests=max(2, int(120 * scale)), prompt=(16, 200), output=(4, 40),
                       arrivals_per_step=1.5, num_kv_heads=2, head_dim=64, max_running=16)
        return cls(requests=max(2, int(400 * scale)), prompt=(64, 2048), output=(16, 128),
                   arrivals_per_step=4.0, num_kv_heads=8, max_running=128)


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return rng.standard_normal(shape, np.float32).astype(dtype)


def run_demo(backend: Backend, device: int = 0, config: DemoConfig | None = None,
             seed: int | None = None) -> dict[str, Any]:
    """Run the simulation (a bar on a terminal, a line every 10 s elsewhere: ``progress``)
    and return its summary. On the host backend there is no device: the summary has no
    device time and says so (``device_time``)."""
    cfg = config or DemoConfig.for_backend(backend)
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.float32 if backend.name == "host" else ml_dtypes.bfloat16)
    prompts = rng.integers(cfg.prompt[0], cfg.prompt[1] + 1, cfg.requests)
    outputs = rng.integers(cfg.output[0], cfg.output[1] + 1, cfg.requests)
    # the pool holds pool_fraction of what max_running average requests need: it fills
    per_request = float(np.mean(-(-(prompts + outputs) // cfg.block_size)))
    largest = -(-(cfg.prompt[1] + cfg.output[1]) // cfg.block_size)
    blocks = max(int(cfg.max_running * per_request * cfg.pool_fraction), 2 * largest) + 1
    q_heads = cfg.num_kv_heads * cfg.group
    cache_cfg = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size,
                            blocks, dtype, num_q_heads=q_heads)
    stats: dict[str, Any] = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                             "checks": 0, "device_ms": [], "step_ms": [], "host_share": []}
    started = time.perf_counter()
    shown = progress.bar(cfg.requests, "demo", unit="req")
    with shown, KvCache(cache_cfg, device, backend) as cache:
        sched = Scheduler(cache, max_running=cfg.max_running)
        start_ev, end_ev = Event(device, backend), Event(device, backend)
        in_flight: _Step | None = None  # the decode step queued and not waited for yet
        submitted = 0
        while submitted < cfg.requests or not sched.idle:
            arrivals = rng.poisson(cfg.arrivals_per_step) if submitted < cfg.requests else 0
            for _ in range(min(arrivals, cfg.requests - submitted)):
                sched.submit(Request(submitted, int(prompts[submitted]),
                                     int(outputs[submitted])))
                submitted += 1
            began = time.perf_counter()
            plan = sched.step()  # appends, admits: planned while the device runs the last step
            for _, slots in plan.prefill:
                _write(cache, rng, slots, dtype)
                stats["prefill_tokens"] += len(slots)
            meta = cache.batch([r.request_id for r in plan.decode]) if plan.decode else None
            if in_flight is not None:  # the step before: its result now (a model samples)
                in_flight.land(cache, stats, start_ev, end_ev)
                in_flight = None
            if meta is not None:
                inputs = _step_inputs(cache, rng, len(plan.decode), q_heads, dtype)
                start_ev.record()
                for layer, (key, value, query, out) in enumerate(inputs):
                    cache.write(layer, key, value, meta)
                    cache.attention(layer, out, query, meta)
                end_ev.record()
                check = stats["steps"] % cfg.check_every == 0
                in_flight = _Step(meta, inputs, began, time.perf_counter(), check)
                if check:  # against the cache as this step left it: before later steps
                    in_flight.land(cache, stats, start_ev, end_ev)
                    in_flight = None
            sched.advance(plan)
            stats["steps"] += 1
            _show(shown, len(sched.finished()), cache.stats())
        if in_flight is not None:
            in_flight.land(cache, stats, start_ev, end_ev)
        cache_stats = cache.stats()
        start_ev.close()
        end_ev.close()
    elapsed = time.perf_counter() - started
    with progress.ticking("demo: shared prompts on an fp8 cache", leave=False):
        shared = _shared_prompts_on_fp8(backend, device, cfg, rng)
    with progress.ticking("demo: multi-turn conversations", leave=False):
        turns = multi_turn(backend, device, cfg, dtype, rng, check=_check)
    ops.release_staging()  # the one-off writes' staging memory, kept per device until now
    gc.collect()
    steps_ms = stats["step_ms"] or [0.0]
    return {
        "backend": backend.name, "device": backend.properties(device).name,
        "requests": cfg.requests, "finished": len(sched.finished()),
        "prefill_tokens": stats["prefill_tokens"], "generated_tokens": stats["decode_tokens"],
        "steps": stats["steps"], "seconds": elapsed, "steps_per_s": stats["steps"] / elapsed,
        # a decode step as it runs here: plan (append, batch) + per layer write and
        # attention, the next step planned while the device runs it, then the wait for the
        # device; the host's share is its time to plan and queue the step
        "decode_step_ms_median": statistics.median(steps_ms),
        **_device_time(backend, stats),
        "cache_blocks": blocks - 1, "peak_blocks": cache_stats["peak_used_blocks"],
        "preemptions": cache_stats["preemptions"], "cow_copies": cache_stats["cow_copies"],
        "reference_checks_passed": stats["checks"], **shared, **turns,
        "live_buffers_after_teardown": memory_stats()["live_buffers"],
    }


#: The summary's wall-clock figures: all that differs between two runs of one seed.
TIMINGS = frozenset({"seconds", "steps_per_s", "decode_step_ms_median",
                     "decode_device_ms_median", "decode_host_share_median", "prefill_whole_ms",
                     "prefill_past_hit_ms", "prefix_hit_saved_ms"})


def failures(summary: dict[str, Any]) -> list[str]:
    """What the demo requires of its summary and did not get (empty: OK). A reference check
    that failed has raised already (``AssertionError``, as the cache's invariant checks do);
    here: every request finished, each part checked attention against the reference at
    least once, the prefix cache served the shared system prompt and the multi-turn
    follow-ups, and nothing stayed live after teardown."""
    found = []
    if summary["finished"] != summary["requests"]:
        found.append(f"{summary['requests'] - summary['finished']} of {summary['requests']} "
                     f"requests did not finish")
    for key, part in (("reference_checks_passed", "the decode steps"),
                      ("fp8_checks_passed", "the fp8 cache"),
                      ("turn_checks_passed", "the multi-turn conversations")):
        if summary[key] == 0:
            found.append(f"no attention result of {part} was checked against the reference")
    if summary["prefill_tokens_saved"] == 0:
        found.append("the prefix cache served none of the shared system prompt")
    if summary["turn_cached_prompt_tokens"] == 0:
        found.append("the prefix cache served none of the multi-turn follow-ups")
    if summary["live_buffers_after_teardown"]:
        found.append(f"{summary['live_buffers_after_teardown']} buffers were still live after "
                     f"teardown")
    return found


def outcome(summary: dict[str, Any]) -> str:
    """The words of an OK verdict: what was checked and found."""
    checks = sum(summary[k] for k in ("reference_checks_passed", "fp8_checks_passed",
                                      "turn_checks_passed"))
    return (f"{summary['finished']}/{summary['requests']} requests finished, {checks} attention "
            f"results matched the NumPy reference, the prefix cache served "
            f"{summary['prefill_tokens_saved'] + summary['turn_cached_prompt_tokens']} prompt "
            f"tokens, no buffer live after teardown")


def _shared_prompts_on_fp8(backend: Backend, device: int, cfg: DemoConfig,
                           rng: np.random.Generator, requests: int = 24, system: int = 256,
                           steps: int = 4) -> dict[str, Any]:
    """``requests`` prompts of one ``system``-token system prompt and their own question, on
    an float8_e4m3fn cache: prefix hits, and attention against the reference."""
    act = np.dtype(np.float16 if backend.name == "host" else ml_dtypes.bfloat16)
    scales = tuple((0.02 * (layer + 1), 0.03) for layer in range(cfg.num_layers))
    tokens = [np.concatenate([np.arange(system), rng.integers(1000, 50000, int(n))])
              for n in rng.integers(16, 129, requests)]
    blocks = sum(-(-len(t) // cfg.block_size) + steps for t in tokens) + 1
    q_heads = cfg.num_kv_heads * cfg.group
    config = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size,
                         blocks, "float8_e4m3fn", num_q_heads=q_heads, activation_dtype=act,
                         kv_scales=scales)
    prefilled = 0
    with KvCache(config, device, backend) as cache:
        for seq_id, prompt in enumerate(tokens):
            reservation = cache.add_sequence(seq_id, tokens=prompt)
            slots = reservation.slot_mapping[reservation.num_cached_tokens :]
            _write(cache, rng, slots, act)
            prefilled += len(slots)
        ids = list(range(requests))
        for _ in range(steps):
            cache.append(ids)
            meta = cache.batch(ids)
            inputs = _step_inputs(cache, rng, requests, q_heads, act)
            for layer, (key, value, query, out) in enumerate(inputs):
                cache.write(layer, key, value, meta)
                cache.attention(layer, out, query, meta)
            key, value, query, out = inputs[-1]
            _check(cache, meta, query, out, cfg.num_layers - 1, int(rng.integers(requests)))
            for arrays in inputs:
                for array in arrays:
                    array.buffer.root.close()
        stats = cache.stats()
    prompt_tokens = sum(len(t) for t in tokens)
    return {"fp8_cache": config.dtype.name, "fp8_bytes_per_token": config.bytes_per_token,
            "fp8_checks_passed": steps, "shared_prompt_requests": requests,
            "prefix_hit_rate": stats["prefix_hit_rate"],
            "prefill_tokens_saved": prompt_tokens - prefilled,
            "prefill_tokens_saved_share": 1 - prefilled / prompt_tokens}


@dataclass
class _Step:
    """A decode step queued on the device and not waited for yet: its plan, per-layer
    arrays, when its planning began and when its launches were queued (host seconds), and
    whether its result is checked against the reference."""

    meta: Any
    inputs: list[tuple[DeviceArray, ...]]
    began: float
    queued: float
    check: bool

    def land(self, cache: KvCache, stats: dict[str, Any], start_ev: Event, end_ev: Event
             ) -> None:
        """Wait for the step, record its times, check it if asked, free its arrays."""
        end_ev.synchronize()
        step_s = time.perf_counter() - self.began
        stats["step_ms"].append(1e3 * step_s)
        stats["host_share"].append((self.queued - self.began) / step_s)
        stats["device_ms"].append(end_ev.elapsed_ms_since(start_ev))
        stats["decode_tokens"] += len(self.meta.seq_ids)
        if self.check:
            query, out = self.inputs[-1][2:]
            _check(cache, self.meta, query, out, len(self.inputs) - 1, 0)
            stats["checks"] += 1
        for arrays in self.inputs:
            for array in arrays:
                array.buffer.root.close()


def _step_inputs(cache: KvCache, rng: np.random.Generator, num_seqs: int, q_heads: int,
                 dtype: Any) -> list[tuple[DeviceArray, ...]]:
    """Per layer: the step's new key and value rows, the query, and the output array."""
    c = cache.config
    backend, device = cache.slab.backend, cache.slab.device
    kv_shape, q_shape = (num_seqs, c.num_kv_heads, c.head_dim), (num_seqs, q_heads, c.head_dim)
    return [(*(DeviceArray.from_numpy(_random(rng, shape, dtype), device, backend)
               for shape in (kv_shape, kv_shape, q_shape)),
             DeviceArray.empty(q_shape, dtype, device, backend)) for _ in range(c.num_layers)]


def _write(cache: KvCache, rng: np.random.Generator, slots: np.ndarray, dtype: Any) -> None:
    c = cache.config
    backend, device = cache.slab.backend, cache.slab.device
    for layer in range(c.num_layers):
        k = DeviceArray.from_numpy(_random(rng, (len(slots), c.num_kv_heads, c.head_dim),
                                           dtype), device, backend)
        v = DeviceArray.from_numpy(_random(rng, k.shape, dtype), device, backend)
        cache.write(layer, k, v, slots)
        k.buffer.root.close()
        v.buffer.root.close()


def _check(cache: KvCache, meta: Any, query: DeviceArray, out: DeviceArray, layer: int,
           index: int) -> None:
    """Sequence ``index`` of the step (its query rows: one, or ``meta.query_lens[index]``)
    against the float64 reference; raises on mismatch."""
    k = cache.k_cache(layer).to_numpy()
    v = cache.v_cache(layer).to_numpy()
    lens = (np.ones(len(meta.seq_ids), np.int32) if meta.query_lens is None
            else meta.query_lens)
    starts = reference.query_starts(lens)
    rows = slice(int(starts[index]), int(starts[index + 1]))
    k_scale, v_scale = cache.config.kv_scales[layer]
    want = reference.paged_attention_multi(
        query.to_numpy()[rows], k, v, meta.block_tables[index : index + 1],
        meta.seq_lens[index : index + 1], lens[index : index + 1],
        1 / math.sqrt(cache.config.head_dim), np.float64, k_scale, v_scale)
    got = out.to_numpy()[rows].astype(np.float64)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    tolerance = 1e-5 if cache.config.activation_dtype == np.float32 else 2e-2
    if not error < tolerance:
        raise AssertionError(f"attention of request {meta.seq_ids[index]} differs from the "
                             f"reference: relative error {error:.2e} > {tolerance}")


def _device_time(backend: Backend, stats: dict[str, Any]) -> dict[str, Any]:
    """The decode step's device time and the host's share of the step, on a GPU; on the host
    backend, which runs the step on the CPU as it is queued, a note instead of figures that
    would read as a device's."""
    if backend.name == "host":
        return {"device_time": "none: the host backend runs each step on the CPU as it is "
                               "queued (decode_step_ms_median is that CPU time)"}
    return {"decode_device_ms_median": statistics.median(stats["device_ms"] or [0.0]),
            "decode_host_share_median": statistics.median(stats["host_share"] or [0.0])}


def _show(shown: Any, finished: int, stats: dict[str, Any]) -> None:
    """Advance the demo's bar to ``finished`` requests, with the pool's state beside it."""
    shown.set_postfix_str(f"blocks {stats['used_blocks']}/{stats['num_blocks']}, "
                          f"preemptions {stats['preemptions']}", refresh=False)
    shown.update(finished - shown.n)
