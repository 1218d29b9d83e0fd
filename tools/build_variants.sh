#!/usr/bin/env bash
# Tuning builds of paged_attention for sm_90 into .variants/NAME.cubin (every instance, so any
# shape runs). Usage: tools/build_variants.sh NAME_s3x32768 "-DRF_PA_STAGES=3 -DRF_PA_MIN_BLOCKS=2" ...
# (a name ending in _sSTAGESxBYTES tells tools/attention_variants.py the shared memory size;
# RF_PA_NARROW_BLOCKS sets the narrow head_dim 64 instances' CTAs per SM, rf_pa_stage)
set -euo pipefail
mkdir -p .variants
while [ $# -ge 2 ]; do
  nvcc -O3 -std=c++17 -Inative -cubin -arch=sm_90 ${RF_VARIANT_FLAGS:-} $2 -o ".variants/$1.cubin" \
    native/paged_attention.cu &
  shift 2
done
wait
ls -la .variants
