"""Build and launch kernel sources on the CPU emulation of ``native/compat.h``'s AMD branch.

``load(source, wave_size)`` compiles ``source`` (unchanged: it includes ``compat.h``) with
the host C++ compiler into a shared library together with ``rf_amd_emu.h`` (the target's
attributes and builtins), ``runtime.cc`` (the builtins and the launch) and ``scheduler.cc``
(the work-items as fibers), and loads it. Every kernel the
source defines is found by preprocessing it and registered with a launcher that unpacks the
``void*[]`` kernelParams by the kernel's own parameter types, so the harness needs no list
of kernel names or signatures. Libraries are cached in ``build/amd_emu/`` under a hash of
the source, the headers beside it, the emulator's files, the options and the compiler
version: a changed input builds anew, an unchanged one never rebuilds.

Arguments are packed by ``rocmforge_raw.kernels.module.pack_args`` (ints as 64-bit values, NumPy
scalars as their own type, floats as float32), exactly as a GPU launch packs them, and
checked against the kernel's signature before the launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rocmforge_raw.kernels.module import LaunchConfig, pack_args

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD_DIR = ROOT / "build" / "amd_emu"
NATIVE_DIR = ROOT / "native"  # compat.h: searched after the source's own directory
EMULATOR_FILES = ("rf_amd_emu.h", "fiber.h", "scheduler.h", "scheduler.cc", "runtime.cc",
                  "emulator.py")
WAVE_SIZES = (64, 32)
#: The target each wave size stands for (its predefined macros): wave64 is gfx942 (MFMA),
#: wave32 is gfx1100 (WMMA), so compat.h picks the matrix path each target builds.
TARGET_MACROS = {64: ("-D__gfx942__", "-D__GFX9__"), 32: ("-D__gfx1100__", "-D__GFX11__")}
#: Optimisation ($RF_EMU_OPT, default -O1: the paged-attention library compiles in 3/4 of
#: the time -O2 takes, and the tests run about as fast; "-O0 -g" to debug a kernel).
OPTIMIZE = tuple((os.environ.get("RF_EMU_OPT") or "-O1").split())
FLAGS = ("-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing",
         "-Wno-unknown-pragmas")
_KERNEL = re.compile(r'rf_emu_kernel_threads\s*\((.*?)\)\s*extern\s*"C"\s*void\s+(\w+)\s*\(',
                     re.DOTALL)
_SIZES = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8, "p": 8}
_NAMES = {"p": "a pointer", "f": "float32", "d": "float64", "?": "an unsupported type"}


class EmulationError(RuntimeError):
    """A launch the emulator diagnosed: divergence, deadlock, a bad launch configuration."""


def find_compiler() -> str | None:
    """``$RF_EMU_CXX``, else ``g++``, else ``clang++``; None if there is none."""
    names = [os.environ.get("RF_EMU_CXX") or "", "g++", "clang++", "clang++-19"]
    return next((path for name in names if name and (path := shutil.which(name))), None)


@dataclass(frozen=True)
class Build:
    """One library: ``source`` built for ``wave_size`` (64 or 32) with extra ``defines``
    (``NAME`` or ``NAME=VALUE``) by ``compiler``."""

    source: Path
    wave_size: int
    defines: tuple[str, ...] = ()
    compiler: str = ""

    def __post_init__(self) -> None:
        if self.wave_size not in WAVE_SIZES:
            raise ValueError(f"wave_size must be 64 or 32, got {self.wave_size}")
        object.__setattr__(self, "source", Path(self.source).resolve())
        if not self.compiler:
            found = find_compiler()
            if found is None:
                raise FileNotFoundError("no C++ compiler (g++ or clang++) found")
            object.__setattr__(self, "compiler", found)

    def flags(self) -> list[str]:
        wave = self.wave_size
        includes = dict.fromkeys((HERE, self.source.parent, NATIVE_DIR))
        return [*FLAGS, f"-D__AMDGCN_WAVEFRONT_SIZE__={wave}",
                f"-D__AMDGCN_WAVEFRONT_SIZE={wave}", *TARGET_MACROS[wave],
                *(f"-I{d}" for d in includes),
                *(f"-D{d}" for d in self.defines)]

    def key(self) -> str:
        """Hash of everything the library depends on: compiler, options, the source, the
        headers beside it and in native/, the emulator's own files."""
        digest = hashlib.sha256()
        version = _version(self.compiler)
        headers = sorted({p for d in (self.source.parent, NATIVE_DIR) for p in d.iterdir()
                          if p.suffix in (".h", ".cuh")})
        for part in (self.compiler, version, *OPTIMIZE, *self.flags()):
            digest.update(part.encode() + b"\0")
        for path in (self.source, *headers, *(HERE / f for f in EMULATOR_FILES)):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()[:20]

    @functools.cached_property
    def library(self) -> Path:
        return BUILD_DIR / f"{self.source.stem}.wave{self.wave_size}.{self.key()}.so"


def discover(build: Build) -> list[tuple[str, str]]:
    """(name, thread bound expression) of every kernel ``build.source`` defines."""
    text = _run([build.compiler, "-E", "-P", "-x", "c++", *build.flags(), "-DRF_EMU_DISCOVER",
                 "-include", "rf_amd_emu.h", str(build.source)])
    kernels = dict((name, threads) for threads, name in _KERNEL.findall(text))
    return list(kernels.items())


def generated_source(build: Build, kernels: Iterable[tuple[str, str]]) -> str:
    """The translation unit that includes the source and registers its kernels."""
    rows = "".join(f'    {{"{name}", &rf_emu::launcher<&{name}>, ({threads}), '
                   f"rf_emu::signature(&{name})}},\n" for name, threads in kernels)
    return (f"// generated by tests/amd_emu/emulator.py from {build.source.name}\n"
            '#include "rf_amd_emu.h"\n'
            f'#include "{build.source}"\n'
            "static const rf_emu::Entry table[] = {\n"
            f"{rows}    {{nullptr, nullptr, 0, nullptr}}}};\n"
            'extern "C" const rf_emu::Entry* rf_emu_table() { return table; }\n')


def compile_library(build: Build) -> Path:
    """``build``'s library, compiled unless the cache has it (safe against concurrent
    builds of the same library: each writes its own file and renames it into place)."""
    target = build.library
    if target.exists():
        return target
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD_DIR) as tmp:
        generated = Path(tmp) / f"{build.source.stem}.emu.cc"
        generated.write_text(generated_source(build, discover(build)))
        output = Path(tmp) / target.name
        _run([build.compiler, *build.flags(), *OPTIMIZE, "-shared", "-o", str(output),
              str(generated), str(HERE / "scheduler.cc"), str(HERE / "runtime.cc"), "-ldl"])
        os.replace(output, target)
    return target


def compile_all(builds: Sequence[Build]) -> list[Path]:
    """The libraries of ``builds``, the missing ones compiled in parallel (one per core)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        return list(pool.map(compile_library, builds))


@functools.lru_cache(maxsize=8)
def _version(compiler: str) -> str:
    return _run([compiler, "--version"])


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


@dataclass(frozen=True)
class KernelInfo:
    """A kernel of a library: its index, RF_KERNEL's thread bound and its signature (one
    code per parameter: 'p' pointer, 'f' float32, struct codes for integers)."""

    index: int
    max_threads: int
    signature: str


def check_arguments(name: str, signature: str, codes: str) -> None:
    """Raise TypeError unless the packed argument codes fit the kernel's parameters: same
    count, floats exactly, integers and pointers by size."""
    if len(codes) != len(signature):
        raise TypeError(f"{name} takes {len(signature)} arguments ({signature}), got "
                        f"{len(codes)} ({codes})")
    for i, (want, got) in enumerate(zip(signature, codes)):
        fits = want != "?" and (want == got if "f" in (want, got) or "d" in (want, got)
                                else _SIZES[want] == _SIZES[got])
        if not fits:
            raise TypeError(f"argument {i} of {name} is {_describe(want)}, got {_describe(got)}")


def _describe(code: str) -> str:
    if code in _NAMES:
        return _NAMES[code]
    kind = "uint" if code.isupper() else "int"
    return f"{kind}{8 * _SIZES[code.lower()]}"


class Emulator:
    """A loaded library: ``kernels`` by name, ``launch`` runs one to completion."""

    def __init__(self, build: Build) -> None:
        self.build = build
        self.path = compile_library(build)
        lib = self._lib = ctypes.CDLL(str(self.path))
        for name, restype in (("rf_emu_kernel_name", ctypes.c_char_p),
                              ("rf_emu_kernel_signature", ctypes.c_char_p),
                              ("rf_emu_kernel_threads", ctypes.c_uint)):
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = [ctypes.c_int]
        lib.rf_emu_launch.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
            ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_double,
            ctypes.c_char_p, ctypes.c_size_t]
        lib.rf_emu_matrix_ops.restype = ctypes.c_ulonglong
        lib.rf_emu_lds_trace.argtypes = [ctypes.c_int]
        lib.rf_emu_lds_trace_size.restype = ctypes.c_size_t
        lib.rf_emu_lds_trace_data.restype = ctypes.c_void_p
        self.wave_size = lib.rf_emu_wave_size()
        self._tracing = False
        self.kernels = {
            lib.rf_emu_kernel_name(i).decode(): KernelInfo(
                i, lib.rf_emu_kernel_threads(i), lib.rf_emu_kernel_signature(i).decode())
            for i in range(lib.rf_emu_kernel_count())}

    def launch(self, name: str, grid: int | tuple[int, ...], block: int | tuple[int, ...],
               *args: Any, shared_bytes: int = 0, seed: int = 0,
               timeout_s: float = 120.0) -> None:
        """Run kernel ``name`` on ``grid`` workgroups of ``block`` work-items with ``args``
        (ints for pointers, NumPy scalars for values) and ``shared_bytes`` of dynamic shared
        memory. Workgroups run in grid order, x fastest; ``seed`` != 0 shuffles that order
        and the order lanes run in. Raises KeyError for an unknown kernel, TypeError for
        arguments that do not fit it and EmulationError for what the emulator diagnoses."""
        kernel = self.info(name)
        config = LaunchConfig(grid, block, shared_bytes)
        params = pack_args(args)
        check_arguments(name, kernel.signature, params.format[1:].replace("x", ""))
        error = ctypes.create_string_buffer(4096)
        dims = ctypes.c_uint * 3
        if self._lib.rf_emu_launch(kernel.index, dims(*config.grid), dims(*config.block),
                                   config.shared_bytes, params.address, seed, timeout_s,
                                   error, len(error)):
            raise EmulationError(error.value.decode())

    @property
    def matrix_ops(self) -> int:
        """Matrix-core instructions (MFMA on wave64, WMMA on wave32) run so far, per wave."""
        return self._lib.rf_emu_matrix_ops()

    @contextlib.contextmanager
    def lds_trace(self) -> Iterator[LdsTrace]:
        """Records, for the launches inside the block, every LDS access the kernels make
        through compat.h's helpers (rf_lds_read, rf_lds_load16, rf_lds_store16 and their
        8-byte-aligned forms): ``trace.records`` once the block ends. One block at a time
        per library, and its launches from this thread only (the library keeps one trace)."""
        if self._tracing:
            raise RuntimeError(f"{self.path.name} is already recording an LDS trace")
        trace = LdsTrace()
        self._tracing = True
        self._lib.rf_emu_lds_trace(1)
        try:
            yield trace
            count = self._lib.rf_emu_lds_trace_size()
            if count:
                raw = (ctypes.c_char * (count * LDS_ACCESS.itemsize)).from_address(
                    self._lib.rf_emu_lds_trace_data())
                trace.records = np.frombuffer(bytes(raw), LDS_ACCESS)
        finally:
            self._lib.rf_emu_lds_trace(0)
            self._tracing = False

    def info(self, name: str) -> KernelInfo:
        """Kernel ``name``'s entry; KeyError naming it if the source defines no such kernel."""
        if name not in self.kernels:
            raise KeyError(f"no kernel {name!r} in {self.build.source.name} (it has "
                           f"{len(self.kernels)}: {', '.join(sorted(self.kernels)[:3])}, ...)")
        return self.kernels[name]

    def kernel(self, name: str, seed: int = 0) -> EmulatedKernel:
        """``name`` as an object launched like ``rocmforge_raw.kernels.module.Kernel`` (with
        ``seed`` for every launch)."""
        self.info(name)
        return EmulatedKernel(self, name, seed)


#: One traced LDS access (runtime.cc's LdsAccess): its address (a host address: banks are
#: the same up to a rotation, as every access of a launch is in one thread's block), the
#: workgroup (linear, x fastest), the work-item within it, its size and whether it wrote.
LDS_ACCESS = np.dtype([("address", "<u8"), ("group", "<u4"), ("item", "<u4"),
                       ("bytes", "<i4"), ("write", "<i4")])


@dataclass
class LdsTrace:
    """The LDS accesses of the launches in an ``Emulator.lds_trace()`` block, each work-item's
    in its program order (``LDS_ACCESS`` records; empty until the block ends)."""

    records: np.ndarray = field(default_factory=lambda: np.empty(0, LDS_ACCESS))


@dataclass(frozen=True)
class EmulatedKernel:
    """A kernel with ``module.Kernel``'s ``launch`` signature (the stream is ignored:
    emulated launches complete before they return)."""

    emulator: Emulator
    name: str
    seed: int = 0

    def launch(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args: Any,
               shared_bytes: int = 0, stream: Any = None) -> None:
        self.emulator.launch(self.name, grid, block, *args, shared_bytes=shared_bytes,
                             seed=self.seed)

    __call__ = launch


_loaded: dict[Build, Emulator] = {}


def load(source: str | Path, wave_size: int, defines: Sequence[str] = ()) -> Emulator:
    """The emulator of ``source`` at ``wave_size``, built if needed, loaded once per
    process."""
    build = Build(Path(source), wave_size, tuple(defines))
    if build not in _loaded:
        _loaded[build] = Emulator(build)
    return _loaded[build]
