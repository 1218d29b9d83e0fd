"""What the Scheduler works with: ``Request`` (a prompt and its generation, owned by the
scheduler once submitted: its fields are read-only to everyone else), ``StepPlan`` (one
scheduling step) and ``FinishedRequest`` (what is kept of a finished one)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The counts of a Request, checked as integers when it is submitted.
COUNTS = ("prompt_tokens", "max_new_tokens", "generated", "preemptions", "overtaken")


@dataclass
class Request:
    """A generation request: ``prompt_tokens`` in (or the prompt's ids, ``tokens``: then
    ``prompt_tokens`` may be left 0), up to ``max_new_tokens`` (>= 1) out. ``overtaken``
    counts the later requests admitted while this one waited (bounded by the scheduler's
    ``max_overtakes``). The scheduler keeps the ids generated (``output_tokens``, -1 where
    unknown), the prompt tokens the prefix cache held at admission (``num_cached_tokens``),
    the tokens of its context the cache holds as of the latest step (``num_computed_tokens``:
    a chunked prefill's progress) and whether the request is swapped out. Read-only while a
    scheduler holds it (see the module)."""

    request_id: Hashable
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    generated: int = 0
    preemptions: int = 0
    overtaken: int = 0
    tokens: Any = None
    output_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    swapped: bool = False
    num_computed_tokens: int = 0

    @property
    def context(self) -> int:
        """Tokens whose K/V the cache must hold: prompt plus generated."""
        return self.prompt_tokens + self.generated

    def context_ids(self) -> np.ndarray | None:
        """The ids of the context (prompt, then generated), or None where not all known."""
        if self.tokens is None or len(self.output_tokens) != self.generated or (
                self.generated and min(self.output_tokens) < 0):
            return None
        return np.concatenate([self.tokens, np.asarray(self.output_tokens, np.int64)])

    @property
    def done(self) -> bool:
        """Whether every new token has been generated."""
        return self.generated >= self.max_new_tokens

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_change(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_change(name)
        object.__delattr__(self, name)

    def _refuse_change(self, name: str) -> None:
        if self.__dict__.get("_owner") is not None:
            raise AttributeError(
                f"request {self.request_id!r} belongs to a Scheduler since it was submitted: "
                f"its {name} cannot change (abort() it first, or submit a new Request)")

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles are not submitted: they leave the owner behind."""
        return {k: v for k, v in self.__dict__.items() if k != "_owner"}


def set_fields(request: Request, **values: Any) -> None:
    """The owner's change of ``request``'s fields."""
    for name, value in values.items():
        object.__setattr__(request, name, value)


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. start + len(slots) - 1`` of ``request``'s context (prompt, then
    generated) that a step computes, with their slots; ``last``: they end the context (the
    step's output for its last token gives the request's next token)."""

    request: Request
    start: int
    slots: np.ndarray
    last: bool

    @property
    def end(self) -> int:
        """The context position after the chunk's last token."""
        return self.start + len(self.slots)


@dataclass(frozen=True)
class StepPlan:
    """One scheduling step: requests admitted or continuing their prefill with the slots of
    the prompt tokens this step computes (``prefill``, and the same as ``chunks``: of a
    request admitted by its ids only the uncached ones; with ``max_batched_tokens``, a
    chunk of them), requests decoding one token with their new slots, requests preempted
    during the step, and requests brought back from the host tier (``resumed``: they run
    from the next step). ``step`` numbers the plans of one scheduler; only the latest may
    be advanced, once (the scheduler keeps its own list of what the plan ran).

    For the cache's step: ``seq_ids`` and ``query_lens`` (decodes first, one row each, then
    the chunks) are ``KvCache.batch``'s arguments; ``generating`` lists the requests that
    produce a token this step, in the order ``advance`` takes their ids (the chunks that
    end their context, then the decodes)."""

    prefill: list[tuple[Request, np.ndarray]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    decode_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    preempted: list[Request] = field(default_factory=list)
    step: int = 0
    _owner: Any = field(default=None, repr=False, compare=False)
    resumed: list[Request] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def seq_ids(self) -> list[Hashable]:
        """The ids of the step's sequences: decodes first, then chunks."""
        return [r.request_id for r in self.decode] + [c.request.request_id
                                                      for c in self.chunks]

    @property
    def query_lens(self) -> np.ndarray:
        """Each sequence's query rows this step (int32, ``seq_ids``' order)."""
        return np.array([1] * len(self.decode) + [len(c.slots) for c in self.chunks],
                        np.int32)

    @property
    def generating(self) -> list[Request]:
        """The requests that produce a token this step, in ``advance``'s order."""
        return [c.request for c in self.chunks if c.last] + list(self.decode)


@dataclass(frozen=True)
class FinishedRequest:
    """What is kept of a finished request: when (``clock`` seconds), its token counts and
    why it ended (``reason``: "done", or "aborted" by ``Scheduler.abort``)."""

    request_id: Hashable
    finished_at: float
    prompt_tokens: int
    generated: int
    preemptions: int
    reason: str = "done"
