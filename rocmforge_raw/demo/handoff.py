"""The two sides of the disaggregated demo (``demo.disagg``) and what they share: a prompt
prefilled through the cache in chunks (``prefill``), a decode step (``decode_step``), the
cache both sides use (``cache_config``), the transports (``open_transport``), and the
prefill process itself (``prefill_worker``), which the decode side spawns
(``spawn_prefill``) and hears from (``receive``).

The prefill process owns a cache whose slab it publishes through the transport (IPC: a
shareable slab; Mooncake: the slab registered with its engine), and runs one chunk through
the model first (a warm-up: its one-off costs are no request's). For each prompt, in order:
prefill in chunks of at most ``chunk`` tokens past the prefix hit (the multi-token
attention: ``batch(ids, query_lens=)``), the first token's logits from the last row,
``export_sequence``, a ``Handoff`` sent to the decode side; then it waits for the decode
side's ack and finishes the sequence (its blocks go back to the pool, their prefix hashes
kept: a later prompt sharing the prefix finds them). After the last prompt it waits for
``"end"`` (sent once the decode side let go of its slab), closes everything, and sends
``("done", {...})``: the blocks still used, the live buffers left. An exception goes to the
decode side as ``("error", traceback)``.

Cross-process timestamps are ``time.monotonic()``: one system-wide clock on Linux.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache import CacheConfig, KvCache
from ..cache.transfer.transport import Transport
from ..common import workers
from ..common.workers import WorkerError
from ..memory.buffer import memory_stats
from ..memory.waiting import free_waiting
from ..runtime import get_backend
from .llama import Llama, LlamaShape, random_weights

#: Seconds either side waits for the other before it gives up (never hangs).
TIMEOUT = 300.0


class HandoffError(WorkerError):
    """The prefill process failed (its traceback is logged), ended early or went silent."""


@dataclass(frozen=True)
class Handoff:
    """What the prefill side sends for one prompt: the sequence's description (the bytes stay
    in its slab until acked), the last prompt row's logits (the first token's), the prompt
    tokens the prefix cache held, the chunks computed, and its times: prefill and export
    seconds, and when the export began (``time.monotonic()``)."""

    seq_id: int
    desc: Any
    logits: np.ndarray
    cached_tokens: int
    chunks: int
    prefill_s: float
    export_s: float
    exported_at: float


def cache_config(shape: LlamaShape, prompts: Sequence[np.ndarray], new_tokens: int,
                 block_size: int) -> CacheConfig:
    """The cache of both sides (and of the one-process run): float32 K/V of the model's
    layers and heads, room for every prompt and its new tokens at once (no preemption, and
    no cached prefix reused before the last prompt)."""
    blocks = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) + 1
    return CacheConfig(shape.layers, shape.kv_heads, shape.head_dim, block_size, blocks,
                       "float32", num_q_heads=shape.heads)


def open_transport(name: str) -> Transport:
    """The transport ``name`` (``ipc``, or ``mooncake``: an engine on loopback, TCP)."""
    from ..transport import IpcTransport, MooncakeTransport

    return IpcTransport() if name == "ipc" else MooncakeTransport("127.0.0.1")


def prefill(model: Llama, cache: KvCache, seq_id: Hashable, prompt: np.ndarray,
            chunk: int) -> tuple[np.ndarray, int, int]:
    """Add ``prompt`` (token ids) to ``cache`` as ``seq_id`` and compute it in chunks of at
    most ``chunk`` tokens past the prefix hit, each chunk one step of the multi-token
    attention. Returns (the last row's logits, the prompt tokens the cache held, chunks)."""
    start = cache.cached_tokens(prompt)
    end = min(len(prompt), start + chunk)
    cached = start = cache.add_sequence(seq_id, tokens=prompt[:end]).num_cached_tokens
    chunks = 0
    while True:
        meta = cache.batch([seq_id], query_lens=[end - start])
        logits = model.step(cache, meta, prompt[start:end], np.arange(start, end))
        chunks += 1
        if end == len(prompt):
            return logits[-1], cached, chunks
        start, end = end, min(len(prompt), end + chunk)
        cache.extend([seq_id], [end - start], tokens=prompt[start:end])


def decode_step(model: Llama, cache: KvCache, seq_ids: Sequence[Hashable], tokens: list[int],
                positions: list[int]) -> np.ndarray:
    """One decode step: ``tokens[i]`` (at ``positions[i]``) appended to ``seq_ids[i]``;
    the logits of each, ``[len(seq_ids), vocab]``."""
    cache.append(list(seq_ids))
    meta = cache.batch(list(seq_ids))
    return model.step(cache, meta, np.asarray(tokens), np.asarray(positions))


def receive(conn: Any, process: Any, timeout: float = TIMEOUT) -> Any:
    """The prefill process's next message; ``HandoffError`` if it failed (its last line;
    the whole traceback is logged), ended, or sent nothing in ``timeout`` seconds."""
    return workers.receive(conn, process, "the prefill process", timeout, HandoffError)


def spawn_prefill(backend: str, device: int, transport: str, config: CacheConfig,
                  shape: LlamaShape, weights_seed: int, prompts: list[np.ndarray], chunk: int
                  ) -> tuple[Any, Any]:
    """Start the prefill process (``prefill_worker``, spawned: a fresh interpreter, on one
    BLAS thread); (the process, this side's end of its pipe)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=prefill_worker, daemon=True, args=(
        backend, device, transport, config, shape, weights_seed, prompts, chunk, child))
    with _one_blas_thread():
        worker.start()
    child.close()  # the worker's end is its own: its exit reads as end of file here
    return worker, conn


#: The thread-count variables of the BLAS libraries NumPy may be built with.
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """A process spawned in the body runs NumPy's BLAS on one thread (unless the user set
    its thread count): the model's matrices are small, and two processes' thread pools on
    one host only fight (measured on the host backend, 2 busy cores: the prefill took 10 to
    30 times as long with the default pool)."""
    saved = {name: os.environ.get(name) for name in _BLAS_THREADS}
    for name in _BLAS_THREADS:
        os.environ.setdefault(name, "1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)


def prefill_worker(backend: str, device: int, transport: str, config: CacheConfig,
                   shape: LlamaShape, weights_seed: int, prompts: list[np.ndarray],
                   chunk: int, conn: Any) -> None:
    """The prefill process (module docstring); ``conn`` is its end of the pipe."""
    with workers.reporting(conn):
        _prefill_all(backend, device, transport, config, shape, weights_seed, prompts, chunk,
                     conn)


def _prefill_all(backend: str, device: int, transport: str, config: CacheConfig,
                 shape: LlamaShape, weights_seed: int, prompts: list[np.ndarray], chunk: int,
                 conn: Any) -> None:
    model = Llama(shape, random_weights(shape, weights_seed))
    target = get_backend(backend)
    with open_transport(transport) as link, KvCache(
            config, device, target, strict=True, shareable=transport == "ipc") as cache:
        link.publish(cache.slab)
        _warm_up(model, cache, chunk)
        for seq_id, prompt in enumerate(prompts):
            began = time.perf_counter()
            logits, cached, chunks = prefill(model, cache, seq_id, prompt, chunk)
            exported_at = time.monotonic()
            prefilled = time.perf_counter()
            desc = cache.export_sequence(seq_id)
            conn.send(Handoff(seq_id, desc, logits, cached, chunks, prefilled - began,
                              time.perf_counter() - prefilled, exported_at))
            _expect(conn, ("imported", seq_id))  # the decode side has the bytes
            cache.finish(seq_id)
        used = cache.stats()["used_blocks"]
        _expect(conn, "end")  # the decode side let go of the slab
    gc.collect()
    free_waiting()
    conn.send(("done", {"used_blocks": used, "live_buffers": memory_stats()["live_buffers"]}))


def _warm_up(model: Llama, cache: KvCache, chunk: int) -> None:
    """One chunk through the model and the cache, then gone (its blocks unnamed): the
    process's one-off costs (first launches, staging) are not the first request's."""
    cache.add_sequence("warm-up", num_tokens=chunk)
    meta = cache.batch(["warm-up"], query_lens=[chunk])
    model.step(cache, meta, np.zeros(chunk, np.int64), np.arange(chunk))
    cache.remove("warm-up")


def _expect(conn: Any, word: Any) -> None:
    """Wait for the decode side's ``word``; ``RuntimeError`` for anything else."""
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"the decode side sent nothing in {TIMEOUT:g} s")
    message = conn.recv()
    if message != word:
        raise RuntimeError(f"the decode side sent {message!r}, not {word!r}")
