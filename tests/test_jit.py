"""Run-time compilation: every kernel source through NVRTC (sm_80, sm_90) and hiprtc (gfx90a),
no GPU needed; the on-disk cache (keys, corrupt entries rebuilt, processes compiling at once);
RF_KERNELS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from code_objects import KERNELS, check_code_object

import rocmforge_raw as rf
from rocmforge_raw.errors import KernelNotAvailableError
from rocmforge_raw.kernels import jit, module

NVRTC_ARCHS = ("sm_80", "sm_90")
HIPRTC_ARCHS = ("gfx90a",)  # Debian's hiprtc (ROCm 5.2) crashes on gfx942 and gfx1100


def _nvrtc() -> jit.Compiler:
    """NVRTC; skipped only where cuda-python (the ``cuda`` extra) is missing: the extra brings
    NVRTC too, so a failure to load it is a failure here."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra (cuda-python) is not installed")
    return jit.compiler_for("cuda")


def _hiprtc() -> jit.Compiler:
    try:
        return jit.compiler_for("hip")
    except KernelNotAvailableError as exc:
        pytest.skip(f"no hiprtc here (make toolchain names Debian's): {exc}")


def _compile_all(compiler: jit.Compiler, archs: tuple[str, ...], workers: int) -> dict:
    """(stem, arch) -> image, or the exception compiling it raised."""
    def one(job: tuple[str, str]) -> bytes | Exception:
        stem, arch = job
        source = module.SOURCE_DIR / f"{stem}.cu"
        try:
            return compiler.compile(source.read_text(), source.name, arch,
                                    [*jit.OPTIONS, f"-I{module.SOURCE_DIR}"])
        except Exception as exc:
            return exc

    jobs = [(stem, arch) for stem in KERNELS for arch in archs]
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))


@pytest.fixture(scope="module")
def nvrtc_images():
    return _compile_all(_nvrtc(), NVRTC_ARCHS, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def hiprtc_images():
    return _compile_all(_hiprtc(), HIPRTC_ARCHS, 1)  # one at a time: ROCm 5.2's comgr


def _image(images: dict, stem: str, arch: str) -> bytes:
    image = images[stem, arch]
    if isinstance(image, Exception):
        raise image
    return image


@pytest.mark.parametrize("arch", NVRTC_ARCHS)
@pytest.mark.parametrize("stem", list(KERNELS))
def test_every_source_compiles_with_nvrtc(nvrtc_images, stem, arch):
    check_code_object(_image(nvrtc_images, stem, arch), stem, arch)


@pytest.mark.parametrize("arch", HIPRTC_ARCHS)
@pytest.mark.parametrize("stem", list(KERNELS))
def test_every_source_compiles_with_hiprtc(hiprtc_images, stem, arch):
    check_code_object(_image(hiprtc_images, stem, arch), stem, arch)


def test_compile_errors_carry_the_compiler_log():
    with pytest.raises(rf.DeviceError, match=r"broken\.cu for sm_80.*undeclared_name"):
        _nvrtc().compile("__global__ void k() { undeclared_name = 1; }", "broken.cu",
                         "sm_80", [])


# --- the on-disk cache ----------------------------------------------------------------------
def _basic(tmp_path, arch="sm_80"):
    return jit.compile_cached(_nvrtc(), module.SOURCE_DIR / "basic.cu", arch, tmp_path)


def test_second_compile_reads_the_entry_the_first_stored(tmp_path):
    first = _basic(tmp_path)
    second = _basic(tmp_path)
    assert not first.cached and second.cached
    assert second.image == first.image and second.path == first.path
    assert second.seconds == pytest.approx(first.seconds, abs=1e-3)  # recorded in the entry
    assert second.compiler == first.compiler and second.compiler.startswith("nvrtc ")
    assert [e.path for e in jit.cache_entries(tmp_path)] == [first.path]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "empty", "garbage header"])
def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, damage):
    path = _basic(tmp_path).path
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data[:6] = b"xxxxxx"
    path.write_bytes(bytes(data))
    assert jit.read_entry(path) is None
    rebuilt = _basic(tmp_path)
    assert not rebuilt.cached and rebuilt.path == path
    check_code_object(rebuilt.image, "basic", "sm_80")
    assert jit.read_entry(path).image == rebuilt.image


def test_key_covers_compiler_arch_options_and_every_file():
    base = ("nvrtc 13.0", "sm_90", ("-O3",), [("a.cu", "x"), ("compat.h", "y")])
    variants = [("nvrtc 13.1", *base[1:]), (base[0], "sm_80", *base[2:]),
                (*base[:2], ("-O2",), base[3]), (*base[:3], [("a.cu", "x"), ("compat.h", "z")]),
                (*base[:3], [("a.cu", "x!"), ("compat.h", "y")])]
    keys = {jit.cache_key(*v) for v in [base, *variants]}
    assert len(keys) == 1 + len(variants)


def test_editing_an_included_header_makes_a_new_entry(tmp_path):
    sources = tmp_path / "src"
    shutil.copytree(module.SOURCE_DIR, sources, ignore=shutil.ignore_patterns("*.md"))
    compiler = _nvrtc()
    first = jit.compile_cached(compiler, sources / "basic.cu", "sm_80", tmp_path / "cache")
    compat = sources / "compat.h"
    compat.write_text(compat.read_text() + "\n// edited\n")
    second = jit.compile_cached(compiler, sources / "basic.cu", "sm_80", tmp_path / "cache")
    assert not second.cached and second.path != first.path


def test_unwritable_cache_still_returns_the_compiled_image(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="could not store a compiled kernel"):
        compiled = jit.compile_cached(_nvrtc(), module.SOURCE_DIR / "cache_ops.cu", "sm_90",
                                      blocker)
    check_code_object(compiled.image, "cache_ops", "sm_90")


_RACER = textwrap.dedent("""
    import pathlib, sys, time
    from rocmforge_raw.kernels import jit, module
    root, me = pathlib.Path(sys.argv[1]), sys.argv[2]
    compiler = jit.compiler_for("cuda")
    (root / f"ready-{me}").touch()
    while not (root / "go").exists():
        time.sleep(0.001)
    compiled = jit.compile_cached(compiler, module.SOURCE_DIR / "cache_ops.cu", "sm_90",
                                  root / "cache")
    print(compiled.cached, compiled.path)
""")


def test_two_processes_compiling_into_one_cache_at_once_both_succeed(tmp_path):
    _nvrtc()
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), str(i)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
        if any(r.poll() is not None for r in racers) or time.monotonic() > deadline:
            for r in racers:
                r.kill()
            pytest.fail(f"a racer did not get ready: {[r.communicate() for r in racers]}")
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = [r.communicate(timeout=120) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], results
    paths = {out.split()[1] for out, _ in results}
    assert len(paths) == 1
    entries = os.listdir(tmp_path / "cache" / "cuda")
    assert len(entries) == 1, f"temporary files left behind: {entries}"
    check_code_object(jit.read_entry(tmp_path / "cache" / "cuda" / entries[0]).image,
                      "cache_ops", "sm_90")


# --- RF_KERNELS -----------------------------------------------------------------------------
def test_unknown_kernel_mode_is_named(monkeypatch):
    monkeypatch.setenv("RF_KERNELS", "fastest")
    with pytest.raises(ValueError, match="RF_KERNELS='fastest' is not one of auto, prebuilt"):
        module.load_kernels("basic", backend="host")


def test_prebuilt_mode_never_compiles(monkeypatch):
    monkeypatch.setenv("RF_KERNELS", "prebuilt")
    with pytest.raises(KernelNotAvailableError, match="RF_KERNELS=prebuilt rules out"):
        module.load_kernels("basic", backend="host")


def test_jit_mode_compiles_at_run_time_on_gpu(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("RF_KERNELS", "jit")
    monkeypatch.setenv("RF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_origins", {})
    kernels = module.load_kernels("basic", backend=gpu)
    origin, = module.loaded_kernels().values()
    assert "compiled now" in origin and str(tmp_path) in origin
    with rf.HipBuffer(4096, backend=gpu) as buf:
        kernels.function("rf_fill_f32")(4, 256, buf, 2.5, 1024)
        assert (buf.to_numpy(np.float32) == 2.5).all()
    kernels.unload()
