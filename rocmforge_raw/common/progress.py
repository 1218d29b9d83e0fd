"""Progress displays for long work (run-time compilation, the soak, benchmarks, the demo).

Bars are tqdm's, on stderr, and shown only where someone watches: when stderr is a terminal,
unless turned off. ``set_enabled(False)`` turns them off (the CLI does under ``--json``),
``set_enabled(True)`` forces them on, and ``RF_PROGRESS=0`` turns them off for the process
(for logs of programs that run on a terminal). Off, every display is a no-op.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
_forced: bool | None = None  # None: shown when stderr is a terminal


def set_enabled(flag: bool | None) -> None:
    """Show displays (``True``), hide them (``False``), or decide by the terminal (``None``)."""
    global _forced
    _forced = flag


def enabled() -> bool:
    """Whether displays are shown now (see the module's docstring)."""
    if os.environ.get("RF_PROGRESS", "").strip() == "0":
        return False
    if _forced is not None:
        return _forced
    return sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", **options: Any) -> tqdm[Any]:
    """A tqdm bar on stderr, hidden (a no-op) unless ``enabled()``; ``leave=False`` by
    default (the command's own output follows)."""
    options.setdefault("leave", False)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled(),
                dynamic_ncols=True, **options)


def track(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None
          ) -> Iterator[T]:
    """``items``, with a bar that advances as each is taken (hidden unless ``enabled()``)."""
    shown = bar(total if total is not None else _length(items), desc, unit)
    with shown:
        for item in items:
            yield item
            shown.update()


def _length(items: Iterable[Any]) -> int | None:
    return len(items) if isinstance(items, Sized) else None


@contextmanager
def ticking(desc: str, interval: float = 0.5) -> Iterator[None]:
    """A line showing ``desc`` and the time elapsed, refreshed every ``interval`` seconds
    while the body runs (one blocking call, such as a compilation), and left on the screen
    with the final time. Refreshed from a thread: where the call holds the GIL the time
    shows when it returns."""
    if not enabled():
        yield
        return
    done = threading.Event()
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr,
              dynamic_ncols=True) as shown:
        ticker = threading.Thread(target=_tick, args=(shown, done, interval), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _tick(shown: tqdm[Any], done: threading.Event, interval: float) -> None:
    while not done.wait(interval):
        shown.refresh()


__all__ = ["bar", "enabled", "set_enabled", "ticking", "track"]
