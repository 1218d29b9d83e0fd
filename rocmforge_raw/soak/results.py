"""What a soak run is asked (``SoakConfig``), what it samples (``Row``) and what it finds
(``SoakResult``): the values ``run`` and ``report`` share."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..common import checks
from . import drift

MiB = 1 << 20
#: The churn a soak may run: buffers, the cache under a Scheduler and module loads by default
#: (``DEFAULT_WORKLOADS``), and on demand the host tier, sequence transfers and graph
#: replays (``churn``).
WORKLOADS = ("buffers", "cache", "modules", "tier", "transfer", "graph")
DEFAULT_WORKLOADS = ("buffers", "cache", "modules")
#: Samples are taken once a second; the steadiness test and the fit need this many seconds
#: after the warm-up, so no shorter run can be judged.
MIN_SECONDS = 2 * drift.MIN_HALF
PASS, FAIL, UNSETTLED = "PASS", "FAIL", "UNSETTLED"


@dataclass
class SoakConfig:
    """A soak run: ``seconds`` of churn, drift limits in bytes. Checked at construction: a run
    shorter than ``MIN_SECONDS`` is refused (it could never be judged)."""

    seconds: float = 60.0
    max_device_drift_bytes: int = 1 * MiB
    max_rss_drift_bytes: int = 8 * MiB
    inject_leak: bool = False
    leak_bytes_per_s: int = 0
    out_dir: str = "soak-out"
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS

    def __post_init__(self) -> None:
        seconds = checks.real(self.seconds, "seconds", 0.0)
        if seconds < MIN_SECONDS:
            raise ValueError(f"a {seconds:g}-second soak cannot be judged: the drift fit needs "
                             f"at least {MIN_SECONDS} s (one sample a second) after memory "
                             "settles; run 60 s or more (a leak gate that tests nothing must "
                             "not pass)")
        checks.integer(self.max_device_drift_bytes, "max_device_drift_bytes", 0)
        checks.integer(self.max_rss_drift_bytes, "max_rss_drift_bytes", 0)
        checks.integer(self.leak_bytes_per_s, "leak_bytes_per_s", 0)
        checks.flag(self.inject_leak, "inject_leak")
        if not isinstance(self.out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir must be a path, got {checks.show(self.out_dir)}")
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown or not self.workloads or isinstance(self.workloads, str):
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, got "
                             f"{checks.show(self.workloads)}")


@dataclass
class SoakResult:
    """``verdict`` is PASS, FAIL or UNSETTLED (``passed``: PASS); ``reasons`` say why it is not
    PASS. ``warmup_s`` is where the judged span starts (None when unsettled); the drifts are
    in bytes over the judged span (None: not judged). ``notes`` say what was left out (a
    plot without matplotlib)."""

    verdict: str
    passed: bool
    reasons: list[str]
    cycles: int
    samples: int
    baseline_live_buffers: int
    final_live_buffers: int
    warmup_s: float | None
    device_drift_bytes: float | None
    rss_drift_bytes: float | None
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


#: One sample: seconds, live bytes, live buffers, device used bytes (GPU), RSS bytes
Row = tuple[float, int, int, int | None, int]
