"""``rocmforge-raw demo``: the KV cache under a scheduler, attention checked against the
NumPy reference (``run``), and conversations of several turns over a host tier (``turns``).

An application: imports any layer of the library; nothing in the library imports it.
"""

from .run import TIMINGS, DemoConfig, failures, outcome, run_demo

__all__ = ["TIMINGS", "DemoConfig", "failures", "outcome", "run_demo"]
