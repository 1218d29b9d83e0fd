#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, on an NVIDIA machine (the lent GPU machine: wheels in
# .whl are installed to /tmp/site, the compiled core is built in place, as tools/device_run.sh).
#
#   bash tools/sanitize.sh [memcheck|racecheck|synccheck|initcheck|all] [pytest args]
#
# memcheck runs with --leak-check full. Under initcheck the tests marked foreign_writes are
# skipped (RF_SANITIZER tells conftest.py): they read memory another process wrote through an
# IPC mapping, which initcheck cannot see written, so every byte of it counts as an error. pytest args default to `-m "gpu and not timing" tests`
# (every test that runs on a GPU backend, but those that time device work: the sanitizers
# slow kernels and serialize launches); pass files or -k to split the work into runs that each fit a
# 10-minute command, e.g. `bash tools/sanitize.sh racecheck tests/test_ops.py -k bfloat16`.
# Each run stops after RF_SANITIZE_SECONDS (default 540) so its summary still prints. Logs go
# to $OUT (or ./sanitize-out), one per tool and arguments. One line per tool: errors and leaks
# summed over every process's summary; exits non-zero if any, if pytest failed, or on timeout.
set -uo pipefail
tool=${1:-all}
shift || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-m "gpu and not timing" tests)
case $tool in
  memcheck|racecheck|synccheck|initcheck) tools=("$tool") ;;
  all) tools=(memcheck racecheck synccheck initcheck) ;;
  *) echo "sanitize.sh: unknown tool '$tool' (memcheck, racecheck, synccheck, initcheck, all)" >&2
     exit 2 ;;
esac
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$sanitizer" ] || { echo "sanitize.sh: compute-sanitizer not found" >&2; exit 2; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null || exit 1
out=${OUT:-sanitize-out}
mkdir -p "$out"
slug=$(printf '%s_' "${args[@]}" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-80)

# The number in each "ERROR SUMMARY: 3 errors" / "LEAK SUMMARY: 96 bytes leaked in 2
# allocations" line of a log, summed over the processes (pytest and any it starts).
count() { grep -o "$1" "$2" | tr -d '(' | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+$/) {
  sum += $i; break } } END { print sum + 0 }'; }

rc=0
for t in "${tools[@]}"; do
  # API errors are not counted: tests provoke some on purpose (out of memory, bad handles).
  # Host backtraces stay off: capturing one keeps the Python frames active at every CUDA call
  # alive, with their locals, so buffers freed by garbage collection leak under the sanitizer
  # (tools/who_holds.py shows the frames holding them); device backtraces stay on.
  # Only pytest's own process: a forked child (tests fork to show a child frees nothing it
  # inherited) would report the parent's allocations as its leaks when it exits.
  flags=(--tool "$t" --target-processes application-only --report-api-errors no
         --error-exitcode 86
         --show-backtrace device)
  [ "$t" = memcheck ] && flags+=(--leak-check full)
  log="$out/$t.${slug%_}.log"
  start=$SECONDS
  RF_SANITIZER=$t timeout --signal=INT --kill-after=30 "${RF_SANITIZE_SECONDS:-540}" \
    "$sanitizer" "${flags[@]}" python3 -m pytest -q -p no:cacheprovider "${args[@]}" \
    >"$log" 2>&1
  status=$?
  # "ERROR SUMMARY: N errors" (not "N errors were not printed"); racecheck says
  # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
  errors=$(( $(count 'ERROR SUMMARY: [0-9]\+ errors\?$' "$log")
             + $(count 'hazards displayed ([0-9]\+ error' "$log") ))
  leaked=$(count 'LEAK SUMMARY: [0-9]\+ bytes' "$log")
  summaries=$(grep -c 'ERROR SUMMARY: [0-9]\+ errors\?$\|RACECHECK SUMMARY' "$log")
  tests=$(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' "$log" | tail -1)
  verdict=ok
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then verdict="TIMEOUT (split the run)"
  elif [ "$summaries" = 0 ]; then verdict="NO SUMMARY (sanitizer did not finish)"
  elif [ "$errors" != 0 ] || [ "$leaked" != 0 ]; then verdict=FAIL
  elif [ "$status" = 5 ]; then verdict="FAIL (no test selected: does a GPU answer?)"
  elif [ "$status" != 0 ]; then verdict="FAIL (exit $status)"
  fi
  [ "$verdict" = ok ] || rc=1
  echo "$t: $verdict, $errors errors, $leaked bytes leaked, $summaries process(es)," \
       "$((SECONDS - start)) s, pytest: ${tests:-no summary}; log $log"
done
exit $rc
