"""The soak's files: ``soak.csv`` (one row a second), ``soak.json`` (the verdict, the fits,
the configuration) and ``soak.png`` (each series with the verdict, the detected warm-up, the
fitted drift and its limit; every axis in MiB from 0). Without matplotlib the plot is skipped
and a note in the result says so and why.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .drift import Fit
from .results import Row, SoakResult

MiB = 1 << 20


def write(out: Path, rows: list[Row], gpu: bool, result: SoakResult, fits: dict[str, Fit],
          summary: dict[str, Any]) -> None:
    """Write the three files into ``out``; record them in ``result.files`` (and in
    ``result.notes`` why the plot is missing, if it is)."""
    result.files["csv"] = str(out / "soak.csv")
    with open(out / "soak.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seconds", "live_bytes", "live_buffers", "device_used_bytes",
                         "rss_bytes"])
        writer.writerows(rows)
    skipped = _plot(out / "soak.png", rows, gpu, result, fits, summary)
    if skipped:
        result.notes.append(f"plot skipped: {skipped}")
    else:
        result.files["png"] = str(out / "soak.png")
    result.files["json"] = str(out / "soak.json")
    document = {**asdict(result), **{k: _plain(v) for k, v in summary.items()}}
    (out / "soak.json").write_text(json.dumps(document, indent=2))


def _plain(value: Any) -> Any:
    """Dataclasses (the config, fits) as dicts, a fit with its drift, for JSON."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Fit):
        return {**asdict(value), "drift": value.drift}
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


def _plot(path: Path, rows: list[Row], gpu: bool, result: SoakResult, fits: dict[str, Fit],
          summary: dict[str, Any]) -> str | None:
    """Draw the plot; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'rocmforge_raw[plot]'"
    config = summary["config"]
    limits = {"RSS": config.max_rss_drift_bytes,
              "device used bytes": config.max_device_drift_bytes}
    t = np.array([r[0] for r in rows])
    series = [("library live bytes", np.array([r[1] for r in rows], np.float64))]
    if gpu:
        series.append(("device used bytes", np.array([r[3] for r in rows], np.float64)))
    series.append(("RSS", np.array([r[4] for r in rows], np.float64)))
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 2.8 * len(series)), sharex=True,
                             squeeze=False)
    for ax, (name, values) in zip(axes[:, 0], series):
        ax.plot(t, values / MiB, color="tab:blue", lw=1.2, label=name)
        _mark_warmup(ax, result, float(t[-1]))
        fit = fits.get(name)
        if fit is not None:
            span = np.array([fit.start, fit.start + fit.span])
            line = (fit.intercept + fit.slope * span) / MiB
            limit = limits[name]
            ax.plot(span, line, "--", color="tab:red", lw=1.5,
                    label=f"fitted drift {fit.drift / MiB:.2f} MiB over {fit.span:.0f} s "
                          f"({fit.slope / 1024:.1f} KiB/s)")
            ax.plot(span, line[0] + np.array([0.0, limit / MiB]), ":", color="tab:orange",
                    lw=1.2, label=f"limit: {limit / MiB:.2f} MiB over the same span")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{name}, MiB")
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    why = "" if result.passed else ": " + "; ".join(r.split(":")[0] for r in result.reasons)
    fig.suptitle(f"soak on {summary['backend']} ({summary['device']}), {config.seconds:g} s, "
                 f"{result.cycles} cycles: {result.verdict}{why}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _mark_warmup(ax: Any, result: SoakResult, end: float) -> None:
    if result.warmup_s is not None:
        ax.axvspan(0, result.warmup_s, color="0.85",
                   label=f"warm-up: {result.warmup_s:.0f} s (until memory settled)")
    else:
        ax.axvspan(0, end, color="0.92", label="never settled: not judged")


__all__ = ["write"]
