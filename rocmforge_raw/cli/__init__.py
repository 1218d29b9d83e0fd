"""``rocmforge-raw``: the command line (``main``), its flags' parsers (``flags``), its
``bench`` command (``bench``) and what ``info`` says about HIP (``hipinfo``).

An application: imports any layer of the library and the other applications (``bench``,
``demo``, ``soak``); nothing in the library imports it.
"""

from .main import main

__all__ = ["main"]
