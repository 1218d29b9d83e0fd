"""Kernels: the packaged code objects (built here by ``make kernels``, beside the sources in
``native/``), their loading and launch (``module``), run-time compilation (``jit``), ELF
reading (``codeobject``), launch planning (``planning``), stream-ordered staging of launch
metadata (``staging``, ``_pack``), the ops (``ops``) and their NumPy reference
(``reference``, which the host backend runs).

Imports ``memory``, ``runtime`` and ``common``; ``cache`` and above build on it.
"""
