#!/usr/bin/env bash
# One call on a GPU machine of two GPUs (nvidia-h100-x2 / nvidia-h200-x2; AMD alike): set up
# as tools/device_run.sh does (carried wheels, the compiled core), then
#   devices   tests/test_devices.py on the GPU backend: a cache per device in one process,
#             16 threads for RF_TWO_DEVICE_MINUTES (default 2), plans, pools and streams never
#             crossing devices, finalizers of one device's memory while the other is current;
#             steps and drift per device in $OUT/devices.xml (printed)
#   transfer  the two-device tests of tests/test_transfer.py: import_sequence between caches
#             on two GPUs (peer copies, both ways, fp8 too) and a prefill process on one GPU
#             handing a sequence to a decoder on the other through IPC
#   bench     bench --transfer --json, the sender on GPU 1 and the receiver on GPU 0: IPC and
#             in-process peer rows against a raw peer copy of the same bytes
#             ($OUT/transfer_two_gpus.json)
#   suite     the GPU suite on the second GPU: RF_DEVICE=1 pytest -m gpu (test_devices.py
#             ran above), stopped with its summary at the deadline
# Usage: bash tools/device_two_gpus.sh [devices] [transfer] [bench] [suite] (default: all, in
# this order). The whole run stops at RF_TOTAL_SECONDS (default 470) after it starts: the
# suite gets what is left (run `bash tools/device_two_gpus.sh suite` alone for all of it).
# Logs go to $OUT; the last lines say each part's exit status (0: passed).
set -uo pipefail
start=$SECONDS
deadline=$((start + ${RF_TOTAL_SECONDS:-470}))
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(devices transfer bench suite)
source tools/device_setup.sh || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>/dev/null
nvidia-smi topo -m 2>/dev/null | tee "$OUT/topo.txt"
python3 -m rocmforge_raw.cli info
pytest=(python3 -m pytest -q -p no:cacheprovider -rs)
declare -A status

left() { echo $((deadline - SECONDS > 10 ? deadline - SECONDS : 10)); }

for part in "${parts[@]}"; do
  echo "=== $part ($((SECONDS - start)) s in)"
  case $part in
    devices)
      RF_TWO_DEVICE_MINUTES=${RF_TWO_DEVICE_MINUTES:-2} timeout -s INT "$(left)" \
        "${pytest[@]}" -m gpu tests/test_devices.py --junitxml="$OUT/devices.xml" \
        -o junit_logging=no -o junit_family=legacy 2>&1 | tee "$OUT/devices.log" | tail -20
      status[$part]=${PIPESTATUS[0]}
      python3 - "$OUT/devices.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).iter("testcase"):
    found = {p.get("name"): p.get("value") for p in case.iter("property")}
    if found:
        print(case.get("name"), found)
PY
      ;;
    transfer)
      timeout -s INT "$(left)" "${pytest[@]}" -m gpu tests/test_transfer.py \
        -k "two_devices or on_one_device or peer_access" 2>&1 | tee "$OUT/transfer.log" \
        | tail -20
      status[$part]=${PIPESTATUS[0]}
      ;;
    bench)
      timeout -s INT "$(left)" python3 -m rocmforge_raw.cli bench --transfer --device 0 \
        --from-device 1 --iters 10 --json >"$OUT/transfer_two_gpus.json" 2>"$OUT/bench.log"
      status[$part]=$?
      cat "$OUT/transfer_two_gpus.json"
      ;;
    suite)
      RF_DEVICE=1 timeout -s INT "$(left)" "${pytest[@]}" -m gpu tests \
        --ignore=tests/test_devices.py 2>&1 | tee "$OUT/suite_device1.log" | tail -40
      status[$part]=${PIPESTATUS[0]}
      ;;
    *) echo "device_two_gpus.sh: unknown part '$part' (devices, transfer, bench, suite)" >&2
       exit 2 ;;
  esac
done
echo "=== done in $((SECONDS - start)) s"
for part in "${parts[@]}"; do echo "$part: exit ${status[$part]}"; done
