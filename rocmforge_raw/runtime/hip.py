"""HIP backend: AMD GPUs through hip-python (``from hip import hip``). The primary target.

HIP's current device is per thread; every call that depends on it first makes the owning
device current in the calling thread. Mirrors ``cuda.py`` call for call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ..errors import BackendUnavailableError, DeviceError, OutOfMemoryError
from ._alloc import Allocator, HipAllocator
from ._launch import DriverCalls, LaunchApi
from .base import Backend, DeviceProperties, ThreadDevices, address, as_text, peer_enabled, unwrap
from .hip_compile import hiprtc_compile

try:
    from hip import hip
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"hip-python is not installed ({exc}): pip install 'rocmforge_raw[hip]' brings it "
        f"(for AMD GPUs; it must match the installed ROCm)") from exc

_SUCCESS = hip.hipError_t.hipSuccess
_OOM = hip.hipError_t.hipErrorOutOfMemory
_NOT_READY = hip.hipError_t.hipErrorNotReady
_KIND = hip.hipMemcpyKind


def _describe(status: Any) -> tuple[str, str]:
    return as_text(hip.hipGetErrorName(status)), as_text(hip.hipGetErrorString(status))


def check(api: str, result: Any) -> Any:
    return unwrap(api, result, _SUCCESS, _describe)


class HipBackend(ThreadDevices, Backend):
    name = "hip"
    dlpack_device_type = 10  # kDLROCM

    def __init__(self) -> None:
        try:
            self._count = check("hipGetDeviceCount", hip.hipGetDeviceCount())
        except Exception as exc:  # no libamdhip64, or hipErrorNoDevice
            raise BackendUnavailableError(f"no HIP device answers: {exc}") from exc
        if self._count == 0:
            raise BackendUnavailableError("the HIP runtime reports no device")
        self._local = threading.local()
        self._peers: dict[tuple[int, int], bool] = {}

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self._count:
            raise BackendUnavailableError(
                f"HIP device {device} does not exist: {self._count} device(s) present"
            )

    def _make_current(self, device: int) -> None:
        self._check_device(device)
        check("hipSetDevice", hip.hipSetDevice(device))

    def device_count(self) -> int:
        return self._count

    def properties(self, device: int) -> DeviceProperties:
        self._check_device(device)  # the calls name the device: the active one stays
        attr = hip.hipDeviceAttribute_t

        def get(a: Any) -> int:
            return check("hipDeviceGetAttribute", hip.hipDeviceGetAttribute(a, device))

        props = check("hipGetDeviceProperties", hip.hipGetDeviceProperties(device))
        return DeviceProperties(
            backend=self.name, index=device, name=as_text(props.name),
            arch=as_text(props.gcnArchName).split(":", 1)[0],
            total_bytes=check("hipDeviceTotalMem", hip.hipDeviceTotalMem(device)),
            multiprocessors=get(attr.hipDeviceAttributeMultiprocessorCount),
            warp_size=get(attr.hipDeviceAttributeWarpSize),
        )

    def mem_info(self, device: int) -> tuple[int, int]:
        self.activate(device)
        free, total = check("hipMemGetInfo", hip.hipMemGetInfo())
        return int(free), int(total)

    def synchronize(self, device: int) -> None:
        self.activate(device)
        check("hipDeviceSynchronize", hip.hipDeviceSynchronize())

    def malloc(self, nbytes: int, device: int) -> int:
        self.activate(device)
        status, ptr = hip.hipMalloc(nbytes)
        if status != _SUCCESS:  # the hot path skips check()'s generality, not its errors
            if status == _OOM:
                free, total = self.mem_info(device)
                raise OutOfMemoryError("hipMalloc", nbytes, free, total, int(status),
                                       _describe(status)[0])
            check("hipMalloc", (status, ptr))
        return int(ptr)

    def free(self, ptr: int, device: int) -> None:
        check("hipFree", self.restoring(device, lambda: hip.hipFree(ptr)))

    def make_allocator(self) -> Allocator:
        try:  # hip-python's C layer: rocm.bindings.cyhip since 10.0, hip.chip before
            try:
                from rocm.bindings import cyhip as chip
            except ImportError:
                from hip import chip

            return HipAllocator(self, self._count, chip.__pyx_capi__)
        except (ImportError, AttributeError):  # a binding without a matching C layer
            return super().make_allocator()

    def make_launch_api(self) -> LaunchApi | None:
        try:
            try:
                from rocm.bindings import cyhip as chip
            except ImportError:
                from hip import chip

            return LaunchApi(self.allocator, chip.__pyx_capi__, "hipModuleLaunchKernel",
                             "enum hipError_t (hipFunction_t, unsigned int, unsigned int, "
                             "unsigned int, unsigned int, unsigned int, unsigned int, "
                             "unsigned int, hipStream_t, void **, void **)")
        except (ImportError, AttributeError, TypeError):  # no matching C layer
            return None

    def make_driver_calls(self) -> DriverCalls | None:
        try:
            try:
                from rocm.bindings import cyhip as chip
            except ImportError:
                from hip import chip

            return DriverCalls(chip.__pyx_capi__,
                               ("hipEventRecord", "enum hipError_t (hipEvent_t, hipStream_t)"),
                               ("hipEventQuery", "enum hipError_t (hipEvent_t)"),
                               ("hipMemcpyHtoDAsync", "enum hipError_t (void *, void const *, "
                                                      "size_t, hipStream_t)"),
                               int(_NOT_READY),
                               ("hipMemcpyBatchAsync", "",  # (HIP's has a failure index)
                                "enum hipError_t (void **, void **, size_t *, size_t, struct "
                                "hipMemcpyAttributes *, size_t *, size_t, size_t *, "
                                "hipStream_t)"))
        except (ImportError, AttributeError, TypeError):  # no matching C layer
            return None

    def host_alloc(self, nbytes: int, device: int) -> int:
        self.activate(device)
        portable = 1  # hipHostMallocPortable: page-locked for every device
        return int(check("hipHostMalloc", hip.hipHostMalloc(nbytes, portable)))

    def host_free(self, ptr: int, device: int) -> None:
        check("hipHostFree", self.restoring(device, lambda: hip.hipHostFree(ptr)))

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any, stream: Any) -> None:
        if stream is None:
            check("hipMemcpy", hip.hipMemcpy(dst, src, nbytes, kind))
        else:
            check("hipMemcpyAsync", hip.hipMemcpyAsync(dst, src, nbytes, kind, stream))

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any = None) -> None:
        self._copy(dst, src_host, nbytes, _KIND.hipMemcpyHostToDevice, stream)

    def upload(self, dst: int, src_pinned: int, nbytes: int, stream: Any = None) -> None:
        calls = self.driver_calls
        if calls is not None and calls.upload(dst, src_pinned, nbytes, address(stream)):
            return
        check("hipMemcpyAsync", hip.hipMemcpyAsync(
            dst, src_pinned, nbytes, _KIND.hipMemcpyHostToDevice, stream))

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._copy(dst_host, src, nbytes, _KIND.hipMemcpyDeviceToHost, stream)

    def download(self, dst_pinned: int, src: int, nbytes: int, stream: Any = None) -> None:
        check("hipMemcpyAsync", hip.hipMemcpyAsync(
            dst_pinned, src, nbytes, _KIND.hipMemcpyDeviceToHost, stream))

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, to_host: bool, stream: Any = None) -> None:
        kind = _KIND.hipMemcpyDeviceToHost if to_host else _KIND.hipMemcpyHostToDevice
        check("hipMemcpy2DAsync", hip.hipMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width,
                                                       height, kind, stream))

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._copy(dst, src, nbytes, _KIND.hipMemcpyDeviceToDevice, stream)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            check("hipMemset", hip.hipMemset(ptr, value, nbytes))
        else:
            check("hipMemsetAsync", hip.hipMemsetAsync(ptr, value, nbytes, stream))

    def memcpy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                    stream: Any = None) -> None:
        self.activate(dst_device)
        if stream is None:
            check("hipMemcpyPeer", hip.hipMemcpyPeer(dst, dst_device, src, src_device, nbytes))
        else:
            check("hipMemcpyPeerAsync", hip.hipMemcpyPeerAsync(
                dst, dst_device, src, src_device, nbytes, stream))

    def peer_access(self, device: int, peer: int) -> bool:
        key = (device, peer)
        if key not in self._peers:
            for d in key:  # both exist, else BackendUnavailableError
                self._check_device(d)
            allowed = device == peer or bool(check(
                "hipDeviceCanAccessPeer", hip.hipDeviceCanAccessPeer(device, peer)))
            if allowed and device != peer:
                self.activate(device)
                (status,) = hip.hipDeviceEnablePeerAccess(peer, 0)
                if status != _SUCCESS:  # handled here: not left for hipGetLastError
                    hip.hipGetLastError()
                allowed = peer_enabled("hipDeviceEnablePeerAccess", status, (
                    _SUCCESS, hip.hipError_t.hipErrorPeerAccessAlreadyEnabled), _describe,
                    device, peer)
            self._peers[key] = allowed
        return self._peers[key]

    def ipc_handle(self, ptr: int, device: int) -> bytes:
        self.activate(device)
        handle = check("hipIpcGetMemHandle", hip.hipIpcGetMemHandle(ptr))
        return ctypes.string_at(handle.as_c_void_p().value, handle.c_sizeof())

    def ipc_open(self, handle: bytes, nbytes: int, device: int) -> int:
        native = hip.hipIpcMemHandle_t()
        if len(handle) != native.c_sizeof():
            raise ValueError(f"a HIP IPC handle is {native.c_sizeof()} bytes, got {len(handle)}")
        self.activate(device)
        ctypes.memmove(native.as_c_void_p().value, handle, len(handle))
        return int(check("hipIpcOpenMemHandle", hip.hipIpcOpenMemHandle(
            native, hip.hipIpcMemLazyEnablePeerAccess)))

    def ipc_close(self, ptr: int, nbytes: int, device: int) -> None:
        check("hipIpcCloseMemHandle",
              self.restoring(device, lambda: hip.hipIpcCloseMemHandle(ptr)))

    def stream_create(self, device: int) -> Any:
        self.activate(device)
        return check("hipStreamCreate", hip.hipStreamCreate())

    def stream_destroy(self, stream: Any, device: int) -> None:
        check("hipStreamDestroy", self.restoring(device, lambda: hip.hipStreamDestroy(stream)))

    def stream_synchronize(self, stream: Any) -> None:
        check("hipStreamSynchronize", hip.hipStreamSynchronize(stream))

    def event_create(self, device: int) -> Any:
        self.activate(device)
        return check("hipEventCreate", hip.hipEventCreate())

    def event_destroy(self, event: Any, device: int) -> None:
        check("hipEventDestroy", self.restoring(device, lambda: hip.hipEventDestroy(event)))

    def event_record(self, event: Any, stream: Any = None) -> None:
        calls = self.driver_calls
        if calls is not None and calls.record(address(event), address(stream)):
            return
        check("hipEventRecord", hip.hipEventRecord(event, stream))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        check("hipStreamWaitEvent", hip.hipStreamWaitEvent(stream, event, 0))

    def event_synchronize(self, event: Any) -> None:
        check("hipEventSynchronize", hip.hipEventSynchronize(event))

    def event_query(self, event: Any) -> bool:
        calls = self.driver_calls
        if calls is not None and (done := calls.query(address(event))) is not None:
            return done
        (status,) = hip.hipEventQuery(event)
        if status == _NOT_READY:
            return False
        check("hipEventQuery", (status,))
        return True

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(check("hipEventElapsedTime", hip.hipEventElapsedTime(start, end)))

    def module_load(self, image: bytes, device: int) -> Any:
        self.activate(device)
        return check("hipModuleLoadData", hip.hipModuleLoadData(image))

    def module_unload(self, module: Any, device: int) -> None:
        check("hipModuleUnload", self.restoring(device, lambda: hip.hipModuleUnload(module)))

    def module_function(self, module: Any, name: str) -> Any:
        return check("hipModuleGetFunction", hip.hipModuleGetFunction(module, name.encode()))

    def launch(self, function, grid, block, shared_bytes, stream, params_addr) -> None:
        check("hipModuleLaunchKernel", hip.hipModuleLaunchKernel(
            function, *grid, *block, shared_bytes, stream, params_addr, None,
        ))

    def graph_begin(self, stream: Any) -> None:
        mode = hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        check("hipStreamBeginCapture", hip.hipStreamBeginCapture(stream, mode))

    def graph_end(self, stream: Any) -> Any:
        return check("hipStreamEndCapture", hip.hipStreamEndCapture(stream))

    def graph_instantiate(self, graph: Any, device: int) -> Any:
        self.activate(device)
        return check("hipGraphInstantiateWithFlags", hip.hipGraphInstantiateWithFlags(graph, 0))

    def graph_launch(self, executable: Any, stream: Any) -> None:
        check("hipGraphLaunch", hip.hipGraphLaunch(executable, stream))

    def graph_destroy(self, graph: Any, executable: Any, device: int) -> None:
        if executable is not None:
            check("hipGraphExecDestroy",
                  self.restoring(device, lambda: hip.hipGraphExecDestroy(executable)))
        check("hipGraphDestroy", self.restoring(device, lambda: hip.hipGraphDestroy(graph)))

    def max_active_blocks(self, function: Any, threads: int, shared_bytes: int) -> int:
        return check("hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
                     hip.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(
                         function, threads, shared_bytes))

    def compile_source(self, source: str, name: str, arch: str, options: list[str]) -> bytes:
        return hiprtc_compile(source, name, arch, options)


def _version_name(number: int) -> str:
    """A HIP version number (major * 10**7 + minor * 10**5 + patch) as "major.minor.patch"."""
    return f"{number // 10_000_000}.{number // 100_000 % 100}.{number % 100_000}"


def versions() -> dict[str, str | None]:
    """HIP versions, no device needed, each "major.minor.patch" or None: ``runtime`` and
    ``driver`` (hipRuntimeGetVersion, hipDriverGetVersion of the libamdhip64 hip-python loads;
    None when it cannot be loaded or the call fails, and ``error`` says why) and ``bindings``
    (the HIP version hip-python was generated from, its HIP_VERSION_MAJOR/MINOR/PATCH; its own
    version names the ROCm release, which since 10.0 is not the HIP version: hip-python
    10.0.0 carries HIP 7.15)."""
    found: dict[str, str | None] = {"runtime": None, "driver": None, "bindings": None,
                                    "error": None}
    parts = [getattr(hip, f"HIP_VERSION_{p}", None) for p in ("MAJOR", "MINOR", "PATCH")]
    if None not in parts:
        found["bindings"] = ".".join(map(str, parts))
    for key, api in (("runtime", "hipRuntimeGetVersion"), ("driver", "hipDriverGetVersion")):
        try:
            found[key] = _version_name(check(api, getattr(hip, api)()))
        except (RuntimeError, OSError, DeviceError) as exc:  # no libamdhip64, or a failure
            found["error"] = found["error"] or f"{api}: {exc}"
    return found


def bare_alloc_free(nbytes: int) -> None:
    """hipMalloc + hipFree with no checks: the baseline ``bench --alloc`` compares to."""
    hip.hipFree(hip.hipMalloc(nbytes)[1])
