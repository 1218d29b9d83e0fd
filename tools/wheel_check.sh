#!/usr/bin/env bash
# Installs the newest wheel in dist/ (or the one named) with the cuda extra into a fresh virtual
# environment in a temporary folder outside the source tree, its dependencies from the package
# index, then runs `rocmforge-raw info` and tools/wheel_smoke.py there, from that folder, on the
# host backend. Usage: bash tools/wheel_check.sh [wheel]   (make wheel-check)
set -euo pipefail
tree=$(cd "$(dirname "$0")/.." && pwd)
wheel=${1:-$(ls -t "$tree"/dist/rocmforge_raw-*.whl 2>/dev/null | head -1)}
[ -n "$wheel" ] || { echo "wheel-check: no wheel in $tree/dist: run make wheel" >&2; exit 1; }
wheel=$(realpath "$wheel")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "wheel-check: $(basename "$wheel") into a fresh environment in $work"
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel[cuda]" 2>&1 \
  | { grep -v 'is ignored: it is neither a file nor a directory' || true; }  # this pip.conf
cd "$work"
export RF_BACKEND=host RF_CACHE_DIR="$work/cache"
"$work/venv/bin/rocmforge-raw" info
"$work/venv/bin/python" "$tree/tools/wheel_smoke.py"
