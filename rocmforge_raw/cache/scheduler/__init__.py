"""Continuous batching over a ``KvCache``: requests (``requests``) admitted, decoded,
preempted, resumed and finished by the ``Scheduler`` (``scheduler``).

Imports the cache (``kv_cache``, ``blocks``, ``records``) and the layers below ``cache``.
"""
