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
import logging
import os
import sys
from typing import Any, NoReturn

from .._version import version
from ..common import progress
from ..common.workers import WorkerError
from ..errors import BackendUnavailableError, KernelNotAvailableError
from ..kernels import module
from ..runtime import BACKEND_NAMES
from ..soak.results import DEFAULT_WORKLOADS, WORKLOADS
from . import flags
from .info import cmd_info
from .runs import cmd_demo, cmd_soak
from .shared import emit, target, where

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

#: Each command and what it does (its help, and the list a bare `rocmforge-raw` shows).
COMMANDS = {
    "info": "backends, devices, code objects, versions, and the next step for this install",
    "demo": "a serving simulation on the best backend, checked against the NumPy reference",
    "bench": "allocation, attention, decode-step and cache benchmarks (all of them without a "
             "selection)",
    "soak": "memory-leak soak: churn, sample, judge the drift",
}

EXAMPLES = {
    "info": "examples:\n  rocmforge-raw info\n  rocmforge-raw info --backend cuda --json",
    "demo": "examples:\n  rocmforge-raw demo\n  rocmforge-raw demo --scale 0.3 --seed 3\n"
            "  rocmforge-raw demo --disaggregated\n"
            "  rocmforge-raw demo --disaggregated --transport mooncake --json\n\n"
            "exit status: 0 OK, 1 FAILED (the last line says why)",
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
                        help="print one JSON document on stdout (progress goes to stderr as plain "
                             "lines, no bars)")
    parser.add_argument("--backend", choices=BACKEND_NAMES,
                        help="force a backend (default: hip, else cuda, else host: the first "
                             "that answers; RF_BACKEND sets it too)")
    parser.add_argument("--device", type=flags.count(0, MAX_DEVICE), default=None,
                        metavar="N",
                        help="device ordinal (default: the backend's current device, 0)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log what happens on stderr (-v: info, -vv: debug; default: "
                             "warnings only)")


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench as cli_bench

    given = [flag for flag, value in (("--transport", args.transport),
                                      ("--from-device", args.from_device)) if value is not None]
    if given and not args.transfer:
        verb = "go" if len(given) > 1 else "goes"
        args.parser.error(f"{' and '.join(given)} {verb} with --transfer, which was not given")
    args.transport = args.transport or "ipc"
    backend, device = target(args)
    if args.transfer:  # before any process starts: an engine that is absent or cannot
        from ..demo.disagg import check_transport  # reach the backend's memory, one line

        check_transport(args.transport, backend)
    if args.from_device is not None:  # a device of the backend, before anything runs
        backend.resolve_device(args.from_device)
    result, lines = cli_bench.run(args, backend, device, where(backend, device, args.backend))
    emit(args, result, "\n".join(lines))
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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")  # none: _bare
    info = _subcommand(commands, "info", COMMANDS["info"])
    info.set_defaults(run=cmd_info)
    demo = _subcommand(commands, "demo", COMMANDS["demo"])
    demo.add_argument("--scale", type=flags.real(above=0.0, at_most=1000.0), default=1.0,
                      help="multiply the request count (in (0, 1000])")
    demo.add_argument("--seed", type=flags.count(0, MAX_SEED), default=None,
                      help="random seed (default: a fresh one each run, printed first: "
                           "--seed N repeats that run)")
    demo.add_argument("--disaggregated", action="store_true",
                      help="instead: a spawned process prefills a small Llama's prompts and "
                           "hands each sequence to this one, which decodes it; logits checked "
                           "against one process, transfer time beside prefill time")
    demo.add_argument("--transport", choices=["ipc", "mooncake"], default=None,
                      help="with --disaggregated: IPC handles (the default) or Mooncake's "
                           "engine (TCP loopback, as between hosts)")
    demo.set_defaults(run=cmd_demo)
    soak = _subcommand(commands, "soak", COMMANDS["soak"])
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
    soak.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                      choices=list(WORKLOADS),
                      help="which churn to run: buffers, the cache under a Scheduler, module "
                           "loads (the default), the host tier's swaps and prefixes, sequence "
                           "transfers between caches, graph replays of mixed steps (a GPU's)")
    soak.add_argument("--max-device-drift-mib", default=1.0,
                      type=flags.real(at_least=0.0, at_most=MAX_DRIFT_MIB),
                      help="FAIL above this drift of the device's used memory after warm-up")
    soak.add_argument("--max-rss-drift-mib", default=8.0,
                      type=flags.real(at_least=0.0, at_most=MAX_DRIFT_MIB),
                      help="FAIL above this drift of the process's RSS after warm-up")
    soak.add_argument("--seed", type=flags.count(0, MAX_SEED), default=None,
                      help="random seed (default: a fresh one each run)")
    soak.set_defaults(run=cmd_soak)
    bench = _subcommand(commands, "bench", COMMANDS["bench"])
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
                       help=f"timed runs per measurement, in [1, {MAX_ITERS}] (--prefill, "
                            "--transfer and --offload take at most 20 and say so; --step and "
                            "--cache time fixed counts)")
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


def _bare(parser: argparse.ArgumentParser) -> int:
    """A bare `rocmforge-raw`: a short usage on stderr that points to --help; status 2, as
    argparse gives any other usage error."""
    width = max(map(len, COMMANDS))
    print(parser.format_usage().rstrip("\n"), "commands:",
          *[f"  {name:{width}}  {what}" for name, what in COMMANDS.items()],
          f"{parser.prog}: no command given: run `{parser.prog} --help` for more, "
          f"`{parser.prog} COMMAND --help` for a command's flags and examples",
          sep="\n", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return _bare(parser)
    _setup_logging(args.verbose)
    progress.set_mode("lines" if args.json else None)  # progress on stderr, never a bar
    try:
        module.kernel_mode()  # RF_KERNELS, checked before any work
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        return int(args.run(args))
    except (BackendUnavailableError, KernelNotAvailableError) as exc:
        args.parser.error(str(exc))  # what is not here: a backend, a device, a code object
    except WorkerError as exc:  # a spawned process failed: its traceback is logged above
        args.parser.error(str(exc))
    except BrokenPipeError:
        return _reader_gone()
    raise AssertionError("unreachable: parser.error exits")


if __name__ == "__main__":
    sys.exit(main())
