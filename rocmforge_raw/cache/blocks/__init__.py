"""Block ids and who holds them: the one ``BlockPool`` (free stack, ref counts, the prefix
index), each sequence's row of block tables and lengths (``rows``, its C loops in ``_rows``
and ``_gather``), prefix hashes (``prefix``) and the token chains that name full blocks
(``chains``). No device memory: ids and host arrays only.

Imports ``kernels``, ``memory``, ``common``; used by the rest of ``cache``.
"""
