"""Sequences moving between KV caches: a description on one side, its blocks on the other.

``KvCache.export_sequence(seq_id)`` describes a sequence (``SequenceDescription``, a plain
picklable value): the sender's layout and its fingerprint, the block ids in the sender's
slab, the token count, the prefix hashes of its leading full blocks, the fp8 scales, and the
endpoints its slab is published with (``Transport.publish``). It waits for the cache's stream
first, so the K/V written there are in memory before the description leaves. The sender keeps
the sequence (and writes nothing more into its blocks) until the receiver's import returned:
blocks a sender frees can be reused under a reader.

``KvCache.import_sequence(desc, transport)`` checks the layout before it allocates anything
(block size, heads, head size, layers, dtypes, scales: a mismatch names the field), finds the
leading blocks whose prefix hashes it already holds (shared by ref count, not moved),
allocates the rest (never preempting: ``CacheFullError`` when too few blocks are free), reads
their bytes through ``transport`` into the cache's slab on the cache's stream, and only then
adds the sequence. If the bytes do not arrive (the transport fails, the sender exited or closed
its slab, or ``timeout`` seconds passed first: copies still queued then stay ordered on the
cache's stream before any later use of the blocks), every block it took goes back and the cache is
as before, except that cached-free prefix blocks the read may have reached are forgotten
(their contents are no longer what their hashes name). The read runs under the cache's lock.

A block is ``2 * num_layers`` chunks in the slab (layer ``l``'s K then V plane), so a run of
consecutive blocks on both sides moves as one span per plane.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...common import checks
from ...errors import CacheFullError
from ..blocks.prefix import HASH_BYTES
from ..config import CacheConfig
from ..core import operation
from ..tiers.swap import TierOps
from . import _spans
from .transport import Transport, published, read_timeout, wait

_LAYOUT = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "activation_dtype",
           "kv_scales")


def layout(config: CacheConfig) -> dict[str, Any]:
    """What two caches must agree on for a block of one to mean the same in the other."""
    return {name: getattr(config, name).name if name.endswith("dtype")
            else getattr(config, name) for name in _LAYOUT}


def fingerprint(fields: dict[str, Any]) -> str:
    """A digest of ``layout()`` (hex): equal layouts, equal fingerprints."""
    text = repr([(name, fields[name]) for name in _LAYOUT])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@functools.lru_cache(maxsize=32)
def _constants(config: CacheConfig) -> tuple[dict[str, Any], str, int, np.ndarray]:
    """Per receiving layout, made once: ``layout(config)`` (never handed out: descriptions
    get their own), its fingerprint, the bytes of one block of one plane, and each plane's
    offset in this config's slab (read-only)."""
    fields = layout(config)
    chunk = config.block_bytes // (2 * config.num_layers)
    planes = np.arange(2 * config.num_layers, dtype=np.int64) * (config.num_blocks * chunk)
    planes.flags.writeable = False
    return fields, fingerprint(fields), chunk, planes


@dataclass(frozen=True)
class SequenceDescription:
    """A sequence of a sending cache: ``layout`` (and its ``fingerprint``), its
    ``num_tokens``, its ``block_ids`` in the sender's slab of ``num_blocks`` blocks, the
    ``prefix_hashes`` of its leading full blocks, its ``kv_scales`` and the ``endpoints`` of
    the sender's slab by transport name."""

    seq_id: Hashable
    fingerprint: str
    layout: dict[str, Any]
    num_tokens: int
    block_ids: tuple[int, ...]
    num_blocks: int
    prefix_hashes: tuple[bytes, ...]
    endpoints: dict[str, Any]

    @property
    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Per layer (k_scale, v_scale): what an fp8 cache's codes are multiplied by."""
        scales: tuple[tuple[float, float], ...] = self.layout["kv_scales"]
        return scales


@dataclass(frozen=True)
class Imported:
    """What ``import_sequence`` did: blocks read through the transport (``blocks_moved``,
    ``nbytes`` bytes in ``seconds``) and blocks the receiver already held by prefix hash
    (``blocks_shared``)."""

    seq_id: Hashable
    num_tokens: int
    blocks_moved: int
    blocks_shared: int
    nbytes: int
    seconds: float


class SequenceTransfer(TierOps):
    """``KvCache``'s operations that move sequences between caches (module docstring)."""

    @operation
    def export_sequence(self, seq_id: Hashable) -> SequenceDescription:
        """A picklable description of ``seq_id`` for another cache's ``import_sequence``
        (after the K/V queued on the cache's stream are in memory). Keep the sequence, and
        write nothing more into it, until that import returned. A swapped-out sequence is
        refused (``swap_in`` it first)."""
        self._resident_rows([seq_id])
        return _export(self, seq_id)

    @operation
    def import_sequence(self, desc: SequenceDescription, transport: Any,
                        seq_id: Hashable | None = None, *, timeout: float | None = None
                        ) -> Imported:
        """Add the sequence ``desc`` describes (as ``seq_id``, default its id there), its
        blocks read through ``transport`` (``rocmforge_raw.transport``) into fresh blocks,
        but those whose prefix this cache holds already. Checks the layout before it
        allocates; never preempts; if the bytes do not arrive (within ``timeout`` seconds
        where given: ``TransferError``), the cache is as before."""
        return _import(self, desc, transport, seq_id, timeout)


def _export(cache: TierOps, seq_id: Hashable) -> SequenceDescription:
    """The description of ``seq_id`` (lock held); see the module docstring."""
    rows, row = cache._rows, cache._rows.row(seq_id)
    if rows.dropped[row]:
        raise NotImplementedError(
            f"export of sequence {seq_id!r}, whose first {int(rows.dropped[row])} blocks left "
            "every window (freed): only whole sequences move for now")
    ids = rows.tables[row, : rows.nblocks[row]].tolist()
    hashes = []
    for block in ids:
        digest = cache.pool.hashes.get(block)
        if digest is None:
            break
        hashes.append(digest)
    wait(cache.slab.buffer, cache.stream)  # the K/V written so far are in memory
    fields = layout(cache.config)
    return SequenceDescription(seq_id, fingerprint(fields), fields, int(rows.lens[row]),
                               tuple(ids), cache.config.num_blocks, tuple(hashes),
                               published(cache.slab.buffer))


def _import(cache: TierOps, desc: Any, transport: Any, seq_id: Hashable | None = None,
            timeout: float | None = None) -> Imported:
    """Add ``desc``'s sequence to ``cache`` as ``seq_id`` (default: its id there), its bytes
    read through ``transport`` (lock held); see the module docstring."""
    if not isinstance(desc, SequenceDescription):
        raise TypeError(f"desc must be a SequenceDescription (from export_sequence), got "
                        f"{checks.show(desc)}")
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a Transport, got {checks.show(transport)}")
    seq_id = checks.hashable(desc.seq_id if seq_id is None else seq_id, "seq_id")
    timeout = read_timeout(timeout)
    if seq_id in cache._rows.index or cache._swapped(seq_id) is not None:
        raise ValueError(f"sequence {seq_id!r} already exists")
    config = cache.config
    src_ids = _check(desc, config)
    if transport.name not in desc.endpoints:
        raise ValueError(f"the sending cache's slab is published through "
                         f"{sorted(desc.endpoints) or 'no transport'}, not {transport.name!r}: "
                         f"publish it there first ({type(transport).__name__}.publish(slab))")
    # the sender's slab has num_blocks blocks of this layout, exactly: a description whose
    # count was altered would read other blocks' bytes at the planes' strides
    slab = transport.endpoint_nbytes(desc.endpoints[transport.name])
    if slab != desc.num_blocks * config.block_bytes:
        raise ValueError(f"desc.num_blocks {desc.num_blocks} makes a slab of "
                         f"{desc.num_blocks * config.block_bytes} bytes, but the endpoint names "
                         f"{slab}: the description was altered")
    now = cache._now()
    pool = cache.pool
    hits = pool.lookup(list(desc.prefix_hashes))
    need = len(src_ids)
    fresh = need - len(hits)
    needed = fresh + (int(np.count_nonzero(pool.ref_cnt[hits] == 0)) if hits else 0)
    if needed > pool.num_free:
        raise CacheFullError(needed, pool.num_free, "an import never preempts")
    # Where the free stack holds every fresh block, the read goes into the blocks the
    # allocation will take (``peek``), and the bookkeeping changes only once the bytes are
    # in: a failed read leaves nothing to undo (plain free blocks hold no prefix), and no
    # snapshot of the whole cache is taken (O(blocks in the cache), not of the sequence).
    fast = fresh <= pool.num_plain_free
    saved = None if fast else cache._save()
    new = np.zeros(0, np.int32)
    try:
        if fast:
            new = pool.peek(fresh, hits)[0].astype(np.int32)
        else:
            new = cache._allocate(fresh, cache.stream, hits)  # demotes what it reuses
        spans = block_spans(src_ids[len(hits) :], new, desc.num_blocks, config)
        start = time.perf_counter()
        if len(spans):  # every block a prefix hit: nothing to map, move or wait for
            if cache._order is not None:
                cache._order.used(cache.stream)
            transport.read(desc.endpoints[transport.name], cache.slab.buffer, spans,
                           cache.stream, timeout=timeout)
    except BaseException:
        if saved is not None:
            cache._reached[0].extend(new.tolist())  # the read's blocks: forgotten if cached
            cache._restore(saved)
        raise
    seconds = time.perf_counter() - start
    if fast:
        taken = cache._allocate(fresh, cache.stream, hits)
        assert np.array_equal(taken, new), "the allocation took other blocks than it peeked"
    ids = np.concatenate([np.array(hits, np.int32), new]) if hits else new
    hashes = list(desc.prefix_hashes)
    if len(hashes) > len(hits):  # hashes of blocks moved: named here
        cache._name(ids, hashes, list(range(len(hits), len(hashes))), None)
    cache._add_row(seq_id, ids, desc.num_tokens, len(hits) == need, now)
    # (the spans cover each moved block's 2 * num_layers chunks once)
    return Imported(seq_id, desc.num_tokens, fresh, len(hits), fresh * config.block_bytes,
                    seconds)


def _check(desc: SequenceDescription, config: CacheConfig) -> np.ndarray:
    """The sender's block ids, once ``desc`` is known to fit ``config``: the same layout
    (each differing field named), a matching fingerprint, consistent counts."""
    ours, digest = _constants(config)[:2]
    theirs = desc.layout if isinstance(desc.layout, dict) else {}
    differ = [] if theirs == ours else [  # (one C comparison where they are equal)
        f"{name} {theirs.get(name)!r} (this cache: {ours[name]!r})"
        for name in _LAYOUT if theirs.get(name) != ours[name]]
    if differ:
        raise ValueError("the sequence comes from a cache of another layout: "
                         + ", ".join(differ))
    if desc.fingerprint != digest:
        raise ValueError(f"fingerprint {desc.fingerprint!r} does not match the layout "
                         f"{digest!r}: the description was altered")
    num_tokens = checks.integer(desc.num_tokens, "desc.num_tokens", 1)
    src_blocks = checks.integer(desc.num_blocks, "desc.num_blocks", 2)
    checked = _spans.block_ids(desc.block_ids, src_blocks)  # a tuple of plain ints in range (C)
    _check_types(desc, checked is None)
    ids = np.asarray(desc.block_ids, np.int64) if checked is None else checked
    if ids.size != -(-num_tokens // config.block_size):
        raise ValueError(f"{ids.size} blocks cannot hold {num_tokens} tokens of "
                         f"{config.block_size} per block")
    if checked is None and (ids.min() < 1 or ids.max() >= src_blocks):
        raise ValueError(f"block ids {checks.show(list(desc.block_ids))} leave 1.."
                         f"{src_blocks - 1}")
    hashes, full = desc.prefix_hashes, num_tokens // config.block_size  # a partial block: none
    if len(hashes) > full or not set(map(type, hashes)) <= {bytes} or not set(
            map(len, hashes)) <= {HASH_BYTES}:  # (set(map(...)): C speed over many blocks)
        raise ValueError(f"prefix_hashes must be at most {full} hashes (one per full block) of "
                         f"{HASH_BYTES} bytes, got {checks.show(hashes)}")
    if len(set(hashes)) != len(hashes):  # chained hashes never repeat: one block each
        raise ValueError(f"prefix_hashes repeat a hash: {checks.show(hashes)}")
    return ids


def _check_types(desc: SequenceDescription, check_ids: bool = True) -> None:
    """The containers of ``desc`` as ``export_sequence`` makes them (never cast: a float
    block id is no block; the ids' types unless ``check_ids`` is false: ``block_ids`` found
    them plain ints)."""
    ids, hashes, endpoints = desc.block_ids, desc.prefix_hashes, desc.endpoints
    if check_ids and (not isinstance(ids, (tuple, list)) or not all(  # each type once: C speed
            issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))
            for t in set(map(type, ids)))):
        raise TypeError(f"desc.block_ids must be a tuple of ints, got {checks.show(ids)}")
    if not isinstance(hashes, (tuple, list)):
        raise TypeError(f"desc.prefix_hashes must be a tuple of bytes, got {checks.show(hashes)}")
    if not isinstance(endpoints, dict):
        raise TypeError(f"desc.endpoints must be a dict (transport name: endpoint), got "
                        f"{checks.show(endpoints)}")


def block_spans(src: np.ndarray, dst: np.ndarray, src_blocks: int,
                config: CacheConfig) -> np.ndarray:
    """Spans (src offset, dst offset, bytes), int64 ``[n, 3]``, that copy blocks ``src`` of
    a slab of ``src_blocks`` blocks to blocks ``dst`` of this ``config``'s slab: one per
    plane (layer, K/V) per run of blocks consecutive on both sides, their destinations
    ascending (C-contiguous: ``ops.copy_spans`` takes such a table in one pass)."""
    src = np.ascontiguousarray(src, np.int64)
    if not src.size:
        return np.zeros((0, 3), np.int64)
    _, _, chunk, planes = _constants(config)  # one block of one plane; planes' offsets here
    dst = np.asarray(dst)
    if dst.dtype != np.int32:
        dst = np.asarray(dst, np.int64)
    table = _spans.spans(src, np.ascontiguousarray(dst), src_blocks, config.num_blocks, chunk,
                         planes.size)  # C, where the destinations ascend
    if table is not None:
        return table
    dst = dst.astype(np.int64)
    dst_step = np.diff(dst)
    if (dst_step < 0).any():  # in destination order (the runs stay consecutive runs)
        order = np.argsort(dst, kind="stable")
        src, dst = src[order], dst[order]
        dst_step = np.diff(dst)
    starts = np.flatnonzero((np.diff(src) != 1) | (dst_step != 1)) + 1
    starts = np.concatenate([[0], starts])
    lengths = np.diff(starts, append=src.size)
    plane = np.arange(planes.size, dtype=np.int64)[:, None]
    spans = np.empty((planes.size, starts.size, 3), np.int64)
    spans[:, :, 0] = (plane * src_blocks + src[starts]) * chunk  # the sender's slab
    spans[:, :, 1] = planes[:, None] + dst[starts] * chunk  # this config's
    spans[:, :, 2] = lengths * chunk
    return spans.reshape(-1, 3)
