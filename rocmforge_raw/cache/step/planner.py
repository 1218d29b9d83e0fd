"""The plan of one step: metadata uploaded once, launches made ready once, one launch a call.

``KvCache.batch`` hands its host snapshots to ``StepPlanner.plan``, which checks them once,
copies them into a pinned staging slot of the cache's ``StagingRing`` with the attention's
work split computed in place beside them (one compiled call, ``Staging.put_step``) and
queues one asynchronous upload on the step's stream, then prepares the step's launches (the
K/V write and the attention kernel with its split-K plan and workspace) with every argument
packed except the four pointers that change per layer. ``write``/``attention`` then check shapes
and dtypes (O(1)) and launch once, from C: no allocation, upload or synchronization.

Lifetimes: a plan is current until the cache changes or plans again. Its staging slot's
fence is marked on its stream when it stops being current (``retire``): every launch that
read the slot was queued before then, so the ring reuses the slot only after the device
passed them all. The slot's workspace is covered by the same fence.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ...common import checks
from ...kernels import ops
from ...kernels.planning import (
    ATTENTION_PATCH,
    OUT_SCALE_ARG,
    SCALE_ARG,
    STEP_ARGS,
    THREADS,
    WRITE_PATCH,
    WRITE_SCALE_ARGS,
    WRITE_THREADS,
    AttentionKernel,
    AttentionPlan,
    WorkSplit,
    attention_kernel,
    default_scale,
    kernel_scales,
    plan_work,
    split_rule,
    split_workspace,
    step_arguments,
    write_arguments,
    write_kernel,
)
from ...kernels.staging import Staging, StagingRing
from ...memory.array import DeviceArray
from ...memory.stream import Stream
from ...runtime._launch import Launch
from ..config import CacheConfig
from .metadata import BatchMetadata
from .multi import plan_multi


class StepPlanner:
    """Plans the steps of one cache and launches their kernels (see the module docstring)."""

    def __init__(self, config: CacheConfig, slab: DeviceArray) -> None:
        self.config, self.slab = config, slab
        self.backend, self.device = slab.backend, slab.device
        self.on_host = self.backend.name == "host"
        self.ring = None if self.on_host else StagingRing(self.device, self.backend)
        self.current: BatchMetadata | None = None
        c = config
        self.plane_bytes = c.num_blocks * c.block_size * c.num_kv_heads * c.head_dim * (
            c.dtype.itemsize)
        self.row_shape = (c.num_kv_heads, c.head_dim)
        self.row_bytes = c.num_kv_heads * c.head_dim * c.activation_dtype.itemsize  # of a token
        self._kernels: dict[int, AttentionKernel] = {}  # by num_q_heads (``_kernel``)
        self.default_scale = default_scale(c.head_dim, None)
        self.act = c.activation_dtype  # queries, outputs, K/V written: c.dtype unless fp8
        # an fp8 cache's kernel scales per layer, computed once: (the K scale's part of the
        # score scale, out_scale) for attention, and the inverse scales the write takes
        self.fp8 = c.is_fp8
        self._attention_scales = [kernel_scales(c.dtype, 1.0, k, v) for k, v in c.kv_scales]
        self._extreme_scales = (min(c.kv_scales), max(c.kv_scales))  # by k_scale
        self._write_scales = [(1.0 / k, 1.0 / v) for k, v in c.kv_scales]
        base = slab.ptr
        self._slab_span = (base, base + c.total_bytes)
        self._planes = [(base + 2 * layer * self.plane_bytes,
                         base + (2 * layer + 1) * self.plane_bytes)
                        for layer in range(c.num_layers)]

    def plan(self, owner: Any, epoch: int, seq_ids: tuple[Hashable, ...], tables: np.ndarray,
             lens: np.ndarray, slots: np.ndarray, stream: Stream | None,
             query_lens: np.ndarray | None = None) -> BatchMetadata:
        """The current plan for these snapshots (``owner``'s state at ``epoch``), which
        ``SequenceRows.gather`` checked and handed out read-only; ``query_lens`` for a step
        of many query tokens per sequence (``slots`` then one per token: ``multi``). Built
        whole, then made current: a plan that fails leaves the current one current."""
        n, num_q_heads = len(seq_ids), self.config.num_q_heads
        rows = n if query_lens is None else int(query_lens.sum())
        fields: dict[str, Any] = dict(
            seq_ids=seq_ids, block_tables=tables, seq_lens=lens, slot_mapping=slots,
            stream=stream, query_lens=query_lens, _owner=owner, _epoch=epoch,
            _kv_shape=(rows, *self.row_shape), _kv_bytes=rows * self.row_bytes)
        staging, found = None, None
        try:
            if num_q_heads is not None:
                found = self._kernel(num_q_heads)
                fields.update(self._query_fields(rows, num_q_heads))
            if not self.on_host and n:
                assert self.ring is not None  # a device cache stages its uploads
                staging = self.ring.acquire()
                if query_lens is not None:
                    addresses = staging.put([slots, lens, tables], stream)
                    fields.update(_staging=staging, _addresses=tuple(addresses[2::-1]),
                                  _write=self._write_launch(staging, rows, addresses[0],
                                                            stream))
                    if num_q_heads is not None:
                        fields["_attention"] = plan_multi(self, staging, num_q_heads, lens,
                                                          query_lens, tables.shape[1],
                                                          addresses, stream)
                elif found is None:  # attention is planned by its first call
                    # slots and lengths first: their addresses stay put while tables widen
                    addresses = staging.put([slots, lens, tables], stream)
                else:  # with the work split, computed where the upload reads it
                    addresses, split = staging.put_step(
                        slots, lens, tables, self.config.num_kv_heads * found.groups,
                        found.slots, split_rule(found.sms, found.rule), stream)
                if query_lens is None:
                    slots_at, lens_at, tables_at = addresses[:3]
                    fields.update(_staging=staging, _addresses=(tables_at, lens_at, slots_at),
                                  _write=self._write_launch(staging, n, slots_at, stream))
                if found is not None and query_lens is None:
                    assert num_q_heads is not None  # (found for it)
                    fields["_attention"] = self._attention_launch(
                        staging, found, num_q_heads, n, split, tables.shape[1], addresses,
                        stream)
        except BaseException:  # the upload may be queued: its slot waits for it all the same
            if staging is not None:
                staging.fence.mark(stream)
                assert self.ring is not None  # (it handed the slot out)
                self.ring.put_back(staging)  # not the current plan's slot next
            raise
        meta = BatchMetadata._planned(fields)
        self.retire()  # only now: a plan that failed leaves the current one current
        self.current = meta
        return meta

    def _write_launch(self, staging: Staging, n: int, slots_at: int, stream: Stream | None
                      ) -> Launch:
        """The K/V write of a step of ``n`` sequences whose slots are at ``slots_at``,
        reused from its staging slot: the slots are its upload's first array, so their
        address is the slot's until it grows (which drops its launches)."""
        c = self.config
        key = ("write", n, stream)
        launch = staging.launches.get(key)
        if launch is None:
            launch = staging.launches[key] = write_kernel(
                self.backend, self.device, self.act, c.dtype).prepare(
                n, WRITE_THREADS, *write_arguments(
                    0, 0, 0, 0, slots_at, c.num_kv_heads, c.block_size,
                    c.head_dim * self.act.itemsize, c.dtype), stream=stream,
                patch=WRITE_PATCH)
        return launch

    def retire(self) -> None:
        """The current plan stops being current: fence its slot on its stream."""
        meta, self.current = self.current, None
        if meta is not None and meta._staging is not None:
            meta._staging.fence.mark(meta.stream)

    def close(self) -> None:
        """Free the staging memory once the device has passed every launch that used it."""
        self.retire()
        if self.ring is not None:
            self.ring.close()

    # --- per-layer launches --------------------------------------------------------------
    def planes(self, layer: int) -> tuple[int, int]:
        """Device addresses of ``layer``'s K and V caches (the slab is open: a closed cache
        has no current plan, and its views refuse use)."""
        if type(layer) is int and 0 <= layer < len(self._planes):
            return self._planes[layer]
        if isinstance(layer, bool) or not hasattr(layer, "__index__"):
            raise TypeError(f"layer must be an integer, got {layer!r}")
        if not 0 <= operator.index(layer) < len(self._planes):
            raise IndexError(f"layer {layer!r} outside [0, {self.config.num_layers})")
        return self._planes[operator.index(layer)]

    def write(self, meta: BatchMetadata, layer: int, key: DeviceArray, value: DeviceArray
              ) -> None:
        """Each sequence's new token: ``key``/``value`` ``[n, num_kv_heads, head_dim]``,
        memory of their own (not the cache's)."""
        shape = meta._kv_shape
        self._check("key", key, shape)
        self._check("value", value, shape)
        k_ptr, v_ptr = self.planes(layer)
        key_ptr, value_ptr, nbytes = key.ptr, value.ptr, meta._kv_bytes
        start, end = self._slab_span  # inline: a write's host time is a measured figure
        if (key_ptr < end and start < key_ptr + nbytes) or (
                value_ptr < end and start < value_ptr + nbytes):
            self._outside_slab("key", key_ptr, nbytes)
            self._outside_slab("value", value_ptr, nbytes)
        if meta._write is not None:
            if self.fp8:  # this layer's inverse scales
                k_inverse, v_inverse = self._write_scales[layer]
                meta._write.set_float(WRITE_SCALE_ARGS[0], k_inverse)
                meta._write.set_float(WRITE_SCALE_ARGS[1], v_inverse)
            meta._write(k_ptr, v_ptr, key_ptr, value_ptr)
        elif self.on_host:
            k, v = self._host_planes(layer)
            k_scale, v_scale = self.config.kv_scales[layer]
            ops.reshape_and_cache(key, value, k, v, meta.slot_mapping, check=False,
                                  k_scale=k_scale, v_scale=v_scale)

    def attention(self, meta: BatchMetadata, layer: int, out: DeviceArray, query: DeviceArray,
                  scale: float | None) -> None:
        """Decode attention of ``layer`` for the plan's sequences into ``out`` (memory of
        its own: neither the query's nor the cache's). Every argument is checked before the
        plan changes: the first call of a plan without ``num_q_heads`` plans attention for
        the query's heads only once its arguments are all good."""
        q_shape = meta._q_shape
        if q_shape is None:
            self._check("query", query, None)
            q_shape = (meta._kv_shape[0], query.shape[1], self.config.head_dim)
            self._check_heads(q_shape[1])
        self._check("query", query, q_shape)
        self._check("out", out, q_shape)
        k_ptr, v_ptr = self.planes(layer)
        wanted = self.default_scale if scale is None else default_scale(
            self.config.head_dim, scale)
        if self.fp8 and wanted != meta._scale:
            self._check_folded(wanted)
        out_ptr, query_ptr = out.ptr, query.ptr
        q_bytes = meta._q_bytes or math.prod(q_shape) * self.act.itemsize
        start, end = self._slab_span
        if out_ptr < end and start < out_ptr + q_bytes:
            self._outside_slab("out", out_ptr, q_bytes)
        if out_ptr < query_ptr + q_bytes and query_ptr < out_ptr + q_bytes:
            raise ValueError("out overlaps query: the kernel would overwrite the queries it "
                             "reads; give out memory of its own")
        if meta._q_shape is None:  # every argument is good: plan now
            self._plan_attention(meta, q_shape[1])
        if wanted != meta._scale:
            if meta._attention is not None and not self.fp8:
                meta._attention.set_float(SCALE_ARG, wanted)  # (fp8: set per layer below)
            meta._set(_scale=wanted)
        if meta._attention is not None:
            if self.fp8:  # this layer's scales, folded with the softmax scale
                k_part, out_scale = self._attention_scales[layer]
                meta._attention.set_float(SCALE_ARG, meta._scale * k_part)
                meta._attention.set_float(OUT_SCALE_ARG, out_scale)
            meta._attention(out_ptr, query_ptr, k_ptr, v_ptr)
        elif self.on_host:
            k, v = self._host_planes(layer)
            k_scale, v_scale = self.config.kv_scales[layer]
            ops.paged_attention(out, query, k, v, meta.block_tables, meta.seq_lens,
                                meta._scale, check=False, k_scale=k_scale, v_scale=v_scale,
                                query_lens=meta.query_lens)

    def _check_heads(self, num_q_heads: int) -> None:
        """``num_q_heads`` serves the cache's kv heads (a positive multiple of them)."""
        if num_q_heads < 1 or num_q_heads % self.config.num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                             f"{self.config.num_kv_heads}")

    def _check_folded(self, scale: float) -> None:
        """The softmax ``scale`` folded with every layer's K scale fits float32."""
        for k_scale, v_scale in self._extreme_scales:
            kernel_scales(self.config.dtype, scale, k_scale, v_scale)

    def _outside_slab(self, name: str, ptr: int, nbytes: int) -> None:
        """``nbytes`` at ``ptr`` (an activation) share no byte with the cache's slab."""
        start, end = self._slab_span
        if ptr < end and start < ptr + nbytes:
            raise ValueError(f"{name} overlaps the cache's slab (bytes {ptr:#x}..{ptr + nbytes:#x}"
                             f" in {start:#x}..{end:#x}): the kernel would write over, or read "
                             f"while writing, cached K/V; give {name} memory of its own")

    def _kernel(self, num_q_heads: int) -> AttentionKernel | None:
        """The attention kernel for ``num_q_heads`` (checked), looked up once per count;
        None on the host, which runs no kernel."""
        found = self._kernels.get(num_q_heads)
        if found is None:
            self._check_heads(num_q_heads)
            if self.on_host:
                return None
            c = self.config
            found = self._kernels[num_q_heads] = attention_kernel(
                self.backend, self.device, self.act, c.head_dim, num_q_heads // c.num_kv_heads,
                c.dtype)
        return found

    def _query_fields(self, n: int, num_q_heads: int) -> dict[str, Any]:
        """A plan's query fields: its shape and bytes, at the default scale."""
        return dict(_q_shape=(n, num_q_heads, self.config.head_dim), _scale=self.default_scale,
                    _q_bytes=n * num_q_heads * self.config.head_dim * self.act.itemsize)

    def _plan_attention(self, meta: BatchMetadata, num_q_heads: int) -> None:
        """Attention for ``num_q_heads`` planned into ``meta`` by its first attention call
        (a cache without ``num_q_heads``): the work split planned and appended to the
        slot's upload, the launch prepared. ``meta`` changes only once all of it is done."""
        found = self._kernel(num_q_heads)
        n = meta._kv_shape[0]
        fields = self._query_fields(n, num_q_heads)
        if found is not None and n and meta.query_lens is not None:
            assert meta._staging is not None  # planned on the device
            tables_at, lens_at, slots_at = meta._addresses
            fields["_attention"] = plan_multi(
                self, meta._staging, num_q_heads, meta.seq_lens, meta.query_lens,
                meta.block_tables.shape[1], [slots_at, lens_at, tables_at], meta.stream)
        elif found is not None and n:
            staging = meta._staging
            assert staging is not None  # planned on the device
            work = plan_work(self.config.num_kv_heads * found.groups, found.slots, n,
                             meta.seq_lens, sms=found.sms, rule=found.rule)
            tables_at, lens_at, slots_at = meta._addresses
            addresses = [slots_at, lens_at, tables_at,
                         *staging.put(work.arrays, meta.stream, append=True)]
            fields["_attention"] = self._attention_launch(
                staging, found, num_q_heads, n,
                (work.num_ctas, work.per_cta, work.total, work.whole, work.lean),
                meta.block_tables.shape[1], addresses, meta.stream)
        meta._set(**fields)

    def _attention_launch(self, staging: Staging, found: AttentionKernel, num_q_heads: int,
                          n: int, split: tuple[int, int, int, bool, bool], width: int,
                          addresses: Sequence[int], stream: Stream | None) -> Launch:
        """The attention launch of a step of ``n`` sequences whose work split is ``split``
        (num_ctas, per_cta, total, whole, lean of a ``WorkSplit`` of real lengths) and whose
        slots, lengths, tables, cum16 and first_seq are at ``addresses``: prepared once per
        staging slot, shape, stream and occupancy, then given each step's grid, addresses,
        table width and work split (``STEP_ARGS``) and the default scale."""
        c = self.config
        num_ctas, per_cta, total, whole, lean = split
        part_bytes, counters = split_workspace(num_ctas, found.group, c.head_dim,
                                               n * c.num_kv_heads * found.groups, whole)
        part_buf, count_buf = staging.workspace.ready(part_bytes, counters) or (
            staging.workspace.get(part_bytes, counters, self.slab, stream))
        _, lens_at, tables_at, cum16_at, first_seq_at = addresses
        key = (num_q_heads, n, stream, lean)
        launch = staging.launches.get(key)
        if launch is None:
            if len(staging.launches) > 64:  # shapes and streams come and go
                staging.launches.clear()
            work = WorkSplit(num_ctas, per_cta, total, c.num_kv_heads * found.groups, 0,
                             whole=whole, lean=lean)
            plan = AttentionPlan(found.kernel, found.group, work, found.shared_for(work), n,
                                 num_q_heads, c.num_kv_heads, c.head_dim, c.block_size, width)
            launch = staging.launches[key] = plan.kernel.prepare(
                plan.grid, THREADS, *plan.arguments(0, 0, 0, 0, tables_at, lens_at,
                                                    self.default_scale, part_buf.ptr,
                                                    count_buf.ptr),
                shared_bytes=plan.shared_bytes, stream=stream, patch=ATTENTION_PATCH)
        assert isinstance(launch, Launch)
        launch.set_grid(num_ctas)  # (a prepared launch's STEP_ARGS are this step's below)
        launch.set_ints(STEP_ARGS, step_arguments((0, per_cta, total), part_buf.ptr,
                                                  count_buf.ptr, tables_at, lens_at, cum16_at,
                                                  first_seq_at, width))
        launch.set_float(SCALE_ARG, self.default_scale)  # an earlier step changed it?
        return launch

    def _check(self, name: str, array: Any, shape: tuple[int, ...] | None) -> None:
        """``array`` is a DeviceArray of the cache's dtype, backend and device and of
        ``shape`` (any 3-d shape for None); one test on the way that passes."""
        if (type(array) is DeviceArray and array.shape == shape
                and (array.dtype is self.act or array.dtype == self.act)
                and array.buffer.backend is self.backend and array.buffer.device == self.device):
            return
        if type(array) is not DeviceArray:
            raise TypeError(f"{name} must be a DeviceArray, not {type(array).__name__}")
        if array.dtype != self.act:
            raise ValueError(f"{name} must be {self.act}, got {array.dtype}")
        checks.colocated(name, array.backend, array.device, "the cache", self.backend,
                         self.device)
        if shape is None:
            if len(array.shape) != 3:
                raise ValueError(f"{name} must have 3 dimensions, got shape {array.shape}")
            return
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")

    def _host_planes(self, layer: int) -> tuple[DeviceArray, DeviceArray]:
        c = self.config
        shape = (c.num_blocks, c.num_kv_heads, c.block_size, c.head_dim)
        offset = 2 * layer * self.plane_bytes
        return (DeviceArray(self.slab.buffer, c.dtype, shape, offset),
                DeviceArray(self.slab.buffer, c.dtype, shape, offset + self.plane_bytes))
