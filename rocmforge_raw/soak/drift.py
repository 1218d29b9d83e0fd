"""Judging a memory series for a leak: where its warm-up ends, and how much it drifts after.

A process's memory climbs at first (allocator arenas learn the sizes, pools and caches fill)
and then levels off; a leak keeps it climbing at a steady rate. So the warm-up is not a fixed
share of the run: it ends at the first sample from which the series is *steady*: the slopes
of the two halves of the rest agree and its first few samples lie on the straight line fitted
through the others (a curve still bending over fails one or the other; a flat line and a
steady leak pass both). The drift is then the slope over the rest
times its span. A series that never becomes steady within the run cannot be judged: the run
was too short for it to settle. A rise that stays straight for the whole run is a leak as far
as any run can tell: a machine so slow that its warm-up fills the run needs a longer run.

Slopes are Theil-Sen's (the median of the slopes between all pairs of samples): the driver's
used bytes dip for single samples (module unloads, the pool between cycles), and a
least-squares line tilts by a megabyte with where those dips fall, while a leak lifts the
whole series. Times are in seconds, values in bytes, slopes in bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

#: Samples in each half of the steadiness test, and in its leading window: a judged span
#: holds at least twice as many.
MIN_HALF = 5
#: Tolerances of the steadiness test (``is_steady``): a share of the larger half-slope, a
#: share of the drift limit, and a floor in bytes (for a limit of 0).
RELATIVE_TOLERANCE = 0.1
LIMIT_SHARE = 0.25
FLOOR_BYTES = 64 * 1024
_MAX_FIT = 1000  # samples in one Theil-Sen fit: 500 000 pairs at most
_MAX_CANDIDATES = 200  # warm-up ends tried


@dataclass(frozen=True)
class Fit:
    """The judged part of a series: from ``start`` seconds (the warm-up's end) over ``span``
    seconds, ``slope`` bytes per second and the line's value ``intercept`` at 0 s (for
    plotting). ``drift`` is ``slope * span``, in bytes."""

    start: float
    span: float
    slope: float
    intercept: float

    @property
    def drift(self) -> float:
        return self.slope * self.span


def theil_sen(times: NDArray[np.float64], values: NDArray[np.float64]) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line through the samples: robust to single-sample
    dips and spikes (up to ~29 % of the samples). Pairs grow as the square of the samples, so
    a long series is thinned to ``_MAX_FIT`` evenly spaced samples. Needs two samples."""
    t, v = np.asarray(times, np.float64), np.asarray(values, np.float64)
    if len(t) > _MAX_FIT:
        pick = np.linspace(0, len(t) - 1, _MAX_FIT).round().astype(np.int64)
        t, v = t[pick], v[pick]
    first, second = np.triu_indices(len(t), k=1)
    dt = t[second] - t[first]
    slopes = (v[second] - v[first])[dt > 0] / dt[dt > 0]
    slope = float(np.median(slopes))
    return slope, float(np.median(v - slope * t))


def is_steady(times: NDArray[np.float64], values: NDArray[np.float64],
              max_drift: float) -> bool:
    """Whether the samples rise along one straight line from the first on, judged against
    ``max_drift`` bytes (the limit the series will be held to; below a share of it a bend
    cannot change the verdict):

    - the Theil-Sen slopes of the two halves agree (a slow bend makes them differ), within
      ``RELATIVE_TOLERANCE`` of the larger or ``LIMIT_SHARE`` of the slope that would reach
      ``max_drift`` over the span (at least ``FLOOR_BYTES`` over it); and
    - the first ``MIN_HALF`` samples lie on the line through the others, their median distance
      from it within ``LIMIT_SHARE`` of ``max_drift`` (at least ``FLOOR_BYTES``): a climb
      still under way at the start lies below it, though robust slopes ignore a few samples.
    """
    span = float(times[-1] - times[0])
    allowed = max(LIMIT_SHARE * max_drift, FLOOR_BYTES)
    half = len(times) // 2
    early, _ = theil_sen(times[:half], values[:half])
    late, _ = theil_sen(times[half:], values[half:])
    if abs(early - late) > max(RELATIVE_TOLERANCE * max(abs(early), abs(late)), allowed / span):
        return False
    slope, intercept = theil_sen(times[MIN_HALF:], values[MIN_HALF:])
    lead = values[:MIN_HALF] - (intercept + slope * times[:MIN_HALF])
    return abs(float(np.median(lead))) <= allowed


def settle_index(times: NDArray[np.float64], values: NDArray[np.float64],
                 max_drift: float) -> int | None:
    """The first sample from which the series is steady, or ``None`` if it never is with at
    least ``2 * MIN_HALF`` samples left (the run was too short for it to settle)."""
    last = len(times) - 2 * MIN_HALF
    if last < 0:
        return None
    candidates = np.unique(np.linspace(0, last, min(last + 1, _MAX_CANDIDATES)).round())
    for start in candidates.astype(np.int64):
        if is_steady(times[start:], values[start:], max_drift):
            return int(start)
    return None


def fit_from(times: NDArray[np.float64], values: NDArray[np.float64], start: int) -> Fit:
    """The Theil-Sen fit of the samples from index ``start`` on (two at least)."""
    t, v = times[start:], values[start:]
    slope, intercept = theil_sen(t, v)
    return Fit(float(t[0]), float(t[-1] - t[0]), slope, intercept)


__all__ = ["MIN_HALF", "Fit", "fit_from", "is_steady", "settle_index", "theil_sen"]
