# Sourced by the GPU machine's scripts (device_run.sh, device_two_gpus.sh): install the
# carried wheels (.whl, and .transfer: Mooncake's engine with the Debian packages it loads)
# into /tmp/site, put them and this checkout on PYTHONPATH, find the libraries Mooncake's
# engine loads, and build the compiled core in place for this Python. Returns non-zero (the
# caller exits) if an install or the build fails.
wheels=$(ls .whl/*.whl .transfer/*.whl 2>/dev/null)
[ -z "$wheels" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $wheels || return 1
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
python3 setup.py -q build_ext --inplace >/dev/null || return 1  # the compiled core
OUT=${OUT:-/tmp/rf-out}
mkdir -p "$OUT"
