"""The multi-token kernel against FlashInfer's BatchPrefillWithPagedKVCacheWrapper on the very
same K/V memory: the bench's P1-P5 (``rocmforge_raw.bench.prefill``), FlashInfer's fa2
backend and, on Hopper, its fa3 backend beside ours.

Run on the GPU machine from the project root, with the wheels of ../shared/device/wheels.sh
and flashinfer.sh installed to /tmp/site, the compiled core built and the cubins in place:
    PYTHONPATH=/tmp/site:$PWD python3 tools/prefill_side_by_side.py [--shapes P1,P4]
The first run JIT-compiles FlashInfer's kernels (minutes; ~/.cache/flashinfer keeps them while
the machine is held). K/V/q live in DeviceArrays; FlashInfer reads them through
torch.from_dlpack (zero copy, HND layout), so both read the same pages in the same random
order. Device time between CUDA events, a torch.cuda._sleep hold queued first so that host
enqueue time stays out; medians. ours = bench.prefill.PrefillLaunch (a step's prepared
launches). One JSON line per shape and backend, then a table; ratio > 1: ours is slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from rocmforge_raw.bench.prefill import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    PREFILL_SHAPES,
    Q_HEADS,
    PrefillLaunch,
    prefill_inputs,
)
from rocmforge_raw.runtime import get_backend


def device_seconds(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    enqueue = []
    for _ in range(3):
        start = time.perf_counter_ns()
        fn()
        enqueue.append(time.perf_counter_ns() - start)
        torch.cuda.synchronize()
    hold = int(2 * (2 * statistics.median(enqueue) + 30_000))
    begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
    samples = []
    for _ in range(iters):
        torch.cuda._sleep(hold)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples) / 1e3


def main() -> int:
    import flashinfer

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(s.name for s in PREFILL_SHAPES))
    parser.add_argument("--backends", default="fa2,fa3")
    args = parser.parse_args()
    chosen = set(args.shapes.split(","))
    backend = get_backend("cuda")
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    print(json.dumps({"device": torch.cuda.get_device_name(),
                      "flashinfer": flashinfer.__version__}), flush=True)
    table = []
    for shape in PREFILL_SHAPES:
        if shape.name not in chosen:
            continue
        rng = np.random.default_rng(sum(map(ord, shape.name)))
        q, out, k, v, tables, lens, q_lens = prefill_inputs(shape, rng, backend, 0)
        ours = PrefillLaunch(out, q, k, v, tables, lens, q_lens)
        ours()
        torch.cuda.synchronize()
        tq, tk, tv, tout = (torch.from_dlpack(a) for a in (q, k, v, out))
        mine = tout.double().clone()
        t_ours = device_seconds(ours)
        need = -(-lens // BLOCK)
        qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(need)]).astype(np.int32))
        indices = torch.tensor(np.concatenate([tables[i, : need[i]] for i in range(len(lens))]))
        last = torch.tensor(((lens - 1) % BLOCK + 1).astype(np.int32))
        flops = shape.flops()
        row = {"shape": shape.name, "ours_ms": round(t_ours * 1e3, 4),
               "ours_tflops": round(flops / t_ours / 1e12, 1)}
        for name in args.backends.split(","):
            try:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND",
                                                                         backend=name)
                wrapper.plan(qo_indptr.cuda(), kv_indptr.cuda(), indices.cuda(), last.cuda(),
                             Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, causal=True,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                theirs = wrapper.run(tq, (tk, tv))
                torch.cuda.synchronize()
                diff = float((theirs.double() - mine).norm() / theirs.double().norm())
                seconds = device_seconds(lambda w=wrapper, a=tq, b=(tk, tv): w.run(a, b))
                row.update({f"{name}_ms": round(seconds * 1e3, 4),
                            f"{name}_tflops": round(flops / seconds / 1e12, 1),
                            f"{name}_rel_diff": round(diff, 5),
                            f"ratio_{name}": round(t_ours / seconds, 3)})
            except Exception as exc:  # a backend this GPU or build does not take
                row[f"{name}_error"] = repr(exc)[:300]
        print(json.dumps(row), flush=True)
        table.append(row)
        ours.close()
        del tq, tk, tv, tout
        for array in (q, out, k, v):
            array.buffer.root.close()
        torch.cuda.empty_cache()
    print(f"{'shape':>5} {'ours ms':>9} {'TFLOP/s':>8} " + " ".join(
        f"{n + ' ms':>9} {'ratio':>6}" for n in args.backends.split(",")))
    for row in table:
        print(f"{row['shape']:>5} {row['ours_ms']:9.3f} {row['ours_tflops']:8.1f} " + " ".join(
            f"{row.get(n + '_ms', float('nan')):9.3f} {row.get('ratio_' + n, float('nan')):6.3f}"
            for n in args.backends.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
