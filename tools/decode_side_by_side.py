"""Our decode beside FlashInfer's decode wrapper and its XQA decode, on the same K/V memory.

The README's decode comparison, reproducible from the repository.

Rows are the bench's shapes (``rocmforge_raw.bench``): by default S1-S6 and EXTRA_ROWS, the
sweep rows the comparison adds; ``--shapes`` picks any bench or sweep names, ``--sweep`` adds
every sweep row, ``--window`` the sliding-window rows W1 and W2 (each query attends to its
last 4096 of 32768 tokens; bytes the window's). Caches of the shape's 16-bit type, or with
``--fp8`` e4m3fn codes (the bench's fp8 rows) read with the per-tensor scales FP8_SCALES by
every kernel. Inputs are the bench's (``bench.row_inputs``): random values, pages in random
order (an fp8 row the very lengths and pages of its 16-bit row).

K/V/q live in DeviceArrays; FlashInfer reads them through torch.from_dlpack (zero copy, HND;
an fp8 cache as its bytes viewed as torch.float8_e4m3fn). Every kernel is timed as the bench
times ours (``bench.time_ms``: device time between events, each run queued behind a hold
kernel so the host's enqueue stays out; warm-up, then the median of ``--iters`` runs):
- ours: ``bench.AttentionLaunch``, the launch a decode step makes per layer (planned and
  uploaded once; unit scales). An fp8 row's scales are two float arguments of the same kernel
  and plan, so the output checked is ``ops.paged_attention``'s with the scales, and the
  launch's output is checked against the op's at unit scales.
- wrapper: ``BatchDecodeWithPagedKVCacheWrapper``, planned once, the faster of its CUDA-core
  and tensor-core kernels; checked with v_scale, timed without its v_scale multiply (a
  separate kernel after attention; ours and XQA fold v_scale into theirs).
- xqa: ``flashinfer.decode.xqa_batch_decode_with_kv_cache`` (TensorRT-LLM's XQA, SM90 and
  later; fp8 caches in fp8 math), scales folded into bmm1/bmm2; skipped, with the reason,
  where this FlashInfer or GPU has none.
FlashInfer's side is tools/flashinfer_decode.py, imported from beside this file. A window
row plans the wrapper and calls XQA with ``window_left = window - 1``: FlashInfer counts the
keys left of the query, ours the query's own too. One key of 4096 more or fewer moves a bf16
output by about 1.4 % (the NumPy reference, 4 x 8192 tokens), inside the tolerance, so each
FlashInfer output of a window row must also lie nearer ours at the window than ours one token
shorter or longer (``*_window``: the window, in tokens, it lies nearest).

On the GPU machine, from the project root, with FlashInfer's wheels in .whl/
(../shared/device/flashinfer.sh) and the cubins in place:
    source tools/device_setup.sh && python3 tools/decode_side_by_side.py [--fp8] [--json]
(``--shapes W1,W2`` or ``--window``: the window rows).
The first run JIT-compiles FlashInfer's kernels (minutes; ~/.cache/flashinfer keeps them
while the machine is held: ``--shapes`` compiles a few rows at a time). Exit status 1 when an
output disagrees with ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

# FlashInfer's side, beside this file (run as tools/decode_side_by_side.py)
from flashinfer_decode import (
    DEVICE,
    find_xqa,
    relative_diff,
    run_wrapper,
    run_xqa,
    time_us,
    torch_view,
)

import rocmforge_raw
from rocmforge_raw import bench, ops
from rocmforge_raw.runtime import get_backend

#: The sweep rows the comparison adds to S1-S6: head_dim 64 at 8 x 16384, where both
#: kernels read below 88 % of copy (native/NOTES.md v31).
EXTRA_ROWS = ("d64-r4-b16-8x16384", "d64-r8-b16-8x16384", "d64-r8-b32-8x16384")
#: (k_scale, v_scale) of an fp8 row: K = code x k_scale, V = code x v_scale.
FP8_SCALES = (0.75, 1.5)
#: The largest relative difference (Frobenius norm) from ours: the decode GPU tests'
#: tolerances against float64 (tests/test_ops.py, test_fp8.py). XQA over fp8 also rounds q
#: and the softmax weights to e4m3: test_fp8's tolerance for quantized results.
TOLERANCE = {"f16": 1e-2, "bf16": 2e-2}
XQA_FP8_TOLERANCE = 0.06
WORKSPACE_BYTES = 256 << 20
LEGEND = """\
ours: bench.AttentionLaunch (a decode step's launch per layer); wrapper: FlashInfer's
BatchDecodeWithPagedKVCacheWrapper, its faster kernel (cc: CUDA cores, tc: tensor cores);
xqa: FlashInfer's XQA decode. us: median device time. ours/x > 1: ours is slower. % copy: the
row's bytes (K and V once per kv-head group, plus q and out) a second, over the device copy
bandwidth measured in this run (W rows: the window's K and V). check: every output within
tolerance of ours (relative Frobenius norm: f16 1e-2, bf16 2e-2, XQA over fp8 0.06); on a W
row also nearer ours at its window than at one token more or fewer."""
COLUMNS = (("shape", 22), ("ours us", 9), ("wrapper us", 13), ("xqa us", 9),
           ("ours/wrapper", 12), ("ours/xqa", 9), ("ours % copy", 11), ("wrapper %", 9),
           ("xqa %", 7), ("check", 8))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[bench.Shape]]:
    """The options and the rows they select; argument errors exit with status 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=LEGEND,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help="comma-separated bench names (S1, S1-fp8, W1, sweep "
                        "rows such as d64-r8-b16-8x16384); default: S1-S6 and "
                        + ", ".join(EXTRA_ROWS))
    parser.add_argument("--sweep", action="store_true", help="add every sweep row")
    parser.add_argument("--window", action="store_true", help="add the sliding-window rows "
                        "(" + ", ".join(s.name for s in bench.WINDOW_SHAPES) + ")")
    parser.add_argument("--fp8", action="store_true",
                        help=f"e4m3fn caches, k_scale {FP8_SCALES[0]:g} and v_scale "
                        f"{FP8_SCALES[1]:g}")
    parser.add_argument("--iters", type=int, default=50, help="timed runs a median")
    parser.add_argument("--xqa", action=argparse.BooleanOptionalAction, default=True,
                        help="run FlashInfer's XQA decode too")
    parser.add_argument("--json", action="store_true", help="JSON lines: a header, a row each")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    try:
        return args, select_shapes(args.shapes, args.sweep, args.fp8, args.window)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits


def select_shapes(names: str | None, sweep: bool = False, fp8: bool = False,
                  window: bool = False) -> list[bench.Shape]:
    """The rows to run, each once, in order: ``names`` (comma-separated bench names; None:
    S1-S6 and EXTRA_ROWS), then every sweep row if ``sweep``, then the window rows if
    ``window``; with ``fp8`` each row's fp8 row. Raises ValueError naming the names that are
    no bench shape."""
    sweep_rows = bench.sweep_shapes()
    known = {s.name: s for s in (*bench.SHAPES, *bench.FP8_SHAPES, *bench.WINDOW_SHAPES,
                                 *sweep_rows)}
    wanted = ([s.name for s in bench.SHAPES] + list(EXTRA_ROWS) if names is None
              else [name.strip() for name in names.split(",") if name.strip()])
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}: S1-S6, their -fp8 rows, "
                         f"{', '.join(s.name for s in bench.WINDOW_SHAPES)} and the sweep's "
                         "rows are known (tools/profile_attention.py --list)")
    if sweep:
        wanted += [s.name for s in sweep_rows]
    if window:
        wanted += [s.name for s in bench.WINDOW_SHAPES]
    if not wanted:
        raise ValueError("no shapes selected")
    shapes = [known[name] for name in wanted]
    if fp8:
        shapes = [as_fp8(shape) for shape in shapes]
    return list({shape.name: shape for shape in shapes}.values())


def as_fp8(shape: bench.Shape) -> bench.Shape:
    """``shape`` over an e4m3fn cache: the bench's own fp8 row where it has one."""
    if shape.cache:
        return shape
    name = f"{shape.name}-fp8"
    own = [s for s in bench.FP8_SHAPES if s.name == name]
    return own[0] if own else dataclasses.replace(shape, name=name, cache="float8_e4m3fn")


def tolerance(shape: bench.Shape, key: str) -> float:
    """The largest relative difference from ours allowed for the output ``key`` names."""
    if shape.cache and key.startswith("xqa"):
        return XQA_FP8_TOLERANCE
    return TOLERANCE[shape.dtype]


def check(shape: bench.Shape, row: dict[str, Any]) -> list[str]:
    """The outputs of ``row`` (its ``*_diff`` values) farther from ours than allowed, and
    those nearer ours at another window than the row's (its ``*_window`` values, tokens)."""
    far = [f"{key} {row[key]:.3g} > {tolerance(shape, key):g}" for key in sorted(row)
           if key.endswith("_diff") and row[key] is not None
           and not row[key] <= tolerance(shape, key)]  # NaN fails too
    return far + [f"{key} {row[key]} != {shape.window}" for key in sorted(row)
                  if key.endswith("_window") and row[key] != shape.window]


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_line(row: dict[str, Any]) -> str:
    """One row of the table (COLUMNS), "-" where a kernel did not run."""
    wrapper = (None if row["wrapper_us"] is None
               else f"{row['wrapper_us']:.1f} {row['wrapper_kernel']}")
    cells = (row["name"], _cell(row["ours_us"], ".1f"), _cell(wrapper, ""),
             _cell(row["xqa_us"], ".1f"), _cell(row["ours_over_wrapper"], ".3f"),
             _cell(row["ours_over_xqa"], ".3f"), _cell(row["ours_pct_copy"], ".1f"),
             _cell(row["wrapper_pct_copy"], ".1f"), _cell(row["xqa_pct_copy"], ".1f"),
             "ok" if not row["disagrees"] else "DIFFERS")
    return " ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                    for i, (cell, (_, w)) in enumerate(zip(cells, COLUMNS)))


def table_notes(row: dict[str, Any]) -> list[str]:
    """The lines under a row: kernels that failed and outputs that disagree."""
    notes = [f"  {key.removesuffix('_error')}: failed: {row[key]}" for key in sorted(row)
             if key.endswith("_error")]
    return notes + [f"  differs: {what}" for what in row["disagrees"]]


def load_gpu_stack() -> tuple[Any, Any]:
    """torch and flashinfer, or SystemExit with one line saying what is missing."""
    try:
        import flashinfer
        import torch
    except Exception as exc:  # absent, or built for another GPU stack
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SystemExit(f"decode_side_by_side: needs torch and flashinfer ({reason}); on the "
                         "GPU machine: source tools/device_setup.sh with FlashInfer's wheels "
                         "in .whl/ (../shared/device/flashinfer.sh)") from None
    if not torch.cuda.is_available():
        raise SystemExit("decode_side_by_side: torch sees no CUDA device")
    return torch, flashinfer


def driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader", f"--id={DEVICE}"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"


def run_ours(inputs: bench.AttentionInputs, window: int, scales: tuple[float, float],
             tout: Any, iters: int) -> tuple[Any, dict[int, Any], dict[str, Any]]:
    """The op's output at ``scales`` (what FlashInfer's are checked against) and, given a
    ``window`` (tokens), its outputs at a window one token shorter and one longer (keyed by
    window); the prepared launch's time and its difference from the op's output at unit
    scales."""
    q, out, k, v, tables, lens = (inputs.q, inputs.out, inputs.k, inputs.v, inputs.tables,
                                  inputs.lens)

    def op(k_scale: float, v_scale: float, keys: int = window) -> Any:
        ops.paged_attention(out, q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale,
                            window=keys or None)
        q.backend.synchronize(DEVICE)
        return tout.double()  # a copy

    want = op(*scales)
    edges = {w: op(*scales, w) for w in (window - 1, window + 1) if w > 0} if window else {}
    unit = want if scales == (1.0, 1.0) else op(1.0, 1.0)
    launch = bench.AttentionLaunch(out, q, k, v, tables, lens, None, window)
    try:
        launch()
        q.backend.synchronize(DEVICE)
        diff = relative_diff(tout, unit)
        return want, edges, {"ours_us": time_us(launch, iters), "launch_diff": diff}
    finally:
        launch.close()


def run_row(shape: bench.Shape, flashinfer: Any, xqa: Callable[..., Any] | None,
            workspaces: tuple[Any, Any], copy_gbs: float, iters: int) -> dict[str, Any]:
    """One shape's row: the inputs made as the bench makes them, each kernel run on them."""
    backend = get_backend("cuda")
    inputs = bench.row_inputs(shape, backend, DEVICE)
    tables, lens = inputs.tables, inputs.lens
    scales = FP8_SCALES if shape.cache else (1.0, 1.0)
    row: dict[str, Any] = {**dataclasses.asdict(shape), "k_scale": scales[0],
                           "v_scale": scales[1], "tokens": int(bench.attended(shape, lens).sum()),
                           "bytes": bench.attention_bytes(shape, lens)}
    try:
        tq, tout = torch_view(inputs.q), torch_view(inputs.out)
        kv = (torch_view(inputs.k), torch_view(inputs.v))
        want, edges, ours = run_ours(inputs, shape.window, scales, tout, iters)
        row.update(ours)
        row.update(run_wrapper(flashinfer, workspaces[0], shape, tq, kv, tables, lens, scales,
                               want, edges, iters))
        row.update({"xqa_us": None} if xqa is None else
                   run_xqa(xqa, workspaces[1], shape, tq, kv, tables, lens, scales, want, edges,
                           iters))
        del tq, tout, kv, want, edges
    finally:
        backend.synchronize(DEVICE)
        inputs.close()
    for name in ("ours", "wrapper", "xqa"):
        us = row[f"{name}_us"]
        row[f"{name}_pct_copy"] = None if us is None else row["bytes"] / us / 1e3 / copy_gbs * 100
    for name in ("wrapper", "xqa"):
        us = row[f"{name}_us"]
        row[f"ours_over_{name}"] = None if us is None else row["ours_us"] / us
    row["disagrees"] = check(shape, row)
    return row


def main(argv: list[str] | None = None) -> int:
    args, shapes = parse_args(argv)
    torch, flashinfer = load_gpu_stack()
    backend = get_backend("cuda")
    xqa, xqa_reason = find_xqa(torch, flashinfer) if args.xqa else (None, "not asked (--no-xqa)")
    copy_gbs = bench.copy_bandwidth(backend, DEVICE)
    header = {"device": torch.cuda.get_device_name(DEVICE), "driver": driver_version(),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "flashinfer": flashinfer.__version__, "rocmforge_raw": rocmforge_raw.__version__,
              "copy_GBps": copy_gbs, "iters": args.iters, "fp8_scales": FP8_SCALES,
              "xqa_skipped": xqa_reason}
    if args.json:
        print(json.dumps(header), flush=True)
    else:
        print(f"{header['device']}, driver {header['driver']}, torch {header['torch']} (CUDA "
              f"{header['cuda']}), FlashInfer {header['flashinfer']}, rocmforge_raw "
              f"{header['rocmforge_raw']}; copy {copy_gbs:.0f} GB/s; fp8 rows: k_scale "
              f"{FP8_SCALES[0]:g}, v_scale {FP8_SCALES[1]:g}; median of {args.iters} runs")
        if xqa_reason:
            print(f"xqa skipped: {xqa_reason}")
        print(LEGEND + "\n\n" + " ".join(f"{n:<{w}}" if i == 0 else f"{n:>{w}}"
                                         for i, (n, w) in enumerate(COLUMNS)), flush=True)
    workspaces = (torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"),
                  torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"))  # zeroed
    differing = []
    for shape in shapes:
        row = run_row(shape, flashinfer, xqa, workspaces, copy_gbs, args.iters)
        torch.cuda.empty_cache()
        if row["disagrees"]:
            differing.append(shape.name)
        lines = [json.dumps(row)] if args.json else [table_line(row), *table_notes(row)]
        print("\n".join(lines), flush=True)
    if differing:
        print(f"outputs differ from ours on {', '.join(differing)}", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
