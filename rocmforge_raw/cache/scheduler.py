"""Request lifecycle on a KvCache: admit, decode, preempt and finish, continuous batching.

A request's KV is freed the moment it finishes; finished-request records are bounded by count
and age. Preempted requests go back to the front of the queue and are re-admitted later with
their prompt and the tokens generated so far (recompute).

Admission policy (bounded overtaking): each ``step`` admits waiting requests in queue order
while they fit in free blocks without preempting. A request that does not fit is passed
over and later requests that fit are admitted in its place, but a request is overtaken at
most ``max_overtakes`` times in its life: once it has been, nothing behind it is admitted
until it is. It then waits only for running requests to finish, and it fits once they
have, because ``submit`` refuses any request whose longest context exceeds the whole cache.
``max_overtakes=0`` is strict first-come, first-served.

Backpressure: the queue takes at most ``max_waiting`` submissions. ``submit`` raises
``QueueFullError`` when it is full; ``try_submit`` returns False instead. Preempted requests
re-enter the queue whatever its length (they were accepted already), so it can hold up to
``max_waiting + max_running``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import QueueFullError
from .kv_cache import KvCache
from .records import FinishedRecords


@dataclass
class Request:
    """A generation request: ``prompt_tokens`` in, up to ``max_new_tokens`` out.
    ``overtaken`` counts the later requests admitted while this one waited (bounded by the
    scheduler's ``max_overtakes``)."""

    request_id: Hashable
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0
    preemptions: int = 0
    overtaken: int = 0

    @property
    def context(self) -> int:
        """Tokens whose K/V the cache must hold: prompt plus generated."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        """Whether every new token has been generated."""
        return self.generated >= self.max_new_tokens


@dataclass
class StepPlan:
    """One scheduling step: requests admitted with their prompt slots (prefill), requests
    decoding one token with their new slots, and requests preempted during the step.
    ``step`` numbers the plans of one scheduler; only the latest may be advanced, once."""

    prefill: list[tuple[Request, np.ndarray]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    decode_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    preempted: list[Request] = field(default_factory=list)
    step: int = 0
    _owner: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class FinishedRequest:
    """What is kept of a finished request: when (``clock`` seconds) and its token counts."""

    request_id: Hashable
    finished_at: float
    prompt_tokens: int
    generated: int
    preemptions: int


def _count(value: Any, what: str, least: int) -> int:
    """``value`` as an ``int`` >= ``least`` (NumPy integers too; bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    if value < least:
        raise ValueError(f"{what} must be >= {least}, got {value}")
    return int(value)


class Scheduler:
    """Continuous batching over one cache. Thread-safe: one lock around each whole operation
    (taken before the cache's). Every operation either completes or raises with the queues,
    the requests and the cache as they were: all that can refuse is checked before the
    first change."""

    def __init__(self, cache: KvCache, *, max_running: int = 256, max_waiting: int = 4096,
                 max_overtakes: int = 8, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        if not isinstance(cache, KvCache):
            raise TypeError(f"cache must be a KvCache, not {type(cache).__name__}")
        self.cache, self.clock = cache, clock
        self.max_running = _count(max_running, "max_running", 1)
        self.max_waiting = _count(max_waiting, "max_waiting", 1)
        self.max_overtakes = _count(max_overtakes, "max_overtakes", 0)
        self._lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}
        self._queued: set[Hashable] = set()  # ids in ``waiting``
        self._finished = FinishedRecords(_count(max_finished, "max_finished", 1),
                                         finished_ttl_s, clock)
        self.num_preemptions = 0
        self._step = 0  # number of the latest plan
        self._pending: int | None = None  # number of the plan not yet advanced

    # --- submission --------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue ``request``. Raises ``QueueFullError`` when ``max_waiting`` requests wait,
        and ``TypeError``/``ValueError`` for a request that is malformed, already queued or
        running, or larger than the whole cache."""
        if not self.try_submit(request):
            raise QueueFullError(f"request {request.request_id!r} refused: {self.max_waiting} "
                                 f"requests are waiting (max_waiting); submit it later")

    def try_submit(self, request: Request) -> bool:
        """Queue ``request`` and return True, or return False (changing nothing) when
        ``max_waiting`` requests wait. A bad request raises as in ``submit``."""
        with self._lock:
            self._validate(request)
            seq_id = request.request_id
            if seq_id in self.running or seq_id in self._queued:
                raise ValueError(f"request {seq_id!r} is already queued or running")
            if seq_id in self.cache:
                raise ValueError(f"request {seq_id!r} has the id of a sequence the cache "
                                 "already holds")
            if len(self.waiting) >= self.max_waiting:
                return False
            self.waiting.append(request)
            self._queued.add(seq_id)
            return True

    def _validate(self, request: Request) -> None:
        """Refuse a request the scheduler could never finish; normalise its counts to int."""
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a Request, not {type(request).__name__}")
        try:
            hash(request.request_id)
        except TypeError:
            raise TypeError(f"request id {request.request_id!r} is not hashable") from None
        name = f"request {request.request_id!r}:"
        prompt = _count(request.prompt_tokens, f"{name} prompt_tokens", 1)
        new = _count(request.max_new_tokens, f"{name} max_new_tokens", 1)
        if _count(request.generated, f"{name} generated", 0) >= new:
            raise ValueError(f"{name} generated {request.generated} of {new} new tokens "
                             "already: nothing is left to do")
        config = self.cache.config
        longest = prompt + new - 1  # the last token is generated, never written
        blocks = -(-longest // config.block_size)
        if blocks > config.num_blocks - 1:
            raise ValueError(
                f"{name} {prompt} prompt + {new} new tokens need {blocks} blocks of "
                f"{config.block_size} tokens at their longest, but the whole cache has "
                f"{config.num_blocks - 1}: it could never finish")
        request.prompt_tokens, request.max_new_tokens = prompt, new

    # --- steps -------------------------------------------------------------------------------
    def step(self) -> StepPlan:
        """Reserve one decode slot for every running request (preempting LRU ones when the
        cache is full), then admit waiting requests by the module's policy. The plan
        supersedes any earlier one that was not advanced."""
        with self._lock:
            clash = next((s for s in self.cache.seq_ids() if s in self._queued), None)
            if clash is not None:
                raise ValueError(f"request {clash!r} is waiting but the cache already holds a "
                                 "sequence of that id (added outside the scheduler)")
            plan = StepPlan(step=self._step + 1, _owner=self)
            decoding = list(self.running)
            if decoding:  # the first change; the cache refuses it atomically
                reservation = self.cache.append(decoding)
                self._preempted(reservation.preempted, plan)
                keep = reservation.slot_mapping >= 0
                plan.decode = [self.running[s] for s, k in zip(decoding, keep) if k]
                plan.decode_slots = reservation.slot_mapping[keep]
            self._admit(plan)
            self._step = self._pending = plan.step
            return plan

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order while they fit without preempting; one that
        does not fit may be overtaken until its ``overtaken`` reaches ``max_overtakes``."""
        admitted: list[Request] = []
        passed: list[tuple[Request, int]] = []  # requests passed over, admissions before
        deadline = math.inf  # admissions after which a passed request may not be overtaken
        smallest = math.inf  # blocks of the smallest request that did not fit
        block_size = self.cache.config.block_size
        try:
            for request in list(self.waiting):
                if (len(self.running) >= self.max_running or len(admitted) >= deadline
                        or smallest == 1):
                    break
                need = -(-request.context // block_size)
                if need >= smallest or not self.cache.can_allocate(request.context):
                    smallest = min(smallest, need)
                    passed.append((request, len(admitted)))
                    deadline = min(deadline,
                                   len(admitted) + self.max_overtakes - request.overtaken)
                    continue
                reservation = self.cache.add_sequence(request.request_id, request.context)
                admitted.append(request)
                self._queued.discard(request.request_id)
                self.running[request.request_id] = request
                plan.prefill.append((request, reservation.slot_mapping))
                self._preempted(reservation.preempted, plan)  # only if the cache changed
        finally:  # consistent even if the cache refused under another thread's changes
            for request, before in passed:
                request.overtaken += len(admitted) - before
            if admitted:
                chosen = {id(r) for r in admitted}
                self.waiting = deque(r for r in self.waiting if id(r) not in chosen)

    def advance(self, plan: StepPlan) -> list[Request]:
        """Count one generated token for each request the plan ran; finish (and free the KV
        of) those that are done. Returns the requests finished now. Only the latest plan of
        ``step()`` may be advanced, and only once: any other raises ``ValueError``."""
        with self._lock:
            if not isinstance(plan, StepPlan) or plan._owner is not self:
                raise ValueError(f"plan must come from this scheduler's step(), not "
                                 f"{type(plan).__name__}")
            if plan.step != self._pending:
                why = ("was advanced already" if plan.step == self._step else
                       f"is stale: step {self._step} came after it")
                raise ValueError(f"plan of step {plan.step} {why}; advance each plan once, "
                                 "before the next step()")
            ran = [r for r, _ in plan.prefill] + plan.decode
            ran = [r for r in ran if self.running.get(r.request_id) is r]
            finishing = [r for r in ran if r.generated + 1 >= r.max_new_tokens]
            missing = next((r for r in finishing if r.request_id not in self.cache), None)
            if missing is not None:
                raise KeyError(f"request {missing.request_id!r} is running but its sequence "
                               "left the cache outside the scheduler")
            self._pending = None
            for request in ran:
                request.generated += 1
            for request in finishing:
                self.cache.finish(request.request_id)
                del self.running[request.request_id]
                self._finished.add(request.request_id, FinishedRequest(
                    request.request_id, self.clock(), request.prompt_tokens,
                    request.generated, request.preemptions))
            return finishing

    # --- queries -----------------------------------------------------------------------------
    def finished(self) -> dict[Hashable, FinishedRequest]:
        """Recently finished requests by id, bounded by count and age."""
        with self._lock:
            return self._finished.snapshot()

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        with self._lock:
            return not self.waiting and not self.running

    def _preempted(self, ids: list[Hashable], plan: StepPlan) -> None:
        for seq_id in reversed(ids):  # most recent preemption goes to the very front
            request = self.running.pop(seq_id, None)
            if request is not None:
                request.preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(request)
                self._queued.add(seq_id)
                plan.preempted.append(request)
