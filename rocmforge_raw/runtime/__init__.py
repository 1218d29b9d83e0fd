"""Backend selection: ``hip`` if an AMD GPU answers, else ``cuda`` if an NVIDIA GPU answers,
else ``host``. ``RF_BACKEND=hip|cuda|host`` forces one. Backends are created once, on first use.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ..errors import BackendUnavailableError
from .base import Backend, DeviceProperties

__all__ = [
    "BACKEND_NAMES", "Backend", "DeviceProperties", "available_backends", "default_backend",
    "devices", "get_backend",
]


def _hip() -> Backend:
    from .hip import HipBackend

    return HipBackend()


def _cuda() -> Backend:
    from .cuda import CudaBackend

    return CudaBackend()


def bare_alloc_free(backend: Backend, nbytes: int) -> None:
    """One allocation and free through the binding alone (no checks): the bench baseline."""
    if backend.name == "cuda":
        from .cuda import bare_alloc_free as bare
    elif backend.name == "hip":
        from .hip import bare_alloc_free as bare
    else:
        from .host import bare_alloc_free as bare
    bare(nbytes)


def _host() -> Backend:
    from .host import HostBackend

    return HostBackend()


_log = logging.getLogger(__name__)
_FACTORIES: dict[str, Callable[[], Backend]] = {"hip": _hip, "cuda": _cuda, "host": _host}
#: In order of preference.
BACKEND_NAMES = tuple(_FACTORIES)

_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_failures: dict[str, BackendUnavailableError] = {}
_classes: set[type] = set()
_default: Backend | None = None


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend called ``name`` (created on first use), or the default one for ``None``."""
    if name is None:
        return _default or default_backend()
    if name.__class__ in _classes:  # a backend made here (cheaper than an ABC isinstance)
        return name  # type: ignore[return-value]  # a class in _classes is a Backend
    if not isinstance(name, str):
        if not isinstance(name, Backend):
            raise TypeError(f"backend must be a name ({', '.join(BACKEND_NAMES)}), a Backend "
                            f"or None, got {name!r}")
        return name
    if name in _backends:
        return _backends[name]
    if name not in _FACTORIES:
        raise BackendUnavailableError(
            f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}"
        )
    with _lock:
        if name in _backends:
            return _backends[name]
        if name in _failures:
            raise _failures[name]
        try:
            backend = _FACTORIES[name]()
        except BackendUnavailableError as exc:
            _failures[name] = exc
            raise
        except Exception as exc:  # a binding that fails to load is "unavailable", with why
            _failures[name] = BackendUnavailableError(f"{name} backend failed to start: {exc}")
            raise _failures[name] from exc
        _ = backend.allocator  # made here, under the lock: one per backend, whatever the threads
        _backends[name] = backend
        _classes.add(type(backend))
        return backend


def default_backend() -> Backend:
    """``RF_BACKEND`` if set, else the first of hip, cuda, host that answers."""
    global _default
    if _default is not None:
        return _default
    with _lock:
        if _default is None:
            forced = os.environ.get("RF_BACKEND", "").strip().lower()
            if forced:
                _default = get_backend(forced)
            else:
                found = next((b for b in map(_try, BACKEND_NAMES) if b is not None), None)
                if found is None:  # the host answers unless RF_HOST_DEVICES is wrong
                    raise BackendUnavailableError("no backend answers: " + "; ".join(
                        f"{name}: {why}" for name, why in available_backends().items()))
                _default = found
            _log.info("default backend: %s%s", _default.name,
                      f" (RF_BACKEND={forced})" if forced else "")
        return _default


def _try(name: str) -> Backend | None:
    try:
        return get_backend(name)
    except BackendUnavailableError as exc:
        _log.debug("%s backend unavailable: %s", name, exc)
        return None


def available_backends() -> dict[str, str]:
    """Each backend name mapped to ``"ok"`` or the reason it is unavailable."""
    status = {}
    for name in BACKEND_NAMES:
        try:
            get_backend(name)
            status[name] = "ok"
        except BackendUnavailableError as exc:
            status[name] = str(exc)
    return status


def devices() -> list[DeviceProperties]:
    """Properties of every device of every backend that answers, GPUs first."""
    found: list[DeviceProperties] = []
    for name in BACKEND_NAMES:
        backend = _try(name)
        if backend is not None:
            found.extend(backend.properties(i) for i in range(backend.device_count()))
    return found
