"""StepLaunches: a cache's steps: the plan of one (``batch()``: its metadata uploaded once,
its launches prepared), and each layer's device work for the current plan: its K and V
planes, the K/V writes and the attention, one launch each (two or three for a step of many
query tokens: ``multi``), and the step graph that replays a whole step's launches
(``graph``).

A plan is current until the cache changes or plans again (``_current`` refuses any other in
O(1)); a write given a slot mapping instead of a plan is the prefill path
(``ops.reshape_and_cache``). Nothing here waits for the device.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np

from ...common import checks
from ...kernels import ops
from ...kernels.multi_token import CAP_UNSUPPORTED
from ...memory.array import DeviceArray
from ...memory.stream import Stream, stream_handle
from ..core import operation, repeated
from ..tiers.swap import TierOps
from .graph import StepGraph
from .metadata import BatchMetadata
from .multi import query_slots
from .planner import StepPlanner


class StepLaunches(TierOps):
    """``KvCache``'s per-layer device work (module docstring)."""

    _steps: StepPlanner

    # --- the plan -------------------------------------------------------------------------
    @operation
    def batch(self, seq_ids: Iterable[Hashable], stream: Stream | None = None, *,
              query_lens: Any = None) -> BatchMetadata:
        """The step's plan for ``seq_ids`` (in that order): metadata uploaded to the device
        once, asynchronously on ``stream``, and the step's launches prepared. Current until
        the cache changes or plans again; the previous plan stops being current. A
        sequence swapped out to the host tier is refused (``swap_in`` it first).

        ``query_lens`` (one int per sequence, each in ``[1, its length]``): sequence ``i``'s
        last ``query_lens[i]`` tokens are the step's query rows (a prefill chunk, a prefix
        hit's tail, drafted tokens: reserved by ``add_sequence`` or ``extend``): ``write``
        takes their K/V (``[sum(query_lens), num_kv_heads, head_dim]``) and ``attention``
        runs each row over the tokens up to it (``ops.paged_attention``). List decodes
        first: they run in the decode kernel. All ones is the plain decode plan.

        In a cache whose every layer has a window (``CacheConfig.windows``), the blocks of
        ``seq_ids`` that left the widest window before this step's first query are freed
        once the step is planned (``stats()['window_dropped_blocks']``)."""
        ids = checks.id_list(seq_ids, "seq_ids")
        stream = self._stream(stream)
        rows_of = self._rows
        rows = self._resident_rows(ids)
        if not rows_of.distinct():
            raise ValueError(f"batch lists sequence {repeated(ids)!r} twice")
        q_lens = None if query_lens is None else self._query_lens(query_lens, rows)
        c = self.config
        if q_lens is not None and self._steps.multi_capless and (q_lens != 1).any():
            raise NotImplementedError(CAP_UNSUPPORTED)
        firsts = None if c.widest_window is None else self._window_firsts(
            rows, q_lens, c.widest_window)
        if self._order is not None:
            self._order.used(stream)
        now = self._now()
        tables, lens, slots = rows_of.gather(rows, c.num_blocks, c.block_size)
        if q_lens is not None and (q_lens != 1).any():
            slots = query_slots(tables, lens, q_lens, self.pool.ref_cnt, c.block_size)
            slots.setflags(write=False)
            q_lens.setflags(write=False)
        else:
            q_lens = None  # one row each: the decode plan
        meta = self._steps.plan(self, self._epoch, rows_of.last_ids(), tables, lens, slots,
                                stream, q_lens)
        # only now, the plan made: a plan that fails leaves every block where it was (this
        # step's snapshot still names the freed ones; its kernels never read them)
        if firsts is not None and self._leave_windows(rows, firsts):
            meta._set(_epoch=self._epoch)
        rows_of.touch(rows, now)
        return meta

    def _query_lens(self, query_lens: Any, rows: np.ndarray) -> np.ndarray:
        """``query_lens`` checked for ``rows``: one int per sequence in ``[1, length]``."""
        array = np.asarray(query_lens)
        if array.dtype.kind not in "iu" or array.shape != rows.shape:
            raise ValueError(f"query_lens must be {rows.size} integers (one per sequence), "
                             f"got {checks.show(query_lens)}")
        lens = self._rows.lens[rows]
        bad = np.flatnonzero((array < 1) | (array > lens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"query_lens[{i}] = {int(array[i])} is not in [1, {int(lens[i])}] "
                             f"(the sequence's tokens)")
        return array.astype(np.int32)

    # --- planes, writes, attention ---------------------------------------------------------------
    def k_cache(self, layer: int) -> DeviceArray:
        """Layer ``layer``'s K cache, ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        self._check_open()
        return self._plane(layer, 0)

    def v_cache(self, layer: int) -> DeviceArray:
        """Layer ``layer``'s V cache, shaped like ``k_cache``."""
        self._check_open()
        return self._plane(layer, 1)

    def _plane(self, layer: int, kv: int) -> DeviceArray:
        with self._lock:
            ptrs = self._steps.planes(layer)
        c = self.config
        return DeviceArray(self.slab.buffer, c.dtype, c.slab_shape[2:],
                           ptrs[kv] - self.slab.ptr)

    def write(self, layer: int, key: DeviceArray, value: DeviceArray,
              slot_mapping: BatchMetadata | Any, stream: Stream | None = None) -> None:
        """Write K/V of ``layer``: with the current ``batch()`` plan, the K/V of each query
        token of the step (``[sum(query_lens), num_kv_heads, head_dim]``: one row a sequence
        for a decode plan; rows in shared blocks, which already hold them, are skipped), one
        launch; with a slot mapping, any tokens at those slots (``ops.reshape_and_cache``)."""
        with self._lock:
            if isinstance(slot_mapping, BatchMetadata):
                self._steps.write(self._current(slot_mapping, stream), layer, key, value)
            else:
                self._check_open()
                k, v = self.k_cache(layer), self.v_cache(layer)  # checks the layer
                k_scale, v_scale = self.config.kv_scales[layer]
                stream = self._stream(stream)
                if self._order is not None:
                    self._order.used(stream)
                ops.reshape_and_cache(key, value, k, v, slot_mapping, stream=stream,
                                      k_scale=k_scale, v_scale=v_scale)

    def attention(self, layer: int, out: DeviceArray, query: DeviceArray,
                  batch: BatchMetadata, scale: float | None = None,
                  stream: Stream | None = None, *, sinks: DeviceArray | None = None) -> None:
        """Attention of ``layer`` for the current ``batch()`` plan: each query row (one a
        sequence, or ``query_lens``' rows: causal, aligned to the end of its sequence) over
        its sequence's cache, with the launches the plan prepared; within the layer's
        window and with the logit cap of the config (``CacheConfig.windows``,
        ``logit_softcap``). ``sinks``: this layer's attention sinks, a float32 DeviceArray
        ``[num_q_heads]`` beside the query (gpt-oss: one logit a head, in its softmax's
        denominator only; read by the device when the launch runs)."""
        with self._lock:
            self._steps.attention(self._current(batch, stream), layer, out, query, scale,
                                  sinks)

    def step_graph(self, headroom: int = 128, scale: float | None = None,
                   token_budget: int | None = None, max_seqs: int | None = None) -> StepGraph:
        """A ``StepGraph`` of this cache: a step's launches (decodes, or decodes mixed with
        prefill chunks and drafted tokens: ``batch(..., query_lens=)``) captured once as a
        CUDA/HIP graph and replayed per step (``graph.run(batch, layers)``), on the cache's
        stream; a step that outgrows it by ``headroom`` tokens a sequence, or whose members
        or query lengths differ, re-captures. With ``token_budget``, one capture replays
        every step of up to that many query tokens over up to ``max_seqs`` decodes and as
        many other sequences, whatever its composition (the Scheduler's
        ``max_batched_tokens``); each layer's activations then have ``token_budget`` rows."""
        self._check_open()
        return StepGraph(self, headroom, scale, token_budget, max_seqs)

    # --- internals (lock held) ---------------------------------------------------------------
    def _current(self, meta: Any, stream: Stream | None) -> BatchMetadata:
        """``meta`` if it is this cache's current plan (O(1)); raises otherwise."""
        if type(meta) is not BatchMetadata or meta._owner is not self:
            self._check_open()
            if type(meta) is not BatchMetadata:
                raise TypeError(f"batch must be metadata from this cache's batch(), got "
                                f"{checks.show(meta)}")
            raise ValueError("batch must be metadata from this cache's batch(), not another "
                             "cache's")
        if meta is not self._steps.current or meta._epoch != self._epoch:
            self._check_open()
            raise ValueError("batch metadata is stale: the cache changed or planned another "
                             "batch since; call batch() again")
        if stream is not None and stream is not meta.stream:
            stream_handle(stream, "stream", self.slab.backend, self.slab.device)  # a Stream?
            raise ValueError(f"stream differs from the one the batch was planned on (given "
                             f"{stream!r}, planned on {meta.stream!r}): plan the batch on the "
                             "stream that runs it")
        checked: BatchMetadata = meta
        return checked
