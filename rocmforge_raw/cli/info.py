"""``rocmforge-raw info``: backends (and why one does not answer), devices, code objects,
versions, the HIP runtime, and the next step for this install (``nextstep``)."""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any

from ..errors import BackendUnavailableError, KernelNotAvailableError
from ..kernels import jit, module
from ..runtime import available_backends, get_backend
from . import nextstep
from .hipinfo import hip_runtime
from .shared import emit, target, where

#: The kernels (packaged sources) a device needs a code object or a compiler for.
KERNELS = tuple(sorted(p.stem for p in module.SOURCE_DIR.glob("*.cu")))


def _versions() -> dict[str, str]:
    found = {}
    for name in ("rocmforge_raw", "numpy", "ml_dtypes", "cffi", "tqdm", "hip-python",
                 "cuda-bindings"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _code_objects(pattern: str = "*") -> list[str]:
    """Names of the packaged code objects matching ``pattern`` (none in a source install
    that was not built with `make kernels`)."""
    return sorted(p.name for p in module.KERNEL_DIR.glob(pattern)
                  if p.suffix in (".hsaco", ".cubin", ".ptx"))


def missing_objects_note() -> str | None:
    """What to do when this install carries no prebuilt code object (a source install of a
    fresh clone builds none), or None when it carries some. No wheel is published: a clone
    builds one."""
    if _code_objects():
        return None
    return ("no prebuilt code objects in this install: each kernel is compiled at run time "
            "on first use (NVRTC from the cuda extra, hiprtc from ROCm; minutes for "
            "paged_attention, then cached); in a clone, `make kernels` builds them before "
            "`pip install .`, and `make wheel` builds a wheel that carries every target's")


def _missing(arch: str) -> list[str]:
    """The kernels with no packaged code object that runs on ``arch``."""
    return [k for k in KERNELS if not any(p.exists() for p in module.kernel_candidates(k, arch))]


def _compiler_error(backend: str) -> str | None:
    try:
        jit.compiler_for(backend)
    except (BackendUnavailableError, KernelNotAvailableError) as exc:
        return str(exc)
    return None


def _devices(backends: dict[str, str], names: list[str], chosen: Any) -> list[dict[str, Any]]:
    """The devices of the backends in ``names`` that answer (only ``chosen``, if given)."""
    devices = []
    for name in names:
        if backends[name] != "ok":
            continue
        backend = get_backend(name)
        for i in range(backend.device_count()):
            if chosen is not None and (backend, i) != chosen:
                continue
            props = backend.properties(i)
            devices.append({"backend": name, "index": i, "name": props.name,
                            "arch": props.arch, "total_bytes": props.total_bytes,
                            "multiprocessors": props.multiprocessors,
                            "code_objects": _code_objects(f"*.{props.arch}.*")})
    return devices


def cmd_info(args: argparse.Namespace) -> int:
    backends = available_backends()
    chosen = target(args) if args.device is not None else None  # checks --device
    devices = _devices(backends, [args.backend] if args.backend else list(backends), chosen)
    all_objects = _code_objects()
    versions = _versions()
    hip, warnings = hip_runtime(versions["hip-python"])
    default = get_backend(args.backend)
    gpus = _devices(backends, ["hip", "cuda"], None)  # every GPU, whatever the flags chose
    steps = nextstep.next_steps(backends, gpus, nextstep.probe(), versions, _missing,
                                _compiler_error)
    result = {"backends": backends, "default": default.name,
              "default_where": where(default, 0, args.backend), "devices": devices,
              "code_objects": all_objects, "code_objects_note": missing_objects_note(),
              "versions": versions, "hip_runtime": hip, "warnings": warnings,
              "next_steps": steps}
    lines = ["backends:"] + [f"  {n:5} {s}" for n, s in backends.items()]
    lines += [f"default backend: {result['default_where']}", "devices:"]
    lines += [f"  {d['backend']}:{d['index']} {d['name']} ({d['arch']}, "
              f"{d['total_bytes'] / 2**30:.1f} GiB, {d['multiprocessors']} units), "
              f"{len(d['code_objects'])} code objects" for d in devices]
    lines.append(f"code objects built: {len(all_objects)} in {module.KERNEL_DIR}")
    if result["code_objects_note"]:
        lines.append(f"  {result['code_objects_note']}")
    lines += ["versions:"] + [f"  {k} {v}" for k, v in versions.items()]
    lines.append(f"HIP runtime {hip['runtime'] or 'not loaded'} (driver "
                 f"{hip['driver'] or '-'}), hip-python bindings for HIP {hip['bindings'] or '-'}"
                 + (f": {hip['error']}" if hip["error"] else ""))
    lines += [f"warning: {w}" for w in warnings]
    lines += ["next step:", *[f"  {step}" for step in steps]]
    emit(args, result, "\n".join(lines))
    return 0
