"""``rocmforge-raw``: info, demo, bench (and soak). Every command takes --json, --backend and
--device."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any

import numpy as np

from . import module
from .buffer import HipBuffer, memory_stats
from .runtime import BACKEND_NAMES, available_backends, get_backend


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--backend", choices=BACKEND_NAMES, help="force a backend")
    parser.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")


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


def cmd_info(args: argparse.Namespace) -> int:
    backends = available_backends()
    devices = []
    for name, status in backends.items():
        if status != "ok" or (args.backend and name != args.backend):
            continue
        backend = get_backend(name)
        for i in range(backend.device_count()):
            props = backend.properties(i)
            objects = sorted(p.name for p in module.KERNEL_DIR.glob(f"*.{props.arch}.*"))
            devices.append({"backend": name, "index": i, "name": props.name,
                            "arch": props.arch, "total_bytes": props.total_bytes,
                            "multiprocessors": props.multiprocessors, "code_objects": objects})
    all_objects = sorted(p.name for p in module.KERNEL_DIR.iterdir()
                         if p.suffix in (".hsaco", ".cubin", ".ptx"))
    result = {"backends": backends, "default": get_backend(args.backend).name,
              "devices": devices, "code_objects": all_objects, "versions": _versions()}
    lines = ["backends:"] + [f"  {n:5} {s}" for n, s in backends.items()]
    lines += [f"default backend: {result['default']}", "devices:"]
    lines += [f"  {d['backend']}:{d['index']} {d['name']} ({d['arch']}, "
              f"{d['total_bytes'] / 2**30:.1f} GiB, {d['multiprocessors']} units), "
              f"{len(d['code_objects'])} code objects" for d in devices]
    lines += [f"code objects built: {len(all_objects)} in {module.KERNEL_DIR}", "versions:"]
    lines += [f"  {k} {v}" for k, v in result["versions"].items()]
    _emit(args, result, "\n".join(lines))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Until the serving simulation lands: a HipBuffer round trip on the chosen backend."""
    backend = get_backend(args.backend)
    rng = np.random.default_rng()
    data = rng.standard_normal(1 << 20).astype(np.float32)
    with HipBuffer.from_numpy(data, args.device, backend) as buf:
        ok = bool(np.array_equal(buf.to_numpy(np.float32), data))
    result = {"backend": backend.name, "device": args.device, "round_trip_ok": ok,
              "memory": memory_stats()}
    _emit(args, result, f"{backend.name}:{args.device} round trip of {data.nbytes} bytes: "
          f"{'ok' if ok else 'MISMATCH'}; live buffers after: {memory_stats()['live_buffers']}")
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    backend = get_backend(args.backend)
    everything = not (args.alloc or args.attention or args.cache)
    result: dict[str, Any] = {"backend": backend.name,
                              "device": backend.properties(args.device).name}
    lines = [f"device: {backend.name}:{args.device} {result['device']}"]
    if args.alloc or everything:
        rows = result["alloc"] = bench.bench_alloc(backend, args.device, args.iters * 40)
        lines.append(f"{'bytes':>10} {'bare us':>9} {'raw us':>9} {'raw/bare':>9} "
                     f"{'pooled us':>10} {'pool a+f us':>12}")
        lines += [f"{r['bytes']:>10} {r['bare_us']:9.2f} {r['raw_us']:9.2f} "
                  f"{r['raw_over_bare']:9.2f} {r['pooled_us']:10.2f} "
                  f"{r['pool_allocate_free_us']:12.2f}" for r in rows]
    if (args.attention or everything) and backend.name != "host":
        copy = result["copy_gb_per_s"] = bench.copy_bandwidth(backend, args.device)
        rows = result["attention"] = bench.bench_attention(backend, args.device, copy, args.iters)
        lines.append(f"copy bandwidth: {copy:.0f} GB/s (read + write, 1 GiB device copy)")
        lines.append(f"{'shape':5} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'target':>7}")
        lines += [f"{r['name']:5} {r['ms']:8.3f} {r['gb_per_s']:8.0f} {r['pct_of_copy']:6.1f}% "
                  f"{r['target_pct']:6}%" for r in rows]
    elif args.attention:
        lines.append("attention bench needs a GPU backend (host runs the NumPy reference)")
    if args.cache or everything:
        row = result["cache"] = bench.bench_cache()
        lines.append(f"cache decode step ({row['num_seqs']} seqs x ~{row['context']} tokens, "
                     f"block {row['block_size']}): median {row['median_us']:.1f} us, "
                     f"p90 {row['p90_us']:.1f} us (target {row['target_us']:.0f} us)")
    _emit(args, result, "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rocmforge-raw", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backends, devices, code objects, versions")
    _common(info)
    info.set_defaults(run=cmd_info)
    demo = commands.add_parser("demo", help="run the demo on the best backend")
    _common(demo)
    demo.set_defaults(run=cmd_demo)
    bench = commands.add_parser("bench", help="allocation, attention and cache benchmarks")
    _common(bench)
    bench.add_argument("--alloc", action="store_true", help="alloc+free round trips")
    bench.add_argument("--attention", action="store_true", help="paged attention vs copy BW")
    bench.add_argument("--cache", action="store_true", help="KV cache decode step (CPU)")
    bench.add_argument("--iters", type=int, default=50, help="timed runs per measurement")
    bench.set_defaults(run=cmd_bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
