"""Run each bench shape's attention a few times, for a profiler to attach to (ncu -k ...).

Usage: ncu --clock-control none -k regex:rf_paged_attention_bf16 -c 1 \
           python3 tools/profile_attention.py S1
"""

from __future__ import annotations

import sys

from rocmforge_raw import bench
from rocmforge_raw.runtime import get_backend

if __name__ == "__main__":
    names = set(sys.argv[1:]) or {s.name for s in bench.SHAPES}
    shapes = tuple(s for s in bench.SHAPES if s.name in names)
    rows = bench.bench_attention(get_backend("cuda"), 0, 4200.0, iters=3, shapes=shapes)
    for r in rows:
        print(r["name"], f"{r['ms']:.3f} ms", f"{r['pct_of_copy']:.1f}%")
