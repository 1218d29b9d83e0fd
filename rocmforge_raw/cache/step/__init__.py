"""One step of the cache: its metadata (``metadata``), planned and uploaded once
(``planner``), each layer's write and attention one launch, or all layers captured as one
graph and replayed (``graph``, ``graph_layout``).

Imports ``cache.config`` and the layers below ``cache``.
"""
