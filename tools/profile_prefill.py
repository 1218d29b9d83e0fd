"""Run the prefill bench's rows (``bench.prefill``: P1..P5) a few times each, for a profiler
to attach to. Usage, one shape per profiler run:
    ncu --clock-control none -k regex:rf_prefill -s 2 -c 1 python3 tools/profile_prefill.py P1
"""

from __future__ import annotations

import sys

import numpy as np

from rocmforge_raw.bench.prefill import PREFILL_SHAPES, PrefillLaunch, prefill_inputs
from rocmforge_raw.runtime import get_backend

if __name__ == "__main__":
    known = {s.name: s for s in PREFILL_SHAPES}
    unknown = [name for name in sys.argv[1:] if name not in known]
    if unknown:
        sys.exit(f"unknown shape(s) {unknown}: one of {', '.join(known)}")
    backend = get_backend("cuda")
    for name in sys.argv[1:] or list(known):
        shape = known[name]
        inputs = prefill_inputs(shape, np.random.default_rng(1), backend, 0)
        q, out, k, v, tables, lens, q_lens = inputs
        launch = PrefillLaunch(out, q, k, v, tables, lens, q_lens)
        for _ in range(4):
            launch()
        backend.synchronize(0)
        launch.close()
        for array in (q, out, k, v):
            array.buffer.root.close()
        print(f"{name}: {launch.items} items, WM {launch.wm}")
