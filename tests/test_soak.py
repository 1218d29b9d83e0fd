"""The soak's judgement: the warm-up ends where memory settles (detected), a leak's steady rise
counts and single-sample dips do not, a run that never settles is not judged, and the files
(the plot states the verdict, or a note says why there is none)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from rocmforge_raw.soak import drift
from rocmforge_raw.soak import report as soak_report
from rocmforge_raw.soak import run as soak

MiB = 1 << 20
LIMIT = 8 * MiB


def settle_and_fit(times, values, limit=LIMIT):
    start = drift.settle_index(times, values, limit)
    return start, (None if start is None else drift.fit_from(times, values, start))


def warm_up(times, rise=30 * MiB, tau=2.0):
    """RSS as a process's allocator warms up: ``rise`` bytes, settling with time constant
    ``tau`` seconds, above a 45 MiB start."""
    return 45 * MiB + rise * (1 - np.exp(-times / tau))


def test_drift_of_a_steady_leak_is_its_rise_over_the_judged_span(rng):
    times = np.arange(0.0, 120.0)
    values = 500 * MiB + 20_000 * times + rng.normal(0, 50_000, times.size)
    start, fit = settle_and_fit(times, values)
    assert start == 0 and fit.drift == pytest.approx(20_000 * 119, rel=0.05)


def test_drift_ignores_single_sample_dips(rng):
    times = np.arange(0.0, 60.0)
    values = np.full(times.size, 557.0 * MiB)
    dips = rng.choice(times.size, size=12, replace=False)  # a fifth of the samples
    values[dips] -= rng.uniform(2, 30, dips.size) * MiB
    start, fit = settle_and_fit(times, values, 1 * MiB)
    assert start is not None and abs(fit.drift) < 0.05 * MiB


def test_slope_of_an_hours_long_soak_is_fitted_on_a_bounded_sample(rng):
    times = np.arange(0.0, 4 * 3600.0)  # four hours at one sample a second
    values = 500 * MiB + 100 * times + rng.normal(0, 50_000, times.size)
    slope, _ = drift.theil_sen(times, values)
    assert slope == pytest.approx(100, rel=0.05)


def test_warm_up_ends_when_the_climb_levels_off_and_is_left_out(rng):
    """The issue's clean run: +30 MiB in the first seconds, then flat: a fixed quarter of a
    short run judged the climb as drift; the detected warm-up leaves it out."""
    times = np.arange(0.0, 60.0)
    values = warm_up(times) + rng.normal(0, 0.05 * MiB, times.size)
    start, fit = settle_and_fit(times, values)
    assert 4 <= start <= 20 and abs(fit.drift) < 1 * MiB


def test_a_leak_after_the_warm_up_is_judged_over_the_rest_of_the_run(rng):
    times = np.arange(0.0, 60.0)
    values = warm_up(times) + MiB * times + rng.normal(0, 0.05 * MiB, times.size)
    start, fit = settle_and_fit(times, values)
    assert start is not None
    assert fit.drift == pytest.approx(MiB * fit.span, rel=0.05) and fit.drift > LIMIT


def test_a_series_still_bending_at_the_end_never_settles():
    times = np.arange(0.0, 30.0)
    values = warm_up(times, rise=60 * MiB, tau=15.0)  # a slow machine's warm-up, half done
    assert drift.settle_index(times, values, LIMIT) is None


def test_a_bend_too_small_to_change_the_verdict_is_judged():
    times = np.arange(0.0, 30.0)
    values = warm_up(times, rise=8 * MiB, tau=15.0)  # bends by less than a quarter limit
    start, fit = settle_and_fit(times, values)
    assert start is not None and 0 < fit.drift < LIMIT


def test_fewer_samples_than_the_fit_needs_never_settle():
    times = np.arange(0.0, 2 * drift.MIN_HALF - 1)
    assert drift.settle_index(times, np.full(times.size, 1.0 * MiB), LIMIT) is None


# --- the verdict -----------------------------------------------------------------------------
def rows_of(rss, live=0):
    return [(float(t), 0, live, None, int(v)) for t, v in enumerate(rss)]


def judge(rss, final_live=0, seconds=None):
    rows = [*rows_of(rss), (float(len(rss)), 0, final_live, None, int(rss[-1]))]
    config = soak.SoakConfig(seconds=seconds or len(rss))
    return soak._judge(rows, False, config, cycles=1000, baseline=0, final_live=final_live)


def test_a_settled_flat_run_passes_with_its_warm_up_and_drift():
    result, fits = judge(warm_up(np.arange(0.0, 40.0)))
    assert result.verdict == soak.PASS and result.passed and result.reasons == []
    assert result.warmup_s == fits["RSS"].start > 0 and abs(result.rss_drift_bytes) < MiB


def test_a_run_that_never_settles_is_not_judged_and_says_to_run_longer():
    rss = 45 * MiB + 40 * MiB * np.sqrt(np.arange(0.0, 12.0) / 12)
    result, fits = judge(rss)
    assert result.verdict == soak.UNSETTLED and not result.passed and fits == {}
    assert result.warmup_s is None and result.rss_drift_bytes is None
    assert len(result.reasons) == 1
    assert "RSS did not settle within the 12-second run" in result.reasons[0]
    assert "run longer" in result.reasons[0]


def test_leaked_buffers_fail_even_when_memory_never_settled():
    rss = 45 * MiB + 40 * MiB * np.sqrt(np.arange(0.0, 12.0) / 12)
    result, _ = judge(rss, final_live=3)
    assert result.verdict == soak.FAIL
    assert result.reasons[0] == "live buffers: 3 after teardown, baseline 0 (3 leaked)"


def test_drift_over_the_limit_fails_and_names_the_slope():
    times = np.arange(0.0, 40.0)
    result, _ = judge(warm_up(times) + MiB * times)
    assert result.verdict == soak.FAIL and len(result.reasons) == 1
    assert result.reasons[0].startswith("RSS: drift ")
    assert re.search(r"over the \d+ s after warm-up \(slope 10\d\d\.\d KiB/s\) > 8\.00 MiB$",
                     result.reasons[0]), result.reasons[0]


def test_a_run_too_short_to_ever_be_judged_is_refused_before_it_starts():
    with pytest.raises(ValueError, match="a 9-second soak cannot be judged: the drift fit "
                                         "needs at least 10 s"):
        soak.SoakConfig(seconds=9)


# --- the files ---------------------------------------------------------------------------------
def write_report(tmp_path, rss):
    result, fits = judge(rss)
    rows = rows_of(rss)
    summary = {"config": soak.SoakConfig(seconds=len(rss)), "backend": "host",
               "device": "cpu", "fits": fits}
    soak_report.write(tmp_path, rows, False, result, fits, summary)
    return result


def test_without_matplotlib_the_plot_is_skipped_and_a_note_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    result = write_report(tmp_path, warm_up(np.arange(0.0, 20.0)))
    assert not (tmp_path / "soak.png").exists() and "png" not in result.files
    assert len(result.notes) == 1 and result.notes[0].startswith(
        "plot skipped: matplotlib is not installed")
    assert "rocmforge_raw[plot]" in result.notes[0]
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["notes"] == result.notes and written["verdict"] == "PASS"


def test_the_json_holds_the_verdict_the_fit_and_the_limits(tmp_path):
    result = write_report(tmp_path, warm_up(np.arange(0.0, 20.0)))
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["verdict"] == result.verdict and written["warmup_s"] == result.warmup_s
    assert written["fits"]["RSS"]["drift"] == pytest.approx(result.rss_drift_bytes)
    assert written["config"]["max_rss_drift_bytes"] == LIMIT
    lines = (tmp_path / "soak.csv").read_text().splitlines()
    assert lines[0] == "seconds,live_bytes,live_buffers,device_used_bytes,rss_bytes"
    assert len(lines) == 21


def test_the_plot_states_verdict_warm_up_fit_and_limit_on_axes_from_zero(tmp_path,
                                                                         monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    shown = {}
    savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # read the figure as it is saved
        shown["title"] = fig._suptitle.get_text()
        shown["axes"] = [(ax.get_ylim(), [t.get_text() for t in ax.get_legend().get_texts()])
                         for ax in fig.axes]
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    result = write_report(tmp_path, warm_up(np.arange(0.0, 20.0)))
    assert (tmp_path / "soak.png").stat().st_size > 1000 and result.notes == []
    assert shown["title"].endswith(f"{result.cycles} cycles: PASS")
    (live_ylim, _), (rss_ylim, rss_legend) = shown["axes"]
    assert live_ylim[0] == rss_ylim[0] == 0
    assert f"warm-up: {result.warmup_s:.0f} s (until memory settled)" in rss_legend
    assert any(t.startswith("fitted drift ") for t in rss_legend)
    assert "limit: 8.00 MiB over the same span" in rss_legend
