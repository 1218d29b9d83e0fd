"""Planning kernel launches on the host, one module for each thing it plans:

- ``arguments``: the kernels' shapes and dtypes, and the checks of a launch's arrays and
  metadata;
- ``work``: how one attention launch divides its work over the CTAs (the split-K plan);
- ``attention``: the attention kernel of a launch, its shared memory, scales and arguments;
- ``writes``: the K/V write's kernel and arguments.

Everything here runs before any launch and touches no device memory: ``ops`` plans and
launches a one-off call, the KV cache plans once per step (``KvCache.batch``) and launches
per layer. Kernel arguments follow the signatures in ``native/`` (pointers as 64-bit values,
``int`` as int32, the scale as float32).
"""

from .arguments import (
    BLOCK_SIZES,
    DTYPES,
    FP8_DTYPES,
    GROUP_SIZES,
    HEAD_DIMS,
    MAX_CACHE_ROWS,
    check_attention_arrays,
    check_cache_dtype,
    check_disjoint,
    check_kv_scales,
    check_options,
    check_slots,
    check_tables,
    check_write_arrays,
    default_scale,
    device_ints,
    expect,
    fp8_scale_range,
    host_ints,
)
from .attention import (
    ATTENTION_PATCH,
    ATTENTION_STAGES,
    CODE_STAGE_TOKENS,
    FP8_CODE_FACTOR,
    NARROW_ROW_BYTES,
    OUT_SCALE_ARG,
    SCALE_ARG,
    STAGE_ALIGN,
    STEP_ARGS,
    THREADS,
    WORK_ARGS,
    AttentionKernel,
    AttentionPlan,
    attention_instance,
    attention_kernel,
    attention_shared_bytes,
    kernel_scales,
    plan_attention,
    split_rule_of,
    step_arguments,
)
from .work import (
    ALIGNED_SHARE_TOKENS,
    ALIGNED_STRETCH,
    LONE_CTA_FILL,
    MIN_TOKENS_PER_CTA,
    PAD_MARGIN,
    PIECE_COST_TOKENS,
    PIECE_QUANTUM_TOKENS,
    WHOLE_UNIT_WAVES,
    WHOLE_UNIT_WAVES_WIDE,
    WORK_GRANULE,
    WorkSplit,
    plan_work,
    split_rule,
    split_workspace,
)
from .writes import (
    WRITE_PATCH,
    WRITE_SCALE_ARGS,
    WRITE_SLOTS_ARG,
    WRITE_THREADS,
    write_arguments,
    write_kernel,
)

__all__ = [
    "ALIGNED_SHARE_TOKENS", "ALIGNED_STRETCH", "ATTENTION_PATCH", "ATTENTION_STAGES",
    "BLOCK_SIZES", "CODE_STAGE_TOKENS", "DTYPES", "FP8_CODE_FACTOR", "FP8_DTYPES",
    "GROUP_SIZES", "HEAD_DIMS", "LONE_CTA_FILL", "MAX_CACHE_ROWS", "MIN_TOKENS_PER_CTA",
    "NARROW_ROW_BYTES",
    "OUT_SCALE_ARG", "PAD_MARGIN", "PIECE_COST_TOKENS", "PIECE_QUANTUM_TOKENS", "SCALE_ARG",
    "STAGE_ALIGN", "STEP_ARGS", "THREADS", "WHOLE_UNIT_WAVES", "WHOLE_UNIT_WAVES_WIDE",
    "WORK_ARGS", "WORK_GRANULE", "WRITE_PATCH",
    "WRITE_SCALE_ARGS", "WRITE_SLOTS_ARG", "WRITE_THREADS", "AttentionKernel", "AttentionPlan",
    "WorkSplit",
    "attention_instance", "attention_kernel", "attention_shared_bytes",
    "check_attention_arrays", "check_cache_dtype", "check_disjoint", "check_kv_scales",
    "check_options", "check_slots", "check_tables", "check_write_arrays", "default_scale",
    "device_ints", "expect", "fp8_scale_range", "host_ints", "kernel_scales", "plan_attention",
    "plan_work", "split_rule", "split_rule_of", "split_workspace", "step_arguments",
    "write_arguments", "write_kernel",
]
