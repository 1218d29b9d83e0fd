"""``rocmforge_raw.array``: where ``DeviceArray`` has always been importable from (it lives in
``rocmforge_raw.memory.array``)."""

from .memory.array import DeviceArray

__all__ = ["DeviceArray"]
