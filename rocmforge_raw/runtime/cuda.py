"""CUDA backend: NVIDIA GPUs through cuda-python's driver bindings (``cuda.bindings.driver``).

Uses each device's primary context and makes it current in every thread that calls in
(contexts are per thread). Mirrors ``hip.py`` call for call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ..errors import BackendUnavailableError, OutOfMemoryError
from ._alloc import Allocator, CudaAllocator
from ._launch import DriverCalls, LaunchApi
from .base import Backend, DeviceProperties, ThreadDevices, address, as_text, peer_enabled, unwrap
from .cuda_compile import nvrtc_compile

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"cuda-python is not installed ({exc}): pip install 'rocmforge_raw[cuda]' brings it "
        f"(for NVIDIA GPUs, with NVRTC for run-time compilation)") from exc

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
_NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
#: cuMemcpyBatchAsync's C signature: CUDA 13's, or with "size_t *, " (the failure index)
#: 12.8-12.9's.
_BATCH = ("CUresult (CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, "
          "size_t *, size_t, %sCUstream)")


def _describe(status: Any) -> tuple[str, str]:
    _, name = cu.cuGetErrorName(status)
    _, text = cu.cuGetErrorString(status)
    return as_text(name), as_text(text)


def check(api: str, result: Any) -> Any:
    return unwrap(api, result, _SUCCESS, _describe)


class CudaBackend(ThreadDevices, Backend):
    name = "cuda"
    dlpack_device_type = 2  # kDLCUDA

    def __init__(self) -> None:
        try:
            check("cuInit", cu.cuInit(0))
        except Exception as exc:
            raise BackendUnavailableError(f"no CUDA device answers: {exc}") from exc
        self._count = check("cuDeviceGetCount", cu.cuDeviceGetCount())
        if self._count == 0:
            raise BackendUnavailableError("the CUDA driver reports no device")
        self._contexts: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._shared_raised: dict[int, int] = {}  # function -> its dynamic shared limit
        self._functions: dict[int, set[int]] = {}  # module -> its functions looked up
        self._peers: dict[tuple[int, int], bool] = {}

    def _context(self, device: int) -> Any:
        """``device``'s primary context, retained once. The retain runs outside the lock: a
        collection during it may run a finalizer that needs a context (the same lock)."""
        context = self._contexts.get(device)
        if context is not None:
            return context
        if not 0 <= device < self._count:
            raise BackendUnavailableError(
                f"CUDA device {device} does not exist: {self._count} device(s) present")
        handle = check("cuDeviceGet", cu.cuDeviceGet(device))
        context = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(handle))
        with self._lock:
            kept = self._contexts.setdefault(device, context)
            if kept is context and isinstance(self.allocator, CudaAllocator):
                self.allocator.set_context(device, int(context))
        if kept is not context:  # another thread retained it first: one retain is kept
            check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(handle))
        return kept

    def _make_current(self, device: int) -> None:
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._context(device)))

    def device_count(self) -> int:
        return self._count

    def properties(self, device: int) -> DeviceProperties:
        self._context(device)
        handle = check("cuDeviceGet", cu.cuDeviceGet(device))
        attr = cu.CUdevice_attribute

        def get(a: Any) -> int:
            return check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(a, handle))

        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        return DeviceProperties(
            backend=self.name, index=device,
            name=as_text(check("cuDeviceGetName", cu.cuDeviceGetName(256, handle))),
            arch=f"sm_{major}{minor}",
            total_bytes=check("cuDeviceTotalMem", cu.cuDeviceTotalMem(handle)),
            multiprocessors=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            warp_size=get(attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE),
        )

    def mem_info(self, device: int) -> tuple[int, int]:
        self.activate(device)
        free, total = check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free), int(total)

    def synchronize(self, device: int) -> None:
        self.activate(device)
        check("cuCtxSynchronize", cu.cuCtxSynchronize())

    def malloc(self, nbytes: int, device: int) -> int:
        self.activate(device)
        status, ptr = cu.cuMemAlloc(nbytes)
        if status != _SUCCESS:  # the hot path skips check()'s generality, not its errors
            if status == _OOM:
                free, total = self.mem_info(device)
                raise OutOfMemoryError("cuMemAlloc", nbytes, free, total, int(status),
                                       _describe(status)[0])
            check("cuMemAlloc", (status, ptr))
        return int(ptr)

    def free(self, ptr: int, device: int) -> None:
        check("cuMemFree", self.restoring(device, lambda: cu.cuMemFree(ptr)))

    def make_allocator(self) -> Allocator:
        try:
            from cuda.bindings import cydriver

            return CudaAllocator(self, self._count, cydriver.__pyx_capi__)
        except (ImportError, AttributeError):  # a binding without a matching C layer
            return super().make_allocator()

    def make_launch_api(self) -> LaunchApi | None:
        try:
            from cuda.bindings import cydriver

            return LaunchApi(self.allocator, cydriver.__pyx_capi__, "cuLaunchKernel",
                             "CUresult (CUfunction, unsigned int, unsigned int, unsigned int, "
                             "unsigned int, unsigned int, unsigned int, unsigned int, CUstream, "
                             "void **, void **)")
        except (ImportError, AttributeError, TypeError):  # no matching C layer
            return None

    def make_driver_calls(self) -> DriverCalls | None:
        try:
            from cuda.bindings import cydriver

            return DriverCalls(cydriver.__pyx_capi__,
                               ("cuEventRecord", "CUresult (CUevent, CUstream)"),
                               ("cuEventQuery", "CUresult (CUevent)"),
                               ("cuMemcpyHtoDAsync",
                                "CUresult (CUdeviceptr, void const *, size_t, CUstream)"),
                               int(_NOT_READY), ("cuMemcpyBatchAsync", _BATCH % "",
                                                 _BATCH % "size_t *, "))
        except (ImportError, AttributeError, TypeError):  # no matching C layer
            return None

    def host_alloc(self, nbytes: int, device: int) -> int:
        self.activate(device)
        portable = 1  # CU_MEMHOSTALLOC_PORTABLE: page-locked for every context
        return int(check("cuMemHostAlloc", cu.cuMemHostAlloc(nbytes, portable)))

    def host_free(self, ptr: int, device: int) -> None:
        check("cuMemFreeHost", self.restoring(device, lambda: cu.cuMemFreeHost(ptr)))

    def memcpy_htod(self, dst: int, src_host: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            check("cuMemcpyHtoD", cu.cuMemcpyHtoD(dst, src_host, nbytes))
        else:
            check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(dst, src_host, nbytes, stream))

    def upload(self, dst: int, src_pinned: int, nbytes: int, stream: Any = None) -> None:
        calls = self.driver_calls
        if calls is not None and calls.upload(dst, src_pinned, nbytes, address(stream)):
            return
        check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(dst, src_pinned, nbytes,
                                                        0 if stream is None else stream))

    def memcpy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            check("cuMemcpyDtoH", cu.cuMemcpyDtoH(dst_host, src, nbytes))
        else:
            check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(dst_host, src, nbytes, stream))

    def download(self, dst_pinned: int, src: int, nbytes: int, stream: Any = None) -> None:
        check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(dst_pinned, src, nbytes,
                                                        0 if stream is None else stream))

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                  height: int, to_host: bool, stream: Any = None) -> None:
        copy = cu.CUDA_MEMCPY2D()
        host, device = cu.CUmemorytype.CU_MEMORYTYPE_HOST, cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        if to_host:
            copy.srcMemoryType, copy.srcDevice = device, src
            copy.dstMemoryType, copy.dstHost = host, dst
        else:
            copy.srcMemoryType, copy.srcHost = host, src
            copy.dstMemoryType, copy.dstDevice = device, dst
        copy.srcPitch, copy.dstPitch, copy.WidthInBytes, copy.Height = (
            src_pitch, dst_pitch, width, height)
        check("cuMemcpy2DAsync", cu.cuMemcpy2DAsync(copy, 0 if stream is None else stream))

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            check("cuMemcpyDtoD", cu.cuMemcpyDtoD(dst, src, nbytes))
        else:
            check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream))

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            check("cuMemsetD8", cu.cuMemsetD8(ptr, value, nbytes))
        else:
            check("cuMemsetD8Async", cu.cuMemsetD8Async(ptr, value, nbytes, stream))

    def memcpy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                    stream: Any = None) -> None:
        dst_ctx, src_ctx = self._context(dst_device), self._context(src_device)
        self.activate(dst_device)
        if stream is None:
            check("cuMemcpyPeer", cu.cuMemcpyPeer(dst, dst_ctx, src, src_ctx, nbytes))
        else:
            check("cuMemcpyPeerAsync",
                  cu.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, stream))

    def peer_access(self, device: int, peer: int) -> bool:
        key = (device, peer)
        if key not in self._peers:
            peer_context = self._context(peer)
            self._context(device)  # both exist, else BackendUnavailableError
            handle, peer_handle = (check("cuDeviceGet", cu.cuDeviceGet(d)) for d in key)
            allowed = device == peer or bool(check(
                "cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(handle, peer_handle)))
            if allowed and device != peer:
                self.activate(device)
                (status,) = cu.cuCtxEnablePeerAccess(peer_context, 0)
                allowed = peer_enabled("cuCtxEnablePeerAccess", status, (
                    _SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED), _describe,
                    device, peer)
            self._peers[key] = allowed
        return self._peers[key]

    def ipc_handle(self, ptr: int, device: int) -> bytes:
        self.activate(device)
        handle = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(ptr))
        # opaque since cuda-bindings 13.4 (no .reserved): its 64 bytes read in place
        return ctypes.string_at(handle.getPtr(), int(cu.CU_IPC_HANDLE_SIZE))

    def ipc_open(self, handle: bytes, nbytes: int, device: int) -> int:
        if len(handle) != int(cu.CU_IPC_HANDLE_SIZE):
            raise ValueError(f"a CUDA IPC handle is {int(cu.CU_IPC_HANDLE_SIZE)} bytes, got "
                             f"{len(handle)}")
        self.activate(device)
        native = cu.CUipcMemHandle()
        ctypes.memmove(native.getPtr(), handle, len(handle))
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(check("cuIpcOpenMemHandle", cu.cuIpcOpenMemHandle(native, flags)))

    def ipc_close(self, ptr: int, nbytes: int, device: int) -> None:
        check("cuIpcCloseMemHandle",
              self.restoring(device, lambda: cu.cuIpcCloseMemHandle(ptr)))

    def stream_create(self, device: int) -> Any:
        self.activate(device)
        return check("cuStreamCreate", cu.cuStreamCreate(0))

    def stream_destroy(self, stream: Any, device: int) -> None:
        check("cuStreamDestroy", self.restoring(device, lambda: cu.cuStreamDestroy(stream)))

    def stream_synchronize(self, stream: Any) -> None:
        check("cuStreamSynchronize", cu.cuStreamSynchronize(stream))

    def event_create(self, device: int) -> Any:
        self.activate(device)
        return check("cuEventCreate", cu.cuEventCreate(0))

    def event_destroy(self, event: Any, device: int) -> None:
        check("cuEventDestroy", self.restoring(device, lambda: cu.cuEventDestroy(event)))

    def event_record(self, event: Any, stream: Any = None) -> None:
        calls = self.driver_calls
        if calls is not None and calls.record(address(event), address(stream)):
            return
        check("cuEventRecord", cu.cuEventRecord(event, 0 if stream is None else stream))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        check("cuStreamWaitEvent", cu.cuStreamWaitEvent(0 if stream is None else stream,
                                                        event, 0))

    def event_synchronize(self, event: Any) -> None:
        check("cuEventSynchronize", cu.cuEventSynchronize(event))

    def event_query(self, event: Any) -> bool:
        calls = self.driver_calls
        if calls is not None and (done := calls.query(address(event))) is not None:
            return done
        (status,) = cu.cuEventQuery(event)
        if status == _NOT_READY:
            return False
        check("cuEventQuery", (status,))
        return True

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return float(check("cuEventElapsedTime", elapsed(start, end)))

    def module_load(self, image: bytes, device: int) -> Any:
        self.activate(device)
        return check("cuModuleLoadData", cu.cuModuleLoadData(image))

    def module_unload(self, module: Any, device: int) -> None:
        """Unload ``module`` and forget its functions' shared-memory opt-ins: a function of
        a module loaded later may get the same address, at the default limit. Forgotten
        first, while the handle is live (no other module can take it); each dict call is
        atomic, with no lock: a module's finalizer may run this from a collection inside
        allow_shared's locked section, on the same thread."""
        for key in list(self._functions.pop(int(module), ())):
            self._shared_raised.pop(key, None)
        check("cuModuleUnload", self.restoring(device, lambda: cu.cuModuleUnload(module)))

    def module_function(self, module: Any, name: str) -> Any:
        function = check("cuModuleGetFunction", cu.cuModuleGetFunction(module, name.encode()))
        self._functions.setdefault(int(module), set()).add(int(function))
        return function

    def allow_shared(self, function: Any, shared_bytes: int) -> None:
        """Opt ``function`` in to ``shared_bytes`` of dynamic shared memory: needed once its
        static plus dynamic shared memory passes 48 KiB, harmless below. The limit only
        rises: a launch prepared earlier for more (the attention's two occupancies) stays
        valid."""
        key = int(function)
        if shared_bytes <= self._shared_raised.get(key, 0):
            return
        with self._lock:
            if shared_bytes > self._shared_raised.get(key, 0):
                attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check("cuFuncSetAttribute", cu.cuFuncSetAttribute(function, attr, shared_bytes))
                self._shared_raised[key] = shared_bytes

    def launch(self, function, grid, block, shared_bytes, stream, params_addr) -> None:
        self.allow_shared(function, shared_bytes)
        check("cuLaunchKernel", cu.cuLaunchKernel(
            function, *grid, *block, shared_bytes, 0 if stream is None else stream,
            params_addr, 0,
        ))

    def graph_begin(self, stream: Any) -> None:
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check("cuStreamBeginCapture", cu.cuStreamBeginCapture(stream, mode))

    def graph_end(self, stream: Any) -> Any:
        return check("cuStreamEndCapture", cu.cuStreamEndCapture(stream))

    def graph_instantiate(self, graph: Any, device: int) -> Any:
        self.activate(device)
        return check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))

    def graph_launch(self, executable: Any, stream: Any) -> None:
        check("cuGraphLaunch", cu.cuGraphLaunch(executable, 0 if stream is None else stream))

    def graph_destroy(self, graph: Any, executable: Any, device: int) -> None:
        if executable is not None:
            check("cuGraphExecDestroy",
                  self.restoring(device, lambda: cu.cuGraphExecDestroy(executable)))
        check("cuGraphDestroy", self.restoring(device, lambda: cu.cuGraphDestroy(graph)))

    def max_active_blocks(self, function: Any, threads: int, shared_bytes: int) -> int:
        self.allow_shared(function, shared_bytes)
        return check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                     cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads,
                                                                    shared_bytes))

    def compile_source(self, source: str, name: str, arch: str, options: list[str]) -> bytes:
        return nvrtc_compile(source, name, arch, options)


def bare_alloc_free(nbytes: int) -> None:
    """cuMemAlloc + cuMemFree with no checks: the baseline ``bench --alloc`` compares to."""
    cu.cuMemFree(cu.cuMemAlloc(nbytes)[1])
