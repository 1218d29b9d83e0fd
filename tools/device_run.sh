#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels (.whl, and .transfer: Mooncake's
# engine with the Debian packages it loads), build the compiled core, run the test suite on
# the GPU, then the benchmarks. Logs go to $OUT. Usage: bash tools/device_run.sh [pytest args]
set -uo pipefail
source tools/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -m rocmforge_raw.cli info
python3 -m pytest -q -p no:cacheprovider -rs "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -40
if [ -z "${RF_SKIP_BENCH:-}" ]; then
  python3 -m rocmforge_raw.cli bench 2>&1 | tee "$OUT/bench.txt"
fi
if [ -n "${RF_DEMO_SOAK:-}" ]; then
  python3 -m rocmforge_raw.cli demo 2>&1 | tee "$OUT/demo.txt"
  python3 -m rocmforge_raw.cli soak --seconds "${RF_SOAK_SECONDS:-120}" --out "$OUT/soak" \
    2>&1 | tee "$OUT/soak.txt"
  cp "$OUT"/soak/soak.png "$OUT"/soak/soak.json "$OUT"/soak/soak.csv "$OUT"/ 2>/dev/null
  rm -rf "$OUT/soak"
fi
