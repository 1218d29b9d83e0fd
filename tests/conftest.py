"""Every test runs on the host backend; GPU tests also run on each GPU backend that answers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.runtime import BACKEND_NAMES, get_backend

AVAILABLE = [name for name, status in rf.available_backends().items() if status == "ok"]
GPU_BACKENDS = [name for name in AVAILABLE if name != "host"]


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (minutes each: calibrations)")


def pytest_collection_modifyitems(config, items):
    """Mark each test that runs on a GPU backend (through ``gpu`` or ``backend``) ``gpu``, so
    ``pytest -m gpu`` selects the GPU suite (tools/sanitize.sh does); skip the tests marked
    ``slow`` unless ``--slow`` is given (each has a faster variant that always runs)."""
    skip_slow = pytest.mark.skip(reason="slow (minutes): run with `pytest --slow`")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
        params = getattr(item, "callspec", None)
        if params and any(params.params.get(f) in GPU_BACKENDS for f in ("gpu", "backend")):
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


@pytest.fixture
def rng(request):
    """Fresh random data for every test, seeded by the test's id through CRC-32 (``hash()`` of
    a str is salted per process), so a failure reproduces in the next run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def no_leaked_buffers():
    """Each test leaves exactly as many live buffers as it found."""
    import gc

    from rocmforge_raw import ops

    before = rf.memory_stats()["live_buffers"]
    yield
    gc.collect()
    ops.release_staging()  # the one-off ops' staging memory is kept per device, not leaked
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


__all__ = ["AVAILABLE", "BACKEND_NAMES", "GPU_BACKENDS"]
