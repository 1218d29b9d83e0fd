"""NVRTC: the CUDA backend's run-time compiler (cuda-python's ``cuda.bindings.nvrtc``), which
needs no GPU or driver: sources compile to cubins on any machine that has libnvrtc."""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError, DeviceError, KernelNotAvailableError
from .base import as_text, unwrap

try:
    from cuda.bindings import nvrtc
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"cuda-python is not installed ({exc}): pip install 'rocmforge_raw[cuda]' brings it "
        f"(with NVRTC for run-time compilation)") from exc


def _nvrtc(api: str, result: Any) -> Any:
    return unwrap(api, result, nvrtc.nvrtcResult.NVRTC_SUCCESS,
                  lambda s: (as_text(nvrtc.nvrtcGetErrorString(s)), ""))


def nvrtc_version() -> str:
    """NVRTC's version (``nvrtc 13.5``). Loads libnvrtc (the ``cuda`` extra brings its wheel,
    ``nvidia-cuda-nvrtc``); needs no GPU or driver. Raises ``KernelNotAvailableError`` when it
    cannot be loaded."""
    try:
        major, minor = _nvrtc("nvrtcVersion", nvrtc.nvrtcVersion())
    except RuntimeError as exc:  # cuda.pathfinder found no libnvrtc
        raise KernelNotAvailableError(
            f"NVRTC cannot be loaded ({exc}); pip install 'rocmforge_raw[cuda]' brings it"
        ) from exc
    return f"nvrtc {major}.{minor}"


def nvrtc_compile(source: str, name: str, arch: str, options: list[str]) -> bytes:
    """``source`` compiled by NVRTC to a cubin for ``arch`` (``sm_90``); needs no GPU.
    A compilation error raises ``DeviceError`` carrying NVRTC's log."""
    nvrtc_version()  # a missing libnvrtc is reported as such, not as a failed call
    prog = _nvrtc("nvrtcCreateProgram",
                  nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        opts = [f"--gpu-architecture={arch}", *options]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            _nvrtc("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log))
            raise DeviceError("nvrtcCompileProgram", int(status), f"{name} for {arch}",
                              as_text(log))
        size = _nvrtc("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _nvrtc("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
