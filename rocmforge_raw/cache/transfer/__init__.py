"""Sequences moving between caches: the interface a transport implements for the cache
(``transport``: publish a slab, read spans of it) and a sequence's description, export and
import (``sequences``). The transports themselves live above the cache
(``rocmforge_raw.transport``) and implement this interface.

Imports ``cache.core``, ``cache.config``, ``cache.blocks`` and the layers below ``cache``.
"""
