"""What cuda.py and hip.py do with their bindings' answers where no GPU answers (CI): each
test puts a test double in place of the binding (``cuda.bindings.driver``, hip-python's
``hip``), playing two GPUs that see each other, because the hardware is absent. The doubles
return the bindings' own status enums; the backends are built past their ``__init__``
(which asks the real driver for devices) with what it would have set."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

STATUSES = {  # binding -> (already enabled, another failure of the enable call)
    "cuda": ("CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "CUDA_ERROR_TOO_MANY_PEERS"),
    "hip": ("hipErrorPeerAccessAlreadyEnabled", "hipErrorPeerAccessUnsupported"),
}


class CudaDouble:
    """``cuda.bindings.driver`` for two GPUs with peer access between them."""

    def __init__(self, driver: Any, enable_status: Any) -> None:
        self.CUresult = driver.CUresult
        self._ok, self.enable_status, self.enables = driver.CUresult.CUDA_SUCCESS, \
            enable_status, 0

    def cuDeviceGet(self, device: int) -> tuple:
        return self._ok, device

    def cuDeviceCanAccessPeer(self, device: int, peer: int) -> tuple:
        return self._ok, 1

    def cuCtxSetCurrent(self, context: Any) -> tuple:
        return (self._ok,)

    def cuCtxEnablePeerAccess(self, context: Any, flags: int) -> tuple:
        self.enables += 1
        return (self.enable_status,)

    def cuGetErrorName(self, status: Any) -> tuple:
        return self._ok, status.name.encode()

    def cuGetErrorString(self, status: Any) -> tuple:
        return self._ok, b"as the double says"


class HipDouble:
    """hip-python's ``hip`` for two GPUs with peer access between them; it keeps the
    device ``hipSetDevice`` made current and counts the reads of the sticky last error."""

    def __init__(self, hip: Any, enable_status: Any) -> None:
        self.hipError_t, self.hipDeviceAttribute_t = hip.hipError_t, hip.hipDeviceAttribute_t
        self._ok, self.enable_status = hip.hipError_t.hipSuccess, enable_status
        self.current, self.enables, self.last_error_reads = None, 0, 0

    def hipSetDevice(self, device: int) -> tuple:
        self.current = device
        return (self._ok,)

    def hipDeviceCanAccessPeer(self, device: int, peer: int) -> tuple:
        return self._ok, 1

    def hipDeviceEnablePeerAccess(self, peer: int, flags: int) -> tuple:
        self.enables += 1
        return (self.enable_status,)

    def hipGetLastError(self) -> tuple:
        self.last_error_reads += 1
        return (self._ok,)

    def hipGetErrorName(self, status: Any) -> str:
        return str(status.name)

    def hipGetErrorString(self, status: Any) -> str:
        return "as the double says"

    def hipGetDeviceProperties(self, device: int) -> tuple:
        return self._ok, SimpleNamespace(name=b"double", gcnArchName=b"gfx942:sramecc+")

    def hipDeviceTotalMem(self, device: int) -> tuple:
        return self._ok, 1 << 30

    def hipDeviceGetAttribute(self, attribute: Any, device: int) -> tuple:
        return self._ok, 64


class Warnings(logging.Handler):
    """The messages of the warnings logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _backend(binding: str, which: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(a backend of ``binding`` with two devices, its binding's double), the double's
    enable call answering the ``which``-th of ``STATUSES[binding]``."""
    try:
        if binding == "cuda":
            from rocmforge_raw.runtime import cuda as module
        else:
            from rocmforge_raw.runtime import hip as module
    except Exception as exc:  # BackendUnavailableError: the binding is not installed
        pytest.skip(f"{binding}'s binding is not installed: {exc}")
    if binding == "cuda":
        driver = module.cu
        double = CudaDouble(driver, getattr(driver.CUresult, STATUSES[binding][which]))
        monkeypatch.setattr(module, "cu", double)
        backend = object.__new__(module.CudaBackend)
        backend._contexts, backend._lock = {0: "context 0", 1: "context 1"}, threading.Lock()
    else:
        hip = module.hip
        double = HipDouble(hip, getattr(hip.hipError_t, STATUSES[binding][which]))
        monkeypatch.setattr(module, "hip", double)
        backend = object.__new__(module.HipBackend)
    backend._count, backend._peers, backend._local = 2, {}, threading.local()
    return backend, double


@pytest.mark.parametrize("binding", sorted(STATUSES))
def test_peer_access_already_enabled_is_on(binding, monkeypatch):
    """An enable that finds access on already means on; HIP's sticky last error that the
    failing call set is read once (cleared), so nothing later mistakes it for its own."""
    backend, double = _backend(binding, 0, monkeypatch)
    assert backend.peer_access(0, 1) is True
    assert backend.peer_access(0, 1) is True
    assert double.enables == 1
    if binding == "hip":
        assert double.last_error_reads == 1


@pytest.mark.parametrize("binding", sorted(STATUSES))
def test_peer_access_the_driver_refuses_is_off_logged_and_not_asked_again(
        binding, monkeypatch):
    """An enable that fails otherwise (too many peers, unsupported) means off, as
    ``Backend.peer_access`` promises (memcpy_peer stages through host memory): logged once
    as a warning naming the call and status, remembered for the pair, never raised."""
    backend, double = _backend(binding, 1, monkeypatch)
    handler = Warnings()
    logger = logging.getLogger("rocmforge_raw")  # on it: the CLI may stop its propagation
    logger.addHandler(handler)
    try:
        assert backend.peer_access(0, 1) is False
        assert backend.peer_access(0, 1) is False
    finally:
        logger.removeHandler(handler)
    warnings = handler.messages
    assert double.enables == 1
    assert backend._peers == {(0, 1): False}
    assert len(warnings) == 1
    assert "EnablePeerAccess(0 -> 1)" in warnings[0]
    assert STATUSES[binding][1] in warnings[0]
    if binding == "hip":
        assert double.last_error_reads == 1


def test_hip_properties_leave_the_active_device_as_it_was(monkeypatch):
    """properties(1) asks by device index, as cuda.py's does: device 0 stays active, in the
    backend's bookkeeping and in the runtime."""
    backend, double = _backend("hip", 0, monkeypatch)
    backend.activate(0)
    props = backend.properties(1)
    assert (props.index, props.arch, props.warp_size) == (1, "gfx942", 64)
    assert (backend._local.device, double.current) == (0, 0)
    from rocmforge_raw.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="HIP device 2 does not exist"):
        backend.properties(2)


def test_a_finalizer_that_needs_a_context_during_a_retain_does_not_deadlock(monkeypatch):
    """A collection during the retain of device 1's primary context runs a finalizer that
    needs device 0's context: the retain runs outside the backend's lock, so it is served
    (it used to wait for the lock its own thread held: a hang). Every retain but the kept
    one is released."""
    backend, double = _backend("cuda", 0, monkeypatch)
    backend._contexts, backend.allocator = {}, None
    retained, released = [], []

    def retain(handle: int) -> tuple:
        retained.append(handle)
        if handle == 1 and 0 not in backend._contexts:  # "a finalizer" of device 0 runs here
            backend._context(0)
        return double._ok, f"context {handle}"

    double.cuDevicePrimaryCtxRetain = retain
    double.cuDevicePrimaryCtxRelease = lambda handle: (released.append(handle), double._ok)[1:]
    worker = threading.Thread(target=backend._context, args=(1,), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "retaining a context deadlocked on the backend's lock"
    assert backend._contexts == {0: "context 0", 1: "context 1"}
    assert retained == [1, 0] and released == []
