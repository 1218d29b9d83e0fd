"""Code objects: load (from bytes, a path, or the packaged kernels), look up, pack args, launch.

Kernel arguments are packed once per launch into one buffer of 8-byte slots with a ``void*[]``
of the slots' addresses (``kernelParams``), the convention ``hipModuleLaunchKernel`` and
``cuLaunchKernel`` share; both copy the arguments at launch, so the buffer is reused.
Plain ``int`` arguments (and buffers) pass as 64-bit values, plain ``float`` as float32; NumPy
scalars (``np.int32(3)``) pass with their own type.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..common import checks
from ..errors import KernelNotAvailableError
from ..memory.stream import Stream, stream_handle
from ..runtime import Backend, DeviceProperties, get_backend
from ..runtime._launch import Launch
from . import codeobject, jit

#: The packaged code objects (``make kernels`` builds them here) and the kernel sources (a link
#: to the repository's ``native/``, a folder of the wheel) the run-time compilers read.
KERNEL_DIR = Path(__file__).resolve().parent
SOURCE_DIR = KERNEL_DIR / "native"

_log = logging.getLogger(__name__)

#: struct codes of the NumPy scalar types a kernel argument may have
_CODES = {np.int8: "b", np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i",
          np.uint32: "I", np.int64: "q", np.uint64: "Q", np.float32: "f", np.float64: "d"}


def _code_value(index: int, arg: Any) -> tuple[str, Any]:
    """The struct code and value argument ``index`` passes as."""
    kind = type(arg)
    code = _CODES.get(kind)  # the common cases first: NumPy scalars, then ints
    if code is not None:
        return code, arg
    if kind is int:
        if not -(1 << 63) <= arg < (1 << 64):
            raise OverflowError(f"kernel argument {index}: {arg} does not fit in 64 bits")
        return ("Q" if arg >= 0 else "q"), arg
    if kind is float:
        return "f", arg
    if isinstance(arg, bool):
        raise TypeError(f"kernel argument {index}: pass booleans as np.int32, not bool")
    if isinstance(arg, np.generic):
        raise TypeError(f"kernel argument {index}: unsupported scalar type {arg.dtype}")
    if isinstance(arg, (int, float)):  # subclasses pass as the plain type
        return _code_value(index, int(arg) if isinstance(arg, int) else float(arg))
    ptr = getattr(arg, "ptr", None)  # HipBuffer, DeviceArray
    if ptr is None:
        raise TypeError(f"kernel argument {index}: cannot pass {kind.__name__}")
    return "Q", ptr


class KernelParams:
    """A ``kernelParams`` array for one argument signature: each argument in its own 8-byte
    slot of one buffer, and ``array`` holding the slots' addresses (``address``)."""

    def __init__(self, codes: str) -> None:
        count = max(len(codes), 1)
        self.format = "=" + "".join(c + "x" * (8 - struct.calcsize(c)) for c in codes)
        self.slots = ctypes.create_string_buffer(8 * count)
        base = ctypes.addressof(self.slots)
        self.array = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        self.address = ctypes.addressof(self.array)

    def pack(self, values: list[Any]) -> None:
        struct.pack_into(self.format, self.slots, 0, *values)


_packers = threading.local()


def pack_args(args: tuple[Any, ...]) -> KernelParams:
    """``args`` packed as kernelParams (ints and buffers as 64-bit values, floats as float32,
    NumPy scalars as their own type) into this thread's buffer for their signature: valid
    until this thread packs that signature again (a launch copies its arguments)."""
    codes, values = [], []
    for index, arg in enumerate(args):
        code, value = _code_value(index, arg)
        codes.append(code)
        values.append(value)
    signature = "".join(codes)
    cache: dict[str, KernelParams] = _packers.__dict__.setdefault("by_signature", {})
    params = cache.get(signature)
    if params is None:
        params = cache[signature] = KernelParams(signature)
    params.pack(values)
    return params


@dataclass(frozen=True)
class LaunchConfig:
    """Grid in blocks and block in threads (an integer or one to three of them, each in
    [1, 2**31); missing dimensions are 1), dynamic shared memory in bytes (an unsigned
    32-bit count) and the stream. Checked and normalised at construction."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0
    stream: Stream | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", _dims(self.grid, "grid"))
        object.__setattr__(self, "block", _dims(self.block, "block"))
        object.__setattr__(self, "shared_bytes",
                           checks.integer(self.shared_bytes, "shared_bytes", 0, (1 << 32) - 1))
        stream_handle(self.stream)  # an open Stream or None



def _dims(value: Any, name: str) -> tuple[int, int, int]:
    dims = checks.dims(value, name)
    if not 1 <= len(dims) <= 3 or not all(1 <= d < 1 << 31 for d in dims):
        raise ValueError(f"{name} must be one to three sizes in [1, 2**31), got "
                         f"{checks.show(value)}")
    return (*dims, *(1,) * (3 - len(dims)))  # type: ignore[return-value]


class Kernel:
    """One function of a loaded module; calling it launches it."""

    def __init__(self, module: Module, name: str) -> None:
        self.module, self.name = module, name
        self.handle = module.backend.module_function(module.handle, name)
        self._occupancy: dict[tuple[int, int], int] = {}

    def max_active_blocks(self, threads: int, shared_bytes: int = 0) -> int:
        """Blocks of ``threads`` resident per multiprocessor (cached per configuration)."""
        key = (threads, shared_bytes)
        if key not in self._occupancy:
            self._occupancy[key] = self.module.backend.max_active_blocks(
                self.handle, threads, shared_bytes)
        return self._occupancy[key]

    def launch(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args: Any,
               shared_bytes: int = 0, stream: Stream | None = None) -> None:
        config = LaunchConfig(grid, block, shared_bytes, stream)  # type: ignore[arg-type]
        self.module._check_open()
        handle = self.module.stream_of(stream)
        self.module.backend.launch(
            self.handle, config.grid, config.block, config.shared_bytes, handle,
            pack_args(args).address,
        )

    __call__ = launch

    def prepare(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args: Any,
                shared_bytes: int = 0, stream: Stream | None = None,
                patch: tuple[int, ...] = ()) -> Launch:
        """This launch made ready, ``args`` packed once: calling the result with up to four
        pointers replaces the arguments at ``patch`` (in order) and launches from C
        (``runtime._launch``). For launches repeated with a few pointers changed."""
        config = LaunchConfig(grid, block, shared_bytes, stream)  # type: ignore[arg-type]
        self.module._check_open()
        packed = pack_args(args).slots.raw[: 8 * len(args)]
        return Launch(self.module, self.handle, config.grid, config.block, config.shared_bytes,
                      self.module.stream_of(stream), packed, patch)


class Module:
    """A loaded code object (AMD code object, cubin or PTX) on one device. ``name`` names
    the image in errors (default: the file's name, or its size for bytes)."""

    def __init__(self, image: bytes | str | Path, device: int | None = None,
                 backend: str | Backend | None = None, *, name: str | None = None) -> None:
        if not isinstance(image, (bytes, str, os.PathLike)):
            raise TypeError(f"image must be bytes or a path, got {checks.show(image)}")
        self.backend = get_backend(backend)
        self.device = self.backend.resolve_device(device)
        data = image if isinstance(image, bytes) else Path(image).read_bytes()
        if name is None:
            name = f"a {len(data)}-byte image" if isinstance(image, bytes) else Path(image).name
        if self.backend.name == "hip":
            check_wave_size(data, self.backend.cached_properties(self.device), name)
        self.handle = self.backend.module_load(data, self.device)
        self._kernels: dict[str, Kernel] = {}
        self._finalizer = weakref.finalize(
            self, _unload, self.backend, self.handle, self.device, os.getpid())
        self._finalizer.atexit = False

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise KernelNotAvailableError("the module was unloaded")

    def stream_of(self, stream: Stream | None) -> Any:
        """The handle of ``stream``, a ``Stream`` of this module's device or None (then the
        device is activated: a launch on the default stream goes to its default stream)."""
        return stream_handle(stream, "stream", self.backend, self.device)

    def function(self, name: str) -> Kernel:
        """The kernel called ``name`` (cached)."""
        if not isinstance(name, str):
            raise TypeError(f"kernel name must be a str, got {checks.show(name)}")
        self._check_open()
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]

    def unload(self) -> None:
        """Unload now. Idempotent; kernels of this module cannot be launched afterwards."""
        self._finalizer()

    close = unload

    def __enter__(self) -> Module:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unload()


def check_wave_size(image: bytes, props: DeviceProperties, name: str) -> None:
    """Refuse (``KernelNotAvailableError``) an AMD code object whose kernels were built for
    another wavefront size than the device's ``warp_size``: lane arithmetic compiled for 64
    lanes computes wrong results on 32 and the other way round. Read from the object's kernel
    descriptors, before any driver call; other images (cubins, PTX) pass unread."""
    if not codeobject.is_amdgpu(image):
        return
    built = codeobject.wave_size(image)
    if built is None or built == props.warp_size:
        return
    raise KernelNotAvailableError(
        f"{name} holds wave{built} kernels (built for {codeobject.elf_arch(image)}) but "
        f"{props.backend} device {props.index} ({props.name}, {props.arch}) runs "
        f"wave{props.warp_size}: rebuild it for {props.arch} with wavefront size "
        f"{props.warp_size} (`make kernels-amd` passes -DRF_WAVE_SIZE per target; clang's "
        f"-mwavefrontsize64 or -mno-wavefrontsize64 selects it), or remove it so the source is "
        f"compiled for this device at run time")


def _unload(backend: Backend, handle: Any, device: int, pid: int) -> None:
    if os.getpid() == pid and not sys.is_finalizing():
        try:
            backend.module_unload(handle, device)
        except Exception as exc:
            sys.stderr.write(f"rocmforge_raw: unloading a module failed: {exc}\n")


# --- packaged kernels ------------------------------------------------------------------------
def kernel_candidates(stem: str, arch: str) -> list[Path]:
    """Packaged objects that can run on ``arch``, best first."""
    if arch.startswith("gfx"):
        return [KERNEL_DIR / f"{stem}.{arch}.hsaco"]
    if arch.startswith("sm_"):
        major, minor = int(arch[3:-1]), int(arch[-1])
        same_major = [KERNEL_DIR / f"{stem}.sm_{major}{m}.cubin" for m in range(minor, -1, -1)]
        ptx = sorted(KERNEL_DIR.glob(f"{stem}.compute_*.ptx"), reverse=True)
        return same_major + [p for p in ptx if int(p.name.split("_")[-1][:-4]) <= major * 10
                             + minor]
    return []


#: RF_KERNELS values: where ``load_kernels`` takes code objects from.
KERNEL_MODES = ("auto", "prebuilt", "jit")


def kernel_mode() -> str:
    """``RF_KERNELS``: ``auto`` (default; a prebuilt object if one fits, else compiled at run
    time), ``prebuilt`` (never compile) or ``jit`` (ignore prebuilt objects: compile at run
    time, through the on-disk cache)."""
    mode = os.environ.get("RF_KERNELS") or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"RF_KERNELS={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


def _compile(backend: Backend, stem: str, arch: str) -> jit.Compiled:
    """The packaged source ``stem`` compiled for ``arch`` by the backend's run-time compiler,
    through the on-disk cache (``jit``)."""
    return jit.compile_cached(jit.compiler_for(backend.name), SOURCE_DIR / f"{stem}.cu", arch)


_loaded: dict[tuple[str, int, str], Module] = {}
_origins: dict[tuple[str, int, str], str] = {}
_loaded_lock = threading.Lock()


def loaded_kernels() -> dict[str, str]:
    """Where each module ``load_kernels`` loaded came from, by ``backend:device stem``: the
    prebuilt object's file name, or the run-time compiler with its compile time and whether
    the on-disk cache had it."""
    with _loaded_lock:
        return {f"{b}:{d} {stem}": origin for (b, d, stem), origin in _origins.items()}


def _load_prebuilt(stem: str, arch: str, device: int, backend: Backend, errors: list[str]
                   ) -> tuple[Module, str] | None:
    for path in kernel_candidates(stem, arch):
        if path.exists():
            try:
                return Module(path, device, backend), f"prebuilt {path.name}"
            except Exception as exc:  # e.g. a cubin from a newer toolkit than the driver
                errors.append(f"{path.name}: {exc}")
    return None


def _load_compiled(stem: str, arch: str, device: int, backend: Backend) -> tuple[Module, str]:
    compiled = _compile(backend, stem, arch)
    how = "from the cache" if compiled.cached else "compiled now"
    origin = f"{how}, {compiled.compiler}, {compiled.seconds:.1f} s to compile: {compiled.path}"
    if not compiled.cached:
        _log.info("%s for %s: %s", stem, arch, origin)
    return Module(compiled.image, device, backend, name=compiled.path.name), origin


def load_kernels(stem: str, device: int | None = None, backend: str | Backend | None = None
                 ) -> Module:
    """The packaged module ``stem`` (``paged_attention``, ``cache_ops``, ``basic``) for the
    device's arch, loaded once per process and device: a prebuilt object if one fits, else
    compiled at run time into the on-disk cache, else ``KernelNotAvailableError``.
    ``RF_KERNELS`` (``kernel_mode()``) can rule out either way."""
    if not isinstance(stem, str):
        raise TypeError(f"stem must be a str, got {checks.show(stem)}")
    mode = kernel_mode()
    backend = get_backend(backend)
    device = backend.resolve_device(device)
    key = (backend.name, device, stem)
    with _loaded_lock:
        if key in _loaded:
            return _loaded[key]
        arch = backend.properties(device).arch
        errors: list[str] = []
        found = None if mode == "jit" else _load_prebuilt(stem, arch, device, backend, errors)
        if found is None and mode == "prebuilt":
            raise KernelNotAvailableError(
                f"no {stem} code object for {backend.name} arch {arch} in {KERNEL_DIR} and "
                f"RF_KERNELS=prebuilt rules out run-time compilation; build it with "
                f"`make kernels` ({'; '.join(errors) or 'none fits'})")
        if found is None:
            try:
                found = _load_compiled(stem, arch, device, backend)
            except Exception as exc:
                errors.append(f"run-time compilation: {exc}")
                raise KernelNotAvailableError(
                    f"no {stem} code object for {backend.name} arch {arch} in {KERNEL_DIR} and "
                    f"run-time compilation failed; build it with `make kernels` "
                    f"{'(and unset RF_KERNELS=jit) ' if mode == 'jit' else ''}"
                    f"({'; '.join(errors)})"
                ) from exc
        _loaded[key], _origins[key] = found
        return found[0]
