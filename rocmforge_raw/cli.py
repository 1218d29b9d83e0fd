"""``rocmforge-raw``: info, demo, bench, soak. Every command takes --json, --backend and
--device.

Every flag is checked when it is parsed (``_flags``); a bad value, a backend that does not
answer or a device it does not have ends the command with one line on stderr and exit status
2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any, NoReturn

from . import _flags as flags
from . import module
from .errors import BackendUnavailableError
from .runtime import BACKEND_NAMES, Backend, available_backends, get_backend


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--backend", choices=BACKEND_NAMES, help="force a backend")
    parser.add_argument("--device", type=flags.count(0), default=None,
                        help="device ordinal (default: the backend's current device, 0)")


def _target(args: argparse.Namespace) -> tuple[Backend, int]:
    """The backend and device the flags name (``BackendUnavailableError`` if absent)."""
    backend = get_backend(args.backend)
    return backend, backend.resolve_device(args.device)


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(json.dumps(result, indent=2, default=str) if args.json else text)


def _versions() -> dict[str, str]:
    found = {}
    for name in ("rocmforge_raw", "numpy", "ml_dtypes", "cffi", "hip-python", "cuda-bindings"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _hip_runtime(hip_python: str) -> tuple[dict[str, Any], list[str]]:
    """The HIP runtime's version and the one hip-python's bindings were generated for (no
    device needed), and a warning when their major.minor differ: the bindings' C layer (the
    allocation and launch fast paths use it) then follows another HIP's headers."""
    try:
        from .runtime.hip import versions
    except BackendUnavailableError as exc:  # hip-python is not installed
        return {"runtime": None, "driver": None, "bindings": None, "error": str(exc)}, []
    found = versions()
    runtime, bindings = found["runtime"], found["bindings"]
    if runtime is None or bindings is None or \
            runtime.split(".")[:2] == bindings.split(".")[:2]:
        return found, []
    return found, [f"hip-python {hip_python} was generated for HIP {bindings} but the HIP "
                   f"runtime is {runtime}: install the hip-python release of the installed "
                   f"ROCm, or the ROCm these bindings were made for"]


def cmd_info(args: argparse.Namespace) -> int:
    backends = available_backends()
    chosen = _target(args) if args.device is not None else None  # checks --device
    devices = []
    for name, status in backends.items():
        if status != "ok" or (args.backend and name != args.backend):
            continue
        backend = get_backend(name)
        for i in range(backend.device_count()):
            if chosen is not None and (backend, i) != chosen:
                continue
            props = backend.properties(i)
            objects = sorted(p.name for p in module.KERNEL_DIR.glob(f"*.{props.arch}.*"))
            devices.append({"backend": name, "index": i, "name": props.name,
                            "arch": props.arch, "total_bytes": props.total_bytes,
                            "multiprocessors": props.multiprocessors, "code_objects": objects})
    all_objects = sorted(p.name for p in module.KERNEL_DIR.iterdir()
                         if p.suffix in (".hsaco", ".cubin", ".ptx"))
    versions = _versions()
    hip_runtime, warnings = _hip_runtime(versions["hip-python"])
    result = {"backends": backends, "default": get_backend(args.backend).name,
              "devices": devices, "code_objects": all_objects, "versions": versions,
              "hip_runtime": hip_runtime, "warnings": warnings}
    lines = ["backends:"] + [f"  {n:5} {s}" for n, s in backends.items()]
    lines += [f"default backend: {result['default']}", "devices:"]
    lines += [f"  {d['backend']}:{d['index']} {d['name']} ({d['arch']}, "
              f"{d['total_bytes'] / 2**30:.1f} GiB, {d['multiprocessors']} units), "
              f"{len(d['code_objects'])} code objects" for d in devices]
    lines += [f"code objects built: {len(all_objects)} in {module.KERNEL_DIR}", "versions:"]
    lines += [f"  {k} {v}" for k, v in result["versions"].items()]
    lines.append(f"HIP runtime {hip_runtime['runtime'] or 'not loaded'} (driver "
                 f"{hip_runtime['driver'] or '-'}), hip-python bindings for HIP "
                 f"{hip_runtime['bindings'] or '-'}"
                 + (f": {hip_runtime['error']}" if hip_runtime["error"] else ""))
    lines += [f"warning: {w}" for w in warnings]
    _emit(args, result, "\n".join(lines))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    backend, device = _target(args)
    config = DemoConfig.for_backend(backend, args.scale)
    result = run_demo(backend, device, config, args.seed, progress=not args.json)
    lines = [f"{k:28} {v:.3f}" if isinstance(v, float) else f"{k:28} {v}"
             for k, v in result.items()]
    _emit(args, result, "\n".join(lines))
    return 0 if result["live_buffers_after_teardown"] == 0 else 1


def cmd_soak(args: argparse.Namespace) -> int:
    from .soak import SoakConfig, run_soak

    seconds = args.seconds if args.minutes is None else 60 * args.minutes
    try:
        config = SoakConfig(seconds=seconds, inject_leak=args.inject_leak, out_dir=args.out,
                            warmup_fraction=args.warmup, workloads=tuple(args.workloads),
                            max_device_drift_bytes=int(args.max_device_drift_mib * 2**20),
                            max_rss_drift_bytes=int(args.max_rss_drift_mib * 2**20))
    except ValueError as exc:  # a run too short to judge
        args.parser.error(str(exc))
    backend, device = _target(args)
    result = run_soak(backend, device, config, args.seed)
    verdict = "PASS" if result.passed else "FAIL"
    lines = [f"soak on {backend.name}:{device} for {seconds:.0f} s: {verdict}",
             f"  cycles {result.cycles}, samples {result.samples}, live buffers "
             f"{result.baseline_live_buffers} -> {result.final_live_buffers}",
             f"  RSS drift {result.rss_drift_bytes / 2**20:.2f} MiB" + (
                 f", device drift {result.device_drift_bytes / 2**20:.2f} MiB"
                 if result.device_drift_bytes is not None else ""),
             *[f"  FAIL: {reason}" for reason in result.reasons],
             *[f"  wrote {path}" for path in result.files.values()]]
    from dataclasses import asdict

    _emit(args, asdict(result), "\n".join(lines))
    return 0 if result.passed else 1


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _attention_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per attention row: time, bandwidth, % of copy and of read (with targets; an
    fp8 row gives its time over its 16-bit shape's instead)."""
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'shape':{width}} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'% read':>7} "
             f"{'target':>7} {'host us':>8}"]
    for r in rows:
        target = (f"{r['read_target_pct']:6}%" if r["read_target_pct"] is not None else
                  f"x{r['time_vs_16bit']:.2f}t" if r.get("time_vs_16bit") else "      -")
        lines.append(f"{r['name']:{width}} {r['ms']:8.3f} {r['gb_per_s']:8.0f} "
                     f"{r['pct_of_copy']:6.1f}% {r['pct_of_read']:6.1f}% {target:>7} "
                     f"{r['host_us']:8.1f}")
    return lines


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    backend, device = _target(args)
    args.attention = args.attention or args.sweep
    everything = not (args.alloc or args.attention or args.cache or args.step or args.transfer)
    result: dict[str, Any] = {"backend": backend.name,
                              "device": backend.properties(device).name}
    lines = [f"device: {backend.name}:{device} {result['device']}"]
    if args.alloc or everything:
        rows = result["alloc"] = bench.bench_alloc(backend, device, args.iters * 40)
        lines.append(f"{'bytes':>10} {'bare us':>9} {'C us':>9} {'raw us':>9} {'raw/bare':>9} "
                     f"{'pooled us':>10} {'pool a+f us':>12} {'cupy pool us':>13}")
        lines += [f"{r['bytes']:>10} {r['bare_us']:9.2f} {r['c_us']:9.2f} {r['raw_us']:9.2f} "
                  f"{r['raw_over_bare']:9.2f} {r['pooled_us']:10.2f} "
                  f"{r['pool_allocate_free_us']:12.2f} {_us(r['cupy_pooled_us']):>13}"
                  for r in rows]
    if (args.attention or everything) and backend.name != "host":
        copy = result["copy_gb_per_s"] = bench.copy_bandwidth(backend, device)
        read = result["read_gb_per_s"] = bench.read_bandwidth(backend, device)
        rows = result["attention"] = bench.bench_attention(
            backend, device, copy, args.iters, bench.SHAPES + bench.FP8_SHAPES, read_gbs=read)
        lines.append(f"copy bandwidth: {copy:.0f} GB/s (read + write, 1 GiB device copy); "
                     f"read bandwidth: {read:.0f} GB/s (1 GiB read-only)")
        lines += _attention_table(rows)
        if args.sweep:
            rows = result["sweep"] = bench.bench_attention(
                backend, device, copy, args.iters, bench.sweep_shapes(), read_gbs=read)
            lines.append("sweep: bf16, 8 kv heads, q heads = 8 x GQA ratio")
            lines += _attention_table(rows)
    elif args.attention:
        lines.append("attention bench needs a GPU backend (host runs the NumPy reference)")
    if (args.step or everything) and backend.name != "host":
        from .bench_step import STEP_SHAPES, bench_step

        rows = result["step"] = [bench_step(backend, device, shape) for shape in STEP_SHAPES]
        lines.append(f"decode step, {STEP_SHAPES[0].layers} layers, bf16, 32/8 heads, head_dim "
                     f"128, block 16 (targets: step <= 1.05 x kernels, <= 10 us host per call)")
        lines.append(f"{'batch x ctx':>12} {'step ms':>8} {'kernels ms':>10} {'ratio':>6} "
                     f"{'append us':>9} {'batch us':>8} {'write us':>8} {'attn us':>8}")
        lines += [f"{r['batch']:>5} x {r['context']:<5} {r['step_ms']:8.3f} "
                  f"{r['kernels_ms']:10.3f} {r['step_over_kernels']:6.3f} "
                  f"{r['append_host_us']:9.1f} {r['batch_host_us']:8.1f} "
                  f"{r['write_host_us']:8.2f} {r['attention_host_us']:8.2f}" for r in rows]
    elif args.step:
        lines.append("step bench needs a GPU backend (host runs the NumPy reference)")
    if args.cache or everything:
        row = result["cache"] = bench.bench_cache()
        lines.append(f"cache decode step ({row['num_seqs']} seqs x ~{row['context']} tokens, "
                     f"block {row['block_size']}): median {row['median_us']:.1f} us, "
                     f"p90 {row['p90_us']:.1f} us (target {row['target_us']:.0f} us)")
    if args.transfer:
        from .bench_transfer import bench_transfer

        rows = result["transfer"] = bench_transfer(backend, device, args.transport,
                                                   min(args.iters, 20))
        lines.append(f"a sequence's KV between two processes over {args.transport} "
                     "(median; copy: the same bytes through the same copy engine)")
        lines.append(f"{'blocks':>11} {'MiB':>7} {'spans':>6} {'transfer GB/s':>14} "
                     f"{'import GB/s':>12} {'copy GB/s':>10} {'% copy':>7}")
        lines += [f"{r['layout']:>11} {r['bytes'] / 2**20:7.0f} {r['spans']:6} "
                  f"{r['transfer_gb_per_s']:14.2f} {r['import_gb_per_s']:12.2f} "
                  f"{r['copy_gb_per_s']:10.2f} {r['pct_of_copy']:6.1f}%" for r in rows]
    _emit(args, result, "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="rocmforge-raw", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backends, devices, code objects, versions")
    _common(info)
    info.set_defaults(run=cmd_info)
    demo = commands.add_parser("demo", help="run the demo on the best backend")
    _common(demo)
    demo.add_argument("--scale", type=flags.real(above=0.0, at_most=1000.0), default=1.0,
                      help="multiply the request count (in (0, 1000])")
    demo.add_argument("--seed", type=flags.count(0), default=None)
    demo.set_defaults(run=cmd_demo)
    soak = commands.add_parser("soak", help="memory-leak soak: churn, sample, judge drift")
    _common(soak)
    soak.add_argument("--seconds", type=flags.real(above=0.0), default=60.0)
    soak.add_argument("--minutes", type=flags.real(above=0.0), default=None)
    soak.add_argument("--out", type=flags.out_dir, default="soak-out",
                      help="folder for soak.csv/json/png")
    soak.add_argument("--inject-leak", action="store_true", help="leak one buffer per cycle")
    soak.add_argument("--workloads", nargs="+", default=["buffers", "cache", "modules"],
                      choices=["buffers", "cache", "modules"],
                      help="which churn to run (buffers, cache, modules)")
    soak.add_argument("--warmup", type=flags.real(at_least=0.0, below=1.0), default=0.25,
                      help="fraction of the run left out of the drift fit, in [0, 1)")
    soak.add_argument("--max-device-drift-mib", type=flags.real(at_least=0.0), default=1.0)
    soak.add_argument("--max-rss-drift-mib", type=flags.real(at_least=0.0), default=8.0)
    soak.add_argument("--seed", type=flags.count(0), default=None)
    soak.set_defaults(run=cmd_soak)
    bench = commands.add_parser("bench", help="allocation, attention and cache benchmarks")
    _common(bench)
    bench.add_argument("--alloc", action="store_true", help="alloc+free round trips")
    bench.add_argument("--attention", action="store_true", help="paged attention vs copy BW")
    bench.add_argument("--sweep", action="store_true",
                       help="with --attention: head_dim x GQA x block x batch shapes (GPU)")
    bench.add_argument("--cache", action="store_true", help="KV cache decode step (CPU)")
    bench.add_argument("--step", action="store_true",
                       help="a whole decode step through the cache's API (GPU)")
    bench.add_argument("--transfer", action="store_true",
                       help="a sequence's KV between two processes vs the copy bandwidth")
    bench.add_argument("--transport", choices=["ipc", "mooncake"], default="ipc",
                       help="with --transfer: IPC handles or Mooncake's engine (TCP loopback)")
    bench.add_argument("--iters", type=flags.count(1), default=50,
                       help="timed runs per measurement (>= 1)")
    bench.set_defaults(run=cmd_bench)
    args = parser.parse_args(argv)
    args.parser = commands.choices[args.command]
    try:
        return args.run(args)
    except BackendUnavailableError as exc:  # --backend or --device names what is not here
        args.parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
