"""The soak's drift estimate: a leak's steady rise counts, single-sample dips do not."""

from __future__ import annotations

import numpy as np
import pytest

from rocmforge_raw.soak import _drift

MiB = 1 << 20


def test_drift_of_a_steady_leak_is_its_rise_over_the_judged_span(rng):
    times = np.arange(0.0, 120.0)
    values = 500 * MiB + 20_000 * times + rng.normal(0, 50_000, times.size)
    assert _drift(times, values, start=30.0) == pytest.approx(20_000 * 89, rel=0.05)


def test_drift_ignores_single_sample_dips(rng):
    times = np.arange(0.0, 60.0)
    values = np.full(times.size, 557.0 * MiB)
    dips = rng.choice(times.size, size=12, replace=False)  # a fifth of the samples
    values[dips] -= rng.uniform(2, 30, dips.size) * MiB
    assert abs(_drift(times, values, start=15.0)) < 0.05 * MiB


def test_drift_of_an_hours_long_soak_is_fitted_on_a_bounded_sample(rng):
    times = np.arange(0.0, 4 * 3600.0)  # four hours at one sample a second
    values = 500 * MiB + 100 * times + rng.normal(0, 50_000, times.size)
    assert _drift(times, values, start=0.0) == pytest.approx(100 * times[-1], rel=0.05)
