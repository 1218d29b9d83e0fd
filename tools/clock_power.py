"""Steady-state SM clock and board power of the attention kernel, beside FlashInfer's.

Each kernel runs back to back for ``--seconds`` while ``nvidia-smi`` samples the SM clock and
the board's power every 50 ms: the medians of the samples after the first 0.5 s, with the
mean device time of a launch (events around the whole run). A board held at its power limit
gives a kernel that spends more energy per byte a lower SM clock (docs/kernels.md v28, which
this reproduces: there FlashInfer's kernels kept 1875-1965 MHz and ours 1508-1800 on an H200).

Shapes by ``bench`` name (S1..S6, S1-fp8.., sweep rows); ``--dtype bf16|f16`` overrides the
activations' dtype (the values read: f16 normals cost more power than bf16 ones, v28).
``--variants DIR`` runs each ``DIR/*.cubin`` (tools/build_variants.sh; its name sets its
pipeline and CTAs per SM as tools/attention_variants.py reads them) in place of the packaged
object; ``--flashinfer`` adds FlashInfer's
CUDA-core and tensor-core decode on the same pages (needs torch and flashinfer, as
../shared/device/side_by_side.py); ``--references`` first runs ``rf_read_bytes`` and a
device copy over 1 GiB. On the GPU machine:
    python3 tools/clock_power.py S1 S4 --flashinfer --references
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from attention_variants import load_variant  # (this directory: run as tools/clock_power.py)

from rocmforge_raw import bench
from rocmforge_raw.kernels import module
from rocmforge_raw.memory.array import DeviceArray
from rocmforge_raw.memory.buffer import HipBuffer
from rocmforge_raw.memory.stream import Event
from rocmforge_raw.runtime import get_backend

GiB = 1 << 30
SAMPLE_MS, SETTLE_SAMPLES = 50, 10  # nvidia-smi's period; samples dropped at the start


def sample(backend: Any, launch: Callable[[], Any], seconds: float) -> tuple[float, float, float]:
    """(SM MHz, board W, ms a launch) while ``launch`` runs back to back for ``seconds``."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)],
                           stdout=subprocess.PIPE, text=True)
    start, end = Event(0, backend), Event(0, backend)
    try:
        begin, launches = time.perf_counter(), 0
        start.record()
        while time.perf_counter() - begin < seconds:
            for _ in range(20):
                launch()
            launches += 20
            backend.synchronize(0)
        end.record()
        end.synchronize()
        ms = end.elapsed_ms_since(start) / launches
    finally:
        smi.terminate()
        out = smi.communicate()[0]
        start.close()
        end.close()
    rows = [[float(x) for x in line.split(",")] for line in out.splitlines() if line.strip()]
    rows = rows[SETTLE_SAMPLES:] or rows
    if not rows:
        raise RuntimeError("nvidia-smi gave no samples")
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), ms


def report(name: str, what: str, result: tuple[float, float, float], extra: str = "") -> None:
    clock, power, ms = result
    print(f"{name:10} {what:20} {ms:8.4f} ms  SM {clock:5.0f} MHz  {power:4.0f} W{extra}",
          flush=True)


def references(backend: Any, seconds: float) -> None:
    """``rf_read_bytes`` and a device copy, each over 1 GiB of random values."""
    rng = np.random.default_rng(1)
    kernel = module.load_kernels("basic", 0, backend).function("rf_read_bytes")
    blocks = 8 * backend.cached_properties(0).multiprocessors
    with HipBuffer(GiB, 0, backend) as src, HipBuffer(GiB, 0, backend) as dst, \
            HipBuffer(4, 0, backend) as sink:
        bench.fill_random(src, rng, np.float32)
        args = (src, GiB // 16, blocks * 256, np.uint32(0x9E3779B9), sink)
        result = sample(backend, lambda: kernel.launch(blocks, 256, *args), seconds)
        report("reference", "read 1 GiB", result, f"  {GiB / result[2] / 1e6:5.0f} GB/s")
        result = sample(backend, lambda: dst.copy_from(src), seconds)
        report("reference", "copy 1 GiB", result, f"  {2 * GiB / result[2] / 1e6:5.0f} GB/s")


def flashinfer_runs(shape: bench.Shape, q: DeviceArray, k: DeviceArray, v: DeviceArray,
                    tables: np.ndarray, lens: np.ndarray) -> list[tuple[str, Callable]]:
    """FlashInfer's CUDA-core and tensor-core decode over the same pages (an fp8 cache's
    codes copied to torch: fp8 arrays have no DLPack export here)."""
    import flashinfer
    import torch

    tq = torch.from_dlpack(q)
    if k.dtype.itemsize == 1:
        tk, tv = (torch.from_numpy(a.to_numpy().view(np.uint8)).cuda().view(
            torch.float8_e4m3fn) for a in (k, v))
    else:
        tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
    need = -(-lens // shape.block_size)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(need)]).astype(np.int32),
                          device="cuda")
    indices = torch.tensor(np.concatenate([tables[i, : need[i]] for i in range(len(lens))]),
                           device="cuda")
    last = torch.tensor(((lens - 1) % shape.block_size + 1).astype(np.int32), device="cuda")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    runs = []
    for tensor_cores in (False, True):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last, shape.q_heads, shape.kv_heads, shape.head_dim,
                     shape.block_size, q_data_type=tq.dtype, kv_data_type=tk.dtype)
        runs.append((f"FlashInfer tc={int(tensor_cores)}",
                     lambda w=wrapper: w.run(tq, (tk, tv))))
    return runs


def variants(directory: str | None) -> list[Path | None]:
    """The cubins to run (None: the packaged object)."""
    if directory is None:
        return [None]
    found = sorted(Path(directory).glob("*.cubin"))
    if not found:
        raise SystemExit(f"no .cubin in {directory}")
    return list(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--dtype", choices=("bf16", "f16"))
    parser.add_argument("--variants")
    parser.add_argument("--flashinfer", action="store_true")
    parser.add_argument("--references", action="store_true")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    known = {s.name: s for s in (*bench.SHAPES, *bench.FP8_SHAPES, *bench.sweep_shapes())}
    unknown = [name for name in args.shapes if name not in known]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}: see tools/profile_attention.py --list")
    backend = get_backend("cuda")
    if args.references:
        references(backend, args.seconds)
    for name in args.shapes:
        shape = known[name]
        if args.dtype:
            shape = dataclasses.replace(shape, dtype=args.dtype)
        dtype = np.dtype(ml_dtypes.bfloat16 if shape.dtype == "bf16" else np.float16)
        cache = np.dtype(getattr(ml_dtypes, shape.cache)) if shape.cache else dtype
        rng = bench.shape_rng(shape)  # an fp8 row reads its 16-bit row's lengths and pages
        tables, lens, num_blocks = bench.attention_inputs(shape, rng)
        pages = (num_blocks, shape.kv_heads, shape.block_size, shape.head_dim)
        q = DeviceArray.empty((shape.batch, shape.q_heads, shape.head_dim), dtype, 0, backend)
        out = DeviceArray.empty(q.shape, dtype, 0, backend)
        k = DeviceArray.empty(pages, cache, 0, backend)
        v = DeviceArray.empty(pages, cache, 0, backend)
        for array, of in ((q, dtype), (k, cache), (v, cache)):
            bench.fill_random(array.buffer, rng, of)
        label = f"{shape.name}/{shape.dtype}"
        if args.flashinfer:
            for what, run in flashinfer_runs(shape, q, k, v, tables, lens):
                report(label, what, sample(backend, run, args.seconds))
        for path in variants(args.variants):
            if path is not None:
                load_variant(path, backend)
            launch = bench.AttentionLaunch(out, q, k, v, tables, lens)
            try:
                report(label, "ours" if path is None else path.stem,
                       sample(backend, launch, args.seconds))
            finally:
                launch.close()
        for array in (q, out, k, v):
            array.buffer.root.close()


if __name__ == "__main__":
    main()
