"""Device memory: ``HipBuffer`` (one owned allocation) and its process-wide registry, the
stream-ordered ``MemoryPool``, ``DeviceArray`` (typed views), ``Stream``/``Event``, DLPack
export and IPC handles shared between processes.

The compiled core lives here (``buffer``, ``pool``, ``_registry``, ``_freelist``,
``_dlpack_release``). Imports ``runtime`` and ``common`` only; ``kernels`` and everything
above build on it.
"""

from . import array as _array  # registers DeviceArray as HipBuffer.typed's type  # noqa: F401
