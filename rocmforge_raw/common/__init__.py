"""The foundation every layer may use: argument checks (``checks``), processes and the
shared-memory names of this package (``procs``) and progress displays (``progress``).

Owns no device state and touches no device. Imports nothing of this package but
``rocmforge_raw.errors``; every other layer may import it.
"""
