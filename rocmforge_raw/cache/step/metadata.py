"""BatchMetadata: one step's kernel metadata and its plan, as ``KvCache.batch`` returns it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...kernels.staging import Staging
from ...memory.stream import Stream
from ...runtime._launch import Launch


@dataclass(eq=False, frozen=True)
class BatchMetadata:
    """Kernel metadata for ``seq_ids`` and the plan of their step.

    Host snapshots (read-only): ``block_tables`` int32 ``[n, max_blocks]`` padded with the
    null block 0, ``seq_lens`` int32 ``[n]``, ``slot_mapping`` int64 ``[n]`` (each
    sequence's last reserved slot; -1: none). A step of many query tokens per sequence
    (``batch(seq_ids, query_lens=...)``) has ``query_lens`` int32 ``[n]`` and one slot per
    query token (``[sum(query_lens)]``, each sequence's last ``query_lens`` tokens; -1: a
    token in a shared block an earlier sequence of the step writes). On a GPU the same
    arrays already live on the device, uploaded on ``stream``. Usable with
    ``KvCache.write``/``attention`` while current: until the cache changes (add, append,
    fork, finish, remove, preemption) or plans another batch. Read-only: only the planner
    sets its private fields.
    """

    seq_ids: tuple[Hashable, ...]
    block_tables: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    stream: Stream | None = None
    _owner: Any = field(default=None, repr=False)
    _epoch: int = field(default=-1, repr=False)
    _staging: Staging | None = field(default=None, repr=False)
    _addresses: tuple[int, int, int] = field(default=(0, 0, 0), repr=False)
    _write: Launch | None = field(default=None, repr=False)
    _attention: Launch | None = field(default=None, repr=False)
    _q_shape: tuple[int, int, int] | None = field(default=None, repr=False)
    _kv_shape: tuple[int, int, int] = field(default=(0, 0, 0), repr=False)
    _kv_bytes: int = field(default=0, repr=False)  # of a key or value, and of a query:
    _q_bytes: int = field(default=0, repr=False)
    _scale: float = field(default=0.0, repr=False)
    # (last: the positional order of the fields before it is as it was before it came)
    query_lens: np.ndarray | None = None
    _windowed: dict[int, Launch] | None = field(default=None, repr=False)  # by window

    def __post_init__(self) -> None:
        for array in (self.block_tables, self.seq_lens, self.slot_mapping, self.query_lens):
            if array is not None:
                array.setflags(write=False)

    def _set(self, **fields: Any) -> None:
        """The planner's change of private fields (the dataclass is frozen to its users)."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def _planned(cls, fields: dict[str, Any]) -> BatchMetadata:
        """The planner's constructor: what ``BatchMetadata(**fields)`` makes of read-only
        arrays (``gather``'s), without the frozen ``__init__``'s ``object.__setattr__`` for
        each of its 18 fields nor ``__post_init__``'s flags (most of a step's plan on the
        host)."""
        meta = cls.__new__(cls)
        meta.__dict__.update(_DEFAULTS)
        meta.__dict__.update(fields)
        return meta


#: The fields of a ``BatchMetadata`` that have defaults, with them (``_planned``).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BatchMetadata)
             if f.default is not dataclasses.MISSING}
