"""The memory-leak soak: churn buffers, the KV cache and modules, sample memory every second,
and judge whether anything grows.

Workload per cycle: (a) raw and pooled HipBuffers of random sizes, (b) a KV cache under a
scheduler (add/append/fork/finish/preempt) with reshape_and_cache and paged_attention
launches, (c) on GPUs, loading, launching and unloading a code object. Samples: library live
bytes and buffers, device used bytes (mem_info, GPU only) and process RSS. PASS when live
buffers return to their baseline after teardown and, after warm-up, the fitted drift (slope x
post-warm-up duration) of device-used bytes and of RSS stays under the thresholds. The slope
is Theil-Sen's (the median of the slopes between all pairs of samples): the driver's used
bytes dip for single samples (module unloads, the pool between cycles) and a least-squares
line tilts by a megabyte with where those dips happen to fall, while a leak lifts the whole
series.
``inject_leak`` keeps one small buffer per cycle, which must FAIL.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import checks, ops
from .array import DeviceArray
from .buffer import HipBuffer, memory_stats
from .cache import CacheConfig, KvCache, Request, Scheduler
from .module import Module, kernel_candidates
from .pool import MemoryPool
from .runtime import Backend

MiB = 1 << 20
WORKLOADS = ("buffers", "cache", "modules")
#: Samples are taken once a second; the drift fit needs three after the warm-up, so a run
#: must leave at least this many seconds to judge.
MIN_JUDGED_S = 3.0
MIN_SAMPLES = 3


@dataclass
class SoakConfig:
    """A soak run: ``seconds`` of churn, the first ``warmup_fraction`` of it left out of the
    drift fit, drift thresholds in bytes. Checked at construction: a run too short to judge
    (fewer than ``MIN_JUDGED_S`` seconds after the warm-up) is refused."""

    seconds: float = 60.0
    warmup_fraction: float = 0.25
    max_device_drift_bytes: int = 1 * MiB
    max_rss_drift_bytes: int = 8 * MiB
    inject_leak: bool = False
    out_dir: str = "soak-out"
    workloads: tuple[str, ...] = WORKLOADS

    def __post_init__(self) -> None:
        seconds = checks.real(self.seconds, "seconds", 0.0)
        warmup = checks.real(self.warmup_fraction, "warmup_fraction", 0.0)
        if warmup >= 1.0:
            raise ValueError(f"warmup_fraction must be below 1, got {warmup}")
        judged = seconds * (1.0 - warmup)
        if judged < MIN_JUDGED_S:
            raise ValueError(f"a {seconds:g}-second soak with warm-up {warmup:g} leaves "
                             f"{judged:g} s to judge drift; at least {MIN_JUDGED_S:g} s are "
                             "needed (a leak gate that tests nothing must not pass)")
        checks.integer(self.max_device_drift_bytes, "max_device_drift_bytes", 0)
        checks.integer(self.max_rss_drift_bytes, "max_rss_drift_bytes", 0)
        checks.flag(self.inject_leak, "inject_leak")
        if not isinstance(self.out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir must be a path, got {checks.show(self.out_dir)}")
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown or not self.workloads or isinstance(self.workloads, str):
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, got "
                             f"{checks.show(self.workloads)}")


@dataclass
class SoakResult:
    passed: bool
    reasons: list[str]
    cycles: int
    samples: int
    baseline_live_buffers: int
    final_live_buffers: int
    device_drift_bytes: float | None
    rss_drift_bytes: float
    files: dict[str, str] = field(default_factory=dict)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_MAX_FIT = 1000  # samples in the drift fit: 500 000 pairs at most


def _drift(times: np.ndarray, values: np.ndarray, start: float) -> float:
    """Theil-Sen slope of ``values`` after ``start`` (bytes per second), times the span it
    covers: robust to single-sample dips and spikes (up to ~29% of the samples). Pairs grow
    as the square of the samples, so a soak of hours is thinned to ``_MAX_FIT`` evenly
    spaced samples (one per second up to ~16 minutes)."""
    keep = times >= start
    if keep.sum() < 3:
        return 0.0
    t, v = times[keep], values[keep].astype(np.float64)
    if len(t) > _MAX_FIT:
        pick = np.linspace(0, len(t) - 1, _MAX_FIT).round().astype(np.int64)
        t, v = t[pick], v[pick]
    first, second = np.triu_indices(len(t), k=1)
    dt = t[second] - t[first]
    slopes = (v[second] - v[first])[dt > 0] / dt[dt > 0]
    return float(np.median(slopes) * (t[-1] - t[0]))


class _Workload:
    """One cycle of churn; everything it creates is released before the next cycle, except
    the long-lived cache, scheduler and pool, released in ``close``."""

    def __init__(self, backend: Backend, device: int, rng: np.random.Generator,
                 workloads: tuple[str, ...]) -> None:
        self.backend, self.device, self.rng = backend, device, rng
        self.workloads = workloads
        self.pool = MemoryPool(device, backend)
        dtype = "float32" if backend.name == "host" else "bfloat16"
        self.cache = KvCache(CacheConfig(2, 2, 64, 16, 64, dtype), device, backend)
        self.sched = Scheduler(self.cache, max_running=16)
        self.next_request = 0
        module = next((p for p in kernel_candidates("basic", backend.properties(device).arch)
                       if p.exists()), None) if backend.name != "host" else None
        self.module_image = module.read_bytes() if module else None

    def cycle(self, leak_into: list[HipBuffer] | None) -> None:
        rng = self.rng
        for _ in range(8 if "buffers" in self.workloads else 0):  # (a) buffers
            size = int(rng.integers(1, 4 * MiB))
            with HipBuffer(size, self.device, self.backend) as buf:
                buf.fill(int(rng.integers(256)), 0, min(size, 4096))
            HipBuffer(size, pool=self.pool).close()
        if rng.random() < 0.05:
            self.pool.free_all()
        if "cache" in self.workloads:
            self._cache_step()  # (b) cache with kernels
        if self.module_image is not None and "modules" in self.workloads:  # (c) modules
            with Module(self.module_image, self.device, self.backend) as mod, \
                    HipBuffer(4096, self.device, self.backend) as buf:
                mod.function("rf_fill_f32")(4, 256, buf, 1.0, 1024)
                self.backend.synchronize(self.device)
        if leak_into is not None:  # the planted leak: a buffer kept past the workload's life
            leak_into.append(HipBuffer(64 * 1024, self.device, self.backend))

    def _cache_step(self) -> None:
        rng, sched, cache = self.rng, self.sched, self.cache
        # arrivals only while the queue is short: a soak must not grow its own backlog
        for _ in range(int(rng.integers(0, 3)) if len(sched.waiting) < 32 else 0):
            sched.submit(Request(self.next_request, int(rng.integers(1, 300)),
                                 int(rng.integers(1, 40))))
            self.next_request += 1
        if sched.running and rng.random() < 0.1:  # fork a running sequence, then drop it
            parent = next(iter(sched.running))
            child = ("fork", self.next_request)
            cache.fork(parent, child)
            if cache.can_append([child]):  # never preempt the scheduler's sequences
                cache.append([child])
            cache.finish(child)
        plan = sched.step()
        c = cache.config
        slots = np.concatenate([s for _, s in plan.prefill] + [plan.decode_slots])
        if slots.size:
            kv = rng.standard_normal((slots.size, c.num_kv_heads, c.head_dim), np.float32)
            key = DeviceArray.from_numpy(kv.astype(c.dtype), self.device, self.backend)
            cache.write(0, key, key, slots)
            key.buffer.close()
        if plan.decode:
            meta = cache.batch([r.request_id for r in plan.decode])
            q = DeviceArray.from_numpy(rng.standard_normal(
                (len(plan.decode), c.num_kv_heads * 2, c.head_dim), np.float32).astype(c.dtype),
                self.device, self.backend)
            out = DeviceArray.empty(q.shape, c.dtype, self.device, self.backend)
            cache.attention(0, out, q, meta)
            q.buffer.close()
            out.buffer.close()
        sched.advance(plan)

    def close(self) -> None:
        self.cache.close()
        self.pool.free_all()
        ops.release_staging()
        self.backend.synchronize(self.device)


def run_soak(backend: Backend, device: int, config: SoakConfig,
             seed: int | None = None) -> SoakResult:
    """Run the soak and write ``soak.csv``, ``soak.json`` and ``soak.png`` (if matplotlib is
    installed) into ``config.out_dir``."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gc.collect()
    baseline = memory_stats()["live_buffers"]
    gpu = backend.name != "host"
    rows: list[tuple[float, int, int, int | None, int]] = []
    workload = _Workload(backend, device, np.random.default_rng(seed), config.workloads)
    leaked: list[HipBuffer] = []
    start = time.monotonic()
    next_sample, cycles = start, 0

    def sample() -> None:
        stats = memory_stats()
        used = None
        if gpu:
            free, total = backend.mem_info(device)
            used = total - free
        rows.append((time.monotonic() - start, stats["live_bytes"], stats["live_buffers"],
                     used, _rss()))

    try:
        while time.monotonic() - start < config.seconds:
            workload.cycle(leaked if config.inject_leak else None)
            cycles += 1
            if time.monotonic() >= next_sample:
                gc.collect()
                sample()
                next_sample += 1.0
    finally:
        workload.close()
        del workload
        gc.collect()
        sample()
    final_live = memory_stats()["live_buffers"]
    leaked_on_purpose = len(leaked)
    for buf in leaked:  # judged already: give the planted leak back to the process
        buf.close()
    running = rows[:-1]  # the last sample is after teardown: it judges live buffers only
    times = np.array([r[0] for r in running])
    warm = config.seconds * config.warmup_fraction
    device_drift = _drift(times, np.array([r[3] for r in running], np.float64), warm) if gpu \
        else None
    rss_drift = _drift(times, np.array([r[4] for r in running], np.float64), warm)
    reasons = []
    judged = int((times >= warm).sum())
    if judged < MIN_SAMPLES:
        reasons.append(f"only {judged} samples after the warm-up ({cycles} cycles in all): "
                       f"too few to judge drift; run longer")
    if final_live != baseline:
        reasons.append(f"live buffers: {final_live} after teardown, baseline {baseline} "
                       f"({final_live - baseline} leaked)")
    if device_drift is not None and device_drift > config.max_device_drift_bytes:
        reasons.append(f"device used bytes: drift {device_drift / MiB:.2f} MiB over the run "
                       f"(slope {device_drift / max(times[-1] - warm, 1e-9) / 1024:.1f} KiB/s) "
                       f"> {config.max_device_drift_bytes / MiB:.2f} MiB")
    if rss_drift > config.max_rss_drift_bytes:
        reasons.append(f"RSS: drift {rss_drift / MiB:.2f} MiB over the run (slope "
                       f"{rss_drift / max(times[-1] - warm, 1e-9) / 1024:.1f} KiB/s) > "
                       f"{config.max_rss_drift_bytes / MiB:.2f} MiB")
    files = _write_outputs(out, rows, gpu)
    result = SoakResult(not reasons, reasons, cycles, len(rows), baseline, final_live,
                        device_drift, rss_drift, files)
    summary = {**asdict(result), "config": asdict(config), "backend": backend.name,
               "device": backend.properties(device).name,
               "leaked_on_purpose": leaked_on_purpose}
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    result.files["json"] = str(out / "soak.json")
    return result


def _write_outputs(out: Path, rows: list[tuple], gpu: bool) -> dict[str, str]:
    files = {"csv": str(out / "soak.csv")}
    with open(out / "soak.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seconds", "live_bytes", "live_buffers", "device_used_bytes",
                         "rss_bytes"])
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return files
    t = [r[0] for r in rows]
    series = [("library live bytes", [r[1] for r in rows]), ("process RSS", [r[4] for r in rows])]
    if gpu:
        series.insert(1, ("device used bytes", [r[3] for r in rows]))
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.4 * len(series)), sharex=True)
    for ax, (name, values) in zip(axes, series):
        ax.plot(t, np.asarray(values, np.float64) / MiB)
        ax.set_ylabel("MiB")
        ax.set_title(name, fontsize=10)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=100)
    plt.close(fig)
    files["png"] = str(out / "soak.png")
    return files


__all__ = ["SoakConfig", "SoakResult", "run_soak"]
