"""``rocmforge-raw``: info, demo, bench, soak. Every command takes --json, --backend, --device
and -v.

Every flag is checked when it is parsed (``_flags``), and ``RF_KERNELS`` before any command
runs; a bad value, a backend that does not answer, a device it does not have or a kernel with
neither a code object nor a run-time compiler ends the command with one line on stderr (which
says how to get what is missing) and exit status 2, never a traceback. A reader that stops
early (``soak --json | head -5``) ends the command quietly with status 141 (128 + SIGPIPE).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import metadata
from typing import Any, NoReturn

from .._version import version
from ..common import progress
from ..errors import BackendUnavailableError, KernelNotAvailableError
from ..kernels import module
from ..runtime import BACKEND_NAMES, Backend, available_backends, get_backend
from . import flags

#: The bounds of the flags: a run of at most a week, drift thresholds up to 1 TiB, a planted
#: leak of at most 1 GiB/s, devices and seeds as the runtime and NumPy take them, at most
#: 100 000 timed runs a measurement.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_DRIFT_MIB = float(1 << 20)
MAX_DEVICE = (1 << 31) - 1
MAX_SEED = (1 << 64) - 1
MAX_ITERS = 100_000
MAX_LEAK_MIB_PER_S = 1024.0

DESCRIPTION = """\
Torch-free GPU memory and a paged KV cache on the hip (AMD), cuda (NVIDIA) or host (CPU)
backend. Run `rocmforge-raw COMMAND --help` for a command's flags and examples."""

EXAMPLES = {
    "info": "examples:\n  rocmforge-raw info\n  rocmforge-raw info --backend cuda --json",
    "demo": "examples:\n  rocmforge-raw demo\n  rocmforge-raw demo --scale 0.3 --seed 3",
    "bench": "examples:\n  rocmforge-raw bench --cache\n  rocmforge-raw bench --attention "
             "--sweep --json > sweep.json\n  rocmforge-raw bench --step --iters 20\n"
             "  rocmforge-raw bench --prefill --json\n"
             "  rocmforge-raw bench --offload --json",
    "soak": "examples:\n  rocmforge-raw soak                      # 60 s, files in soak-out/\n"
            "  rocmforge-raw soak --minutes 10 --out /tmp/soak\n"
            "  rocmforge-raw soak --seconds 30 --inject-leak   # must FAIL\n\n"
            "exit status: 0 PASS, 1 FAIL, 2 not judged (memory never settled: run longer)",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that keeps the description's and examples' lines and shows each flag's default
    (unless its help already speaks of it, or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or \
                action.option_strings == [] or isinstance(action.default, bool):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (and no progress bars)")
    parser.add_argument("--backend", choices=BACKEND_NAMES,
                        help="force a backend (default: hip, else cuda, else host: the first "
                             "that answers; RF_BACKEND sets it too)")
    parser.add_argument("--device", type=flags.count(0, MAX_DEVICE), default=None,
                        metavar="N",
                        help="device ordinal (default: the backend's current device, 0)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log what happens on stderr (-v: info, -vv: debug; default: "
                             "warnings only)")


def _target(args: argparse.Namespace) -> tuple[Backend, int]:
    """The backend and device the flags name (``BackendUnavailableError`` if absent)."""
    backend = get_backend(args.backend)
    return backend, backend.resolve_device(args.device)


def where(backend: Backend, device: int, forced: str | None) -> str:
    """The target as output names it: ``cuda:0``, or the host backend and why it runs (no GPU
    answered, or what forced it), so that host figures are never read as a GPU's."""
    if backend.name != "host":
        return f"{backend.name}:{device}"
    if forced == "host":
        return "host backend (--backend host)"
    chosen = os.environ.get("RF_BACKEND", "").strip()
    return f"host backend (RF_BACKEND={chosen})" if chosen else "host backend (no GPU answered)"


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    sys.stdout.flush()  # a reader that went away is found here, inside main's handler


def _versions() -> dict[str, str]:
    found = {}
    for name in ("rocmforge_raw", "numpy", "ml_dtypes", "cffi", "tqdm", "hip-python",
                 "cuda-bindings"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _code_objects(pattern: str = "*") -> list[str]:
    """Names of the packaged code objects matching ``pattern`` (none in a source install
    that was not built with `make kernels`)."""
    return sorted(p.name for p in module.KERNEL_DIR.glob(pattern)
                  if p.suffix in (".hsaco", ".cubin", ".ptx"))


def cmd_info(args: argparse.Namespace) -> int:
    from .hipinfo import hip_runtime

    backends = available_backends()
    chosen = _target(args) if args.device is not None else None  # checks --device
    devices: list[dict[str, Any]] = []
    for name, status in backends.items():
        if status != "ok" or (args.backend and name != args.backend):
            continue
        backend = get_backend(name)
        for i in range(backend.device_count()):
            if chosen is not None and (backend, i) != chosen:
                continue
            props = backend.properties(i)
            devices.append({"backend": name, "index": i, "name": props.name,
                            "arch": props.arch, "total_bytes": props.total_bytes,
                            "multiprocessors": props.multiprocessors,
                            "code_objects": _code_objects(f"*.{props.arch}.*")})
    all_objects = _code_objects()
    versions = _versions()
    hip, warnings = hip_runtime(versions["hip-python"])
    default = get_backend(args.backend)
    result = {"backends": backends, "default": default.name,
              "default_where": where(default, 0, args.backend), "devices": devices,
              "code_objects": all_objects, "code_objects_note": module.missing_objects_note(),
              "versions": versions, "hip_runtime": hip, "warnings": warnings}
    lines = ["backends:"] + [f"  {n:5} {s}" for n, s in backends.items()]
    lines += [f"default backend: {result['default_where']}", "devices:"]
    lines += [f"  {d['backend']}:{d['index']} {d['name']} ({d['arch']}, "
              f"{d['total_bytes'] / 2**30:.1f} GiB, {d['multiprocessors']} units), "
              f"{len(d['code_objects'])} code objects" for d in devices]
    lines.append(f"code objects built: {len(all_objects)} in {module.KERNEL_DIR}")
    if result["code_objects_note"]:
        lines.append(f"  {result['code_objects_note']}")
    lines += ["versions:"] + [f"  {k} {v}" for k, v in versions.items()]
    lines.append(f"HIP runtime {hip['runtime'] or 'not loaded'} (driver "
                 f"{hip['driver'] or '-'}), hip-python bindings for HIP {hip['bindings'] or '-'}"
                 + (f": {hip['error']}" if hip["error"] else ""))
    lines += [f"warning: {w}" for w in warnings]
    _emit(args, result, "\n".join(lines))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.run import DemoConfig, run_demo

    backend, device = _target(args)
    config = DemoConfig.for_backend(backend, args.scale)
    result = {"where": where(backend, device, args.backend),
              **run_demo(backend, device, config, args.seed)}
    lines = [f"{k:28} {v:.3f}" if isinstance(v, float) else f"{k:28} {v}"
             for k, v in result.items()]
    _emit(args, result, "\n".join(lines))
    return 0 if result["live_buffers_after_teardown"] == 0 else 1


def cmd_soak(args: argparse.Namespace) -> int:
    from dataclasses import asdict

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
    backend, device = _target(args)
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
              *[f"  {note}" for note in result.notes],
              *[f"  wrote {path}" for path in result.files.values()]]
    _emit(args, {"where": where(backend, device, args.backend), **asdict(result)},
          "\n".join(lines))
    return {"PASS": 0, "FAIL": 1}.get(result.verdict, 2)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench as cli_bench

    given = [flag for flag, value in (("--transport", args.transport),
                                      ("--from-device", args.from_device)) if value is not None]
    if given and not args.transfer:
        verb = "go" if len(given) > 1 else "goes"
        args.parser.error(f"{' and '.join(given)} {verb} with --transfer, which was not given")
    args.transport = args.transport or "ipc"
    if args.transfer and args.transport == "mooncake":  # before any process starts
        from ..transport.mooncake import engine_class

        engine_class()
    backend, device = _target(args)
    if args.from_device is not None:  # a device of the backend, before anything runs
        backend.resolve_device(args.from_device)
    result, lines = cli_bench.run(args, backend, device, where(backend, device, args.backend))
    _emit(args, result, "\n".join(lines))
    return 0


def _subcommand(commands: Any, name: str, help: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=help, epilog=EXAMPLES[name], formatter_class=_Formatter)
    _common(parser)
    parser.set_defaults(parser=parser)  # its own errors name the command
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rocmforge-raw", description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = _subcommand(commands, "info", "backends, devices, code objects, versions")
    info.set_defaults(run=cmd_info)
    demo = _subcommand(commands, "demo", "a serving simulation on the best backend")
    demo.add_argument("--scale", type=flags.real(above=0.0, at_most=1000.0), default=1.0,
                      help="multiply the request count (in (0, 1000])")
    demo.add_argument("--seed", type=flags.count(0, MAX_SEED), default=None,
                      help="random seed (default: a fresh one each run)")
    demo.set_defaults(run=cmd_demo)
    soak = _subcommand(commands, "soak", "memory-leak soak: churn, sample, judge the drift")
    soak.add_argument("--seconds", type=flags.real(above=0.0, at_most=MAX_SECONDS),
                      default=60.0,
                      help="how long to churn (10 at least: the drift fit needs 10 samples "
                           "after memory settles)")
    soak.add_argument("--minutes", type=flags.real(above=0.0, at_most=MAX_SECONDS / 60),
                      default=None,
                      help="how long to churn, in minutes (replaces --seconds)")
    soak.add_argument("--out", type=flags.out_dir, default="soak-out",
                      help="folder for soak.csv, soak.json and soak.png")
    soak.add_argument("--inject-leak", action="store_true",
                      help="keep one 64 KiB buffer per cycle (the run must FAIL)")
    soak.add_argument("--inject-rss-leak-mib", default=None,
                      type=flags.real(at_least=0.0, at_most=MAX_LEAK_MIB_PER_S),
                      metavar="MIB_PER_S",
                      help="keep this many MiB of host memory per second, unknown to the "
                           "library (only the RSS drift can find it: a calibration)")
    soak.add_argument("--workloads", nargs="+", default=["buffers", "cache", "modules"],
                      choices=["buffers", "cache", "modules"],
                      help="which churn to run (default: all three)")
    soak.add_argument("--max-device-drift-mib", default=1.0,
                      type=flags.real(at_least=0.0, at_most=MAX_DRIFT_MIB),
                      help="FAIL above this drift of the device's used memory after warm-up")
    soak.add_argument("--max-rss-drift-mib", default=8.0,
                      type=flags.real(at_least=0.0, at_most=MAX_DRIFT_MIB),
                      help="FAIL above this drift of the process's RSS after warm-up")
    soak.add_argument("--seed", type=flags.count(0, MAX_SEED), default=None,
                      help="random seed (default: a fresh one each run)")
    soak.set_defaults(run=cmd_soak)
    bench = _subcommand(commands, "bench", "allocation, attention, decode-step and cache "
                        "benchmarks (all of them without a selection)")
    bench.add_argument("--alloc", action="store_true", help="alloc+free round trips")
    bench.add_argument("--attention", action="store_true", help="paged attention vs copy BW "
                       "(GPU)")
    bench.add_argument("--sweep", action="store_true",
                       help="with --attention: head_dim x GQA x block x batch shapes (GPU)")
    bench.add_argument("--cache", action="store_true", help="KV cache decode step (CPU)")
    bench.add_argument("--step", action="store_true",
                       help="a whole decode step through the cache's API (GPU)")
    bench.add_argument("--prefill", action="store_true",
                       help="attention over many query tokens a sequence: prefill, chunks, "
                            "prefix hits, speculative verify, mixed steps (GPU)")
    bench.add_argument("--transfer", action="store_true",
                       help="a sequence's KV between two processes vs the copy bandwidth")
    bench.add_argument("--offload", action="store_true",
                       help="swapping a sequence to the host tier and back vs pinned copies")
    bench.add_argument("--transport", choices=["ipc", "mooncake"], default=None,
                       help="with --transfer: IPC handles (the default) or Mooncake's engine "
                            "(TCP loopback)")
    bench.add_argument("--from-device", type=flags.count(0, MAX_DEVICE), default=None,
                       metavar="N",
                       help="with --transfer: the sender's device (default: --device); "
                            "another device adds peer copies and in-process peer rows")
    bench.add_argument("--iters", type=flags.count(1, MAX_ITERS), default=50,
                       help=f"timed runs per measurement, in [1, {MAX_ITERS}]")
    bench.set_defaults(run=cmd_bench)
    return parser


def _setup_logging(verbosity: int) -> None:
    """Log records of this package on stderr: warnings always, info with -v, debug with -vv."""
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("rocmforge_raw")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _reader_gone() -> int:
    """stdout's reader went away (``| head``): point stdout at /dev/null so the interpreter's
    last flush has nowhere to fail, and end as a process killed by SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    progress.set_enabled(False if args.json else None)
    try:
        module.kernel_mode()  # RF_KERNELS, checked before any work
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        return int(args.run(args))
    except (BackendUnavailableError, KernelNotAvailableError) as exc:
        args.parser.error(str(exc))  # what is not here: a backend, a device, a code object
    except BrokenPipeError:
        return _reader_gone()
    raise AssertionError("unreachable: parser.error exits")


if __name__ == "__main__":
    sys.exit(main())
