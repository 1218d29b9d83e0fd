"""Who keeps live buffers alive? Runs a workload (the ops tests' shapes), drops every
reference, collects garbage, then prints the live buffers and the chain of referrers of each.
A diagnostic for leaks that appear only in some environments (e.g. under compute-sanitizer).
Usage: python3 tools/who_holds.py"""

from __future__ import annotations

import gc
import sys
import types

import numpy as np

import rocmforge_raw as rf
from rocmforge_raw.kernels import ops
from rocmforge_raw.memory import _registry
from rocmforge_raw.memory.array import DeviceArray


def workload(backend) -> None:
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((6, 2, 16, 64), np.float32)
    dk = DeviceArray.from_numpy(cache, backend=backend)
    dv = DeviceArray.from_numpy(cache, backend=backend)
    key = rng.standard_normal((5, 2, 64), np.float32)
    slots = np.array([17, -1, 3, 95, -1], np.int64)
    ops.reshape_and_cache(DeviceArray.from_numpy(key, backend=backend),
                          DeviceArray.from_numpy(key, backend=backend), dk, dv, slots)
    dk.to_numpy()


def describe(obj: object) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def main() -> int:
    backend = rf.get_backend()
    before = rf.memory_stats()["live_buffers"]
    workload(backend)
    gc.collect()
    ops.release_staging()
    live = _registry.live_buffers()
    print(f"{backend.name}: live buffers {before} before, {len(live)} after")
    for buf in live:
        print(f"  {buf!r}")
        seen, layer = {id(live)}, [buf]
        for depth in range(6):
            holders = [r for obj in layer for r in gc.get_referrers(obj)
                       if id(r) not in seen and r is not layer and r is not live]
            seen.update(id(h) for h in holders)
            if not holders:
                break
            print("   " * (depth + 2) + ", ".join(describe(h) for h in holders[:6]))
            layer = holders[:6]
    return 1 if len(live) > before else 0


if __name__ == "__main__":
    sys.exit(main())
