#!/usr/bin/env bash
# One call on the GPU machine: the attention bench and sweep, then Nsight Compute over the
# named shapes (one profiled launch each, after warm-up). Output in $OUT: bench.json, ncu.txt.
# Usage: bash tools/profile_run.sh [SHAPE ...]   (names: python3 tools/profile_attention.py --list)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null || exit 1
OUT=${OUT:-/tmp/rf-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
if [ -z "${RF_SKIP_BENCH:-}" ]; then
  python3 -m rocmforge_raw.cli bench --attention ${RF_SWEEP:+--sweep} --json > "$OUT/bench.json"
  python3 - "$OUT/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"copy {r['copy_gb_per_s']:.0f} GB/s, read {r['read_gb_per_s']:.0f} GB/s")
for row in r["attention"] + r.get("sweep", []):
    print(f"{row['name']:24} {row['ms']:8.4f} ms {row['pct_of_copy']:5.1f}% copy "
          f"{row['pct_of_read']:5.1f}% read (target {row['read_target_pct']})")
PY
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
metrics=sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,sm__cycles_elapsed.avg
metrics+=,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum
metrics+=,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size
for shape in "$@"; do
  echo "=== $shape" >> "$OUT/ncu.txt"
  "$ncu" --clock-control none -k regex:rf_paged_attention -s 3 -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section LaunchStats --metrics "$metrics" \
    python3 tools/profile_attention.py "$shape" >> "$OUT/ncu.txt" 2>&1
done
[ $# -gt 0 ] && grep -E "^===|Duration|DRAM Throughput|Achieved Occupancy|sm__cycles_active|dram__bytes_read|lts__t_sectors_srcunit|Registers Per|Stall Long|Theoretical Occ|Grid Size" "$OUT/ncu.txt" | head -200
exit 0
