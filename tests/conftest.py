"""Every test runs on the host backend; GPU tests also run on each GPU backend that answers.

The host backend runs with two logical devices here (``RF_HOST_DEVICES=2`` unless set, also
for the processes tests start), so the tests of several devices run on every machine, a
two-GPU one adding its GPUs. ``RF_DEVICE=N`` runs every test on device N of each backend
instead of device 0: each test starts with N as its thread's device (``set_device``), so
whatever a test makes without naming a device is made there. Every backend that answers
must have that device; a backend without it ends the run at once.
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("RF_HOST_DEVICES", "2")  # before any backend starts

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.runtime import BACKEND_NAMES, get_backend

AVAILABLE = [name for name, status in rf.available_backends().items() if status == "ok"]
GPU_BACKENDS = [name for name in AVAILABLE if name != "host"]
#: Backends with two devices or more here: the host (two logical devices) and the GPUs of a
#: machine with several.
MULTI_DEVICE = [name for name in AVAILABLE if get_backend(name).num_devices >= 2]
#: The device every test runs on (``RF_DEVICE``, default 0), of every backend.
DEVICE = int(os.environ["RF_DEVICE"]) if os.environ.get("RF_DEVICE", "").isdigit() else 0


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (minutes each: calibrations)")


def pytest_configure(config):
    """``RF_DEVICE`` must name a device of every backend that answers."""
    value = os.environ.get("RF_DEVICE", "")
    if value and not value.isdigit():
        raise pytest.UsageError(f"RF_DEVICE must be a device ordinal (0, 1, ...), got {value!r}")
    for name in AVAILABLE:
        count = get_backend(name).num_devices
        if count <= DEVICE:
            hint = " (RF_HOST_DEVICES=N gives it N)" if name == "host" else ""
            raise pytest.UsageError(f"RF_DEVICE={DEVICE}: the {name} backend has {count} "
                                    f"device(s){hint}")


def pytest_report_header(config):
    return f"rocmforge_raw: every test on device {DEVICE} of {', '.join(AVAILABLE)} (RF_DEVICE)"


@pytest.fixture(autouse=True)
def on_the_chosen_device():
    """Each test starts with ``DEVICE`` as its thread's device, on every backend."""
    for name in AVAILABLE:
        get_backend(name).set_device(DEVICE)


def pytest_collection_modifyitems(config, items):
    """Mark each test that runs on a GPU backend (through ``gpu``, ``backend`` or
    ``two_devices``) ``gpu``, so ``pytest -m gpu`` selects the GPU suite (tools/sanitize.sh
    does); skip the tests marked ``slow`` unless ``--slow`` is given (each has a faster
    variant that always runs), and those marked ``foreign_writes`` under initcheck
    (``RF_SANITIZER``, set by tools/sanitize.sh)."""
    skip_slow = pytest.mark.skip(reason="slow (minutes): run with `pytest --slow`")
    skip_foreign = pytest.mark.skip(reason="initcheck cannot see another process's writes to "
                                    "memory mapped here: every read of it reads as unwritten")
    under_initcheck = os.environ.get("RF_SANITIZER") == "initcheck"
    for item in items:
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
        if under_initcheck and "foreign_writes" in item.keywords:
            item.add_marker(skip_foreign)
        params = getattr(item, "callspec", None)
        if params and any(params.params.get(f) in GPU_BACKENDS
                          for f in ("gpu", "backend", "two_devices")):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(params=AVAILABLE)
def backend(request):
    """Each backend that answers here (host always)."""
    return get_backend(request.param)


@pytest.fixture(params=GPU_BACKENDS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no GPU backend answers here"))])
def gpu(request):
    """Each GPU backend that answers here."""
    return get_backend(request.param)


@pytest.fixture(params=MULTI_DEVICE or [pytest.param(None, marks=pytest.mark.skip(
    reason="no backend has two devices here (RF_HOST_DEVICES=1, and one GPU or none)"))])
def two_devices(request):
    """Each backend that has two devices or more here."""
    return get_backend(request.param)


@pytest.fixture
def rng(request):
    """Fresh random data for every test, seeded by the test's id through CRC-32 (``hash()`` of
    a str is salted per process), so a failure reproduces in the next run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def no_leaked_buffers():
    """Each test leaves exactly as many live buffers as it found, once the device has passed
    what is waiting and it is freed (``free_waiting``: also the one-off ops' staging
    memory, which is kept per device, not leaked)."""
    import gc

    before = rf.memory_stats()["live_buffers"]
    yield
    gc.collect()
    rf.free_waiting()
    after = rf.memory_stats()["live_buffers"]
    if after > before:  # name the newest live allocations (the registry keeps creation order)
        leaked = rf.live_allocations()[before - after:]
        where = "".join(f"\n{r.nbytes} bytes on {r.backend}:{r.device}"
                        + ("".join(r.stack[-6:]) if r.stack else " (RF_TRACK_STACKS=1 says where)")
                        for r in leaked)
        pytest.fail(f"test leaked {after - before} buffer(s):{where}")


@pytest.fixture
def hip_runtime_without_device():
    """Debian's real libamdhip64 with no AMD GPU behind it (what CI has); skip otherwise."""
    import ctypes

    try:
        ctypes.CDLL("libamdhip64.so")
    except OSError:
        pytest.skip("libamdhip64 is not installed here (make test installs Debian's)")
    if "hip" in AVAILABLE:
        pytest.skip("an AMD GPU answers here")


__all__ = ["AVAILABLE", "BACKEND_NAMES", "DEVICE", "GPU_BACKENDS", "MULTI_DEVICE"]
