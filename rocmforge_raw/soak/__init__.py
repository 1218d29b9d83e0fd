"""``rocmforge-raw soak``: the memory-leak soak (``run``), its verdict on each memory
series (``drift``) and its files (``report``).

An application: imports any layer of the library; nothing in the library imports it.
"""

from .run import UNSETTLED, SoakConfig, SoakResult, run_soak

__all__ = ["UNSETTLED", "SoakConfig", "SoakResult", "run_soak"]
