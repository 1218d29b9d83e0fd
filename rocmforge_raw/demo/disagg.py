"""``rocmforge-raw demo --disaggregated``: one process prefills, another decodes.

A spawned prefill process (``handoff.prefill_worker``) prefills each prompt of a small
Llama (``demo.llama``: float64 math, random weights from the seed; attention through the
cache's multi-token attention, in chunks past the prefix hit) and hands the sequence over:
its description (``export_sequence``) and the first token's logits go through a pipe, its
K/V through the transport (``ipc``: IPC handles on one host; ``mooncake``: Mooncake's
Transfer Engine over TCP on loopback, as between hosts). This process, the decode side,
imports each sequence as it arrives (``import_sequence``: prefix blocks it holds already are
shared, the rest read), acks it (the prefill side then frees it) and continues generating
greedy tokens: every decode step runs over the requests that have arrived and not finished
(continuous batching, arrivals taken between steps).

Then the same prompts run in one process and one cache: the same chunks, the same decode
steps (the batches the decode side ran, replayed), the tokens it generates itself. Both runs
do the same float64 model math in the same batch shapes over the same float32 K/V bytes
(the transport copies bytes), so their logits are bitwise equal where the transfer is right
(measured on the host backend: 0); the check asks for the same tokens and every logits row
within ``TOLERANCE`` relative. The lowest bit of one K value flipped in transit showed as a
relative difference of 3e-8 (measured) in the rows whose float32 attention it changed at all
(it may round away in some); a flipped high byte, as 1e-3 to 1e-2.

Per request: prefill time, transfer time (the sender's export plus the receiver's
import: checks, allocation, the transport's read, of which ``read_ms`` is the read alone),
the handoff latency (export begun to import done, across the two processes: also the pipe
and the wait for the decode loop's next look), bytes and blocks moved and shared, decode
time (import done to last token). ``failures`` says what the run required and did not get.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cache import KvCache
from ..common import progress
from ..errors import BackendUnavailableError
from ..kernels import ops
from ..memory.buffer import memory_stats
from ..memory.waiting import free_waiting
from ..runtime import Backend
from . import handoff
from .handoff import TIMEOUT, Handoff, HandoffError, cache_config, decode_step, prefill, receive
from .llama import Llama, LlamaShape, random_weights

TRANSPORTS = ("ipc", "mooncake")
#: The largest relative difference (2-norm of a logits row) allowed between the two runs.
TOLERANCE = 1e-12
#: The summary's wall-clock figures: all that differs between two runs of one seed (with
#: ``steps`` and ``per_request``, whose timings and decode batches follow the arrivals).
TIMINGS = frozenset({"prefill_ms_per_request", "transfer_ms_per_request",
                     "read_ms_per_request", "first_transfer_ms", "handoff_ms_median",
                     "transfer_gb_per_s",
                     "decode_ms_per_token", "seconds", "one_process_seconds", "handoff"})


@dataclass(frozen=True)
class DisaggConfig:
    """The run's sizes: ``requests`` prompts, every other one opening with the same
    ``system_tokens`` (a prefix both caches share), then ``own_tokens`` of its own (an
    inclusive range); ``new_tokens`` generated each (the first by the prefill side);
    prefill chunks of at most ``chunk`` tokens."""

    requests: int = 6
    system_tokens: int = 48
    own_tokens: tuple[int, int] = (20, 80)
    new_tokens: int = 8
    chunk: int = 32
    block_size: int = 16
    shape: LlamaShape = field(default_factory=LlamaShape)

    @classmethod
    def scaled(cls, scale: float = 1.0) -> DisaggConfig:
        """Six requests times ``scale`` (three at least: two of them share a prefix)."""
        return cls(requests=max(3, round(6 * scale)))


def check_transport(name: str, backend: Backend) -> None:
    """``BackendUnavailableError`` (saying what to install) unless transport ``name`` can
    move ``backend``'s memory here: checked before any process starts."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    if name == "mooncake":
        from ..transport.mooncake import MooncakeTransport, engine_class

        engine_class()  # raises, saying what to install
        if not MooncakeTransport.reaches(backend.name):
            raise BackendUnavailableError(
                f"the installed Mooncake cannot reach {backend.name} memory: install "
                "mooncake-transfer-engine-cuda13 (NVIDIA) or -rocm (AMD), or use "
                "--transport ipc")


def prompts_of(rng: np.random.Generator, config: DisaggConfig) -> list[np.ndarray]:
    """The prompts (token ids): even requests open with one shared system prompt."""
    vocab = config.shape.vocab
    system = rng.integers(0, vocab, config.system_tokens)
    low, high = config.own_tokens
    return [np.concatenate([system if i % 2 == 0 else rng.integers(0, vocab, len(system)),
                            rng.integers(0, vocab, int(rng.integers(low, high + 1)))])
            for i in range(config.requests)]


@dataclass
class _Served:
    """A request on the decode side: its handoff, import, tokens and logits rows."""

    handoff: Handoff
    imported: Any
    import_s: float
    imported_at: float
    prompt_tokens: int
    tokens: list[int]
    logits: list[np.ndarray]
    finished_at: float = 0.0


def run_disaggregated(backend: Backend, device: int = 0, config: DisaggConfig | None = None,
                      seed: int | None = None, transport: str = "ipc") -> dict[str, Any]:
    """Prefill in a spawned process, decode here, then the same in one process; the
    summary (module docstring). A failure of the prefill process raises ``HandoffError``."""
    cfg = config or DisaggConfig()
    check_transport(transport, backend)
    rng = np.random.default_rng(seed)
    prompts = prompts_of(rng, cfg)
    weights_seed = int(rng.integers(1 << 62))
    model = Llama(cfg.shape, random_weights(cfg.shape, weights_seed))
    cache_cfg = cache_config(cfg.shape, prompts, cfg.new_tokens, cfg.block_size)
    live = memory_stats()["live_buffers"]
    started = time.perf_counter()
    served, steps, worker = _disaggregated(backend, device, transport, cfg, cache_cfg, model,
                                           weights_seed, prompts)
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    reference = _one_process(backend, device, cfg, cache_cfg, model, prompts, steps)
    one_process_s = time.perf_counter() - started
    ops.release_staging()
    gc.collect()
    free_waiting()
    mismatches, max_diff = _compare(served, reference)
    rows = [_row(s) for s in served]
    decoded = sum(len(s.tokens) - 1 for s in served)
    summary: dict[str, Any] = {
        "transport": transport, "backend": backend.name,
        "device": backend.properties(device).name,
        "model": f"Llama {cfg.shape.layers} layers, {cfg.shape.heads}/{cfg.shape.kv_heads} "
                 f"heads of {cfg.shape.head_dim}, vocab {cfg.shape.vocab} (float64)",
        "cache_dtype": cache_cfg.dtype.name, "requests": cfg.requests,
        "new_tokens": cfg.new_tokens, "prefill_chunk": cfg.chunk, "steps": len(steps),
        "per_request": rows,
        **_figures(rows),
        # a request's decode time over the tokens it decoded (concurrent requests overlap)
        "decode_ms_per_token": 1e3 * sum(s.finished_at - s.imported_at for s in served)
        / max(decoded, 1),
        "seconds": seconds, "one_process_seconds": one_process_s,
        "logits_rows_compared": sum(len(s.logits) for s in served),
        "max_logits_relative_difference": max_diff, "tolerance": TOLERANCE,
        "mismatches": mismatches, "prefill_exit_code": worker["exit_code"],
        "prefill_used_blocks_after": worker["used_blocks"],
        "prefill_live_buffers_after": worker["live_buffers"],
        "live_buffers_after_teardown": memory_stats()["live_buffers"] - live,
    }
    summary["handoff"] = handoff_line(summary)
    return summary


def _disaggregated(backend: Backend, device: int, transport: str, cfg: DisaggConfig,
                   cache_cfg: Any, model: Llama, weights_seed: int, prompts: list[np.ndarray]
                   ) -> tuple[list[_Served], list[list[int]], dict[str, Any]]:
    """The prefill process started, every request decoded here; (the requests, the decode
    steps' batches, what the prefill process said last and its exit code)."""
    worker, conn = handoff.spawn_prefill(backend.name, device, transport, cache_cfg, cfg.shape,
                                         weights_seed, prompts, cfg.chunk)
    try:
        with handoff.open_transport(transport) as link, KvCache(cache_cfg, device, backend,
                                                        strict=True) as cache:
            served, steps = _decode(cache, link, model, conn, worker, cfg.new_tokens,
                                    len(prompts))
        conn.send("end")  # the slab is unmapped (or unregistered) here: it may go
        word, said = receive(conn, worker)
        if word != "done":
            raise HandoffError(f"the prefill process said {word!r}, not 'done'")
        worker.join(TIMEOUT)
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        if worker.is_alive():
            worker.kill()
            worker.join()
    return served, steps, {**said, "exit_code": worker.exitcode}


def _decode(cache: KvCache, link: Any, model: Llama, conn: Any, worker: Any, new_tokens: int,
            count: int) -> tuple[list[_Served], list[list[int]]]:
    """Import each request as it arrives (waiting only when nothing runs), run decode steps
    over the running ones until each has ``new_tokens``; (requests, steps' batches)."""
    served: list[_Served] = []
    running: list[_Served] = []
    steps: list[list[int]] = []
    with progress.bar(count, "demo: disaggregated", unit="req") as shown:
        while len(served) < count or running:
            while len(served) < count and conn.poll(0 if running else TIMEOUT):
                request = _import(cache, link, receive(conn, worker))
                conn.send(("imported", request.handoff.seq_id))
                served.append(request)
                running.append(request)
            if not running:
                raise HandoffError(f"the prefill process sent nothing in {TIMEOUT:g} s")
            ids = [r.handoff.seq_id for r in running]
            logits = decode_step(model, cache, ids, [r.tokens[-1] for r in running],
                                 [r.prompt_tokens + len(r.tokens) - 1 for r in running])
            steps.append(ids)
            for request, row in zip(running, logits):
                request.logits.append(row)
                request.tokens.append(int(np.argmax(row)))
            for request in [r for r in running if len(r.tokens) == new_tokens]:
                cache.finish(request.handoff.seq_id)
                request.finished_at = time.monotonic()
                running.remove(request)
                shown.update(1)
    return served, steps


def _import(cache: KvCache, link: Any, message: Handoff) -> _Served:
    began = time.perf_counter()
    imported = cache.import_sequence(message.desc, link)
    import_s, imported_at = time.perf_counter() - began, time.monotonic()
    return _Served(message, imported, import_s, imported_at, message.desc.num_tokens,
                   [int(np.argmax(message.logits))], [message.logits])


def _one_process(backend: Backend, device: int, cfg: DisaggConfig, cache_cfg: Any,
                 model: Llama, prompts: list[np.ndarray], steps: list[list[int]]
                 ) -> dict[int, tuple[int, list[int], list[np.ndarray]]]:
    """The same prompts in one cache: the same chunks, then ``steps`` replayed; per request
    (prompt tokens cached, tokens, logits rows)."""
    done: dict[int, tuple[int, list[int], list[np.ndarray]]] = {}
    with KvCache(cache_cfg, device, backend, strict=True) as cache:
        for seq_id, prompt in enumerate(prompts):
            logits, cached, _ = prefill(model, cache, seq_id, prompt, cfg.chunk)
            done[seq_id] = (cached, [int(np.argmax(logits))], [logits])
        for ids in steps:
            tokens = [done[i][1] for i in ids]
            rows = decode_step(model, cache, ids, [t[-1] for t in tokens],
                               [len(prompts[i]) + len(t) - 1 for i, t in zip(ids, tokens)])
            for i, row in zip(ids, rows):
                done[i][2].append(row)
                done[i][1].append(int(np.argmax(row)))
    return done


def _compare(served: list[_Served],
             reference: dict[int, tuple[int, list[int], list[np.ndarray]]]
             ) -> tuple[list[str], float]:
    """What differs between the two runs, a line each (the first difference of a request),
    and the largest relative difference of a logits row."""
    found, largest = [], 0.0
    for request in served:
        seq_id = request.handoff.seq_id
        cached, tokens, rows = reference[seq_id]
        if request.handoff.cached_tokens != cached:
            found.append(f"request {seq_id}'s prefill found {request.handoff.cached_tokens} "
                         f"prompt tokens cached, the one-process run {cached}")
        for step, (got, want) in enumerate(zip(request.logits, rows)):
            diff = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            largest = max(largest, diff if diff == diff else math.inf)  # NaN: the most
            if not diff <= TOLERANCE:
                where = "after prefill" if step == 0 else f"at decode step {step}"
                found.append(f"request {seq_id}'s logits {where} differ from the one-process "
                             f"run: relative difference {diff:.2e} > {TOLERANCE:g}")
                break
        if request.tokens != tokens:
            first = next(i for i, (a, b) in enumerate(zip(request.tokens, tokens)) if a != b)
            found.append(f"request {seq_id}'s tokens differ from the one-process run from "
                         f"token {first} on")
    return found, largest


def _row(request: _Served) -> dict[str, Any]:
    """A request's line of the report (times in ms)."""
    sent, done = request.handoff, request.imported
    return {"request": sent.seq_id, "prompt_tokens": request.prompt_tokens,
            "cached_tokens": sent.cached_tokens, "chunks": sent.chunks,
            "prefill_ms": 1e3 * sent.prefill_s,
            "transfer_ms": 1e3 * (sent.export_s + request.import_s),
            "read_ms": 1e3 * done.seconds,
            "handoff_ms": 1e3 * (request.imported_at - sent.exported_at),
            "bytes": done.nbytes, "blocks_moved": done.blocks_moved,
            "blocks_shared": done.blocks_shared,
            "decode_ms": 1e3 * (request.finished_at - request.imported_at),
            "tokens": request.tokens}


def _figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's figures of the requests: medians a request (the first transfer apart:
    it maps the sender's slab or connects to its engine), totals, and the transfer rate of
    the requests after the first."""
    later = rows[1:] or rows
    moved = sum(r["bytes"] for r in later)
    seconds = sum(r["transfer_ms"] for r in later) / 1e3
    return {"prefill_ms_per_request": statistics.median(r["prefill_ms"] for r in rows),
            "transfer_ms_per_request": statistics.median(r["transfer_ms"] for r in later),
            "read_ms_per_request": statistics.median(r["read_ms"] for r in later),
            "first_transfer_ms": rows[0]["transfer_ms"],
            "handoff_ms_median": statistics.median(r["handoff_ms"] for r in rows),
            "bytes_moved": sum(r["bytes"] for r in rows),
            "blocks_moved": sum(r["blocks_moved"] for r in rows),
            "blocks_shared": sum(r["blocks_shared"] for r in rows),
            "transfer_gb_per_s": moved / seconds / 1e9 if seconds else 0.0}


#: What the first transfer of each transport does besides moving bytes.
_FIRST = {"ipc": "maps the slab", "mooncake": "connects"}


def handoff_line(summary: dict[str, Any]) -> str:
    """The summary's one line: ``demo: handoff over ipc: 6 requests, ...``."""
    mib = summary["bytes_moved"] / 2**20
    equal = ("logits equal to one process" if not summary["mismatches"] else
             f"logits differ from one process (largest relative difference "
             f"{summary['max_logits_relative_difference']:.1e})")
    return (f"demo: handoff over {summary['transport']}: {summary['requests']} requests, "
            f"prefill {summary['prefill_ms_per_request']:.1f} ms/request, transfer "
            f"{summary['transfer_ms_per_request']:.2f} ms/request (the first "
            f"{summary['first_transfer_ms']:.1f} ms: it {_FIRST[summary['transport']]}), "
            f"{mib:.2f} MiB moved ({summary['transfer_gb_per_s']:.3g} GB/s), "
            f"{summary['blocks_shared']} blocks "
            f"shared, decode {summary['decode_ms_per_token']:.1f} ms/token, {equal}")


def failures(summary: dict[str, Any]) -> list[str]:
    """What the run requires and did not get (empty: OK): every logits row and token equal
    to the one-process run's, a prefix shared on both sides, the prefill process done with
    every block back and no buffer live, exit status 0, nothing live here after teardown."""
    found = list(summary["mismatches"])
    if summary["blocks_shared"] == 0:
        found.append("the decode side shared no prefix block of an earlier request")
    if summary["prefill_used_blocks_after"]:
        found.append(f"the prefill process still used {summary['prefill_used_blocks_after']} "
                     f"blocks after every request was handed over")
    if summary["prefill_live_buffers_after"]:
        found.append(f"{summary['prefill_live_buffers_after']} buffers were still live in the "
                     f"prefill process after teardown")
    if summary["prefill_exit_code"] != 0:
        found.append(f"the prefill process exited with status {summary['prefill_exit_code']}")
    if summary["live_buffers_after_teardown"]:
        found.append(f"{summary['live_buffers_after_teardown']} buffers were still live after "
                     f"teardown")
    return found


def outcome(summary: dict[str, Any]) -> str:
    """The words of an OK verdict."""
    return (f"{summary['requests']}/{summary['requests']} requests prefilled in one process "
            f"and decoded in another over {summary['transport']}, "
            f"{summary['logits_rows_compared']} logits rows and every token equal to one "
            f"process (largest relative difference "
            f"{summary['max_logits_relative_difference']:.1e}), the prefill process exited 0 "
            f"with every block back, no buffer live after teardown")


def report_lines(summary: dict[str, Any]) -> list[str]:
    """The per-request table (times in ms, bytes in KiB) and the summary's figures."""
    lines = [f"disaggregated prefill -> decode over {summary['transport']}: "
             f"{summary['model']}, {summary['cache_dtype']} cache, {summary['requests']} "
             f"requests of {summary['new_tokens']} new tokens, prefill chunks of "
             f"{summary['prefill_chunk']}",
             f"{'request':>7} {'prompt':>6} {'cached':>6} {'chunks':>6} {'prefill ms':>10} "
             f"{'transfer ms':>11} {'read ms':>8} {'handoff ms':>10} {'KiB':>7} "
             f"{'moved':>5} {'shared':>6} {'decode ms':>9}"]
    lines += [f"{r['request']:>7} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
              f"{r['chunks']:>6} {r['prefill_ms']:>10.2f} {r['transfer_ms']:>11.2f} "
              f"{r['read_ms']:>8.2f} {r['handoff_ms']:>10.2f} {r['bytes'] / 1024:>7.0f} "
              f"{r['blocks_moved']:>5} {r['blocks_shared']:>6} {r['decode_ms']:>9.2f}"
              for r in summary["per_request"]]
    lines += ["  transfer: the sender's export plus the receiver's import (checks, allocation, "
              "the read);",
              "  read: the transport's read alone; handoff: export begun to import done, across "
              "the processes",
              "  (also the pipe and the decode loop's wait); KiB, moved: bytes and blocks read; "
              "shared: blocks",
              "  the decode side held already (a prefix); decode: import done to the last token",
              f"decode steps {summary['steps']}, {summary['seconds']:.2f} s disaggregated, "
              f"{summary['one_process_seconds']:.2f} s in one process"]
    return lines
