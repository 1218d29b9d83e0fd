"""What ``info`` says to do next, for the install it finds (``next_steps``).

The cases: a GPU that answers and has prebuilt code objects for its arch (ready); one that
answers without them (each kernel compiles at first use: NVRTC on NVIDIA, hiprtc on AMD, or
`make kernels` ahead); an NVIDIA GPU the cuda backend cannot use (cuda-python missing, or a
driver older than cuda-python 13 needs); an AMD GPU the hip backend cannot use (hip-python
missing, or a ROCm older than its oldest release this package supports); and no GPU at all
(the host backend, and what a GPU would need). The hardware is found without any binding
(``probe``): the NVIDIA kernel driver's version and GPUs under /proc and /sys, the AMD GPUs
the kfd driver lists and ROCm's version file. No step says to install a wheel: none is
published; a clone builds one with `make wheel`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .hipinfo import OLDEST_SUPPORTED

#: The oldest NVIDIA Linux driver that cuda-python 13 (CUDA 13.0, the ``cuda`` extra) runs
#: on: 580.65 (cuda.core's installation page: "CUDA 13: driver 580.65+ (Linux)").
CUDA_DRIVER_FLOOR = (580, 65)
#: What each GPU backend's run-time compiler is called, and where it comes from.
COMPILERS = {"cuda": "NVRTC (the cuda extra's nvidia-cuda-nvrtc)", "hip": "hiprtc (ROCm's)"}


@dataclass(frozen=True)
class Machine:
    """The GPUs found without any binding: the loaded NVIDIA kernel driver's version (None:
    none loaded), how many NVIDIA GPUs it lists, the AMD targets (``gfx942``) the kfd driver
    lists, and the installed ROCm's version (None: not found)."""

    nvidia_driver: str | None = None
    nvidia_gpus: int = 0
    amd_archs: tuple[str, ...] = ()
    rocm: str | None = None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def probe(root: Path = Path("/")) -> Machine:
    """The ``Machine`` under ``root`` (``/``; tests pass a fake tree)."""
    driver = _read(root / "sys/module/nvidia/version").strip() or None
    if driver is None:
        found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", _read(root / "proc/driver/nvidia/version"))
        driver = found.group(1) if found else None
    gpus = root / "proc/driver/nvidia/gpus"
    nvidia = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    nvidia = nvidia or len([p for p in (root / "dev").glob("nvidia*")
                            if re.fullmatch(r"nvidia\d+", p.name)])
    archs = []
    for node in sorted((root / "sys/class/kfd/kfd/topology/nodes").glob("*/properties")):
        found = re.search(r"^gfx_target_version (\d+)$", _read(node), re.M)
        if found and int(found.group(1)):
            version = int(found.group(1))
            archs.append(f"gfx{version // 10000}{version // 100 % 100:x}{version % 100:x}")
    rocm = next((text.strip().split("-")[0] for text in map(_read, sorted(
        (root / "opt").glob("rocm*/.info/version"))) if text.strip()), None)
    return Machine(driver, nvidia, tuple(archs), rocm)


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def install(extra: str) -> str:
    """How to install the ``extra``: pip on its dependencies (this install's metadata names
    them), or on a clone."""
    try:
        requires = metadata.requires("rocmforge_raw") or []
    except metadata.PackageNotFoundError:
        requires = []
    wanted = [r.split(";")[0].strip() for r in requires
              if re.search(rf"""extra\s*==\s*["']{extra}["']""", r)]
    clone = f"pip install '.[{extra}]' in a clone"
    if not wanted:
        return f"install the {extra} extra: {clone}"
    return (f"install the {extra} extra: pip install " + " ".join(f"'{r}'" for r in wanted)
            + f" (or {clone})")


def _hip_python(rocm: str | None) -> str:
    """How to get the hip-python that fits ``rocm`` (None: not found)."""
    oldest = ".".join(map(str, OLDEST_SUPPORTED))
    if rocm is None:
        return (f"install ROCm {oldest} or newer and the hip-python release numbered as it "
                f"(pip install 'hip-python=={oldest}.*' for ROCm {oldest})")
    major, minor = _numbers(rocm)[:2]
    if (major, minor) < OLDEST_SUPPORTED:
        return (f"ROCm {rocm} is older than {oldest}, the oldest whose hip-python this package "
                f"supports: install ROCm {oldest} or newer and its hip-python")
    return f"pip install 'hip-python=={major}.{minor}.*' (the hip-python release of ROCm {rocm})"


def _driver_floor(driver: str | None) -> str:
    """What the cuda extra asks of the NVIDIA driver, and whether ``driver`` has it."""
    floor = ".".join(map(str, CUDA_DRIVER_FLOOR))
    if driver is not None and _numbers(driver)[:2] < CUDA_DRIVER_FLOOR:
        return (f"; but first update the NVIDIA driver: {driver} is older than {floor}, the "
                f"oldest that its cuda-python 13 (CUDA 13.0) runs on")
    return f"; its cuda-python 13 (CUDA 13.0) needs NVIDIA driver {floor} or newer"


def _nvidia(machine: Machine, status: str, versions: Mapping[str, str]) -> str:
    driver = f"driver {machine.nvidia_driver}" if machine.nvidia_driver else "driver ?"
    here = f"an NVIDIA GPU is here ({driver}) but the cuda backend does not answer"
    if versions.get("cuda-bindings", "not installed") == "not installed":
        return (f"{here}: cuda-python is not installed; {install('cuda')}"
                f"{_driver_floor(machine.nvidia_driver)}")
    return f"{here} ({status}); the cuda extra{_driver_floor(machine.nvidia_driver)}"


def _amd(machine: Machine, status: str, versions: Mapping[str, str]) -> str:
    rocm = f", ROCm {machine.rocm}" if machine.rocm else ", no ROCm found"
    here = (f"an AMD GPU is here ({', '.join(sorted(set(machine.amd_archs)))}{rocm}) but the "
            f"hip backend does not answer")
    if versions.get("hip-python", "not installed") == "not installed":
        return f"{here}: hip-python is not installed; {_hip_python(machine.rocm)}"
    return f"{here} ({status}); {_hip_python(machine.rocm)}"


def _cpu_only() -> list[str]:
    return ["CPU only: everything runs on the host backend (CPU memory; the kernels run as "
            "their NumPy reference, so its timings say nothing of a GPU's)",
            f"for an NVIDIA GPU: {install('cuda')}{_driver_floor(None)}",
            f"for an AMD GPU: {_hip_python(None)}"]


def _device(device: Mapping[str, Any], missing: list[str],
            compiler_error: Callable[[str], str | None]) -> str:
    name = f"{device['backend']}:{device['index']} ({device['arch']})"
    if not missing:
        return f"ready: {name} has prebuilt code objects for every kernel: try `rocmforge-raw demo`"
    compiler = COMPILERS[device["backend"]]
    line = (f"{name} has no prebuilt code object for {', '.join(missing)}: each compiles at run "
            f"time on first use with {compiler} (minutes for paged_attention, then cached); "
            f"`make kernels` in a clone builds them ahead")
    error = compiler_error(device["backend"])
    if error is not None:
        line += f"; but no run-time compiler loads here: {error}"
    return line


def next_steps(backends: Mapping[str, str], devices: Sequence[Mapping[str, Any]],
               machine: Machine, versions: Mapping[str, str],
               missing: Callable[[str], list[str]],
               compiler_error: Callable[[str], str | None]) -> list[str]:
    """What to do next, one line a finding: ``devices`` of the backends that answer,
    ``missing(arch)`` the kernels without a prebuilt code object for ``arch``,
    ``compiler_error(backend)`` why its run-time compiler cannot load (None: it loads)."""
    steps = [_device(d, missing(d["arch"]), compiler_error) for d in devices
             if d["backend"] != "host"]
    nvidia = machine.nvidia_driver is not None or machine.nvidia_gpus > 0
    if nvidia and backends.get("cuda") != "ok":
        steps.append(_nvidia(machine, backends.get("cuda", "?"), versions))
    if machine.amd_archs and backends.get("hip") != "ok":
        steps.append(_amd(machine, backends.get("hip", "?"), versions))
    return steps or _cpu_only()


__all__ = ["CUDA_DRIVER_FLOOR", "Machine", "install", "next_steps", "probe"]
