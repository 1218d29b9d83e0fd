"""``rocmforge_raw.ops``: the ops users call, where they have always been importable from.

They live in ``rocmforge_raw.kernels.ops`` (see its docstring: paged-attention decode, K/V
writes by slot mapping, block and span copies on device memory).
"""

from .kernels.ops import (
    ATTENTION_STAGES,
    BLOCK_SIZES,
    DTYPES,
    GROUP_SIZES,
    HEAD_DIMS,
    PIECE_BYTES,
    THREADS,
    Workspace,
    attention_shared_bytes,
    copy_blocks,
    copy_spans,
    host_view,
    paged_attention,
    plan_work,
    release_staging,
    reshape_and_cache,
)

__all__ = ["ATTENTION_STAGES", "BLOCK_SIZES", "DTYPES", "GROUP_SIZES", "HEAD_DIMS",
           "PIECE_BYTES", "THREADS", "Workspace", "attention_shared_bytes", "copy_blocks",
           "copy_spans", "host_view", "paged_attention", "plan_work", "release_staging",
           "reshape_and_cache"]
