"""The memory-leak soak: churn buffers, the KV cache and modules, sample memory every second,
and judge whether anything grows.

Workload per cycle: (a) raw and pooled HipBuffers of random sizes, (b) a KV cache under a
scheduler (add/append/fork/finish/preempt) with reshape_and_cache and paged_attention
launches, (c) on GPUs, loading, launching and unloading a code object. Samples: library live
bytes and buffers, device used bytes (mem_info, GPU only) and process RSS.

Verdict (``drift``): PASS when live buffers return to their baseline after teardown and,
after the warm-up, the fitted drift (Theil-Sen slope x judged span) of RSS and of device-used
bytes stays under its limit; FAIL when either does not. The warm-up ends where every judged
series has become steady (detected, not a fixed share of the run); a run in which one never
does is UNSETTLED: too short to judge, never a PASS (a leak gate that tests nothing must not
pass) and never a FAIL (the machine did not leak). ``inject_leak`` keeps one small buffer per
cycle and ``leak_bytes_per_s`` keeps host memory at a steady rate: both must FAIL.
"""

from __future__ import annotations

import gc
import mmap
import os
import time
from pathlib import Path

import numpy as np

from ..cache import CacheConfig, KvCache, Request, Scheduler
from ..common import progress
from ..kernels import ops
from ..kernels.module import Module, kernel_candidates
from ..memory.array import DeviceArray
from ..memory.buffer import HipBuffer, memory_stats
from ..memory.pool import MemoryPool
from ..runtime import Backend
from . import drift
from . import report as soak_report
from .churn import CHURN, Churn
from .results import FAIL, MIN_SECONDS, PASS, UNSETTLED, MiB, Row, SoakConfig, SoakResult

#: Bytes ``inject_leak`` keeps every cycle (one buffer of the backend's memory).
LEAK_BYTES = 64 * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
        churn = tuple(name for name in workloads if name in CHURN)
        self.churn = Churn(backend, device, rng, churn) if churn else None

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
        if self.churn is not None:  # (d) host tier, transfers, graph replays
            self.churn.cycle()
        if leak_into is not None:  # the planted leak: a buffer kept past the workload's life
            leak_into.append(HipBuffer(LEAK_BYTES, self.device, self.backend))

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
        if self.churn is not None:
            self.churn.close()
        self.cache.close()
        self.pool.free_all()
        ops.release_staging()
        self.backend.synchronize(self.device)


class _PlantedLeak:
    """Host memory kept at ``rate`` bytes per second of the run, unknown to the registry: only
    the drift can find it (the calibration's leak). Mapped pages of its own (``mmap``), every
    one written: the process's RSS grows by exactly ``rate`` a second (heap memory would
    first fill the holes the workload's frees leave, and grow RSS by less)."""

    CHUNK = 256 * 1024  # bytes mapped at a time: four maps a second at 1 MiB/s

    def __init__(self, rate: int) -> None:
        self.rate, self.held = rate, 0
        self.kept: list[mmap.mmap] = []

    def feed(self, elapsed: float) -> None:
        owed = int(elapsed * self.rate) - self.held
        if owed >= self.CHUNK:
            pages = mmap.mmap(-1, owed)
            pages.write(b"\xa5" * owed)
            self.kept.append(pages)
            self.held += owed

    def close(self) -> None:
        for pages in self.kept:
            pages.close()
        self.kept.clear()


def run_soak(backend: Backend, device: int, config: SoakConfig,
             seed: int | None = None) -> SoakResult:
    """Run the soak (a bar on a terminal, a line every 10 s elsewhere: ``progress``), judge
    it and write ``soak.csv``, ``soak.json`` and ``soak.png`` (if matplotlib is installed;
    else a note says why not) into ``config.out_dir``."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gc.collect()
    baseline = memory_stats()["live_buffers"]
    gpu = backend.name != "host"
    rows: list[Row] = []
    workload = _Workload(backend, device, np.random.default_rng(seed), config.workloads)
    leaked: list[HipBuffer] = []
    planted = _PlantedLeak(config.leak_bytes_per_s)
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

    shown = progress.bar(config.seconds, f"soak {backend.name}:{device}", unit="s",
                         bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s{postfix}")
    try:
        with shown:
            while (elapsed := time.monotonic() - start) < config.seconds:
                workload.cycle(leaked if config.inject_leak else None)
                planted.feed(elapsed)
                cycles += 1
                if time.monotonic() >= next_sample:
                    gc.collect()
                    sample()
                    next_sample += 1.0
                    kept = len(leaked) * LEAK_BYTES + planted.held
                    shown.set_postfix_str(_status(rows, cycles, kept), refresh=False)
                    shown.update(min(elapsed, config.seconds) - shown.n)
    finally:
        workload.close()
        del workload
        gc.collect()
        sample()
    final_live = memory_stats()["live_buffers"]
    leaked_on_purpose = len(leaked)
    for buf in leaked:  # judged already: give the planted leaks back to the process
        buf.close()
    planted.close()
    result, fits = _judge(rows, gpu, config, cycles, baseline, final_live)
    summary = {"config": config, "backend": backend.name,
               "device": backend.properties(device).name, "leaked_on_purpose": leaked_on_purpose,
               "planted_bytes": planted.held, "fits": fits}
    soak_report.write(out, rows, gpu, result, fits, summary)
    return result


def _status(rows: list[Row], cycles: int, kept: int) -> str:
    """The progress display's words: cycles so far, RSS growth since the first sample, and
    the ``kept`` bytes of a planted leak (and their rate), if any."""
    rss = (rows[-1][4] - rows[0][4]) / MiB
    words = f"{cycles} cycles, RSS {rss:+.1f} MiB"
    if kept:
        rate = kept / MiB / max(rows[-1][0], 1e-3)
        words += f", planted leak {kept / MiB:.0f} MiB ({rate:.1f} MiB/s)"
    return words


def _judge(rows: list[Row], gpu: bool, config: SoakConfig, cycles: int, baseline: int,
           final_live: int) -> tuple[SoakResult, dict[str, drift.Fit]]:
    """The verdict on the samples (the last one, after teardown, judges live buffers only),
    and the fit of each judged series (none when a series never settled)."""
    running = rows[:-1]
    times = np.array([r[0] for r in running], np.float64)
    series = {"RSS": (np.array([r[4] for r in running], np.float64),
                      config.max_rss_drift_bytes)}
    if gpu:
        series["device used bytes"] = (np.array([r[3] for r in running], np.float64),
                                       config.max_device_drift_bytes)
    reasons = []
    if final_live != baseline:
        reasons.append(f"live buffers: {final_live} after teardown, baseline {baseline} "
                       f"({final_live - baseline} leaked)")
    starts = {name: drift.settle_index(times, values, limit)
              for name, (values, limit) in series.items()}
    unsettled = [name for name, index in starts.items() if index is None]
    fits: dict[str, drift.Fit] = {}
    if unsettled:
        reasons += [_unsettled(name, times, series[name][0], config.seconds)
                    for name in unsettled]
        verdict = FAIL if final_live != baseline else UNSETTLED
    else:
        first = max(index for index in starts.values() if index is not None)
        for name, (values, limit) in series.items():
            fit = fits[name] = drift.fit_from(times, values, first)
            if fit.drift > limit:
                reasons.append(f"{name}: drift {fit.drift / MiB:.2f} MiB over the "
                               f"{fit.span:.0f} s after warm-up (slope "
                               f"{fit.slope / 1024:.1f} KiB/s) > {limit / MiB:.2f} MiB")
        verdict = FAIL if reasons else PASS
    warmup = next(iter(fits.values())).start if fits else None
    drifts = {name: fit.drift for name, fit in fits.items()}
    result = SoakResult(verdict, verdict == PASS, reasons, cycles, len(rows), baseline,
                        final_live, warmup, drifts.get("device used bytes"), drifts.get("RSS"))
    return result, fits


def _unsettled(name: str, times: np.ndarray, values: np.ndarray, seconds: float) -> str:
    """Why ``name`` was not judged: how it still bent over the second half of the run."""
    half = values[len(values) // 2 :], times[len(times) // 2 :]
    middle = len(half[0]) // 2
    early, _ = drift.theil_sen(half[1][:middle], half[0][:middle])
    late, _ = drift.theil_sen(half[1][middle:], half[0][middle:])
    return (f"{name} did not settle within the {seconds:g}-second run (over its second half "
            f"it rose {early / 1024:.1f} KiB/s, then {late / 1024:.1f} KiB/s): run longer (the "
            f"default is 60 s)")


__all__ = ["FAIL", "LEAK_BYTES", "MIN_SECONDS", "PASS", "UNSETTLED", "SoakConfig", "SoakResult",
           "run_soak"]
