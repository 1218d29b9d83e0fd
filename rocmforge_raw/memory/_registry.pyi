"""Type stub of the compiled ``_registry`` module (see ``_registry.pyx``)."""

from dataclasses import dataclass
from typing import Any

@dataclass
class Allocation:
    nbytes: int
    device: int
    backend: str
    stack: list[str] | None = ...

class Registry:
    track_stacks: bool

registry: Registry

def memory_stats() -> dict[str, int]: ...
def live_allocations() -> list[Allocation]: ...
def reset_peak() -> None: ...
def track_stacks(enabled: bool) -> None: ...
def live_buffers() -> list[Any]: ...
