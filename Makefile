# rocmforge_raw: `make demo` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KDIR := rocmforge_raw/kernels
SOURCES := basic paged_attention cache_ops prefill
NATIVE_HEADERS := $(wildcard native/*.h)
NVCC ?= nvcc
HIPCC ?= hipcc
CLANG ?= clang-19
NVFLAGS := -O3 -std=c++17 -Inative
AMDFLAGS := -O3 -std=c++17 -Inative -nogpulib -nogpuinc --no-gpu-bundle-output

NV_OBJS := $(foreach s,$(SOURCES),$(KDIR)/$(s).sm_80.cubin $(KDIR)/$(s).sm_90.cubin \
                                  $(KDIR)/$(s).compute_90.ptx)
AMD_OBJS := $(foreach s,$(SOURCES),$(KDIR)/$(s).gfx90a.hsaco $(KDIR)/$(s).gfx942.hsaco \
                                   $(KDIR)/$(s).gfx1100.hsaco)
HAVE_NVCC := $(shell command -v $(NVCC) 2>/dev/null)

CORE_SRC := $(shell find rocmforge_raw -name '*.pyx' -o -name '*.pxd')
CORE_STAMP := build/core.stamp

.PHONY: all demo test core kernels kernels-nvidia kernels-amd toolchain pyheaders transferlibs \
        venv bench soak soak-calibrate lint mutate clean wheel wheel-check sanitize typecheck
all: core kernels

# Every extra the tests need: hip (hip-python) and cuda (cuda-python, NVRTC) for the backends
# and run-time compilers, transfer (Mooncake), test, plot (the soak's plot), dev (lint, types,
# wheels, mutants).
venv: $(PY)
$(PY): pyproject.toml setup.py | pyheaders transferlibs
	@echo "[make] $(VENV): the package and every extra the tests need (pip; minutes on a fresh machine)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cuda,hip,plot,dev,transfer]'
	touch $(PY)

# Python's C headers, which the compiled core (Cython) builds against; installed when missing.
pyheaders:
	@if ! $(PYTHON) -c 'import os, sysconfig, sys; \
	    sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; \
	then \
	  echo "installing python3-dev build-essential (Debian) ..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    python3-dev build-essential >/dev/null; \
	fi

# The libraries Mooncake's Transfer Engine (the `transfer` extra) loads; installed when missing.
transferlibs:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 ' || ! ldconfig -p | grep -q 'libnuma.so.1 '; then \
	  echo "installing libibverbs1 libnuma1 (Debian) for Mooncake's Transfer Engine ..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    libibverbs1 libnuma1 >/dev/null; \
	fi

# The compiled core (HipBuffer, registry, pool, allocators): rebuilt when a .pyx changes.
core: $(CORE_STAMP)
$(CORE_STAMP): $(CORE_SRC) setup.py $(PY)
	@echo "[make] the compiled core: Cython, then C (a minute or two)"
	$(PY) setup.py -q build_ext --inplace
	@mkdir -p build && touch $@

# AMD compilers, Debian's HIP runtime (libamdhip64) and hiprtc, installed when missing.
# hip-python loads hiprtc as libhiprtc.so; Debian's ROCm 5.2 keeps hiprtc inside
# libamdhip64.so.5 (later ROCm split it out), so that name is given to it where nothing has it.
toolchain:
	@if ! command -v $(HIPCC) >/dev/null || ! command -v $(CLANG) >/dev/null \
	     || ! command -v ld.lld-19 >/dev/null || ! ldconfig -p | grep -q 'libamdhip64.so ' \
	     || ! ldconfig -p | grep -q 'libhiprtc-builtins.so.5 '; then \
	  echo "installing hipcc clang-19 lld-19 libamdhip64-dev libhiprtc-builtins5 (Debian) ..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    hipcc clang-19 lld-19 llvm-19 libamdhip64-dev libhiprtc-builtins5 >/dev/null; \
	fi
	@lib=$$(ldconfig -p | awk '/libamdhip64\.so\.5 /{print $$NF; exit}'); \
	if [ -n "$$lib" ] && [ ! -e "$$(dirname $$lib)/libhiprtc.so" ] \
	   && nm -D "$$lib" | grep -q ' T hiprtcCreateProgram'; then \
	  echo "naming Debian's hiprtc (in $$lib) libhiprtc.so for hip-python"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO ln -s "$$(basename $$lib)" "$$(dirname $$lib)/libhiprtc.so"; \
	fi

# Built in parallel through tools/make_progress.py: a bar over the objects out of date on a
# terminal (a fresh machine compiles for minutes), make's own lines as they come.
kernels: kernels-amd kernels-nvidia
kernels-amd: toolchain | $(PY)
	@$(PY) tools/make_progress.py "AMD code objects (clang-19)" $(AMD_OBJS)
kernels-nvidia: | $(PY)
ifneq ($(HAVE_NVCC),)
	@$(PY) tools/make_progress.py "NVIDIA code objects (nvcc)" $(NV_OBJS)
else
	@echo "nvcc not found: skipping NVIDIA cubins (the cuda backend compiles with NVRTC instead)"
endif

$(KDIR)/%.sm_80.cubin: native/%.cu $(NATIVE_HEADERS)
	$(NVCC) $(NVFLAGS) -cubin -arch=sm_80 -o $@ $<
$(KDIR)/%.sm_90.cubin: native/%.cu $(NATIVE_HEADERS)
	$(NVCC) $(NVFLAGS) -cubin -arch=sm_90 -o $@ $<
$(KDIR)/%.compute_90.ptx: native/%.cu $(NATIVE_HEADERS)
	$(NVCC) $(NVFLAGS) -ptx -arch=compute_90 -o $@ $<
$(KDIR)/%.gfx90a.hsaco: native/%.cu $(NATIVE_HEADERS)
	$(CLANG) -x hip --cuda-device-only --offload-arch=gfx90a $(AMDFLAGS) -DRF_WAVE_SIZE=64 -o $@ $<
$(KDIR)/%.gfx942.hsaco: native/%.cu $(NATIVE_HEADERS)
	$(CLANG) -x hip --cuda-device-only --offload-arch=gfx942 $(AMDFLAGS) -DRF_WAVE_SIZE=64 -o $@ $<
$(KDIR)/%.gfx1100.hsaco: native/%.cu $(NATIVE_HEADERS)
	$(CLANG) -x hip --cuda-device-only --offload-arch=gfx1100 $(AMDFLAGS) -DRF_WAVE_SIZE=32 -o $@ $<

demo: $(PY) core kernels
	@echo "[make] the demo (rocmforge-raw demo)"
	$(VENV)/bin/rocmforge-raw demo

# -rs: every skipped test's reason in the summary (grouped where they are the same)
test: $(PY) core kernels typecheck
	$(PY) -m pytest -q -rs

# mypy --strict over the public API (the modules listed under [tool.mypy] in pyproject.toml),
# and a user's mypy over the README's example
typecheck: $(PY) core
	$(VENV)/bin/mypy
	$(PY) tools/readme_example.py --mypy

bench: $(PY) core kernels
	$(VENV)/bin/rocmforge-raw bench

soak: $(PY) core kernels
	$(VENV)/bin/rocmforge-raw soak --seconds 60

# The soak's verdict on this machine: 30 clean default-length runs PASS, 10 with a planted
# 1 MiB/s leak FAIL (about 20 minutes; `make test` runs a shorter variant)
soak-calibrate: $(PY) core
	$(PY) tools/soak_calibrate.py --clean 30 --leaky 10 --seconds 60 --jobs 2

# A wheel in dist/ with the compiled core and the code objects of every target (so nvcc too),
# tagged manylinux by auditwheel (the compiled core needs only libc: nothing is grafted in).
wheel: $(PY) kernels
	@missing=$$(for f in $(NV_OBJS) $(AMD_OBJS); do [ -f $$f ] || echo $$f; done); \
	if [ -n "$$missing" ]; then echo "make wheel: not built (nvcc?):" $$missing; exit 1; fi
	rm -rf build/bdist.* dist/rocmforge_raw-*.whl dist/raw
	$(PY) -m pip wheel -q --no-deps -w dist/raw .
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel repair -w dist dist/raw/rocmforge_raw-*.whl
	rm -rf dist/raw
	@ls dist/rocmforge_raw-*.whl

# That wheel installed in a fresh environment outside the tree: info and a smoke test.
wheel-check: wheel
	PYTHON=$(PYTHON) bash tools/wheel_check.sh

# For a GPU machine: compute-sanitizer's four tools over the GPU tests (tools/sanitize.sh splits).
sanitize:
	@rc=0; for tool in memcheck racecheck synccheck initcheck; do \
	  bash tools/sanitize.sh $$tool $(SANITIZE_ARGS) || rc=1; done; exit $$rc

lint: $(PY)
	$(VENV)/bin/ruff check rocmforge_raw tests tools

# Mutation testing (long; not part of `make test`): mutmut over rocmforge_raw/cache (its
# config is in pyproject.toml), then tools/mutants.py: the issue's named mutants, each with
# the test that kills it, and operator mutants of the compiled core, rebuilt one by one.
mutate: $(PY) core kernels
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children $$(nproc) || true
	$(VENV)/bin/mutmut results || true
	$(PY) tools/mutants.py named
	$(PY) tools/mutants.py core

clean:
	rm -f $(KDIR)/*.cubin $(KDIR)/*.ptx $(KDIR)/*.hsaco
	find rocmforge_raw \( -name '*.so' -o -name '*.c' \) -delete
	rm -rf build dist *.egg-info .pytest_cache mutants
