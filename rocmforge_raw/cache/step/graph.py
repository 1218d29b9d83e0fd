"""StepGraph: one step's launches (every layer's K/V write and attention) captured once as a
CUDA/HIP graph and replayed as one launch for later steps of the same shape.

A graph fixes every kernel argument as captured, so what changes per step lives at fixed
device addresses that each ``run`` updates in place: block tables (``width`` blocks per
sequence, padded with the null block), lengths, slots and the decode attention's work split.
The split's numbers (CTAs, tokens per CTA, total) are fixed too: the graph is captured for
the step's lengths plus ``headroom`` tokens, and each replay lays its real work out over
that same total (``graph_layout.padded_work``: every sequence's own work plus an even share
of the slack, which the kernel skips past each sequence's length, so the device time stays
that of the real work).

A step of many query tokens per sequence (``batch(seq_ids, query_lens=...)``: prefill chunks
and drafted tokens after the decodes) is captured for its token count: its ``query_lens``
are fixed, and so are the multi-token kernel's work items (uploaded once, at the capture),
since each item's KV range is computed on the device from the step's lengths; a replay
uploads tables, lengths, slots and the decodes' split, as a decode step's does. A step whose
members (ids, order), query lengths, activations, table width or decode work outgrow the
capture re-captures (``GraphShape.admits``); a plan that is not current is refused as by
``write``/``attention``, so a replay never reads stale metadata.

A graph for a token budget (``token_budget``, ``max_seqs``: ``graph_budget``) replays every
step of up to ``token_budget`` query tokens, whatever its members and query lengths: its
decode and multi-token launches run over fixed regions padded with no-op work, and each
replay uploads its items too. It re-captures only where a step has more sequences than a
region holds, a wider table or more decode work than its room.

Stream order: a run queues its upload (pinned host memory to the fixed addresses) and then
the graph on the plan's stream, so the upload waits for the previous replay to finish
reading; each pinned buffer is reused only once the event after its upload has passed
(``staging.Fence``). Nothing here waits for the device. Graphs are a GPU feature: on the
host backend ``run`` raises ``NotImplementedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...common import checks
from ...kernels.planning import (
    ATTENTION_PATCH,
    OUT_SCALE_ARG,
    SCALE_ARG,
    THREADS,
    WORK_GRANULE,
    WRITE_PATCH,
    WRITE_SCALE_ARGS,
    WRITE_THREADS,
    AttentionPlan,
    attention_kernel,
    default_scale,
    plan_work,
    split_workspace,
    write_arguments,
    write_kernel,
)
from ...kernels.planning._worksplit import prefix_sums
from ...kernels.planning.prefill import leading_decodes, prefill_launch
from ...kernels.staging import ALIGN, Fence
from ...memory.buffer import HipBuffer
from ...memory.stream import Stream
from .graph_budget import DEFAULT_MAX_SEQS, BudgetShape, plan_budget
from .graph_layout import (
    Activations,
    CapturePlan,
    GraphShape,
    Layer,
    PinnedUploads,
    activations_of,
    pack_layout,
)
from .metadata import BatchMetadata
from .multi import MultiLaunch, prefill_launches


class StepGraph:
    """A step of ``cache`` as one graph (see the module docstring): ``run(meta, layers)``
    queues the step of the current plan ``meta`` for ``layers`` (per layer: the new tokens'
    key and value ``[rows, num_kv_heads, head_dim]``, the query and the output ``[rows,
    num_q_heads, head_dim]``, at the same addresses while the graph is replayed; ``rows``
    is the step's sequences, or its query tokens for a step of ``query_lens``; the budget
    for a graph of ``token_budget``), on the cache's stream. ``headroom``: tokens each
    sequence may grow by before a re-capture. ``token_budget``: one capture for every step
    of up to that many query tokens over up to ``max_seqs`` (default
    ``graph_budget.DEFAULT_MAX_SEQS``; at most ``token_budget``) decodes and as many other
    sequences (more re-capture with larger regions); output rows past a step's query
    tokens hold no result.
    ``captures``/``replays`` count runs of each kind. Close it (or use ``with``)."""

    def __init__(self, cache: Any, headroom: int = 128, scale: float | None = None,
                 token_budget: int | None = None, max_seqs: int | None = None) -> None:
        c = cache.config
        if any(w is not None for w in c.windows) or c.logit_softcap is not None:
            raise NotImplementedError(
                f"a step graph of a cache with windows {c.windows} and logit_softcap "
                f"{c.logit_softcap}: graphs replay plain attention only for now (run the "
                "steps' launches: batch, write, attention)")
        self.cache, self.backend = cache, cache.slab.backend
        self.device, self.stream = cache.slab.device, cache.stream
        self.headroom = checks.integer(headroom, "headroom", 0, 1 << 20)
        self.token_budget = None if token_budget is None else checks.integer(
            token_budget, "token_budget", 1, 1 << 20)
        if max_seqs is not None and token_budget is None:
            raise ValueError(f"max_seqs {checks.show(max_seqs)} is a budget graph's: pass "
                             "token_budget too")
        # (a region never holds more sequences than the budget has tokens)
        self.max_seqs = None if token_budget is None else checks.integer(
            DEFAULT_MAX_SEQS if max_seqs is None else max_seqs, "max_seqs", 1, 1 << 20)
        self.scale = default_scale(cache.config.head_dim, scale)
        self.shape: GraphShape | BudgetShape | None = None
        self.captures = self.replays = 0
        self._graph: Any = None
        self._exec: Any = None
        # the metadata, split-K partials and counters (zero between launches), reused by
        # every capture that fits them; outgrown ones wait (``memory_stats``) until close()
        # or ``free_waiting()`` (a free waits for the whole device)
        self._buffers: list[HipBuffer] = []
        self._outgrown: list[HipBuffer] = []
        self._layout: list[tuple[int, tuple[int, ...]]] = []
        self._target = 0  # device address of the current graph's metadata
        self._retired: list[tuple[Fence, Any, Any]] = []  # graphs the device may still run
        self._uploads = PinnedUploads(self.device, self.backend)
        self._capture_stream: Stream | None = None
        self.closed = False

    def run(self, meta: BatchMetadata, layers: Sequence[Layer]) -> bool:
        """Queue ``meta``'s step: replay the graph (True), or capture it first (False) when
        none was captured or the step does not fit it. Raises, changing nothing, for a plan
        that is not the cache's current one, another stream, or bad layers."""
        cache = self.cache
        with cache._lock:
            if self.closed:
                raise ValueError("this StepGraph was closed")
            meta = cache._current(meta, None)
            if meta.stream is not self.stream:
                raise ValueError("the batch was planned on another stream than the cache's, "
                                 "which the graph runs on")
            if self.backend.name == "host":
                raise self.backend.no_graphs()
            if not meta.seq_ids:
                raise ValueError("the batch has no sequences: a graph of no step")
            self.backend.activate(self.device)  # the graph calls' device; the thread's stays
            layers = list(layers)
            if len(layers) != cache.config.num_layers or not all(
                    isinstance(layer, tuple) and len(layer) == 4 for layer in layers):
                raise ValueError(f"layers must be {cache.config.num_layers} tuples (key, "
                                 "value, query, out), one a layer")
            members, activations = tuple(meta.seq_ids), activations_of(layers)
            arrays = None if self.shape is None else self._replay(meta, members, activations)
            replay = arrays is not None
            if arrays is None:
                arrays = self._capture(meta, layers, members, activations)
            self._uploads.upload(arrays, self._layout, self._target, self.stream)
            self.backend.graph_launch(self._exec, None if self.stream is None
                                      else self.stream.handle)
            self.replays += replay
            self._sweep()
            return replay

    def _replay(self, meta: BatchMetadata, members: tuple[Any, ...],
                activations: Activations) -> list[np.ndarray] | None:
        """What a replay of ``meta``'s step uploads, or None where it must re-capture."""
        if isinstance(self.shape, BudgetShape):
            return self.shape.arrays(activations, meta)
        assert self.shape is not None
        q_lens = None if meta.query_lens is None else tuple(meta.query_lens.tolist())
        work = self.shape.admits(members, activations, meta.block_tables.shape[1],
                                 meta.seq_lens, q_lens)
        return None if work is None else [meta.block_tables, meta.seq_lens,
                                          meta.slot_mapping, *work]

    def _capture(self, meta: BatchMetadata, layers: list[Layer], members: tuple[Any, ...],
                 activations: Activations) -> list[np.ndarray]:
        """Capture the step for ``layers`` (for its composition with room for ``headroom``
        more tokens a sequence, or for the token budget); returns what the step uploads. The
        previous graph is retired only once the new one is made."""
        c, steps = self.cache.config, self.cache._steps
        q_heads = self._check_layers(meta, layers)
        if self.token_budget is None:
            plan = self._plan(meta, members, activations, q_heads)
        else:
            assert self.max_seqs is not None  # (set with the budget)
            plan = plan_budget(self, meta, activations, self.token_budget, self.max_seqs,
                               q_heads)
        decode, multi, width = plan.decode, plan.multi, plan.shape.width
        layout, offset = pack_layout(plan.layout_shapes())
        fixed = multi[1].arrays if multi is not None and plan.fixed else []
        fixed_layout, fixed_bytes = pack_layout([(a.dtype, a.shape) for a in fixed])
        # partials for every CTA even of a whole-unit capture: a replay's lengths may be laid
        # out with slack shared out (graph_layout.padded_work), which cuts units
        decode_bytes, counters = (0, 0) if decode is None else split_workspace(
            decode.work.num_ctas, decode.group, c.head_dim, decode.num_seqs * decode.work.groups)
        decode_bytes = -(-decode_bytes // ALIGN) * ALIGN
        piece_bytes = 0 if multi is None else multi[1].partial_bytes(multi[0].shape.bm,
                                                                     c.head_dim)
        rows = len(plan.arrays[2])  # the slots: one a query row
        graph, uploaded = None, False
        try:
            buffers = self._room((offset + fixed_bytes, max(decode_bytes + piece_bytes, 4),
                                  4 * max(counters, 1)))
            base = buffers[0].ptr
            tables, lens_at, slots, *work_at = (base + o for o, _ in layout)
            if fixed:
                uploaded = True  # (where the current graph's metadata may lie)
                self._uploads.upload(fixed, fixed_layout, base + offset, self.stream)
            if self._capture_stream is None:
                self._capture_stream = Stream(self.device, self.backend)
            capture = self._capture_stream
            write = write_kernel(self.backend, self.device, steps.act, c.dtype).prepare(
                rows, WRITE_THREADS, *write_arguments(
                    0, 0, 0, 0, slots, c.num_kv_heads, c.block_size,
                    c.head_dim * steps.act.itemsize, c.dtype), stream=capture, patch=WRITE_PATCH)
            decode_at = work_at[:2] if decode is not None else []
            attention: Any = None if decode is None else decode.kernel.prepare(
                decode.grid, THREADS, *decode.arguments(
                    0, 0, 0, 0, tables, lens_at, self.scale, buffers[1].ptr, buffers[2].ptr,
                    *decode_at), shared_bytes=decode.shared_bytes, stream=capture,
                patch=ATTENTION_PATCH)
            if multi is not None:
                starts_at, items_at, *combines_at = (
                    [base + offset + o for o, _ in fixed_layout] if plan.fixed
                    else work_at[len(decode_at):])
                prefill, combine = prefill_launches(
                    multi[0], multi[1], buffers[1].ptr + decode_bytes,
                    tables + 4 * plan.prefill_row * width, lens_at + 4 * plan.prefill_row,
                    starts_at, items_at, combines_at[0] if combines_at else 0, self.scale,
                    q_heads, c.num_kv_heads, width, c.block_size, capture)
                attention = MultiLaunch(attention, prefill, combine, plan.q_offset)
            graph = self._record(capture, write, attention, layers)
            executable = self.backend.graph_instantiate(graph, self.device)
        except BaseException:
            self._retire(graph, None)
            if uploaded:  # the current graph's metadata may be overwritten: no more replays
                self._retire(self._graph, self._exec)
                self._graph = self._exec = self.shape = None
            raise
        self._retire(self._graph, self._exec)
        for old in self._outgrown:  # the new graph reads none of them: freed once passed
            old.release_after(self.stream)
        self._graph, self._exec, self._layout = graph, executable, layout
        self._target = base
        self.shape = plan.shape
        self.captures += 1
        return plan.arrays

    def _check_layers(self, meta: BatchMetadata, layers: list[Layer]) -> int:
        """Check every layer's arrays against the step (the token budget's rows, in a budget
        graph); the query heads."""
        c, steps = self.cache.config, self.cache._steps
        rows = meta._kv_shape[0] if self.token_budget is None else self.token_budget
        if rows < meta._kv_shape[0]:
            raise ValueError(f"a step of {meta._kv_shape[0]} query tokens exceeds the graph's "
                             f"token_budget {self.token_budget}")
        q_shape: tuple[int, ...] = getattr(layers[0][2], "shape", ())
        q_heads = q_shape[1] if len(q_shape) == 3 else 0
        kv = (rows, c.num_kv_heads, c.head_dim)
        for key, value, query, out in layers:
            for name, array, want in (("key", key, kv), ("value", value, kv),
                                      ("query", query, (rows, q_heads, c.head_dim)),
                                      ("out", out, (rows, q_heads, c.head_dim))):
                steps._check(name, array, want)
        if q_heads < 1 or q_heads % c.num_kv_heads:
            raise ValueError(f"num_q_heads {q_heads} is not a multiple of num_kv_heads "
                             f"{c.num_kv_heads}")
        return q_heads

    def _plan(self, meta: BatchMetadata, members: tuple[Any, ...], activations: Activations,
              q_heads: int) -> CapturePlan:
        """The capture of ``meta``'s composition: its members and query lengths, room for
        ``headroom`` more tokens a sequence; the multi-token work uploaded once."""
        c, steps = self.cache.config, self.cache._steps
        n, lens, rows = len(members), meta.seq_lens, meta._kv_shape[0]
        q_lens = meta.query_lens
        decodes = n if q_lens is None else leading_decodes(q_lens)
        room = (lens.astype(np.int64) + self.headroom).astype(np.int32)
        width = max(meta.block_tables.shape[1], -(-int(room.max()) // c.block_size))
        shape, decode = self._decode_part(members, activations, meta, q_heads, decodes, room,
                                          width)
        work = shape.admits(members, activations, width, lens, shape.query_lens)
        assert work is not None  # the room holds these lengths
        multi = None
        if decodes < n:
            assert q_lens is not None  # (only a multi-token step has non-decodes)
            multi = prefill_launch(self.backend, self.device, steps.act, c.head_dim, c.dtype,
                                   q_lens[decodes:], lens[decodes:], c.num_kv_heads,
                                   q_heads // c.num_kv_heads)
        arrays = [meta.block_tables, meta.seq_lens, meta.slot_mapping, *work]
        shapes = [(np.int32, (n, width)), (np.int32, (n,)), (np.int64, (rows,))] + [
            (a.dtype, a.shape) for a in work]
        offset = decodes * q_heads * c.head_dim * steps.act.itemsize
        return CapturePlan(shape, arrays, decode, multi, prefill_row=decodes, q_offset=offset,
                           fixed=True, shapes=shapes)

    def _decode_part(self, members: tuple[Any, ...], activations: Activations,
                     meta: BatchMetadata, q_heads: int, decodes: int, room: np.ndarray,
                     width: int) -> tuple[GraphShape, AttentionPlan | None]:
        """The capture's shape and the plan of its decode launch over the ``decodes``
        leading sequences (None without), split for their ``room``."""
        c = self.cache.config
        q_lens = None if meta.query_lens is None else tuple(meta.query_lens.tolist())
        if not decodes:
            return GraphShape(members, activations, width, 0, 0, 0, 0, None, q_lens, 0), None
        found = attention_kernel(self.backend, self.device, self.cache._steps.act,
                                 c.head_dim, q_heads // c.num_kv_heads, c.dtype)
        split = plan_work(c.num_kv_heads * found.groups, found.slots, decodes, room[:decodes],
                          sms=found.sms, rule=found.rule)
        bound = prefix_sums(room[:decodes], WORK_GRANULE, np.empty(decodes + 1, np.int64))
        shape = GraphShape(members, activations, width, c.num_kv_heads * found.groups,
                           split.total, split.per_cta, split.num_ctas, bound, q_lens,
                           None if q_lens is None else decodes)
        return shape, AttentionPlan(found.kernel, found.group, split, found.shared_for(split),
                                    decodes, q_heads, c.num_kv_heads, c.head_dim, c.block_size,
                                    width)

    def _record(self, capture: Stream, write: Any, attention: Any, layers: list[Layer]) -> Any:
        """Every layer's write and attention, captured on ``capture``; the graph."""
        steps = self.cache._steps
        self.backend.graph_begin(capture.handle)
        try:
            for layer, (key, value, query, out) in enumerate(layers):
                k_plane, v_plane = steps.planes(layer)
                if steps.fp8:  # this layer's scales, fixed in its launches
                    k_inverse, v_inverse = steps._write_scales[layer]
                    write.set_float(WRITE_SCALE_ARGS[0], k_inverse)
                    write.set_float(WRITE_SCALE_ARGS[1], v_inverse)
                    k_part, out_scale = steps._attention_scales[layer]
                    attention.set_float(SCALE_ARG, self.scale * k_part)
                    attention.set_float(OUT_SCALE_ARG, out_scale)
                write(k_plane, v_plane, key.ptr, value.ptr)
                attention(out.ptr, query.ptr, k_plane, v_plane)
        except BaseException:
            graph = self.backend.graph_end(capture.handle)  # capture ends even on an error
            self._retire(graph, None)
            raise
        return self.backend.graph_end(capture.handle)

    def _room(self, sizes: tuple[int, ...]) -> list[HipBuffer]:
        """The metadata, partials and counters buffers, at least ``sizes`` bytes: those of
        the last capture where they fit (the device reads them in stream order), else new
        ones (counters zeroed on the stream)."""
        if not self._buffers:
            self._buffers = [None] * len(sizes)  # type: ignore[list-item]
        for index, size in enumerate(sizes):
            old = self._buffers[index]
            if old is None or old.nbytes < size:
                if old is not None:
                    self._outgrown.append(old)
                    size = max(size, 2 * old.nbytes)
                self._buffers[index] = HipBuffer(size, self.device, self.backend)
                if index == 2:
                    self._buffers[index].fill(0, stream=self.stream)
        return self._buffers

    def _retire(self, graph: Any, executable: Any) -> None:
        """Destroy ``graph`` and its executable once the device has passed what was queued
        on the stream so far (``_sweep``)."""
        if graph is not None:
            fence = Fence(self.device, self.backend)
            fence.mark(self.stream)
            self._retired.append((fence, graph, executable))

    def _sweep(self, wait: bool = False) -> None:
        """Destroy the retired graphs the device has passed (all of them with ``wait``)."""
        keep = []
        for fence, graph, executable in self._retired:
            if wait or fence.passed():
                fence.wait()
                fence.close()
                self.backend.graph_destroy(graph, executable, self.device)
            else:
                keep.append((fence, graph, executable))
        self._retired = keep

    def close(self) -> None:
        """Free the graph and its memory once the device has passed its last replay.
        Idempotent."""
        with self.cache._lock:
            self.closed = True
            self._retire(self._graph, self._exec)
            self._graph = self._exec = self.shape = None
            self._sweep(wait=True)  # every replay has passed: the memory may go
            for buffer in (*self._buffers, *self._outgrown):
                if buffer is not None:
                    buffer.close()
            self._buffers, self._outgrown = [], []
            self._uploads.close()
            if self._capture_stream is not None:
                self._capture_stream.close()
                self._capture_stream = None

    def __enter__(self) -> StepGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
