"""Which runtime calls wait for the device? Each call runs while a 200 ms hold kernel is
queued; a call that returns after the hold finished synchronized. Usage: python3
tools/probe_sync.py (GPU backends only)."""

from __future__ import annotations

import time

import numpy as np

import rocmforge_raw as rf
from rocmforge_raw.kernels.module import kernel_candidates, load_kernels


def main() -> None:
    backend = rf.get_backend()
    hold = load_kernels("basic", 0, backend).function("rf_hold_ns")
    image = next(p for p in kernel_candidates("basic", backend.properties(0).arch)
                 if p.exists()).read_bytes()
    keep: list = []
    pinned = backend.host_alloc(1 << 20, 0)
    dev = rf.HipBuffer(1 << 20, backend=backend)
    calls = {  # name -> (preparation, call)
        "malloc 1 MiB": (None, lambda: keep.append(rf.HipBuffer(1 << 20, backend=backend))),
        "free 1 MiB": (lambda: keep.append(rf.HipBuffer(1 << 20, backend=backend)),
                       lambda: keep.pop().close()),
        "host_alloc 64 KiB": (None, lambda: keep.append(backend.host_alloc(1 << 16, 0))),
        "host_free 64 KiB": (lambda: keep.append(backend.host_alloc(1 << 16, 0)),
                             lambda: backend.host_free(keep.pop(), 0)),
        "event create": (None, lambda: keep.append(rf.Event(backend=backend))),
        "stream create": (None, lambda: keep.append(rf.Stream(backend=backend))),
        "memcpy_htod async pinned": (None, lambda: backend.memcpy_htod(dev.ptr, pinned, 4096,
                                                                       0)),
        "memset (no stream)": (None, lambda: dev.fill(0, 0, 4096)),
        "module load": (None, lambda: keep.append(rf.Module(image, 0, backend))),
    }
    for name, (prepare, call) in calls.items():
        if prepare is not None:
            prepare()
            backend.synchronize(0)
        hold.launch(1, 32, np.uint64(200_000_000))
        end = rf.Event(backend=backend).record()
        began = time.perf_counter()
        call()
        took = time.perf_counter() - began
        waited = backend.event_query(end.handle)
        print(f"{name:28} {1e3 * took:8.2f} ms  {'WAITS for the device' if waited else 'async'}")
        backend.synchronize(0)


if __name__ == "__main__":
    main()
