"""Paged-attention decode, K/V writes by slot mapping, block and span copies on device memory.

Each op checks its arguments (``planning``), then runs the packaged kernel on a GPU backend
or the NumPy implementation (``reference``) on the host backend. Caches and activations are
``DeviceArray``s. Integer metadata may be NumPy arrays, checked on the host (``check=True``)
and uploaded through this device's ``StagingRing`` (pinned memory, one asynchronous copy,
released by an event, never by synchronizing the device), or ``DeviceArray``s of the op's
device, which are never read back: their shape, dtype and device are checked, their
contents trusted.

Every op queues its work on ``stream``; ``None`` is the backend's default (null) stream,
which orders with every other blocking stream of the device. Nothing here waits for the
device. A decode loop should not call these per layer: ``KvCache.batch`` plans a step once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..common import checks
from ..memory import ipc
from ..memory.array import DeviceArray
from ..memory.buffer import HipBuffer
from ..memory.stream import Stream, stream_handle
from ..runtime import Backend
from ..runtime.base import address
from . import multi_token, reference
from .decode import launch_decode
from .module import load_kernels
from .oneoff import Place, host_view, metadata, release_staging, staging
from .planning import (
    ATTENTION_STAGES,
    BLOCK_SIZES,
    DTYPES,
    GROUP_SIZES,
    HEAD_DIMS,
    THREADS,
    WRITE_THREADS,
    attention_shared_bytes,
    check_attention_arrays,
    check_disjoint,
    check_kv_scales,
    check_options,
    check_slots,
    check_tables,
    check_variants,
    check_write_arrays,
    default_scale,
    expect,
    host_ints,
    kernel_scales,
    plan_work,
    write_arguments,
    write_kernel,
)
from .staging import Workspace

__all__ = ["ATTENTION_STAGES", "BLOCK_SIZES", "DTYPES", "GROUP_SIZES", "HEAD_DIMS",
           "PIECE_BYTES", "THREADS", "Workspace", "attention_shared_bytes", "copy_blocks",
           "copy_spans", "host_view",
           "paged_attention", "plan_work", "release_staging", "reshape_and_cache"]


# --- paged attention ---------------------------------------------------------------------
def paged_attention(out: DeviceArray, query: DeviceArray, k_cache: DeviceArray,
                    v_cache: DeviceArray, block_tables: Any, seq_lens: Any,
                    scale: float | None = None, *, query_lens: Any = None,
                    num_partitions: int | None = None, stream: Stream | None = None,
                    workspace: Workspace | None = None, check: bool = True,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    logit_softcap: float | None = None, sinks: DeviceArray | None = None,
                    window: int | None = None) -> None:
    """``out[s, h] = softmax(scale * q[s, h] . K[s]) V[s]`` over the first ``seq_lens[s]``
    tokens of sequence ``s``'s blocks (with a ``window``, its last ``window``: Mistral's
    sliding window, the blocks before it never read);
    ``logit_softcap`` makes each score ``cap * tanh(s / cap)`` first (Gemma 2), and
    ``sinks`` (float32 ``[num_q_heads]``, on the query's device) adds ``exp(sinks[h] - m)``
    to head h's softmax denominator only (gpt-oss's attention sinks), with or without
    ``query_lens`` (``planning.check_variants`` says which values). An fp8 cache
    (float16/bfloat16 queries) holds codes: K = code * ``k_scale``, V = code * ``v_scale``,
    dequantized in the kernel. The work is split over the CTAs as ``planning.plan_work``
    says (one wave of equal shares, or one CTA a unit where the units are many), over the
    real lengths when ``seq_lens`` is on the host (else every sequence counts the block
    tables' width); ``num_partitions`` instead cuts the longest sequence into that many
    pieces. Scratch for split sequences comes from
    ``workspace`` or from the staging slot of this call. ``check`` validates host metadata
    against the cache (device metadata is never read back: lengths on the device must be
    at most the tables' width x block_size, and their block ids in the cache, as host
    metadata is checked to be; the kernel trusts them).

    With ``query_lens`` (int32 ``[num_seqs]`` on the host), sequence ``s`` has
    ``query_lens[s]`` consecutive query rows (``query`` and ``out`` are ``[sum(query_lens),
    num_q_heads, head_dim]``): its newest tokens, row ``i`` attending to positions ``0 ..
    seq_lens[s] - query_lens[s] + i`` (causal: prefill over a cached prefix, a prefill
    chunk, speculative verification; ``multi_token``). Every length is then checked on the
    host, and ``seq_lens`` must be there too."""
    check_options(query, stream, check, num_partitions, workspace)
    num_seqs, _, head_dim, num_blocks, _, block_size = (
        check_attention_arrays(out, query, k_cache, v_cache))
    scale = default_scale(head_dim, scale)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    kernel_scale, out_scale = kernel_scales(k_cache.dtype, scale, k_scale, v_scale)
    softcap, sinks, window = check_variants(query, logit_softcap, sinks, window)
    if query_lens is not None:
        multi_token.paged_attention_multi(
            out, query, k_cache, v_cache, block_tables, seq_lens, query_lens, scale,
            (kernel_scale, out_scale, k_scale, v_scale), num_partitions, stream, workspace,
            (softcap, sinks, window))
        return
    on_host = query.backend.name == "host"
    tables = metadata(block_tables, "block_tables", np.int32, 2, None, query, "query")
    lens = metadata(seq_lens, "seq_lens", np.int32, 1, (num_seqs,), query, "query")
    if (check or on_host) and tables is not None and lens is not None:
        check_tables(tables, lens, num_seqs, num_blocks, block_size)
    check_disjoint(out, "out", query=query, k_cache=k_cache, v_cache=v_cache,
                   **({} if sinks is None else {"sinks": sinks}))
    if num_seqs == 0:
        return
    if on_host:
        assert tables is not None and lens is not None  # host metadata is always NumPy
        result = reference.paged_attention(
            host_view(query), host_view(k_cache), host_view(v_cache), tables, lens, scale,
            k_scale=k_scale, v_scale=v_scale, logit_softcap=softcap or None,
            sinks=None if sinks is None else host_view(sinks), window=window or None)
        host_view(out)[...] = result.astype(out.dtype)
        return
    launch_decode(out, query, k_cache, v_cache, block_tables, tables, seq_lens, lens,
                  kernel_scale, out_scale, num_partitions, stream, workspace, softcap,
                  0 if sinks is None else sinks.ptr, window)


# --- cache writes and copies -------------------------------------------------------------
def reshape_and_cache(key: DeviceArray, value: DeviceArray, k_cache: DeviceArray,
                      v_cache: DeviceArray, slot_mapping: Any, *, stream: Stream | None = None,
                      check: bool = True, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write token ``i``'s K/V (``[num_tokens, num_kv_heads, head_dim]``) at cache slot
    ``slot_mapping[i]`` (int64; ``block * block_size + offset``; -1 skips the token). An fp8
    cache gets float16/bfloat16 K/V quantized: ``x / scale``, saturated at the format's
    largest value, rounded to nearest even (``reference.quantize``)."""
    check_options(key, stream, check)
    num_tokens, num_blocks, block_size = check_write_arrays(key, value, k_cache, v_cache)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    on_host = key.backend.name == "host"
    slots = metadata(slot_mapping, "slot_mapping", np.int64, 1, (num_tokens,), key, "key")
    if (check or on_host) and slots is not None:
        check_slots(slots, num_blocks, block_size)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_disjoint(cache, name, key=key, value=value)
    if on_host:
        assert slots is not None  # host metadata is always NumPy
        reference.reshape_and_cache(host_view(key), host_view(value), host_view(k_cache),
                                    host_view(v_cache), slots, k_scale, v_scale)
        return
    if num_tokens == 0:
        return
    with staging(key, stream) as slot:
        d_slots = slot_mapping if slots is None else slot.put([slots], stream)[0]
        write_kernel(key.backend, key.device, key.dtype, k_cache.dtype).launch(
            num_tokens, WRITE_THREADS, *write_arguments(
                k_cache, v_cache, key, value, d_slots, key.shape[1], block_size,
                key.shape[2] * key.dtype.itemsize, k_cache.dtype, k_scale, v_scale),
            stream=stream)


def copy_blocks(slab: DeviceArray, pairs: Any, *, stream: Stream | None = None) -> None:
    """Copy block ``src`` to ``dst`` for every ``(src, dst)`` row of ``pairs`` (int64
    ``[n, 2]``) in every layer, K and V, of ``slab`` ``[layers, 2, blocks, heads, bs, dim]``.
    Destinations must be distinct and never also a source."""
    check_options(slab, stream, False)
    expect(slab, "slab", 6)
    num_layers, _, num_blocks = slab.shape[:3]
    block_bytes = math.prod(slab.shape[3:]) * slab.dtype.itemsize
    pairs = host_ints(pairs, "pairs", np.int64)
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [n, 2] (src, dst) rows, got shape {pairs.shape}")
    if pairs.size and (pairs.min() < 0 or pairs.max() >= num_blocks):
        bad = pairs[(pairs < 0).any(1) | (pairs >= num_blocks).any(1)][0]
        raise ValueError(f"block pair {bad.tolist()} is outside [0, {num_blocks})")
    if len(np.unique(pairs[:, 1])) != len(pairs) or np.isin(pairs[:, 1], pairs[:, 0]).any():
        raise ValueError("copy_blocks destinations must be distinct and not sources")
    if slab.backend.name == "host":
        reference.copy_blocks(host_view(slab), pairs)
        return
    if len(pairs) == 0:
        return
    if block_bytes % 16:
        raise ValueError(f"a block of {block_bytes} bytes is not a multiple of 16 bytes")
    module = load_kernels("cache_ops", slab.device, slab.backend)
    with staging(slab, stream) as slot:
        module.function("rf_copy_blocks").launch(
            (len(pairs), num_layers * 2), WRITE_THREADS, slab, slot.put([pairs], stream)[0],
            np.int32(num_blocks), np.int64(block_bytes // 16), stream=stream)


#: The most bytes one CTA of a span copy moves: longer spans are cut into pieces of this
#: size (``rf_copy_pieces`` copies any multiple of 16 bytes; this bounds a CTA's work).
PIECE_BYTES = 1 << 16
#: The most pieces one launch takes (a grid of 256-thread CTAs stays within 2^32 threads,
#: the AMD limit).
MAX_PIECES = (1 << 24) - 1


#: Spans of another device's memory mapped here (an IPC mapping made on the receiver's
#: device, ``ipc.remote_device``) at least this long on average go as one batched driver
#: copy, shorter ones through the span kernel over the link. Two H200s (NVLink), 512 MiB:
#: 8 MiB spans 334 GB/s by the driver's batch against 301 by the kernel; 32 KiB spans 32
#: against 247 (bench --transfer, 2026-11-28).
LINK_SPAN_BYTES = 1 << 20


def copy_spans(dst: HipBuffer, src: HipBuffer, spans: Any, *,
               stream: Stream | None = None) -> None:
    """Copy each span ``(src offset, dst offset, bytes)`` of ``spans`` (integers ``[n, 3]``,
    inside both buffers, no two destinations overlapping, and where ``src`` is ``dst``'s
    memory no source overlapping a destination) from ``src`` to ``dst``, queued on
    ``stream`` of ``dst``'s device. ``src`` is memory of the same backend: ``dst``'s device's
    own, an IPC mapping, or another device's.

    Where ``dst``'s device addresses ``src`` (its own memory, a peer's with peer access on,
    or another device's memory it mapped by IPC itself, whose spans go by the kernel where
    shorter than ``LINK_SPAN_BYTES`` on average; not an IPC mapping made on another device,
    which peer access does not reach: an illegal address on two H200s) and every address
    and size is a multiple of 16 bytes, one launch
    copies every span (cut into pieces of at most ``PIECE_BYTES``, a CTA each): thousands
    of small spans, a scattered sequence's blocks, move at the speed of a few large copies.
    Otherwise the spans are one batched driver copy (``copy_batch``: across devices, an IPC
    mapping of another device's memory too) where the binding and driver have one, else each
    span is one runtime copy (a peer copy across devices, which the runtime stages through
    host memory where the two have no peer access). Nothing waits for the
    device, and across devices nothing orders the copy after work queued on ``src``'s device
    (a runtime peer copy on the default stream would): the caller does, as
    ``export_sequence`` does by waiting before the description leaves."""
    for name, buffer in (("dst", dst), ("src", src)):
        if not isinstance(buffer, HipBuffer):
            raise TypeError(f"{name} must be a HipBuffer, got {checks.show(buffer)}")
        buffer.ptr  # noqa: B018 - raises BufferClosedError once closed, spans or not
    if src.backend is not dst.backend:
        raise ValueError(f"src is {src.backend.name} memory and dst {dst.backend.name}: span "
                         "copies stay within one backend")
    backend, handle = dst.backend, stream_handle(stream, "stream", dst.backend, dst.device)
    remote = src.device == dst.device and ipc.remote_device(src.ptr) is not None
    if not remote and _one_pass(dst, src, spans, stream):
        return
    spans = checks.spans(spans, src.nbytes, dst.nbytes)
    spans = spans[spans[:, 2] > 0]
    if src.ptr < dst.ptr + dst.nbytes and dst.ptr < src.ptr + src.nbytes:
        # one memory (views of one allocation, or two imports of one IPC handle: two roots
        # at one address): no span may read what another writes
        _check_apart(spans, src.ptr - dst.ptr)
    if not len(spans):
        return
    aligned = by_kernel(backend) and not ((src.ptr | dst.ptr) & 15 or (spans & 15).any())
    if remote and len(spans) and spans[:, 2].mean() >= LINK_SPAN_BYTES:
        aligned = False  # large spans over the link: the copy engines' batch is faster
    if aligned:  # the kernel found before any peer state changes
        load_kernels("cache_ops", dst.device, backend).function("rf_copy_pieces")
    direct = True
    if src.device != dst.device:  # the peer copies below make dst's device active again
        direct = backend.peer_access(dst.device, src.device) and not ipc.mapped(src.ptr)
        backend.peer_access(src.device, dst.device)
    if aligned and direct:
        copy_pieces(backend, dst.device, cut_pieces(dst.ptr, src.ptr, spans), stream)
        return
    if copy_batch(dst, src, spans, handle):
        return
    for src_offset, dst_offset, nbytes in spans.tolist():
        if src.device == dst.device:
            backend.memcpy_dtod(dst.ptr + dst_offset, src.ptr + src_offset, nbytes, handle)
        else:
            backend.memcpy_peer(dst.ptr + dst_offset, dst.device, src.ptr + src_offset,
                                src.device, nbytes, handle)


def copy_batch(dst: HipBuffer, src: HipBuffer, spans: np.ndarray, stream: Any) -> bool:
    """Queue checked, non-empty ``spans`` of ``src`` into ``dst`` on ``stream`` (a handle of
    ``dst``'s device; None: the default stream) as one batched driver copy: True; False
    (nothing queued) where the binding or the driver has none. For the default stream the
    batch, which refuses the legacy one, goes on the thread's default stream (2:
    CU_STREAM_PER_THREAD, hipStreamPerThread), which the legacy stream's work before and
    after waits for as any blocking stream's."""
    calls = dst.backend.driver_calls
    if calls is None or not calls.batches:
        return False
    dst.backend.activate(dst.device)
    src_device = ipc.remote_device(src.ptr)  # (the memory's own device: a location hint)
    status = calls.copy_batch((dst.ptr + spans[:, 1]).astype(np.uint64),
                              (src.ptr + spans[:, 0]).astype(np.uint64),
                              spans[:, 2].astype(np.uint64),
                              src.device if src_device is None else src_device, dst.device,
                              address(stream) or 2)
    return status == 0


def _one_pass(dst: HipBuffer, src: HipBuffer, spans: Any, stream: Stream | None) -> bool:
    """``copy_spans``'s common case in one pass (``Staging.put_pieces``): two distinct
    allocations of one device that runs kernels, 16-byte aligned, and ``spans`` an int64
    C-contiguous ``[n, 3]`` array whose spans lie in both buffers, 16-byte aligned, their
    destinations ascending without overlap (what ``block_spans`` makes). The pieces are
    cut straight into a staging slot and launched: True. False (nothing queued) where any
    of that does not hold: the general checks and copies follow."""
    if not (type(spans) is np.ndarray and spans.dtype == np.int64 and spans.ndim == 2
            and spans.shape[1] == 3 and spans.flags.c_contiguous and src.device == dst.device
            and by_kernel(dst.backend) and not (src.ptr | dst.ptr) & 15
            and (src.ptr >= dst.ptr + dst.nbytes or dst.ptr >= src.ptr + src.nbytes)):
        return False
    function = load_kernels("cache_ops", dst.device, dst.backend).function("rf_copy_pieces")
    with staging(Place(dst.backend, dst.device), stream) as slot:
        table, count = slot.put_pieces(spans, src, dst, PIECE_BYTES, stream)
        for start in range(0, count, MAX_PIECES):
            function.launch(min(MAX_PIECES, count - start), WRITE_THREADS, table + 24 * start,
                            stream=stream)
    return count >= 0


def by_kernel(backend: Backend) -> bool:
    """Whether span copies on ``backend`` may run as ``rf_copy_pieces`` launches (a GPU's;
    the host backend runs no kernels and copies span by span)."""
    return backend.name != "host"


def _check_apart(spans: np.ndarray, shift: int) -> None:
    """No source span of ``spans`` (none empty; ``shift`` bytes past the destination's start
    in one allocation) overlaps a destination span: the pieces of one launch run in any
    order."""
    dst = spans[np.argsort(spans[:, 1], kind="stable")][:, 1:]  # disjoint: ends sorted too
    src_start = spans[:, 0] + shift
    before = np.searchsorted(dst[:, 0], src_start + spans[:, 2]) - 1  # last dst starting
    hit = (before >= 0) & (dst[np.maximum(before, 0)].sum(1) > src_start)  # before its end
    if hit.any():
        raise ValueError(f"spans read bytes another span writes (source span "
                         f"{spans[int(np.flatnonzero(hit)[0])].tolist()}): copy through a "
                         "buffer of its own")


def cut_pieces(dst_ptr: int, src_ptr: int, spans: np.ndarray) -> np.ndarray:
    """``spans`` (int64 ``[n, 3]``: src offset, dst offset, bytes; sizes > 0) of the memory
    at ``src_ptr`` and ``dst_ptr`` cut into pieces of at most ``PIECE_BYTES``: int64
    ``[m, 3]`` rows of (src address, dst address, bytes), as ``rf_copy_pieces`` reads them."""
    if spans[:, 2].max(initial=0) <= PIECE_BYTES:  # a piece a span (a block of a plane)
        return spans + np.array([src_ptr, dst_ptr, 0], np.int64)
    counts = -(-spans[:, 2] // PIECE_BYTES)
    owner = np.repeat(np.arange(len(spans)), counts)
    within = (np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)) * (
        PIECE_BYTES)
    sizes = np.minimum(spans[owner, 2] - within, PIECE_BYTES)
    return np.stack([src_ptr + spans[owner, 0] + within, dst_ptr + spans[owner, 1] + within,
                     sizes], 1)


def copy_pieces(backend: Backend, device: int, pieces: np.ndarray,
                stream: Stream | None) -> None:
    """Launch ``rf_copy_pieces`` over ``pieces`` (``cut_pieces``: every address and size a
    multiple of 16, destinations disjoint) on ``stream`` of ``device``, the table uploaded
    through the device's staging ring. The addresses are trusted: the caller checked that
    they lie in memory the device reaches (its own, an IPC mapping, a peer's with peer
    access on, pinned host memory from ``host_alloc``); the table's form is checked."""
    pieces = np.asarray(pieces)
    if pieces.dtype != np.int64 or pieces.ndim != 2 or pieces.shape[1] != 3 or (
            pieces.size and ((pieces & 15).any() or pieces[:, 2].min() <= 0
                             or pieces[:, 2].max() > PIECE_BYTES)):
        raise ValueError(f"pieces must be int64 [m, 3] rows (src address, dst address, bytes), "
                         f"16-byte aligned, sizes 16..{PIECE_BYTES}: got {pieces.dtype} "
                         f"{pieces.shape}")
    function = load_kernels("cache_ops", device, backend).function("rf_copy_pieces")
    if not len(pieces):
        return
    with staging(Place(backend, device), stream) as slot:
        table = slot.put([pieces], stream)[0]
        for start in range(0, len(pieces), MAX_PIECES):
            function.launch(min(MAX_PIECES, len(pieces) - start), WRITE_THREADS,
                            table + 24 * start, stream=stream)

