#!/usr/bin/env bash
# Installs the package two ways, each into a fresh virtual environment in a temporary folder
# outside the source tree (dependencies from the package index, the cuda extra, no hip extra):
#   1. the newest wheel in dist/ (or the one named): tagged manylinux, LICENSE in its metadata,
#      no kernels' notebook (docs/kernels.md), every target's code objects;
#   2. `pip install .` of a fresh `git clone` of this tree (its committed HEAD): no code objects.
# In each: `rocmforge-raw --version`, every command on the host backend (info, demo, bench
# --cache, soak) and tools/wheel_smoke.py, from that folder; then the two installs must hold the
# same files but for the wheel's code objects, and a user's mypy must accept the README's
# example against the installed wheel. Usage: bash tools/wheel_check.sh [wheel]  (make wheel-check)
set -euo pipefail
tree=$(cd "$(dirname "$0")/.." && pwd)
wheel=${1:-$(ls -t "$tree"/dist/rocmforge_raw-*.whl 2>/dev/null | head -1)}
[ -n "$wheel" ] || { echo "wheel-check: no wheel in $tree/dist: run make wheel" >&2; exit 1; }
wheel=$(realpath "$wheel")
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "wheel-check: $*" >&2; exit 1; }
quiet_pip() { grep -v 'is ignored: it is neither a file nor a directory' || true; }  # this pip.conf

echo "wheel-check: $(basename "$wheel")"
case "$(basename "$wheel")" in *manylinux*) ;; *) fail "the wheel is not tagged manylinux";; esac
listing=$(unzip -l "$wheel")
grep -q 'dist-info/licenses/LICENSE$' <<<"$listing" || fail "no LICENSE in the wheel's metadata"
unzip -p "$wheel" '*.dist-info/METADATA' | grep -q '^License-Expression: MIT$' \
  || fail "no License-Expression in the wheel's metadata"
! grep -q 'docs/' <<<"$listing" || fail "the docs are in the wheel"

# Each command of the CLI, as a new user runs it; the status a soak may end with: 0 PASS, 2 not
# judged (a 10-second run may not settle), never 1 (FAIL) or a traceback.
commands() {
  local bin=$1/bin
  "$bin/rocmforge-raw" --version
  "$bin/rocmforge-raw" info
  "$bin/rocmforge-raw" demo --scale 0.05 --seed 1 >/dev/null
  "$bin/rocmforge-raw" bench --cache
  local status=0
  "$bin/rocmforge-raw" soak --seconds 10 --out "$work/soak-$2" >/dev/null || status=$?
  [ "$status" = 0 ] || [ "$status" = 2 ] || fail "soak ended with status $status ($2)"
  set +e
  "$bin/rocmforge-raw" info --backend hip 2>"$work/hip-$2.txt"; status=$?
  set -e
  [ "$status" = 2 ] && grep -q "rocmforge_raw\[hip\]" "$work/hip-$2.txt" \
    || fail "info --backend hip without hip-python does not name the hip extra ($2)"
}
files() {  # the installed package's files, less its code objects and metadata
  "$1/bin/python" -c 'from importlib import metadata
for f in sorted(str(p) for p in metadata.files("rocmforge_raw")):
    if not (".dist-info/" in f or "__pycache__" in f or f.startswith("../")
            or f.endswith((".cubin", ".ptx", ".hsaco"))):
        print(f)'
}

cd "$work"
export RF_BACKEND=host RF_CACHE_DIR="$work/cache" RF_PROGRESS=0

echo "wheel-check: the wheel, in a fresh environment in $work"
"$python" -m venv "$work/wheel"
"$work/wheel/bin/python" -m pip install -q "$wheel[cuda]" mypy 2>&1 | quiet_pip
commands "$work/wheel" wheel
"$work/wheel/bin/python" "$tree/tools/wheel_smoke.py" --objects=all
"$work/wheel/bin/python" "$tree/tools/readme_example.py" --mypy --installed

echo "wheel-check: pip install . of a fresh clone of $(git -C "$tree" rev-parse --short HEAD)"
git clone -q "$tree" "$work/clone"
"$python" -m venv "$work/source"
"$work/source/bin/python" -m pip install -q "$work/clone[cuda]" 2>&1 | quiet_pip
commands "$work/source" source
"$work/source/bin/python" "$tree/tools/wheel_smoke.py" --objects=none

diff <(files "$work/wheel") <(files "$work/source") \
  || fail "the wheel and a fresh clone's pip install . hold different files (< wheel, > clone)"
echo "wheel-check: passed (the wheel and a fresh clone's install hold the same $(files "$work/wheel" | wc -l) files, code objects aside)"
