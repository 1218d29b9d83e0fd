#!/usr/bin/env python3
"""Calibrates the soak's verdict on this machine: clean host runs must all PASS, and runs with
a planted RSS leak (1 MiB/s by default, unknown to the library) must all FAIL.

Each run is `rocmforge-raw soak --backend host --json` in a fresh process (its RSS is its
own), ``--jobs`` at a time. Prints one line per run and the figures: verdicts, where the
warm-up ended, the RSS drift after it. Exit 0 when every verdict is the expected one.

    python tools/soak_calibrate.py                  # 30 clean + 10 leaky runs of 60 s
    python tools/soak_calibrate.py --clean 2 --leaky 2 --seconds 30 --jobs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MiB = 1 << 20


def run_one(seconds: float, leak_mib_per_s: float, out: Path, seed: int) -> dict[str, Any]:
    """One soak in a fresh process: its JSON result, with ``exit`` its exit status."""
    argv = [sys.executable, "-m", "rocmforge_raw.cli", "soak", "--backend", "host", "--json",
            "--seconds", str(seconds), "--out", str(out), "--seed", str(seed)]
    if leak_mib_per_s:
        argv += ["--inject-rss-leak-mib", str(leak_mib_per_s)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 240)
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        result = {"verdict": "ERROR", "reasons": [done.stderr.strip()[-500:]]}
    return {**result, "exit": done.returncode, "leak_mib_per_s": leak_mib_per_s}


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"min": min(values), "median": statistics.median(values),
            "max": max(values)} if values else None


def calibrate(clean: int, leaky: int, seconds: float, jobs: int, leak_mib_per_s: float = 1.0,
              root: Path | None = None) -> dict[str, Any]:
    """Run ``clean`` clean and ``leaky`` leaking soaks of ``seconds`` each, ``jobs`` at a
    time, with their files under ``root`` (a temporary folder by default). Returns the runs,
    the figures and ``right``: every clean run PASSed (exit 0) and every leaky one FAILed
    (exit 1)."""
    with tempfile.TemporaryDirectory() as scratch:
        base = root or Path(scratch)
        plans = [(0.0, i) for i in range(clean)] + [(leak_mib_per_s, i) for i in range(leaky)]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(
                lambda plan: run_one(seconds, plan[0], base / f"{plan[0]:g}-{plan[1]}",
                                     seed=plan[1]), plans))
    clean_runs = [r for r in runs if not r["leak_mib_per_s"]]
    leaky_runs = [r for r in runs if r["leak_mib_per_s"]]
    drifts = [r["rss_drift_bytes"] / MiB for r in clean_runs
              if r.get("rss_drift_bytes") is not None]
    figures = {
        "seconds": seconds, "leak_mib_per_s": leak_mib_per_s,
        "clean_verdicts": [r["verdict"] for r in clean_runs],
        "leaky_verdicts": [r["verdict"] for r in leaky_runs],
        "clean_warmup_s": _spread([r["warmup_s"] for r in clean_runs
                                   if r.get("warmup_s") is not None]),
        "clean_rss_drift_mib": _spread(drifts),
        "leaky_rss_drift_mib": _spread([r["rss_drift_bytes"] / MiB for r in leaky_runs
                                        if r.get("rss_drift_bytes") is not None]),
    }
    right = all(r["verdict"] == "PASS" and r["exit"] == 0 for r in clean_runs) and \
        all(r["verdict"] == "FAIL" and r["exit"] == 1 for r in leaky_runs)
    return {"right": right, "figures": figures, "runs": runs}


def _line(run: dict[str, Any]) -> str:
    warm, rss = run.get("warmup_s"), run.get("rss_drift_bytes")
    return (f"leak {run['leak_mib_per_s']:g} MiB/s: {run['verdict']:9} exit {run['exit']}  "
            f"warm-up {'-' if warm is None else f'{warm:.0f} s':>5}  RSS drift "
            f"{'-' if rss is None else f'{rss / MiB:.2f} MiB':>10}  cycles {run.get('cycles')}"
            + "".join(f"\n    {reason}" for reason in run.get("reasons", [])
                      if run["verdict"] != ("FAIL" if run["leak_mib_per_s"] else "PASS")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", type=int, default=30, help="clean runs (must PASS)")
    parser.add_argument("--leaky", type=int, default=10, help="leaking runs (must FAIL)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run")
    parser.add_argument("--leak-mib", type=float, default=1.0, help="planted leak, MiB/s")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--json", type=Path, help="also write the runs and figures here")
    args = parser.parse_args()
    found = calibrate(args.clean, args.leaky, args.seconds, args.jobs, args.leak_mib)
    print("\n".join(_line(run) for run in found["runs"]))
    print(json.dumps(found["figures"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))
    print("calibration:", "every verdict right" if found["right"] else "WRONG verdicts")
    return 0 if found["right"] else 1


if __name__ == "__main__":
    sys.exit(main())
