"""Bench tuning builds of paged_attention side by side on one GPU.

Loads each ``.variants/NAME.cubin`` (see tools/build_variants.sh) in place of the packaged
object and runs the reference shapes; prints one row per variant and shape. A name ending in
``_sSTAGESxBYTES`` sets the pipeline (so the launch's shared memory) to match. Usage:
    python3 tools/attention_variants.py [--iters 30] [--partitions 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from rocmforge_raw import bench, module, ops
from rocmforge_raw.runtime import get_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--partitions", type=int, nargs="*", default=[])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    backend = get_backend("cuda")
    copy = bench.copy_bandwidth(backend, 0)
    print(f"copy bandwidth {copy:.0f} GB/s")
    results = []
    for path in sorted(Path(".variants").glob("*.cubin")):
        module._loaded[("cuda", 0, "paged_attention")] = module.Module(path, 0, backend)
        stages = re.search(r"_s(\d+)x(\d+)$", path.stem)  # NAME_sSTAGESxBYTES
        if stages:  # built with -DRF_PA_STAGES=STAGES -DRF_PA_STAGE_BYTES=BYTES
            ops.ATTENTION_STAGES["cuda"] = (int(stages[1]), int(stages[2]))
        for parts in [None, *args.partitions]:
            rows = bench.bench_attention(backend, 0, copy, args.iters, num_partitions=parts)
            for r in rows:
                r.update(variant=path.stem, forced_partitions=parts)
                print(f"{path.stem:10} parts={parts!s:5} {r['name']} {r['ms']:7.3f} ms "
                      f"{r['gb_per_s']:6.0f} GB/s {r['pct_of_copy']:5.1f}%")
            results += rows
    Path(args.out, "variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
