"""Progress displays for long work (run-time compilation, the soak, benchmarks, the demo, the
build of the code objects).

Every display writes to stderr, never stdout (``--json`` output stays one JSON document). How
it shows depends on where stderr goes:

- a terminal: a tqdm bar (``"bar"``);
- anything else, a log, a pipe, CI (``"lines"``): a plain line at most every ``interval()``
  seconds (``RF_PROGRESS_EVERY``, default 10), flushed, and a last line when the work ends if
  any was written: long work is never silent in a log, and work shorter than the interval
  leaves nothing. A soak's line reads ``soak host:0: 35/60 s, 1234 cycles, RSS +0.3 MiB``.

``set_mode("bar" | "lines" | "off")`` forces one (the CLI takes lines under ``--json``),
``set_mode(None)`` decides by the terminal again, and ``RF_PROGRESS=0`` turns every display
off for the process. Off, every display is a no-op.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
MODES = ("bar", "lines", "off")
#: Seconds between two lines off a terminal, unless ``RF_PROGRESS_EVERY`` says otherwise.
DEFAULT_INTERVAL = 10.0
_forced: str | None = None  # None: a bar on a terminal, lines elsewhere


class Display(Protocol):
    """What the package's code calls on a display (tqdm's names): a tqdm bar or ``Lines``."""

    n: float

    def update(self, n: float = 1) -> Any: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def refresh(self) -> Any: ...
    def write(self, s: str, file: TextIO | None = None) -> Any: ...
    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None, /) -> Any: ...


def set_mode(mode: str | None) -> None:
    """Show bars, lines or nothing (``MODES``), or decide by the terminal (``None``)."""
    global _forced
    if mode is not None and mode not in MODES:
        raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    _forced = mode


def set_enabled(flag: bool | None) -> None:
    """``set_mode`` in the older words: ``True`` a bar, ``False`` nothing, ``None`` decide."""
    set_mode(None if flag is None else "bar" if flag else "off")


def mode() -> str:
    """How displays show now (see the module's docstring)."""
    if os.environ.get("RF_PROGRESS", "").strip() == "0":
        return "off"
    if _forced is not None:
        return _forced
    return "bar" if sys.stderr.isatty() else "lines"


def enabled() -> bool:
    """Whether displays show anything now."""
    return mode() != "off"


def interval() -> float:
    """Seconds between two lines off a terminal: ``RF_PROGRESS_EVERY`` if it is a positive
    number, else ``DEFAULT_INTERVAL`` (a progress display is never worth an error)."""
    try:
        seconds = float(os.environ.get("RF_PROGRESS_EVERY", ""))
    except ValueError:
        return DEFAULT_INTERVAL
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_INTERVAL


class Lines:
    """A bar off a terminal: ``desc: n/total unit, postfix`` on stderr at most every ``every``
    seconds (checked on ``update``/``refresh``), and ``desc: done, ...`` when it closes if
    a line was written. Elapsed seconds close each line, unless the unit is seconds."""

    def __init__(self, total: float | None, desc: str, unit: str = "it",
                 every: float | None = None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.every = interval() if every is None else every
        self.n: float = 0
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.written = 0
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        now = time.monotonic()
        if not self.closed and now - self.last >= self.every:
            self.last = now
            self._say(self.text(now))

    def text(self, now: float, done: bool = False) -> str:
        """The line at ``now``: the count, the postfix and the time elapsed (left out when
        the count is in seconds)."""
        count = (f"{_number(self.n)}/{_number(self.total)} {self.unit}" if self.total
                 else f"{_number(self.n)} {self.unit}" if self.n else "")
        parts = [p for p in (count, self.postfix) if p]
        seconds = (f"{now - self.start:.0f} s" if self.unit != "s" or not self.total
                   else "")
        if done:
            return f"{self.desc}: done" + (f" in {seconds}" if seconds else "") + "".join(
                f", {p}" for p in parts)
        return f"{self.desc}: " + ", ".join([*parts, *([seconds] if seconds else [])])

    def write(self, s: str, file: TextIO | None = None) -> None:
        """``s`` as one line on ``file`` (stdout, as tqdm's ``write``), at once."""
        print(s, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        if not self.closed and self.written:
            self._say(self.text(time.monotonic(), done=True))
        self.closed = True

    def _say(self, line: str) -> None:
        self.written += 1
        print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None, /) -> None:
        self.close()


class _Off(Lines):
    """A display that shows nothing (``mode()`` is off) but counts as a bar does."""

    def refresh(self) -> None:
        pass


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def bar(total: float | None, desc: str, unit: str = "it", **options: Any) -> Display:
    """A display of ``total`` ``unit``s of work labelled ``desc`` (see the module docstring):
    a tqdm bar on stderr (``options`` are tqdm's; ``leave=False`` by default: the command's
    own output follows), ``Lines`` off a terminal, or nothing."""
    shown = mode()
    if shown == "lines":
        return Lines(total, desc, unit)
    if shown == "off":
        return _Off(total, desc, unit)
    options.setdefault("leave", False)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                **options)


def track(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None
          ) -> Iterator[T]:
    """``items``, with a display that advances as each is taken."""
    shown = bar(total if total is not None else _length(items), desc, unit)
    with shown:
        for item in items:
            yield item
            shown.update()


def _length(items: Iterable[Any]) -> int | None:
    return len(items) if isinstance(items, Sized) else None


@contextmanager
def ticking(desc: str, refresh_every: float = 0.5, leave: bool = True) -> Iterator[None]:
    """``desc`` and the time elapsed while the body runs (one blocking call, such as a
    compilation, or a phase of a benchmark): on a terminal a line refreshed every
    ``refresh_every`` seconds, left on the screen with the final time if ``leave``; off a
    terminal ``desc: 20 s`` every ``interval()`` seconds and ``desc: done, in 42 s``.
    Refreshed from a thread: where the call holds the GIL the time shows when it returns."""
    shown: Display
    if mode() == "off":
        yield
        return
    if mode() == "lines":
        shown = Lines(None, desc, "")
        refresh_every = min(refresh_every, shown.every)
    else:
        shown = tqdm(desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr,
                     dynamic_ncols=True, leave=leave)
    done = threading.Event()
    with shown:
        ticker = threading.Thread(target=_tick, args=(shown, done, refresh_every), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _tick(shown: Display, done: threading.Event, every: float) -> None:
    while not done.wait(every):
        shown.refresh()


__all__ = ["DEFAULT_INTERVAL", "MODES", "Display", "Lines", "bar", "enabled", "interval",
           "mode", "set_enabled", "set_mode", "ticking", "track"]
