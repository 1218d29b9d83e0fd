"""Run bench shapes' attention a few times, for a profiler to attach to.

Shapes by name: S1..S6, or sweep rows such as ``d64-r1-b16-128x2048`` (``--list`` prints
them); ``RF_PA_VARIANT=.variants/NAME.cubin`` runs a tuning build instead of the packaged
object. Usage, one shape per profiler run:
    ncu --clock-control none -k regex:rf_paged_attention -s 3 -c 1 \\
        python3 tools/profile_attention.py S1
"""

from __future__ import annotations

import os
import sys

from rocmforge_raw import bench
from rocmforge_raw.kernels import module
from rocmforge_raw.runtime import get_backend

if __name__ == "__main__":
    known = {s.name: s for s in (*bench.SHAPES, *bench.sweep_shapes())}
    if sys.argv[1:] == ["--list"]:
        print("\n".join(known))
        sys.exit(0)
    unknown = [name for name in sys.argv[1:] if name not in known]
    if unknown:
        sys.exit(f"unknown shape(s) {unknown}: see --list")
    shapes = tuple(known[name] for name in sys.argv[1:]) or bench.SHAPES
    backend = get_backend("cuda")
    if os.environ.get("RF_PA_VARIANT"):
        variant = module.Module(os.environ["RF_PA_VARIANT"], 0, backend)
        module._loaded[("cuda", 0, "paged_attention")] = variant
    rows = bench.bench_attention(backend, 0, 4200.0, iters=3, shapes=shapes)
    for r in rows:
        print(r["name"], f"{r['ms']:.3f} ms", f"{r['pct_of_copy']:.1f}% of 4200 GB/s")
