"""The long runs of ``rocmforge-raw``: ``demo`` (a seed it prints first, a verdict line last)
and ``soak`` (a planted leak announced before it starts, a verdict the exit status carries).

What they say beside their output (the seed under ``--json``, a planted leak) goes to stderr,
so that ``--json``'s stdout stays one JSON document.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import asdict
from typing import Any

from .shared import emit, note, target, where

#: A seed the demo draws when none is given: short enough to type back.
SEED_BITS = 32


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo: ``seed N (rerun with --seed N)`` first, the summary, then ``demo: OK (...)``
    or ``demo: FAILED: <why>`` (exit status 1)."""
    from ..demo.run import DemoConfig, failures, outcome, run_demo

    if args.transport is not None and not args.disaggregated:
        args.parser.error("--transport goes with --disaggregated, which was not given")
    if args.disaggregated:
        return cmd_demo_disaggregated(args)
    backend, device = target(args)
    seed = _seed(args)
    config = DemoConfig.for_backend(backend, args.scale)
    summary: dict[str, Any] = {}
    try:
        summary = run_demo(backend, device, config, seed)
    except AssertionError as exc:  # a reference check or an invariant of the cache
        found = [str(exc)]
    else:
        found = failures(summary)
    lines = [f"{k:28} {v:.3f}" if isinstance(v, float) else f"{k:28} {v}"
             for k, v in {"where": where(backend, device, args.backend), **summary}.items()]
    return _judged(args, backend, device, seed, summary, found, lines, outcome)


def _judged(args: argparse.Namespace, backend: Any, device: int, seed: int,
            summary: dict[str, Any], found: list[str], lines: list[str],
            outcome: Any) -> int:
    """Emit a demo's ``lines`` and its verdict line, ``demo: OK (<outcome(summary)>)`` or
    ``demo: FAILED: <found>`` (the JSON: the summary, seed, verdict and failures); the exit
    status, 1 on FAILED."""
    verdict = f"demo: FAILED: {'; '.join(found)}" if found else f"demo: OK ({outcome(summary)})"
    result = {"where": where(backend, device, args.backend), "seed": seed, **summary,
              "verdict": "FAILED" if found else "OK", "failures": found}
    emit(args, result, "\n".join([*lines, verdict]))
    return 1 if found else 0


def _seed(args: argparse.Namespace) -> int:
    """``--seed``, or one drawn now; said first (on stderr under ``--json``)."""
    seed: int = args.seed if args.seed is not None else secrets.randbits(SEED_BITS)
    said = f"seed {seed} (rerun with --seed {seed})"
    if args.json:
        note(said)
    else:
        print(said, flush=True)
    return seed


def cmd_demo_disaggregated(args: argparse.Namespace) -> int:
    """``demo --disaggregated``: the seed first, the per-request table, the handoff line,
    then ``demo: OK (...)`` or ``demo: FAILED: <why>`` (exit status 1). A transport that
    cannot run here ends it before anything starts (one line, status 2)."""
    from ..demo.disagg import (
        DisaggConfig,
        check_transport,
        failures,
        outcome,
        report_lines,
        run_disaggregated,
    )
    from ..demo.handoff import HandoffError
    from ..errors import IpcError, TransferError

    transport = args.transport or "ipc"
    backend, device = target(args)
    check_transport(transport, backend)
    seed = _seed(args)
    summary: dict[str, Any] = {}
    try:
        summary = run_disaggregated(backend, device, DisaggConfig.scaled(args.scale), seed,
                                    transport)
    except (HandoffError, TransferError, IpcError) as exc:  # the handoff itself failed
        found = [str(exc)]
    else:
        found = failures(summary)
    lines = [*report_lines(summary), summary["handoff"]] if summary else []
    return _judged(args, backend, device, seed, summary, found, lines, outcome)


def planted(args: argparse.Namespace, backend_name: str) -> list[str]:
    """What the soak's flags plant, said before it starts: a run that must FAIL."""
    from ..soak.run import LEAK_BYTES

    lines = []
    if args.inject_leak:
        memory = "host" if backend_name == "host" else "device"
        lines.append(f"soak: --inject-leak plants a leak: one {LEAK_BYTES // 1024} KiB buffer "
                     f"of {memory} memory kept every cycle until the verdict (the progress "
                     f"says how many MiB a second): this run must FAIL")
    if args.inject_rss_leak_mib:
        lines.append(f"soak: --inject-rss-leak-mib plants a host leak of "
                     f"{args.inject_rss_leak_mib:g} MiB/s that the library does not know of: "
                     f"only the RSS drift can find it; this run must FAIL if that drift passes "
                     f"--max-rss-drift-mib ({args.max_rss_drift_mib:g} MiB)")
    return lines


def cmd_soak(args: argparse.Namespace) -> int:
    from ..soak.run import UNSETTLED, SoakConfig, run_soak

    seconds = args.seconds if args.minutes is None else 60 * args.minutes
    try:
        config = SoakConfig(seconds=seconds, inject_leak=args.inject_leak, out_dir=args.out,
                            leak_bytes_per_s=int((args.inject_rss_leak_mib or 0) * 2**20),
                            workloads=tuple(args.workloads),
                            max_device_drift_bytes=int(args.max_device_drift_mib * 2**20),
                            max_rss_drift_bytes=int(args.max_rss_drift_mib * 2**20))
    except (TypeError, ValueError) as exc:  # a run too short to judge
        args.parser.error(str(exc))
    backend, device = target(args)
    for line in planted(args, backend.name):
        note(line)
    result = run_soak(backend, device, config, args.seed)
    verdict = "not judged" if result.verdict == UNSETTLED else result.verdict
    judged = (f"warm-up {result.warmup_s:.0f} s (until memory settled), then "
              if result.warmup_s is not None else "")
    lines = [f"soak on {where(backend, device, args.backend)} for {seconds:.0f} s: {verdict}",
             f"  cycles {result.cycles}, samples {result.samples}, live buffers "
             f"{result.baseline_live_buffers} -> {result.final_live_buffers}"]
    if result.rss_drift_bytes is not None:
        lines.append(f"  {judged}RSS drift {result.rss_drift_bytes / 2**20:.2f} MiB" + (
            f", device drift {result.device_drift_bytes / 2**20:.2f} MiB"
            if result.device_drift_bytes is not None else ""))
    word = "not judged" if result.verdict == UNSETTLED else "FAIL"
    lines += [*[f"  {word}: {reason}" for reason in result.reasons],
              *[f"  {text}" for text in result.notes],
              *[f"  wrote {path}" for path in result.files.values()]]
    emit(args, {"where": where(backend, device, args.backend), **asdict(result)},
         "\n".join(lines))
    return {"PASS": 0, "FAIL": 1}.get(result.verdict, 2)
