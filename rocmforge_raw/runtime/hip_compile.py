"""hiprtc: the HIP backend's run-time compiler (hip-python's ``hip.hiprtc``), which needs no
GPU: sources compile to code objects for any AMD target on a machine that has libhiprtc."""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError, DeviceError, KernelNotAvailableError
from .base import as_text, unwrap

try:
    from hip import hip, hiprtc
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"hip-python is not installed ({exc}): pip install 'rocmforge_raw[hip]' brings it "
        f"(for AMD GPUs; it must match the installed ROCm)") from exc

_HIP_SUCCESS = hip.hipError_t.hipSuccess


def _status(status: Any) -> tuple[str, str]:
    """A HIP status as (name, text), for the one runtime call made here."""
    return as_text(hip.hipGetErrorName(status)), as_text(hip.hipGetErrorString(status))


def _hiprtc(api: str, result: Any) -> Any:
    return unwrap(api, result, hiprtc.hiprtcResult.HIPRTC_SUCCESS,
                  lambda s: (as_text(hiprtc.hiprtcGetErrorString(s)), ""))


def hiprtc_version() -> str:
    """hiprtc's version and the HIP runtime's (``hiprtc 9.0, HIP 50221153``: ROCm 5.2's
    hiprtc always says 9.0), from the ``libhiprtc.so`` hip-python loads (ROCm's, or Debian's
    ROCm 5.2, whose hiprtc lives in libamdhip64: ``make toolchain`` names it); needs no GPU.
    Raises ``KernelNotAvailableError`` when it cannot be loaded."""
    try:
        major, minor = _hiprtc("hiprtcVersion", hiprtc.hiprtcVersion())
    except RuntimeError as exc:  # hip-python could not dlopen libhiprtc.so
        raise KernelNotAvailableError(
            f"hiprtc cannot be loaded ({exc}); install ROCm, or run `make toolchain`"
        ) from exc
    try:
        version = unwrap("hipRuntimeGetVersion", hip.hipRuntimeGetVersion(), _HIP_SUCCESS,
                         _status)
        runtime = f", HIP {version}"
    except (RuntimeError, DeviceError):  # hiprtc without libamdhip64 beside it
        runtime = ""
    return f"hiprtc {major}.{minor}{runtime}"


def hiprtc_compile(source: str, name: str, arch: str, options: list[str]) -> bytes:
    """``source`` compiled by hiprtc to a code object for ``arch`` (``gfx90a``); needs no GPU.
    A compilation error raises ``DeviceError`` carrying hiprtc's log."""
    hiprtc_version()  # a missing libhiprtc is reported as such, not as a failed call
    prog = _hiprtc("hiprtcCreateProgram",
                   hiprtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        opts = [f"--offload-arch={arch}", *options]
        status = hiprtc.hiprtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        if status != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            size = _hiprtc("hiprtcGetProgramLogSize", hiprtc.hiprtcGetProgramLogSize(prog))
            log = bytearray(size)
            _hiprtc("hiprtcGetProgramLog", hiprtc.hiprtcGetProgramLog(prog, log))
            raise DeviceError("hiprtcCompileProgram", int(status), f"{name} for {arch}",
                              as_text(bytes(log)))
        size = _hiprtc("hiprtcGetCodeSize", hiprtc.hiprtcGetCodeSize(prog))
        code = bytearray(size)
        _hiprtc("hiprtcGetCode", hiprtc.hiprtcGetCode(prog, code))
        return bytes(code)
    finally:
        hiprtc.hiprtcDestroyProgram(prog.createRef())
