"""What the Scheduler's steps are made of: a step's chunks of prefill for the running requests
that are still prefilling, the admission of waiting requests (bounded overtaking, a prefix
hit's cached tokens skipped), and the bookkeeping of preempted requests.

Chunked prefill (``max_batched_tokens``): a step spends its token budget on the decodes
first (one token each), then on the next chunk of each running request that is still
prefilling (in admission order), then on admissions, each taking as much of its context as
the budget has left (past the tokens the prefix cache holds). A running request's chunk
grows its sequence by ``extend`` only as far as the cache has room without preempting
(``KvCache.room``): a chunk never evicts work of the same step. Without a budget a request
is admitted with its whole context, as before chunks.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from ...errors import CacheFullError
from .requests import Chunk, Request, set_fields


class Admission:
    """The Scheduler's chunking, admission and preemption bookkeeping (module docstring);
    the attributes are the Scheduler's."""

    cache: Any
    max_running: int
    max_overtakes: int
    max_batched_tokens: int | None
    num_preemptions: int
    _waiting: deque[Request]
    _running: dict[Hashable, Request]
    _queued: dict[Hashable, Request]
    _swapped: set[Hashable]

    def _continue(self, chunks: list[Chunk], preempted: list[Request], budget: float,
                  alone: bool) -> int:
        """The next chunk of each running request still prefilling, in admission order,
        within ``budget`` tokens and the cache's room; returns the tokens they take. Where
        the step has nothing else to run (``alone``: no decodes) and the first of them has
        no room, it preempts others (LRU) to make some: requests that only wait for room
        would wait for ever."""
        used = 0
        for request in list(self._running.values()):
            if self._running.get(request.request_id) is not request:
                continue  # preempted by an earlier chunk of this step
            start = request.num_computed_tokens
            need = request.context - start
            if need <= 1 or budget - used <= 0:
                continue
            count = int(min(need, budget - used, self.cache.room(request.request_id)))
            if count < 1:
                if not (alone and not chunks):
                    continue  # no room now: it waits (decodes and finishes make room)
                count = int(min(need, budget - used))  # room made by preempting others
            ids = request.context_ids()
            try:
                reservation = self.cache.extend(
                    [request.request_id], [count],
                    tokens=None if ids is None else ids[start: start + count])
            except CacheFullError:
                continue
            self._preempted(reservation, preempted)
            set_fields(request, num_computed_tokens=start + count)
            chunks.append(Chunk(request, start, reservation.slot_mapping,
                                start + count == request.context))
            used += count
        return used

    def _admit(self, chunks: list[Chunk], preempted: list[Request], resumed: list[Request],
               changed: bool, budget: float) -> None:
        """Admit waiting requests in queue order while they fit without preempting and the
        step's ``budget`` (tokens) lasts (one the cache swapped out is swapped back in); one
        that does not fit may be overtaken until its ``overtaken`` reaches
        ``max_overtakes``. With the cache's lock held and its clock read, an admission
        cannot fail; if it did after the step ``changed`` anything, admission stops there
        (with a warning) and the step keeps what it did rather than raise half done."""
        admitted: list[Request] = []
        passed: list[tuple[Request, int]] = []  # requests passed over, admissions before
        deadline = math.inf  # admissions after which a passed request may not be overtaken
        smallest = math.inf  # blocks of the smallest request that did not fit
        block_size = self.cache.config.block_size
        try:
            for request in list(self._waiting):
                if (len(self._running) >= self.max_running or len(admitted) >= deadline
                        or smallest == 1 or budget <= 0):
                    break
                ids = request.context_ids()
                end = self._first_end(request, ids, budget)
                need = -(-end // block_size)
                if need >= smallest or not self._fits(request, ids, end):
                    smallest = min(smallest, need)
                    passed.append((request, len(admitted)))
                    deadline = min(deadline,
                                   len(admitted) + self.max_overtakes - request.overtaken)
                    continue
                if request.swapped:  # it fits: swap_in never preempts
                    if self.cache.is_swapped(request.request_id):  # (else a call outside
                        self.cache.swap_in([request.request_id])   # swapped it in already)
                    set_fields(request, swapped=False)
                    self._swapped.discard(request.request_id)
                    resumed.append(request)
                else:
                    reservation = (self.cache.add_sequence(request.request_id, tokens=ids[:end])
                                   if ids is not None else
                                   self.cache.add_sequence(request.request_id, end))
                    cached = reservation.num_cached_tokens
                    set_fields(request, num_cached_tokens=cached, num_computed_tokens=end)
                    chunks.append(Chunk(request, cached, reservation.slot_mapping[cached:],
                                        end == request.context))
                    budget -= end - cached
                    self._preempted(reservation, preempted)  # only if the cache lied
                admitted.append(request)
                del self._queued[request.request_id]
                self._running[request.request_id] = request
        except Exception as exc:
            if not (changed or admitted):
                raise
            warnings.warn(f"admission stopped: {exc!r}", RuntimeWarning, stacklevel=3)
        finally:  # consistent whatever happened
            for request, before in passed:
                set_fields(request, overtaken=request.overtaken + len(admitted) - before)
            if admitted:
                chosen = {id(r) for r in admitted}
                self._waiting = deque(r for r in self._waiting if id(r) not in chosen)

    def _moved_outside(self, held: set[Hashable]) -> None:
        """Take in what calls outside the scheduler did to its requests' sequences (``held``:
        the ids the cache holds). A running request swapped out waits at the front of the
        queue to be swapped back in, as if the cache had preempted it; a waiting one whose
        swapped-out sequence was removed lost its KV and computes its context again, as a
        request the cache dropped. (One swapped back in resumes as it is at admission.)"""
        out = set(self.cache.swapped_ids()) if self._running else set()
        for seq_id in [s for s in self._running if s in out]:
            request = self._running.pop(seq_id)
            set_fields(request, swapped=True)
            self._swapped.add(seq_id)
            self._waiting.appendleft(request)
            self._queued = {seq_id: request} | self._queued
        for seq_id in [s for s in self._swapped if s not in held]:
            set_fields(self._queued[seq_id], swapped=False, num_computed_tokens=0)
            self._swapped.discard(seq_id)

    def _first_end(self, request: Request, ids: np.ndarray | None, budget: float) -> int:
        """Where an admission's first chunk ends: the whole context without a budget; else
        the tokens the cache holds of it plus what the budget allows."""
        if self.max_batched_tokens is None or request.swapped:
            return request.context
        cached = self.cache.cached_tokens(ids) if ids is not None else 0
        return int(min(request.context, cached + budget))

    def _fits(self, request: Request, ids: np.ndarray | None, end: int) -> bool:
        """Whether ``request`` can be admitted now, its first ``end`` tokens, without
        preempting."""
        if request.swapped:
            seq_id = request.request_id
            return not self.cache.is_swapped(seq_id) or bool(self.cache.can_swap_in([seq_id]))
        if ids is not None:
            return bool(self.cache.can_allocate(tokens=ids[:end]))
        return bool(self.cache.can_allocate(end))

    def _last_ids(self, decoding: list[Hashable]) -> np.ndarray | None:
        """The id of each decoding request's newest token (-1: unknown), for ``append``;
        None when no request was given by its ids."""
        requests = [self._running[s] for s in decoding]
        if all(r.tokens is None for r in requests):
            return None
        return np.array([r.output_tokens[-1] if r.tokens is not None and r.output_tokens
                         else -1 for r in requests], np.int64)

    def _preempted(self, reservation: Any, preempted: list[Request]) -> None:
        swapped, front = set(reservation.swapped), []
        for seq_id in reversed(reservation.preempted):  # most recent goes to the very front
            request = self._running.pop(seq_id, None)
            if request is not None:
                kept = seq_id in swapped  # a dropped request computes its context again
                set_fields(request, preemptions=request.preemptions + 1, swapped=kept,
                           num_computed_tokens=request.num_computed_tokens if kept else 0)
                if kept:
                    self._swapped.add(seq_id)
                self.num_preemptions += 1
                self._waiting.appendleft(request)
                front.append(request)
                preempted.append(request)
        if front:  # ``_queued`` keeps ``waiting``'s order: the preempted at its front too
            self._queued = {r.request_id: r for r in reversed(front)} | self._queued
