"""The launch of paged-attention decode (one query token per sequence) over checked
arguments: ``ops.paged_attention`` and the decode rows of a multi-token call use it."""

from __future__ import annotations

from typing import Any

from ..memory.array import DeviceArray
from ..memory.stream import Stream
from .oneoff import staging
from .planning import THREADS, plan_attention
from .staging import Workspace


def launch_decode(out: DeviceArray, query: DeviceArray, k_cache: DeviceArray,
                  v_cache: DeviceArray, block_tables: Any, tables: Any, seq_lens: Any,
                  lens: Any, kernel_scale: float, out_scale: float,
                  num_partitions: int | None, stream: Stream | None,
                  workspace: Workspace | None, softcap: float = 0.0, sinks: int = 0,
                  window: int = 0) -> None:
    """Queue the decode kernel over ``query``'s rows: ``block_tables``/``seq_lens`` as given
    (device arrays are used in place), ``tables``/``lens`` their checked host copies (None
    for device metadata, which is uploaded from here otherwise); the scales are
    ``planning.kernel_scales``'; ``softcap`` (0: none), ``sinks`` (an address, 0: none) and
    ``window`` (0: none) ``planning.check_variants``'."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    plan = plan_attention(query.backend, query.device, query.dtype, num_seqs, num_q_heads,
                          num_kv_heads, head_dim, block_size, block_tables.shape[1], lens,
                          num_partitions, k_cache.dtype, softcap > 0, window)
    with staging(query, stream) as slot:
        uploads = [a for a in (tables, lens) if a is not None] + plan.work.arrays
        addresses = iter(slot.put(uploads, stream))
        d_tables = block_tables if tables is None else next(addresses)
        d_lens = seq_lens if lens is None else next(addresses)
        cum16, first_seq = (next(addresses), next(addresses)) if plan.work.arrays else (0, 0)
        work = workspace or slot.workspace
        part_buf, count_buf = work.get(plan.partial_bytes, plan.num_counters, query, stream)
        plan.kernel.launch(plan.grid, THREADS, *plan.arguments(
            out, query, k_cache, v_cache, d_tables, d_lens, kernel_scale, part_buf.ptr,
            count_buf.ptr, cum16, first_seq, out_scale, softcap, sinks, window),
            shared_bytes=plan.shared_bytes,
            stream=stream)
        if workspace is not None:
            workspace.used(stream)
