"""``rocmforge-raw demo``: the KV cache under a scheduler, attention checked against the
NumPy reference (``run``), conversations of several turns over a host tier (``turns``), and
prefill in one process handed to decode in another (``--disaggregated``: ``handoff``,
``disagg``, over the tiny Llama of ``llama``).

An application: imports any layer of the library; nothing in the library imports it.
"""

from .run import TIMINGS, DemoConfig, failures, outcome, run_demo

__all__ = ["TIMINGS", "DemoConfig", "failures", "outcome", "run_demo"]
