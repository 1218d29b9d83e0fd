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
from collections.abc import Hashable
from typing import Any

import numpy as np

from ...common import checks
from ...kernels import ops
from ...kernels.multi_token import cap_unsupported
from ...kernels.planning import (
    OUT_SCALE_ARG,
    SCALE_ARG,
    SINKS_ARG,
    WRITE_PATCH,
    WRITE_SCALE_ARGS,
    WRITE_THREADS,
    AttentionKernel,
    check_disjoint,
    check_variants,
    default_scale,
    kernel_scales,
    split_rule,
    write_arguments,
    write_kernel,
)
from ...kernels.staging import Staging, StagingRing
from ...memory.array import DeviceArray
from ...memory.stream import Stream
from ...runtime._launch import Launch
from ..config import CacheConfig
from .decode_plans import DecodePlans
from .metadata import BatchMetadata
from .multi import MultiLaunch, plan_multi


class StepPlanner(DecodePlans):
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
        # the attention variants of the config: each layer's window (None: all tokens), the
        # distinct windows (a step plans a split for each that bites), the logit cap (0: none)
        self.windows = c.windows
        self.window_values = sorted({w for w in c.windows if w is not None})
        self.softcap = c.logit_softcap or 0.0
        self.sinks_seen = False  # set by the first call with sinks: calls set them from then
        # a cap the multi-token kernel cannot apply here (gfx11, 16-bit, head_dim 256)
        self.multi_capless = bool(self.softcap) and cap_unsupported(
            self.backend, self.device, self.act, c.head_dim)
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
                        fields["_attention"], fields["_windowed"] = plan_multi(
                            self, staging, num_q_heads, lens, query_lens, tables.shape[1],
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
                    fields.update(self._decode_launches(staging, found, num_q_heads, lens,
                                                        split, tables.shape[1], addresses,
                                                        stream))
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
                  scale: float | None, sinks: DeviceArray | None = None) -> None:
        """Decode attention of ``layer`` for the plan's sequences into ``out`` (memory of
        its own: neither the query's nor the cache's), within the layer's window, with the
        cache's logit cap and ``sinks`` (``ops.paged_attention``'s). Every argument is
        checked before the plan changes: the first call of a plan without ``num_q_heads``
        plans attention for the query's heads only once its arguments are all good."""
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
        if sinks is not None:
            check_variants(query, None, sinks)
            check_disjoint(out, "out", sinks=sinks)
        if meta._q_shape is None:  # every argument is good: plan now
            self._plan_attention(meta, q_shape[1])
        launch = meta._attention
        window = self.windows[layer]
        if window is not None and meta._windowed is not None:
            launch = meta._windowed.get(window, launch)  # (absent: no sequence outgrows it)
        if wanted != meta._scale:
            if not self.fp8:  # (fp8: set per layer below)
                for each in (meta._attention, *(meta._windowed or {}).values()):
                    if each is not None:
                        each.set_float(SCALE_ARG, wanted)
            meta._set(_scale=wanted)
        if launch is not None:
            if self.fp8:  # this layer's scales, folded with the softmax scale
                k_part, out_scale = self._attention_scales[layer]
                launch.set_float(SCALE_ARG, meta._scale * k_part)
                launch.set_float(OUT_SCALE_ARG, out_scale)
            if sinks is not None or self.sinks_seen:
                self.sinks_seen = True
                address = 0 if sinks is None else sinks.ptr
                if isinstance(launch, MultiLaunch):
                    launch.set_sinks(address)
                else:
                    launch.set_ints((SINKS_ARG,), (address,))
            launch(out_ptr, query_ptr, k_ptr, v_ptr)
        elif self.on_host:
            k, v = self._host_planes(layer)
            k_scale, v_scale = self.config.kv_scales[layer]
            ops.paged_attention(out, query, k, v, meta.block_tables, meta.seq_lens,
                                meta._scale, check=False, k_scale=k_scale, v_scale=v_scale,
                                query_lens=meta.query_lens, logit_softcap=self.softcap or None,
                                sinks=sinks, window=window)


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
