"""How a step's decode attention is planned: the kernel for its query heads, the work split
of each launch (over every token, and over each window of the config that a sequence
outgrows), the launches prepared once per staging slot and given each step's split.

``StepPlanner`` (``planner``) takes these as a mixin; they read its configuration and
staging and change nothing but the kernels found and the launches kept per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...kernels.planning import (
    ATTENTION_PATCH,
    SCALE_ARG,
    SINKS_ARG,
    STEP_ARGS,
    THREADS,
    AttentionKernel,
    AttentionPlan,
    WorkSplit,
    attention_kernel,
    plan_work,
    split_workspace,
    step_arguments,
    window_work,
)
from ...kernels.staging import Staging
from ...memory.array import DeviceArray
from ...memory.stream import Stream
from ...runtime._launch import Launch
from ..config import CacheConfig
from .metadata import BatchMetadata
from .multi import plan_multi


class DecodePlans:
    """The decode-attention planning of a ``StepPlanner`` (module docstring)."""

    config: CacheConfig
    slab: DeviceArray
    backend: Any
    device: int
    on_host: bool
    act: np.dtype
    default_scale: float
    window_values: list[int]
    softcap: float
    sinks_seen: bool
    _kernels: dict[int, AttentionKernel]

    def _check_heads(self, num_q_heads: int) -> None:
        """``num_q_heads`` serves the cache's kv heads (a positive multiple of them)."""
        if num_q_heads < 1 or num_q_heads % self.config.num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                             f"{self.config.num_kv_heads}")

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
                c.dtype, bool(self.softcap))
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
            fields["_attention"], fields["_windowed"] = plan_multi(
                self, meta._staging, num_q_heads, meta.seq_lens, meta.query_lens,
                meta.block_tables.shape[1], [slots_at, lens_at, tables_at], meta.stream)
        elif found is not None and n:
            staging = meta._staging
            assert staging is not None  # planned on the device
            work = plan_work(self.config.num_kv_heads * found.groups, found.slots, n,
                             meta.seq_lens, sms=found.sms, rule=found.rule)
            tables_at, lens_at, slots_at = meta._addresses
            addresses = [slots_at, lens_at, tables_at,
                         *work_addresses(staging, work, meta.stream)]
            fields.update(self._decode_launches(
                staging, found, num_q_heads, meta.seq_lens, split_of(work),
                meta.block_tables.shape[1], addresses, meta.stream))
        meta._set(**fields)

    def _decode_launches(self, staging: Staging, found: AttentionKernel, num_q_heads: int,
                         lens: np.ndarray, split: tuple[int, int, int, bool, bool],
                         width: int, addresses: Sequence[int], stream: Stream | None
                         ) -> dict[str, Any]:
        """A decode step's attention launches: ``_attention`` over every token (``split``
        planned at ``addresses``) and, in a cache with windows, ``_windowed`` (window ->
        launch) for each window some sequence outgrows, its split planned over the window's
        work (``window_work``) and appended to the upload. Every launch of the step shares
        the slot's split-K workspace (one after another on the stream): it is sized for
        the largest first, so that none of them is left holding an outgrown buffer."""
        n, c = len(lens), self.config
        longest = int(lens.max()) if n else 0
        windowed = [(window, plan_work(c.num_kv_heads * found.groups, found.slots, n,
                                       window_work(lens, window), sms=found.sms,
                                       rule=found.rule))
                    for window in self.window_values if longest > window]
        if windowed:
            units = n * c.num_kv_heads * found.groups
            sizes = [split_workspace(split[0], found.group, c.head_dim, units, split[3])] + [
                split_workspace(work.num_ctas, found.group, c.head_dim, units, work.whole)
                for _, work in windowed]
            staging.workspace.get(max(size[0] for size in sizes),
                                  max(size[1] for size in sizes), self.slab, stream)
        fields: dict[str, Any] = {"_attention": self._attention_launch(
            staging, found, num_q_heads, n, split, width, addresses, stream)}
        if windowed:
            fields["_windowed"] = {window: self._attention_launch(
                staging, found, num_q_heads, n, split_of(work), width,
                [*addresses[:3], *work_addresses(staging, work, stream)], stream, window)
                for window, work in windowed}
        return fields

    def _attention_launch(self, staging: Staging, found: AttentionKernel, num_q_heads: int,
                          n: int, split: tuple[int, int, int, bool, bool], width: int,
                          addresses: Sequence[int], stream: Stream | None, window: int = 0
                          ) -> Launch:
        """The attention launch of a step of ``n`` sequences whose work split is ``split``
        (num_ctas, per_cta, total, whole, lean of a ``WorkSplit`` of real lengths) and whose
        slots, lengths, tables, cum16 and first_seq are at ``addresses``: prepared once per
        staging slot, shape, stream and occupancy, then given each step's grid, addresses,
        table width and work split (``STEP_ARGS``) and the default scale. ``window``
        (tokens; 0: none) is the launch's sliding window, the cache's logit cap its cap, and
        its sinks start at none (``attention`` sets a layer's)."""
        c = self.config
        num_ctas, per_cta, total, whole, lean = split
        part_bytes, counters = split_workspace(num_ctas, found.group, c.head_dim,
                                               n * c.num_kv_heads * found.groups, whole)
        part_buf, count_buf = staging.workspace.ready(part_bytes, counters) or (
            staging.workspace.get(part_bytes, counters, self.slab, stream))
        _, lens_at, tables_at, cum16_at, first_seq_at = addresses
        key = (num_q_heads, n, stream, lean, window)
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
                                                    count_buf.ptr, softcap=self.softcap,
                                                    window=window),
                shared_bytes=plan.shared_bytes, stream=stream, patch=ATTENTION_PATCH)
        assert isinstance(launch, Launch)
        launch.set_grid(num_ctas)  # (a prepared launch's STEP_ARGS are this step's below)
        launch.set_ints(STEP_ARGS, step_arguments((0, per_cta, total), part_buf.ptr,
                                                  count_buf.ptr, tables_at, lens_at, cum16_at,
                                                  first_seq_at, width))
        launch.set_float(SCALE_ARG, self.default_scale)  # an earlier step changed it?
        if self.sinks_seen:
            launch.set_ints((SINKS_ARG,), (0,))  # an earlier step's layer's
        return launch


def split_of(work: WorkSplit) -> tuple[int, int, int, bool, bool]:
    """A work split's (num_ctas, per_cta, total, whole, lean): what a launch is given."""
    return (work.num_ctas, work.per_cta, work.total, work.whole, work.lean)


def work_addresses(staging: Staging, work: WorkSplit, stream: Stream | None) -> list[int]:
    """The device addresses of ``work``'s cum16 and first_seq appended to ``staging``'s
    upload (0, 0 in uniform mode, which has neither)."""
    return staging.put(work.arrays, stream, append=True) if work.arrays else [0, 0]
