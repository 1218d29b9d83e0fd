"""Argparse types for the CLI's flags: each parses one string and checks its range, or
raises ``argparse.ArgumentTypeError`` with a message that shows the bad value (argparse
prints it on one line, after the flag's name)."""

from __future__ import annotations

import argparse
import math
import operator
import os
from collections.abc import Callable
from pathlib import Path


def _short(text: str) -> str:
    """``text``, shortened for a one-line message."""
    return text if len(text) <= 40 else text[:37] + "..."


def _shown(text: str) -> str:
    """``repr(text)``, shortened for a one-line message."""
    return repr(_short(text))


def count(minimum: int, maximum: int) -> Callable[[str], int]:
    """An integer in [``minimum``, ``maximum``]: every flag is bounded, so that no value
    makes a command run on for ever or overflow what it is turned into."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{_short(text)} is above {maximum}")
        return value

    return parse


def real(*, above: float | None = None, at_least: float | None = None,
         below: float | None = None, at_most: float | None = None) -> Callable[[str], float]:
    """A finite number within the bounds given (exclusive ``above``/``below``, inclusive
    ``at_least``/``at_most``; every flag gives an upper one)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a finite number")
        for bound, ok, words in ((above, operator.gt, "above"),
                                 (at_least, operator.ge, "at least"),
                                 (below, operator.lt, "below"),
                                 (at_most, operator.le, "at most")):
            if bound is not None and not ok(value, bound):
                raise argparse.ArgumentTypeError(f"{_short(text)} is not {words} {bound:.10g}")
        return value

    return parse


def out_dir(text: str) -> str:
    """A folder that exists or can be made: no part of it is a file, and the deepest part
    that exists is writable."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                where = "" if part == path else f" lies under {str(part)!r}, which"
                raise argparse.ArgumentTypeError(f"{text!r}{where} is a file, not a folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise argparse.ArgumentTypeError(f"{text!r}: folder {str(part)!r} is not "
                                                 "writable")
            break
    return text
