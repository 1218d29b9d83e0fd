"""What ``info`` says about HIP: the runtime's version, the HIP version hip-python's bindings
were generated for, and, when their major.minor differ, a warning that says what to do.

hip-python is released per ROCm version (6.2 ... 7.2, then 10.0, which carries HIP 7.15);
this package states ``hip-python>=6.4,<11`` (its ``hip`` extra). No release exists for a ROCm
older than 6.2 (Debian's is 5.2), so there the only fix is a newer ROCm; the cuda and host
backends never use HIP and are not affected by any of this.
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError

#: The oldest ROCm (major, minor) whose hip-python this package supports (its ``hip`` extra).
OLDEST_SUPPORTED = (6, 4)


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def advice(hip_python: str, bindings: str, runtime: str) -> str:
    """The warning for bindings generated for HIP ``bindings`` over a HIP ``runtime`` whose
    major.minor differ: what differs, and what to install."""
    found = (f"hip-python {hip_python} was generated for HIP {bindings} but the HIP runtime "
             f"is {runtime}: the bindings' C layer (the allocation and launch fast paths use "
             f"it) then follows another HIP's headers")
    major, minor = _major_minor(runtime)
    if (major, minor) < OLDEST_SUPPORTED:
        oldest = ".".join(map(str, OLDEST_SUPPORTED))
        return (f"{found}. No hip-python that this package supports matches HIP {major}.{minor}: "
                f"to use the hip backend install ROCm {oldest} or newer and its hip-python "
                f"(pip install 'hip-python=={oldest}.*' for ROCm {oldest}); the cuda and host "
                f"backends do not use HIP and are not affected")
    return (f"{found}. Install the hip-python release of the installed ROCm: pip install "
            f"'hip-python=={major}.{minor}.*' (a release is numbered by its ROCm version; "
            f"since 10.0 `rocmforge-raw info` shows the HIP version it carries)")


def hip_runtime(hip_python: str) -> tuple[dict[str, Any], list[str]]:
    """The HIP runtime's version and the one hip-python's bindings were generated for (no
    device needed), and the warnings to show (``advice``, when their major.minor differ)."""
    try:
        from ..runtime.hip import versions
    except BackendUnavailableError as exc:  # hip-python is not installed
        return {"runtime": None, "driver": None, "bindings": None, "error": str(exc)}, []
    found = versions()
    runtime, bindings = found["runtime"], found["bindings"]
    if runtime is None or bindings is None or _major_minor(runtime) == _major_minor(bindings):
        return found, []
    return found, [advice(hip_python, bindings, runtime)]
