"""Request lifecycle on a KvCache: admit, decode, preempt and finish, continuous batching.

A request's KV is freed the moment it finishes; finished-request records are bounded by count
and age. Preempted requests go back to the front of the queue: one the cache swapped out to
its host tier is brought back (``StepPlan.resumed``: nothing to prefill, it decodes from the
next step), another is re-admitted with its prompt and the tokens generated so far
(recompute).

Token ids: a ``Request(tokens=ids)`` is admitted by its ids (``add_sequence(tokens=...)``),
so the blocks the prefix cache holds are shared and only the rest is prefilled
(``Request.num_cached_tokens``; its prefill slots are those of the uncached tokens).
``advance(plan, token_ids)`` takes the id each request of the plan generated; the next
``step`` appends them (``append(..., tokens=...)``), so every block a conversation fills is
named by its prefix and a follow-up request repeating the conversation hits all of it. An
id not given is unknown (-1): that request's later blocks are not named, and if it is
preempted and dropped it is re-admitted by count.

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

Ownership: a submitted ``Request`` belongs to the scheduler until it finishes or is aborted:
its fields are read-only to everyone else then (a change would stall or corrupt the queue;
copies are not submitted). ``abort(request_id)`` drops a request in any state, frees its KV
and records why. Every operation checks everything that can refuse, reads the clocks (its
own and the cache's, once) and takes the cache's lock before its first change, so it either
completes or raises with the queues, the requests, the records and the cache as they were.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ...common import checks
from ...errors import QueueFullError
from ..blocks import prefix
from ..kv_cache import KvCache
from ..records import FinishedRecords
from .admission import Admission
from .requests import COUNTS, Chunk, FinishedRequest, Request, StepPlan, set_fields


class Scheduler(Admission):
    """Continuous batching over one cache. Thread-safe: one lock around each whole operation
    (taken before the cache's, which each operation holds throughout). Every operation
    either completes or raises with the queues, the requests and the cache as they were: all
    that can refuse is checked before the first change."""

    def __init__(self, cache: KvCache, *, max_running: int = 256, max_waiting: int = 4096,
                 max_overtakes: int = 8, max_finished: int = 1024,
                 finished_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 max_batched_tokens: int | None = None) -> None:
        if not isinstance(cache, KvCache):
            raise TypeError(f"cache must be a KvCache, not {type(cache).__name__}")
        self.max_batched_tokens = (None if max_batched_tokens is None else
                                   checks.integer(max_batched_tokens, "max_batched_tokens", 1))
        self.max_running = checks.integer(max_running, "max_running", 1)
        self.max_waiting = checks.integer(max_waiting, "max_waiting", 1)
        self.max_overtakes = checks.integer(max_overtakes, "max_overtakes", 0)
        self._finished = FinishedRecords(max_finished, finished_ttl_s, clock, least=1)
        self.cache = cache
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()  # read as ``waiting``, ``running``
        self._running: dict[Hashable, Request] = {}
        self._queued: dict[Hashable, Request] = {}  # the requests in ``waiting``, by id
        self._swapped: set[Hashable] = set()  # ids in ``waiting`` the cache swapped out
        self.num_preemptions = 0
        self._step = 0  # number of the latest plan
        self._pending: int | None = None  # number of the plan not yet advanced
        self._pending_ran: list[Request] = []  # the requests that plan ran

    @property
    def waiting(self) -> tuple[Request, ...]:
        """The queue, first to be admitted first (preempted requests at the front)."""
        return tuple(self._waiting)

    @property
    def running(self) -> Mapping[Hashable, Request]:
        """The running requests by id, in admission order (a read-only view)."""
        return MappingProxyType(self._running)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the finished records (seconds), checked when set."""
        return self._finished.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._finished.clock = checks.function(clock, "clock", "a callable returning seconds")

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
            counts = self._validate(request)
            seq_id = request.request_id
            if seq_id in self._running or seq_id in self._queued:
                raise ValueError(f"request {seq_id!r} is already queued or running")
            if seq_id in self.cache:
                raise ValueError(f"request {seq_id!r} has the id of a sequence the cache "
                                 "already holds")
            if len(self._waiting) >= self.max_waiting:
                return False
            set_fields(request, **counts, _owner=self)  # with its ids checked
            self._waiting.append(request)
            self._queued[seq_id] = request
            return True

    def _validate(self, request: Request) -> dict[str, Any]:
        """Refuse a request the scheduler could never finish, or one a scheduler holds;
        return its counts as ints (and its token ids, checked, as int64)."""
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a Request, not {type(request).__name__}")
        checks.hashable(request.request_id, "request_id")
        if request.__dict__.get("_owner") is not None:
            raise ValueError(f"request {request.request_id!r} was submitted already and has "
                             "not finished")
        name = f"request {request.request_id!r}:"
        values: dict[str, Any] = {}
        if request.tokens is not None:
            # a copy: the caller's array may change after submit, the request's may not
            tokens = prefix.token_ids(request.tokens, f"{name} tokens").copy()
            tokens.flags.writeable = False
            if request.prompt_tokens not in (0, tokens.size):
                raise ValueError(f"{name} prompt_tokens {request.prompt_tokens} differs from "
                                 f"its {tokens.size} token ids")
            values.update(tokens=tokens, prompt_tokens=int(tokens.size))
        counts = {c: checks.integer(values.get(c, getattr(request, c)), f"{name} {c}",
                                    1 if c.endswith("tokens") else 0) for c in COUNTS}
        prompt, new = counts["prompt_tokens"], counts["max_new_tokens"]
        if counts["generated"] >= new:
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
        return {**values, **counts}

    # --- steps -------------------------------------------------------------------------------
    def step(self) -> StepPlan:
        """Reserve one decode slot for every running request that has computed its context
        (preempting LRU ones when the cache is full), then the next prefill chunk of those
        still prefilling, then admit waiting requests by the module's policy; with
        ``max_batched_tokens``, within that many tokens (decodes first, ``admission``). The
        plan supersedes any earlier one that was not advanced."""
        with self._lock, self.cache._lock:
            held = set(self.cache.seq_ids())
            clash = next((s for s in self._queued if s in held and s not in self._swapped),
                         None)
            if clash is not None:
                raise ValueError(f"request {clash!r} is waiting but the cache already holds a "
                                 "sequence of that id (added outside the scheduler)")
            self._check_running(held)
            self._moved_outside(held)
            now = self.cache._now()  # the cache's one clock read, before the first change
            budget = math.inf if self.max_batched_tokens is None else self.max_batched_tokens
            decode, slots = [], np.zeros(0, np.int64)
            chunks: list[Chunk] = []
            preempted: list[Request] = []
            resumed: list[Request] = []
            with self.cache._at(now):
                decoding = [s for s, r in self._running.items()
                            if r.context - r.num_computed_tokens <= 1][: int(min(budget, 1 << 62))]
                if decoding:  # the first change; the cache refuses it atomically
                    reservation = self.cache.append(decoding, tokens=self._last_ids(decoding))
                    self._preempted(reservation, preempted)
                    keep = reservation.slot_mapping >= 0
                    decode = [self._running[s] for s, k in zip(decoding, keep) if k]
                    slots = reservation.slot_mapping[keep]
                    for request in decode:
                        set_fields(request, num_computed_tokens=request.num_computed_tokens + 1)
                    budget -= len(decode)
                budget -= self._continue(chunks, preempted, budget, alone=not decode)
                self._admit(chunks, preempted, resumed, bool(decoding or chunks), budget)
            plan = StepPlan([(c.request, c.slots) for c in chunks], decode, slots, preempted,
                            self._step + 1, self, resumed, chunks)
            self._step = self._pending = plan.step
            self._pending_ran = plan.generating
            return plan

    def _check_running(self, held: set[Hashable]) -> None:
        """Every running request still has its sequence in the cache (ids ``held``)."""
        lost = next((s for s in self._running if s not in held), None)
        if lost is not None:
            raise KeyError(f"request {lost!r} is running but its sequence left the cache "
                           f"outside the scheduler: abort({lost!r}) drops it")

    def advance(self, plan: StepPlan, token_ids: Any = None) -> list[Request]:
        """Count one generated token for each request the plan ran; finish (and free the KV
        of) those that are done. Returns the requests finished now. Only the latest plan of
        ``step()`` may be advanced, and only once: any other raises ``ValueError``.
        ``token_ids``: the id each request generated, in the plan's order (its prefill
        requests, then its decode requests); without them the ids are unknown (-1)."""
        with self._lock, self.cache._lock:
            if not isinstance(plan, StepPlan) or plan._owner is not self:
                raise ValueError(f"plan must come from this scheduler's step(), not "
                                 f"{type(plan).__name__}")
            if plan.step != self._pending:
                why = ("was advanced already" if plan.step == self._step else
                       f"is stale: step {self._step} came after it")
                raise ValueError(f"plan of step {plan.step} {why}; advance each plan once, "
                                 "before the next step()")
            ids = self._generated_ids(token_ids, len(self._pending_ran))
            kept = [(r, i) for r, i in zip(self._pending_ran, ids)
                    if self._running.get(r.request_id) is r]
            ran = [r for r, _ in kept]
            finishing = [r for r in ran if r.generated + 1 >= r.max_new_tokens]
            missing = next((r for r in finishing if r.request_id not in self.cache), None)
            if missing is not None:
                raise KeyError(f"request {missing.request_id!r} is running but its sequence "
                               "left the cache outside the scheduler")
            if finishing:  # every clock read before the first change
                now, cache_now = self._finished.now(), self.cache._now()
            self._pending, self._pending_ran = None, []
            for request, token in kept:
                set_fields(request, generated=request.generated + 1)
                request.output_tokens.append(token)  # the owner's list, in place
            for request in finishing:
                with self.cache._at(cache_now):
                    self.cache.finish(request.request_id)
                del self._running[request.request_id]
                self._retire(request, now, "done")
            return finishing

    def abort(self, request_id: Hashable) -> FinishedRequest:
        """Drop ``request_id`` whatever its state: waiting (preempted included) or running.
        Its KV is freed at once if the cache still holds it (once: a second abort raises
        ``KeyError``, as does an id the scheduler does not hold), the request is released
        (its fields writable again) and a finished record with reason "aborted" stays."""
        with self._lock, self.cache._lock:
            checks.hashable(request_id, "request_id")
            request = self._running.get(request_id)
            if request is None:
                request = self._queued.get(request_id)
            if request is None:
                raise KeyError(f"request {request_id!r} is neither waiting nor running here")
            now = self._finished.now()  # before the first change
            if request_id in self._running:
                if request_id in self.cache:
                    self.cache.remove(request_id)  # no clock read, cannot fail now
                del self._running[request_id]
            else:
                if request.swapped and request_id in self.cache:
                    self.cache.remove(request_id)  # its host-tier blocks
                del self._queued[request_id]
                self._swapped.discard(request_id)
                self._waiting = deque(r for r in self._waiting if r is not request)
            return self._retire(request, now, "aborted")

    def _retire(self, request: Request, now: float, reason: str) -> FinishedRequest:
        """Record ``request`` as finished for ``reason`` and give it back to its caller."""
        record = FinishedRequest(request.request_id, now, request.prompt_tokens,
                                 request.generated, request.preemptions, reason)
        self._finished.add(request.request_id, record, now)
        set_fields(request, _owner=None)
        return record

    # --- queries -----------------------------------------------------------------------------
    def finished(self) -> dict[Hashable, FinishedRequest]:
        """Recently finished (or aborted) requests by id, bounded by count and age."""
        with self._lock:
            return self._finished.snapshot()

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        with self._lock:
            return not self._waiting and not self._running

    @staticmethod
    def _generated_ids(token_ids: Any, count: int) -> list[int]:
        """``token_ids`` checked as ``count`` ids (None: ``count`` unknown ids, -1)."""
        if token_ids is None:
            return [-1] * count
        ids = np.asarray(token_ids)
        if ids.shape != (count,) or (count and ids.dtype.kind not in "iu"):
            raise ValueError(f"token_ids must be {count} integer ids, one per request the plan "
                             f"ran, got {ids.dtype} of shape {ids.shape}")
        if not count:
            return []
        # ids >= 0 that fit int64 (-1: not known), as every later step reads them
        checked: list[int] = prefix.token_ids(ids, "token_ids", least=-1).tolist()
        return checked
