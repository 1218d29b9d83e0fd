# rocmforge_raw: `make demo` and `make test` do all set-up on a fresh machine, as root or as an
# ordinary user (who needs sudo, or an administrator, only where a system package is missing).
# Each stage says what it does ([make] ...); stamps in the venv (.venv/.installed-*) record what
# is installed, so a re-run installs nothing, and a failed stage is the only one run again.
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
TOOLS_STAMP := $(VENV)/.installed-tools
PACKAGE_STAMP := $(VENV)/.installed-package
SYSTEM_DEPS := $(PYTHON) tools/system_deps.py check --goal 'make $(or $(MAKECMDGOALS),all)'
# make's start: a stamp newer than it was installed by this run
START := $(shell date +%s)

# The machine's GPU (amd, nvidia or none) decides what `make demo` installs and builds; `make
# demo GPU=none` chooses. Found once: the sub-makes of the kernels' progress display inherit it
# rather than ask nvidia-smi again for every code object.
GPU ?= $(shell $(PYTHON) tools/system_deps.py gpu)
GPU := $(GPU)
export GPU
ifeq ($(filter $(GPU),amd nvidia none),)
$(error GPU is '$(GPU)': amd, nvidia or none (tools/system_deps.py gpu finds it if unset))
endif

.PHONY: all demo test core kernels kernels-nvidia kernels-amd kernels-none toolchain venv \
        env-demo env-test needs-demo needs-test needs-build docs bench soak soak-calibrate lint \
        mutate clean wheel wheel-check sanitize typecheck
all: core kernels

# What the system must provide, as debian-package:kind=name: tools/system_deps.py finds each
# (libraries through ldconfig by its absolute path, as /sbin is not on an ordinary user's PATH;
# commands on PATH; this Python's venv module, headers and C compiler) and installs the missing
# packages (through sudo where not root), or names the apt-get command an administrator must
# run and stops before anything else is done.
BUILD_NEEDS := python3-venv:py=venv python3-dev:py=headers build-essential:py=compiler
# Debian's hipcc and clang-19 + lld-19 (the AMD code objects), llvm-19 (the objects' tests read
# them with its objdump and readelf), the HIP runtime and hiprtc's builtins (run-time compiles)
AMD_NEEDS := hipcc:cmd=$(HIPCC) clang-19:cmd=$(CLANG) lld-19:cmd=ld.lld-19 \
             llvm-19:cmd=llvm-objdump-19 libamdhip64-dev:lib=libamdhip64.so \
             libhiprtc-builtins5:lib=libhiprtc-builtins.so.5
# The libraries Mooncake's Transfer Engine (the `transfer` extra) loads
TRANSFER_NEEDS := libibverbs1:lib=libibverbs.so.1 libnuma1:lib=libnuma.so.1

# Each goal checks all it needs first, so that an administrator gets one list; the stages check
# their own part again, silently, for when they are made alone (make core, make kernels).
needs-demo:
	@$(SYSTEM_DEPS) $(BUILD_NEEDS) $(if $(filter amd,$(GPU)),--name-hiprtc $(AMD_NEEDS))
needs-test:
	@$(SYSTEM_DEPS) --name-hiprtc $(BUILD_NEEDS) $(AMD_NEEDS) $(TRANSFER_NEEDS)
needs-build:
	@$(SYSTEM_DEPS) --quiet $(BUILD_NEEDS)
# Debian's ROCm 5.2 keeps hiprtc inside libamdhip64.so.5 (later ROCm split it out), which
# hip-python loads as libhiprtc.so: --name-hiprtc gives it that name where nothing has it.
toolchain:
	@$(SYSTEM_DEPS) --quiet --name-hiprtc $(AMD_NEEDS)

# The venv with the compiled core's build tools (pyproject.toml's build-system), then the
# package without build isolation: its editable build compiles the core in place with the
# Cython `make core` uses, once (an isolated build's compile would be done again by make core).
# setuptools' notice about editable installs in general is not shown.
$(TOOLS_STAMP): | needs-build
	@echo "[make] creating the virtual environment $(VENV) ($$($(PYTHON) -c \
	  'import sys; print(sys.executable, sys.version.split()[0])'))"
	$(PYTHON) -m venv $(VENV)
	@echo "[make] $(VENV): pip, and the compiled core's build tools (pip)"
	$(PY) -m pip install -q --upgrade pip $(shell $(PYTHON) tools/system_deps.py build-requires)
	@touch $@
$(PACKAGE_STAMP): export PYTHONWARNINGS := ignore:Editable installation:Warning
$(PACKAGE_STAMP): pyproject.toml setup.py $(TOOLS_STAMP)
	@echo "[make] $(VENV): rocmforge_raw (editable) and its dependencies; building it compiles" \
	      "the core (pip, then Cython and C: about 2 minutes)"
	$(PY) -m pip install -q --no-build-isolation -e .
	@touch $@
venv: $(PACKAGE_STAMP)

# The extras of each use. They are installed by name over the editable package (whose metadata
# lists them): adding extras never builds the package again. The package must be there, or pip
# would look for one of that name in the index.
EXTRAS_demo-amd := hip
EXTRAS_demo-nvidia := cuda
EXTRAS_demo-none :=
# every extra the tests need: hip (hip-python) and cuda (cuda-python, NVRTC) for the backends
# and run-time compilers, transfer (Mooncake), test, plot (the soak's plot), dev (lint, types,
# wheels, mutants)
EXTRAS_test := test,cuda,hip,plot,dev,transfer
EXTRAS_plot := plot
EXTRAS_docs := docs
$(VENV)/.installed-extras-%: $(PACKAGE_STAMP)
	@extras='$(EXTRAS_$*)'; if [ -n "$$extras" ]; then \
	  $(PY) -c 'import importlib.metadata as m; m.version("rocmforge_raw")' 2>/dev/null || { \
	    rm -f $(PACKAGE_STAMP); echo "[make] rocmforge_raw is not in $(VENV): run make again" >&2; \
	    exit 1; }; \
	  echo "[make] $(VENV): the extras $$extras (pip$(if $(filter test,$*),: minutes on a fresh machine))"; \
	  $(PY) -m pip install -q "rocmforge_raw[$$extras]"; \
	fi
	@touch $@

# The environment of `make demo` and `make test`, and one line where it was complete already
installed = @[ -n "$$(find $(VENV) -maxdepth 1 -name '.installed-*' -newermt @$(START))" ] \
  || echo "[make] $(VENV): nothing to install (rocmforge_raw$(if $(EXTRAS_$(1)),[$(EXTRAS_$(1))])" \
          "is up to date)"
env-demo: $(VENV)/.installed-extras-demo-$(GPU)
	$(call installed,demo-$(GPU))
env-test: $(VENV)/.installed-extras-test
	$(call installed,test)

# The compiled core (HipBuffer, registry, pool, allocators): rebuilt when a .pyx changes (the
# package's install built it already: then this finds it up to date).
core: $(CORE_STAMP)
$(CORE_STAMP): $(CORE_SRC) setup.py | $(PACKAGE_STAMP)
	@echo "[make] the compiled core: Cython, then C (a minute or two where sources changed)"
	$(PY) setup.py -q build_ext --inplace
	@mkdir -p build && touch $@

# Built in parallel through tools/make_progress.py (it imports the package, hence the core
# first): a bar over the objects out of date on a terminal (a fresh machine compiles for
# minutes), make's own lines as they come. `make kernels` builds every target's (the tests
# check them all); the demo builds its GPU's only, kernels-$(GPU).
kernels: kernels-amd kernels-nvidia
kernels-amd: toolchain | core
	@$(PY) tools/make_progress.py "AMD code objects (clang-19)" $(AMD_OBJS)
kernels-nvidia: | core
ifneq ($(HAVE_NVCC),)
	@$(PY) tools/make_progress.py "NVIDIA code objects (nvcc)" $(NV_OBJS)
else
	@echo "nvcc not found: skipping NVIDIA cubins (the cuda backend compiles with NVRTC instead)"
endif
kernels-none:
	@echo "[make] no GPU found: no code objects to build (the host backend runs NumPy code;" \
	      "GPU=nvidia or GPU=amd builds a GPU's)"

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

demo: needs-demo env-demo core kernels-$(GPU)
	@echo "[make] the demo (rocmforge-raw demo)"
	$(VENV)/bin/rocmforge-raw demo

# -rs: every skipped test's reason in the summary (grouped where they are the same)
test: needs-test env-test core kernels typecheck
	$(PY) -m pytest -q -rs

# mypy --strict over the public API (the modules listed under [tool.mypy] in pyproject.toml),
# and a user's mypy over the README's example
typecheck: $(VENV)/.installed-extras-test core
	$(VENV)/bin/mypy
	$(PY) tools/readme_example.py --mypy

# The documentation site (mkdocs.yml, docs/), strict: a broken link or reference fails. The API
# reference reads the compiled core's docstrings from its built modules, hence core.
docs: $(VENV)/.installed-extras-docs core
	@echo "[make] the documentation: mkdocs build --strict into build/site"
	$(PY) -m mkdocs build --strict --site-dir build/site

bench: $(VENV)/.installed-extras-demo-$(GPU) core kernels-$(GPU)
	$(VENV)/bin/rocmforge-raw bench

soak: $(VENV)/.installed-extras-demo-$(GPU) $(VENV)/.installed-extras-plot core kernels-$(GPU)
	$(VENV)/bin/rocmforge-raw soak --seconds 60

# The soak's verdict on this machine: 30 clean default-length runs PASS, 10 with a planted
# 1 MiB/s leak FAIL (about 20 minutes; `make test` runs a shorter variant)
soak-calibrate: $(VENV)/.installed-extras-plot core
	$(PY) tools/soak_calibrate.py --clean 30 --leaky 10 --seconds 60 --jobs 2

# A wheel in dist/ with the compiled core and the code objects of every target (so nvcc too),
# tagged manylinux by auditwheel (the compiled core needs only libc: nothing is grafted in).
wheel: $(VENV)/.installed-extras-test kernels
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

lint: $(VENV)/.installed-extras-test
	$(VENV)/bin/ruff check rocmforge_raw tests tools

# Mutation testing (long; not part of `make test`): mutmut over rocmforge_raw/cache (its
# config is in pyproject.toml), then tools/mutants.py: the issue's named mutants, each with
# the test that kills it, and operator mutants of the compiled core, rebuilt one by one.
mutate: $(VENV)/.installed-extras-test core kernels
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children $$(nproc) || true
	$(VENV)/bin/mutmut results || true
	$(PY) tools/mutants.py named
	$(PY) tools/mutants.py core

clean:
	rm -f $(KDIR)/*.cubin $(KDIR)/*.ptx $(KDIR)/*.hsaco
	find rocmforge_raw \( -name '*.so' -o -name '*.c' \) -delete
	rm -rf build dist *.egg-info .pytest_cache mutants
