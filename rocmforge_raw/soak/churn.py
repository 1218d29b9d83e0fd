"""The soak's churn of the cache's newer paths: the host tier, sequence transfers and graph
replays. Each ``cycle`` leaves nothing behind but the long-lived caches, transport and graph,
which ``close`` releases; every sequence it adds it finishes (or the next cycle does).

- ``tier``: a cache with a host tier: prompts with shared prefixes (demoted to the host tier
  and promoted back as the pool turns over), swaps out and in, now and then a cleared
  prefix cache.
- ``transfer``: a sequence written in one cache, moved into another through a
  ``PeerTransport`` (prefix blocks the receiver holds shared, the rest copied), decoded there
  and finished on both sides.
- ``graph`` (a GPU's): decode steps and mixed steps (decodes beside prefill chunks) of a
  two-layer cache replayed as one graph, members changing now and then (a re-capture).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..cache import CacheConfig, CacheFullError, KvCache
from ..memory.array import DeviceArray
from ..runtime import Backend
from ..transport import PeerTransport

#: The workloads of this module, in the order ``cycle`` runs them.
CHURN = ("tier", "transfer", "graph")


class Churn:
    """The long-lived objects of the workloads named in ``workloads`` (those of ``CHURN``)."""

    def __init__(self, backend: Backend, device: int, rng: np.random.Generator,
                 workloads: tuple[str, ...]) -> None:
        self.backend, self.device, self.rng = backend, device, rng
        self.dtype = "float32" if backend.name == "host" else "bfloat16"
        self.count = 0
        self.blocks_shared = 0  # by imports, of prefixes the receiver held already
        self.tiered = self.sender = self.receiver = self.link = None
        self.stepped: KvCache | None = None
        self.graph: Any = None
        self.layers: list[tuple[DeviceArray, ...]] = []
        if "tier" in workloads:
            self.tiered = self._cache(num_blocks=24, host_blocks=48)
        if "transfer" in workloads:
            self.sender, self.receiver = self._cache(32), self._cache(32)
            self.link = PeerTransport()
            self.link.publish(self.sender.slab)
        if "graph" in workloads and backend.name != "host":  # graphs are a GPU's
            self.stepped = self._cache(64)
            self.graph = self.stepped.step_graph(headroom=16)

    def _cache(self, num_blocks: int, host_blocks: int = 0) -> KvCache:
        config = CacheConfig(2, 2, 64, 16, num_blocks, self.dtype, num_q_heads=4,
                             host_blocks=host_blocks)
        return KvCache(config, self.device, self.backend)

    def _id(self) -> str:
        self.count += 1
        return f"churn-{self.count}"

    def _write(self, cache: KvCache, slots: np.ndarray) -> None:
        """Random K/V into ``slots`` of every layer (a prefill's or a step's)."""
        c = cache.config
        kv = self.rng.standard_normal((slots.size, c.num_kv_heads, c.head_dim), np.float32)
        key = DeviceArray.from_numpy(kv.astype(c.dtype), self.device, self.backend)
        for layer in range(c.num_layers):
            cache.write(layer, key, key, slots)
        key.buffer.close()

    def _prefill(self, cache: KvCache, seq_id: str, tokens: np.ndarray) -> None:
        """Add ``seq_id`` with ``tokens`` and write the K/V of those the prefix cache did not
        hold (the found blocks are shared: never written again)."""
        reservation = cache.add_sequence(seq_id, tokens=tokens)
        self._write(cache, reservation.slot_mapping[reservation.num_cached_tokens:])

    def cycle(self) -> None:
        if self.tiered is not None:
            self._tier(self.tiered)
        if self.link is not None:
            self._transfer()
        if self.graph is not None:
            self._graph()

    def _tier(self, cache: KvCache) -> None:
        rng = self.rng
        base = np.arange(int(rng.integers(16, 80)))  # a shared prefix of a few blocks
        ids = []
        for _ in range(int(rng.integers(1, 4))):
            tokens = np.concatenate([base, rng.integers(1000, 2000, int(rng.integers(1, 40)))])
            if not cache.can_allocate(len(tokens)):
                break
            seq_id = self._id()
            self._prefill(cache, seq_id, tokens)
            ids.append(seq_id)
        if ids:
            with contextlib.suppress(CacheFullError):  # all or none
                cache.swap_out(ids)
        if ids and cache.can_swap_in(ids):
            cache.swap_in(ids)
        for seq_id in ids:  # those still swapped out too (their host blocks go back)
            cache.finish(seq_id)
        if rng.random() < 0.05:
            cache.clear_prefix_cache()
        cache.events()  # drained: the queue is bounded, but a soak reads it as a user would

    def _transfer(self) -> None:
        rng, src, dst = self.rng, self.sender, self.receiver
        assert src is not None and dst is not None
        seq_id = self._id()
        n = int(rng.integers(1, 120))
        tokens = np.concatenate([np.arange(32), rng.integers(1000, 2000, n)])  # 2 shared blocks
        if not (src.can_allocate(len(tokens)) and dst.can_allocate(len(tokens) + 1)):
            return
        self._prefill(src, seq_id, tokens)
        self.blocks_shared += dst.import_sequence(src.export_sequence(seq_id),
                                                  self.link).blocks_shared
        dst.append([seq_id])
        self._write(dst, dst.batch([seq_id]).slot_mapping)
        src.finish(seq_id)
        dst.finish(seq_id)
        src.events()  # drained, as a user of the events would (the queues are bounded)
        dst.events()

    def _graph(self) -> None:
        cache, rng = self.stepped, self.rng
        assert cache is not None
        if not self.layers or rng.random() < 0.1:  # new members: a re-capture
            self._close_steps()
            chunk = int(rng.integers(2, 9))
            ids = [self._id() for _ in range(3)]
            for seq_id in ids:
                cache.add_sequence(seq_id, int(rng.integers(1, 60)))
            self.ids, self.q_lens = ids, np.array([1, 1, chunk], np.int32)
            c = cache.config
            rows = 2 + chunk
            kv, q = (rows, c.num_kv_heads, c.head_dim), (rows, 2 * c.num_kv_heads, c.head_dim)
            self.layers = [tuple(DeviceArray.empty(s, c.dtype, self.device, self.backend)
                                 for s in (kv, kv, q, q)) for _ in range(c.num_layers)]
            for layer in self.layers:
                for array in layer:
                    array.buffer.fill(0)
        cache.append(self.ids[:2])
        cache.extend(self.ids[2:], [int(self.q_lens[2])])
        if not all(cache.seq_len(s) < 250 for s in self.ids):  # long enough: start over
            self._close_steps()
            return
        self.graph.run(cache.batch(self.ids, query_lens=self.q_lens), self.layers)

    def _close_steps(self) -> None:
        cache = self.stepped
        assert cache is not None
        for layer in self.layers:
            for array in layer:
                array.buffer.close()
        self.layers = []
        for seq_id in getattr(self, "ids", []):
            if seq_id in cache:
                cache.finish(seq_id)
        self.ids = []

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()  # after its last replay (it waits for its fence)
            self._close_steps()
        for cache in (self.tiered, self.sender, self.receiver, self.stepped):
            if cache is not None:
                cache.close()
        if self.link is not None:
            self.link.close()
