"""Request lifecycle on a KvCache: admit, decode, preempt and finish, continuous batching.

A request's KV is freed the moment it finishes; finished-request records are bounded by count
and age. Preempted requests go back to the front of the queue and are re-admitted later with
their prompt and the tokens generated so far (recompute).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import KvCache
from .records import FinishedRecords


@dataclass
class Request:
    """A generation request: ``prompt_tokens`` in, up to ``max_new_tokens`` out."""

    request_id: Hashable
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0
    preemptions: int = 0

    @property
    def context(self) -> int:
        """Tokens whose K/V the cache must hold: prompt plus generated."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens


@dataclass
class StepPlan:
    """One scheduling step: requests admitted with their prompt slots (prefill), requests
    decoding one token with their new slots, and requests preempted during the step."""

    prefill: list[tuple[Request, np.ndarray]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    decode_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    preempted: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: Hashable
    finished_at: float
    prompt_tokens: int
    generated: int
    preemptions: int


class Scheduler:
    """Continuous batching over one cache. Thread-safe (one lock per operation)."""

    def __init__(self, cache: KvCache, *, max_running: int = 256, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.cache, self.max_running, self.clock = cache, max_running, clock
        self._lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}
        self._finished = FinishedRecords(max_finished, finished_ttl_s, clock)
        self.num_preemptions = 0

    def submit(self, request: Request) -> None:
        if request.prompt_tokens < 1 or request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r} needs >= 1 prompt token and >= 1 "
                             f"new token, got {request.prompt_tokens} and "
                             f"{request.max_new_tokens}")
        with self._lock:
            if request.request_id in self.running or any(
                    r.request_id == request.request_id for r in self.waiting):
                raise ValueError(f"request {request.request_id!r} is already queued or running")
            self.waiting.append(request)

    def step(self) -> StepPlan:
        """Reserve one decode slot for every running request (preempting LRU ones when the
        cache is full), then admit waiting requests whose context fits without preempting."""
        with self._lock:
            plan = StepPlan()
            decoding = list(self.running)
            if decoding:
                reservation = self.cache.append(decoding)
                self._preempted(reservation.preempted, plan)
                keep = reservation.slot_mapping >= 0
                plan.decode = [self.running[s] for s, k in zip(decoding, keep) if k]
                plan.decode_slots = reservation.slot_mapping[keep]
            while (self.waiting and len(self.running) < self.max_running
                   and self.cache.can_allocate(self.waiting[0].context)):
                request = self.waiting.popleft()
                slots = self.cache.add_sequence(request.request_id, request.context).slot_mapping
                self.running[request.request_id] = request
                plan.prefill.append((request, slots))
            return plan

    def advance(self, plan: StepPlan) -> list[Request]:
        """Count one generated token for each request the plan ran; finish (and free the KV
        of) those that are done. Returns the requests finished now."""
        with self._lock:
            done = []
            for request in [r for r, _ in plan.prefill] + plan.decode:
                if request.request_id not in self.running:
                    continue
                request.generated += 1
                if request.done:
                    self.cache.finish(request.request_id)
                    del self.running[request.request_id]
                    self._finished.add(request.request_id, FinishedRequest(
                        request.request_id, self.clock(), request.prompt_tokens,
                        request.generated, request.preemptions))
                    done.append(request)
            return done

    def finished(self) -> dict[Hashable, FinishedRequest]:
        with self._lock:
            return self._finished.snapshot()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.waiting and not self.running

    def _preempted(self, ids: list[Hashable], plan: StepPlan) -> None:
        for seq_id in reversed(ids):  # most recent preemption goes to the very front
            request = self.running.pop(seq_id, None)
            if request is not None:
                request.preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(request)
                plan.preempted.append(request)
