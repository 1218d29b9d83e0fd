"""Type stub of the compiled ``runtime._alloc`` module (see ``_alloc.pyx``)."""

from typing import Any

class Allocator:
    backend: Any
    device: int
    def round_trip(self, nbytes: int, device: int) -> None: ...

class HookAllocator(Allocator):
    def __init__(self, backend: Any, alloc: Any, free: Any) -> None: ...
    def release(self, ptr: int, nbytes: int, device: int) -> None: ...

class BackendAllocator(Allocator):
    fallbacks: int
    def __init__(self, backend: Any) -> None: ...

class HostAllocator(BackendAllocator):
    def __init__(self, backend: Any, alignment: int) -> None: ...  # type: ignore[override]

class BindingAllocator(BackendAllocator): ...

class CudaAllocator(BindingAllocator):
    def __init__(self, backend: Any, count: int, capi: dict[str, Any]) -> None: ...  # type: ignore[override]
    def set_context(self, device: int, context: int) -> None: ...

class HipAllocator(BindingAllocator):
    def __init__(self, backend: Any, count: int, capi: dict[str, Any]) -> None: ...  # type: ignore[override]
