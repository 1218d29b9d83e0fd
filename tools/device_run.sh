#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels (.whl, and .transfer: Mooncake's
# engine with the Debian packages it loads), build the compiled core, run the test suite on
# the GPU, then the benchmarks. Logs go to $OUT. Usage: bash tools/device_run.sh [pytest args]
set -uo pipefail
wheels=$(ls .whl/*.whl .transfer/*.whl 2>/dev/null)
[ -z "$wheels" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Mooncake's engine (mooncake-transfer-engine-cuda13) loads libibverbs, libmlx5 and libnuma
# (carried as Debian packages in .transfer, unpacked aside) and libcudart.so.13 (the
# nvidia-cuda-runtime wheel's, where the system has none).
if compgen -G ".transfer/*.deb" >/dev/null; then
  for f in .transfer/*.deb; do dpkg -x "$f" /tmp/debs; done
  export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if ! ldconfig -p | grep -q 'libcudart.so.13 '; then
  cudart=$(python3 -c 'import site, glob; print(next(iter(glob.glob(site.getsitepackages()[0]
    + "/nvidia/**/libcudart.so.13", recursive=True)), ""))')
  [ -n "$cudart" ] && export LD_LIBRARY_PATH=$(dirname "$cudart")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
python3 setup.py -q build_ext --inplace >/dev/null || exit 1  # the compiled core, for this Python
OUT=${OUT:-/tmp/rf-out}
mkdir -p "$OUT"
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
