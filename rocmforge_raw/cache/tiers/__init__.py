"""The host tier below a cache's slab: pinned host blocks (``host_tier``), the copies'
stream order (``order``), prefix blocks across both tiers (``tiered``: lookup, demotion,
promotion) and sequences swapped between them (``swap``).

Imports ``cache.blocks``, ``cache.core``, ``cache.config``, ``cache.events`` and the layers
below ``cache``.
"""
