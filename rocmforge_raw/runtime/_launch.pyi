"""Type stub of the compiled ``runtime._launch`` module (see ``_launch.pyx``)."""

from typing import Any

class LaunchApi:
    def __init__(self, guard: Any, capi: dict[str, Any], name: str, signature: str) -> None: ...

class Launch:
    backend: Any
    device: int
    num_args: int
    fallbacks: int
    def __init__(self, module: Any, function: Any, grid: tuple[int, int, int],
                 block: tuple[int, int, int], shared_bytes: int, stream: Any, packed: bytes,
                 patch: tuple[int, ...] = ()) -> None: ...
    def __call__(self, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None: ...
    def set_float(self, index: int, value: float) -> None: ...
    def slot(self, index: int) -> int: ...
