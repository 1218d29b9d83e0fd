"""Bench tuning builds of paged_attention side by side on one GPU.

Loads each ``.variants/NAME.cubin`` (see tools/build_variants.sh) in place of the packaged
object and runs the reference shapes (or ``--shapes`` by name, sweep rows included); prints
one row per variant and shape. A name with ``_sSTAGESxBYTES`` sets the pipeline (so the
launch's shared memory) to match, ``_cN`` caps the CTAs per SM, and ``_pad`` sizes padded
rows (builds before docs/kernels.md v29, and RF_USE_BULK builds). Usage:
    python3 tools/attention_variants.py [--iters 30] [--partitions 1 2 4] [--shapes S1 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from rocmforge_raw import bench
from rocmforge_raw.kernels import module, planning
from rocmforge_raw.runtime import get_backend


def _at_most(shared_bytes, ctas: int):
    """attention_shared_bytes raised so that at most ``ctas`` CTAs fit an SM of 228 KiB."""
    floor = (228 // ctas - 14) << 10  # static shared memory and the reserve: < 14 KiB
    return lambda *args, **kwargs: max(shared_bytes(*args, **kwargs), floor)


#: The packaged instances' pipeline and shared memory, which a variant's name may change.
PACKAGED_STAGES = planning.ATTENTION_STAGES["cuda"]
PACKAGED_SHARED_BYTES = planning.attention_shared_bytes


def _padded(shared_bytes):
    """attention_shared_bytes of a build whose 16-bit rows and codes are padded as f32 rows
    are (every build before docs/kernels.md v29)."""
    return lambda backend, row_bytes, group, fp8=False, *, itemsize: shared_bytes(
        backend, row_bytes, group, fp8, itemsize=4)


def load_variant(path: Path, backend: Any) -> None:
    """Run the tuning build ``path`` in place of the packaged paged_attention from now on: a
    name ending in ``_sSTAGESxBYTES`` sets the pipeline (so the launch's shared memory), one
    with ``_cN`` at most N CTAs per SM, one with ``_pad`` pads every row (builds before
    v29, and RF_USE_BULK builds); otherwise the packaged ones' settings."""
    module._loaded[("cuda", 0, "paged_attention")] = module.Module(path, 0, backend)
    planning.attention_kernel.cache_clear()
    stages = re.search(r"_s(\d+)x(\d+)(?:_|$)", path.stem)  # NAME_sSTAGESxBYTES
    planning.ATTENTION_STAGES["cuda"] = ((int(stages[1]), int(stages[2]), 16) if stages
                                         else PACKAGED_STAGES)
    ctas = re.search(r"_c(\d+)(?:_|$)", path.stem)  # NAME_cN: N CTAs per SM at most
    shared = _padded(PACKAGED_SHARED_BYTES) if "_pad" in path.stem else PACKAGED_SHARED_BYTES
    planning.attention.attention_shared_bytes = (  # attention_kernel's lookup
        _at_most(shared, int(ctas[1])) if ctas else shared)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--partitions", type=int, nargs="*", default=[])
    parser.add_argument("--shapes", nargs="*", default=[])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    known = {s.name: s for s in (*bench.SHAPES, *bench.FP8_SHAPES, *bench.sweep_shapes())}
    shapes = tuple(known[name] for name in args.shapes) or bench.SHAPES
    backend = get_backend("cuda")
    copy = bench.copy_bandwidth(backend, 0)
    read = bench.read_bandwidth(backend, 0)
    print(f"copy bandwidth {copy:.0f} GB/s, read bandwidth {read:.0f} GB/s")
    results = []
    for path in sorted(Path(".variants").glob("*.cubin")):
        load_variant(path, backend)
        for parts in [None, *args.partitions]:
            rows = bench.bench_attention(backend, 0, copy, args.iters, shapes,
                                         num_partitions=parts, read_gbs=read)
            for r in rows:
                r.update(variant=path.stem, forced_partitions=parts)
                print(f"{path.stem:16} parts={parts!s:5} {r['name']:22} {r['ms']:7.4f} ms "
                      f"{r['gb_per_s']:6.0f} GB/s {r['pct_of_copy']:5.1f}% copy "
                      f"{r['pct_of_read']:5.1f}% read")
            results += rows
    Path(args.out, "variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
