"""Attention of many query tokens per sequence over the paged cache: ``ops.paged_attention``
with ``query_lens`` (DESIGN.md, "Attention over many query tokens").

Sequence ``s`` owns ``query_lens[s]`` consecutive rows of ``query`` (its newest tokens, in
order) and has ``seq_lens[s]`` tokens in the cache, the new ones written already; row ``i``
attends to positions ``0 .. seq_lens[s] - query_lens[s] + i``. Every length is checked on
the host before anything is queued: the launch's work items are planned from them
(``planning.plan_prefill``).

A launch whose rows are all decodes (every ``query_lens`` 1) is the decode kernel's, exactly
``ops.paged_attention`` without ``query_lens``. Otherwise the leading decodes (a step lists
its decodes first, as the Scheduler does) go to the decode kernel and the rest to the
multi-token kernel (``native/prefill.cu``), two launches on one stream: the decode kernel
streams one row's KV at the copy bandwidth, which the multi-token kernel's 16-row tiles
would spend on 1-row work. Decodes elsewhere in the batch run in the multi-token kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..memory.array import DeviceArray
from ..memory.stream import Stream
from . import reference
from .decode import launch_decode
from .oneoff import host_view, metadata, staging
from .planning import check_disjoint, check_tables, host_ints
from .planning.prefill import leading_decodes, prefill_launch
from .staging import Workspace

#: The most query rows one launch takes: the kernels index rows as int32.
MAX_ROWS = (1 << 31) - 1


def check_query_lens(query_lens: Any, seq_lens: np.ndarray, num_rows: int) -> np.ndarray:
    """``query_lens`` as a checked int32 array: one per sequence, each in ``[1,
    seq_lens[s]]``, summing to ``num_rows`` (the query's rows), on the host."""
    if isinstance(query_lens, DeviceArray):
        raise TypeError("query_lens must be host integers (a NumPy int32 array): the launch's "
                        "work is planned from them on the host; got a DeviceArray")
    q_lens = host_ints(query_lens, "query_lens", np.int32, seq_lens.shape)
    if q_lens.size and q_lens.min() < 1:
        s = int(q_lens.argmin())
        raise ValueError(f"query_lens[{s}] = {int(q_lens[s])}: every sequence has at least "
                         f"one query row")
    over = np.flatnonzero(q_lens > seq_lens)
    if over.size:
        s = int(over[0])
        raise ValueError(f"query_lens[{s}] = {int(q_lens[s])} exceeds seq_lens[{s}] = "
                         f"{int(seq_lens[s])}: a sequence's query rows are its newest tokens, "
                         f"already in the cache")
    total = int(q_lens.sum(dtype=np.int64))
    if total != num_rows:
        raise ValueError(f"query_lens sum to {total} rows, but query has {num_rows}")
    return q_lens


def rows(array: DeviceArray, start: int, count: int) -> DeviceArray:
    """Rows ``[start, start + count)`` of ``array`` (its first dimension), a view."""
    per_row = array.nbytes // max(array.shape[0], 1)
    return DeviceArray(array.buffer, array.dtype, (count, *array.shape[1:]), start * per_row)


def paged_attention_multi(out: DeviceArray, query: DeviceArray, k_cache: DeviceArray,
                          v_cache: DeviceArray, block_tables: Any, seq_lens: Any,
                          query_lens: Any, scale: float,
                          scales: tuple[float, float, float, float],
                          num_partitions: int | None, stream: Stream | None,
                          workspace: Workspace | None,
                          variants: tuple[float, DeviceArray | None, int] = (0.0, None, 0)
                          ) -> None:
    """The op (module docstring) over arrays ``ops.paged_attention`` checked; ``scales`` is
    (kernel scale, out scale, k_scale, v_scale), ``variants`` (logit cap, sinks, window) as
    ``planning.check_variants`` gives them."""
    if num_partitions is not None:
        raise ValueError(f"num_partitions={num_partitions} applies to decode launches only; "
                         "a multi-token launch plans its own pieces")
    if isinstance(seq_lens, DeviceArray):
        raise TypeError("seq_lens must be host integers with query_lens: the launch's work is "
                        "planned from them on the host; got a DeviceArray")
    num_rows = query.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"query has {num_rows} rows; a launch takes at most {MAX_ROWS}")
    tables = metadata(block_tables, "block_tables", np.int32, 2, None, query, "query")
    num_seqs, width = (block_tables if tables is None else tables).shape
    lens = host_ints(seq_lens, "seq_lens", np.int32, (num_seqs,))
    q_lens = check_query_lens(query_lens, lens, num_rows)
    num_blocks, _, block_size, _ = k_cache.shape
    if tables is not None:
        check_tables(tables, lens, num_seqs, num_blocks, block_size)
    elif lens.size and int(lens.max()) > width * block_size:  # the ids are trusted on the device
        s = int(lens.argmax())
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} tokens exceeds the block table's "
                         f"{width} blocks x {block_size} = {width * block_size} tokens")
    check_disjoint(out, "out", query=query, k_cache=k_cache, v_cache=v_cache,
                   **({} if variants[1] is None else {"sinks": variants[1]}))
    kernel_scale, out_scale, k_scale, v_scale = scales
    softcap, sinks, window = variants
    sinks_at = 0 if sinks is None else sinks.ptr
    if (softcap and int(q_lens.max(initial=1)) > 1
            and cap_unsupported(query.backend, query.device, query.dtype, k_cache.shape[3])):
        raise NotImplementedError(CAP_UNSUPPORTED)
    if num_seqs == 0:
        return
    if query.backend.name == "host":
        assert tables is not None  # host metadata is always NumPy
        result = reference.paged_attention_multi(
            host_view(query), host_view(k_cache), host_view(v_cache), tables, lens, q_lens,
            scale, k_scale=k_scale, v_scale=v_scale, logit_softcap=softcap or None,
            sinks=None if sinks is None else host_view(sinks), window=window or None)
        host_view(out)[...] = result.astype(out.dtype)
        return
    decodes = leading_decodes(q_lens)
    if decodes:
        launch_decode(rows(out, 0, decodes), rows(query, 0, decodes), k_cache, v_cache,
                      rows(block_tables, 0, decodes) if tables is None else tables[:decodes],
                      None if tables is None else tables[:decodes], lens[:decodes],
                      lens[:decodes], kernel_scale, out_scale, None, stream, workspace,
                      softcap, sinks_at, window)
    if decodes == num_seqs:
        return
    rest = num_seqs - decodes
    launch_prefill(rows(out, decodes, num_rows - decodes),
                   rows(query, decodes, num_rows - decodes), k_cache, v_cache,
                   rows(block_tables, decodes, rest) if tables is None else None,
                   None if tables is None else tables[decodes:], lens[decodes:],
                   q_lens[decodes:], kernel_scale, out_scale, stream, workspace, softcap,
                   sinks_at, window)


CAP_UNSUPPORTED = ("logit_softcap with query_lens at head_dim 256 on a wave32 GPU (gfx11): "
                   "its multi-token kernel has no register room for the cap (decode calls "
                   "take it)")


def cap_unsupported(backend: Any, device: int, dtype: np.dtype, head_dim: int) -> bool:
    """Whether a capped multi-token launch of ``dtype`` activations at ``head_dim`` would
    run without its cap here: 16-bit at head_dim 256 on a wave32 GPU (gfx11), whose WMMA
    instance has no register room for it (``pf_math.h``'s CAPS): such calls are refused."""
    return (head_dim == 256 and np.dtype(dtype).itemsize == 2 and backend.name == "hip"
            and backend.cached_properties(device).warp_size == 32)


def launch_prefill(out: DeviceArray, query: DeviceArray, k_cache: DeviceArray,
                   v_cache: DeviceArray, d_tables: DeviceArray | None, tables: Any,
                   lens: np.ndarray, q_lens: np.ndarray, kernel_scale: float,
                   out_scale: float, stream: Stream | None,
                   workspace: Workspace | None, softcap: float = 0.0, sinks: int = 0,
                   window: int = 0) -> None:
    """Queue the multi-token kernel (and its combine, where items were cut into pieces):
    block tables on the device (``d_tables``) or their checked host copy (``tables``);
    ``softcap`` (0: none), ``sinks`` (an address, 0: none) and ``window`` (tokens, 0: none)
    as ``launch_decode``'s."""
    backend, device = query.backend, query.device
    _, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    found, work = prefill_launch(backend, device, query.dtype, head_dim, k_cache.dtype, q_lens,
                                 lens, num_kv_heads, num_q_heads // num_kv_heads, softcap > 0)
    shape = found.shape
    source = d_tables if tables is None else tables
    assert source is not None  # one of the two
    width = source.shape[1]
    i32, f32 = np.int32, np.float32
    with staging(query, stream) as slot:
        uploads = ([] if tables is None else [tables]) + [lens, *work.arrays]
        addresses = iter(slot.put(uploads, stream))
        table_ptr = d_tables if tables is None else next(addresses)
        lens_ptr, starts_ptr, items_ptr = next(addresses), next(addresses), next(addresses)
        combines_ptr = next(addresses) if len(work.combines) else 0
        scratch = workspace or slot.workspace
        partials, _ = scratch.get(work.partial_bytes(shape.bm, head_dim), 0, query, stream)
        found.kernel.launch(
            len(work.items), found.threads, out, partials.ptr, query, k_cache, v_cache,
            table_ptr, lens_ptr, starts_ptr, items_ptr, f32(kernel_scale), i32(num_q_heads),
            i32(num_kv_heads), i32(width), i32(block_size.bit_length() - 1), f32(out_scale),
            f32(softcap), sinks, i32(window), shared_bytes=shape.shared_bytes, stream=stream)
        if len(work.combines):
            found.combine.launch(len(work.combines), found.threads, out, partials.ptr,
                                 items_ptr, combines_ptr, starts_ptr, i32(num_q_heads),
                                 i32(num_kv_heads), i32(shape.bm), sinks, stream=stream)
        if workspace is not None:
            workspace.used(stream)
