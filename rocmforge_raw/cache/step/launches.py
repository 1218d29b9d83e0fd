"""StepLaunches: a cache's device work per layer: its K and V planes, the K/V writes and the
attention of the current plan (``batch()``), one launch each, and the step graph that
replays a whole step's launches (``graph``).

A plan is current until the cache changes or plans again (``_current`` refuses any other in
O(1)); a write given a slot mapping instead of a plan is the prefill path
(``ops.reshape_and_cache``). Nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any

from ...common import checks
from ...kernels import ops
from ...memory.array import DeviceArray
from ...memory.stream import Stream, stream_handle
from ..core import CacheCore
from .graph import StepGraph
from .metadata import BatchMetadata
from .planner import StepPlanner


class StepLaunches(CacheCore):
    """``KvCache``'s per-layer device work (module docstring)."""

    _steps: StepPlanner

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
        """Write K/V of ``layer``: with the current ``batch()`` plan, each sequence's new
        token (``[n, num_kv_heads, head_dim]``, one launch); with a slot mapping, any tokens
        at those slots (see ``ops.reshape_and_cache``; prefill)."""
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
                  stream: Stream | None = None) -> None:
        """Decode attention of ``layer`` for the current ``batch()`` plan: one launch."""
        with self._lock:
            self._steps.attention(self._current(batch, stream), layer, out, query, scale)

    def step_graph(self, headroom: int = 128, scale: float | None = None) -> StepGraph:
        """A ``StepGraph`` of this cache: a decode step's launches captured once as a
        CUDA/HIP graph and replayed per step (``graph.run(batch, layers)``), on the cache's
        stream; a step that outgrows it by ``headroom`` tokens a sequence re-captures."""
        self._check_open()
        return StepGraph(self, headroom, scale)

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
