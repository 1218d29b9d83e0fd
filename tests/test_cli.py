"""The console script: info, demo, bench --cache, soak (PASS, and FAIL on a planted leak)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from rocmforge_raw.cli import main
from rocmforge_raw.errors import BackendUnavailableError


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_info_lists_backends_devices_and_versions(capsys):
    code, info = run_json(capsys, "info")
    assert code == 0 and info["backends"]["host"] == "ok"
    assert any(d["backend"] == "host" for d in info["devices"])
    assert info["versions"]["numpy"] != "not installed"


def test_console_script_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", "info", "--backend",
                             "host"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "host" in result.stdout


def test_info_device_flag_selects_that_device(capsys):
    code, info = run_json(capsys, "info", "--backend", "host", "--device", "0")
    assert code == 0 and [(d["backend"], d["index"]) for d in info["devices"]] == [("host", 0)]


@pytest.mark.parametrize("argv, words", [
    (["info", "--device", "99", "--backend", "host"], "device 99 does not exist"),
    (["soak", "--seconds", "-5"], "argument --seconds: -5 is not above 0"),
    (["soak", "--seconds", "4", "--warmup", "0.5"], "leaves 2 s to judge drift"),
    (["bench", "--iters", "0"], "argument --iters: 0 is below 1"),
], ids=["device-99", "negative-seconds", "too-short-to-judge", "zero-iters"])
def test_bad_flags_end_in_one_line_and_status_2(argv, words):
    result = subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and words in result.stderr, result.stderr


def test_demo_at_small_size_preempts_checks_and_leaves_nothing_live(capsys):
    code, summary = run_json(capsys, "demo", "--backend", "host", "--scale", "0.3",
                             "--seed", "3")
    assert code == 0
    assert summary["finished"] == summary["requests"] == 36
    assert summary["preemptions"] > 0 and summary["reference_checks_passed"] > 0
    assert summary["live_buffers_after_teardown"] == 0
    assert summary["generated_tokens"] > 0 and summary["peak_blocks"] == summary["cache_blocks"]


def test_bench_cache_reports_a_median(capsys):
    code, result = run_json(capsys, "bench", "--cache", "--backend", "host")
    assert code == 0 and result["cache"]["median_us"] > 0 and result["cache"]["num_seqs"] == 256


def soak(tmp_path, *flags):
    """The soak in a fresh process, as users run it, so the RSS it samples is its own."""
    result = subprocess.run(
        [sys.executable, "-m", "rocmforge_raw.cli", "soak", "--backend", "host", "--json",
         "--out", str(tmp_path), *flags], capture_output=True, text=True, timeout=300)
    return result.returncode, json.loads(result.stdout)


def test_soak_passes_and_writes_its_files(tmp_path):
    # A few seconds are mostly allocator warm-up (glibc grows its heap as it learns the
    # sizes), so this short run allows more RSS drift than the 8 MiB default of real soaks.
    code, result = soak(tmp_path, "--seconds", "8", "--warmup", "0.5",
                        "--max-rss-drift-mib", "32")
    assert code == 0, result["reasons"]
    assert result["passed"] and result["cycles"] > 0
    assert result["final_live_buffers"] == result["baseline_live_buffers"]
    assert (tmp_path / "soak.csv").read_text().startswith("seconds,live_bytes")
    assert json.loads((tmp_path / "soak.json").read_text())["passed"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_soak_with_a_planted_leak_fails_and_names_it(tmp_path):
    code, result = soak(tmp_path, "--seconds", "4", "--inject-leak")
    assert code == 1 and not result["passed"]
    assert any(r.startswith("live buffers:") and "leaked" in r for r in result["reasons"])


# --- the HIP runtime's version and hip-python's -----------------------------------------------
def _hip_module():
    try:
        from rocmforge_raw.runtime import hip
    except BackendUnavailableError as exc:
        pytest.skip(f"hip-python is not installed: {exc}")
    return hip


def _fake_versions(monkeypatch, runtime, bindings):
    monkeypatch.setattr(_hip_module(), "versions", lambda: {
        "runtime": runtime, "driver": runtime, "bindings": bindings, "error": None})


def test_info_names_the_hip_runtime_without_a_device(capsys, hip_runtime_without_device):
    """Debian's libamdhip64 answers the version calls with no GPU; info reports what the
    library itself says (asked here through ctypes) and what the bindings were made for."""
    library = ctypes.CDLL("libamdhip64.so")
    number = ctypes.c_int()
    assert library.hipRuntimeGetVersion(ctypes.byref(number)) == 0
    expected = f"{number.value // 10**7}.{number.value // 10**5 % 100}.{number.value % 10**5}"
    code, info = run_json(capsys, "info")
    hip = _hip_module().hip
    assert code == 0 and info["hip_runtime"]["runtime"] == expected
    assert info["hip_runtime"]["driver"] is not None and info["hip_runtime"]["error"] is None
    assert info["hip_runtime"]["bindings"] == \
        f"{hip.HIP_VERSION_MAJOR}.{hip.HIP_VERSION_MINOR}.{hip.HIP_VERSION_PATCH}"
    differ = expected.split(".")[:2] != [str(hip.HIP_VERSION_MAJOR), str(hip.HIP_VERSION_MINOR)]
    assert len(info["warnings"]) == differ


def test_info_warns_when_bindings_and_runtime_differ(capsys, monkeypatch):
    _fake_versions(monkeypatch, "6.4.43483", "7.15.26333")
    code, info = run_json(capsys, "info", "--backend", "host")
    assert code == 0 and len(info["warnings"]) == 1
    assert "generated for HIP 7.15.26333 but the HIP runtime is 6.4.43483" in info["warnings"][0]
    assert main(["info", "--backend", "host"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning:")] == \
        [f"warning: {info['warnings'][0]}"]
    assert "HIP runtime 6.4.43483 (driver 6.4.43483), hip-python bindings for HIP 7.15.26333" \
        in lines


def test_info_does_not_warn_when_major_minor_agree(capsys, monkeypatch):
    _fake_versions(monkeypatch, "6.4.43483", "6.4.43482")
    code, info = run_json(capsys, "info", "--backend", "host")
    assert code == 0 and info["warnings"] == []


def test_info_without_a_loadable_runtime_says_why_and_does_not_warn(capsys, monkeypatch):
    binding = _hip_module().hip

    def unloadable():
        raise RuntimeError("failed to dlopen 'libamdhip64.so'")

    monkeypatch.setattr(binding, "hipRuntimeGetVersion", unloadable)
    code, info = run_json(capsys, "info", "--backend", "host")
    assert code == 0 and info["hip_runtime"]["runtime"] is None and info["warnings"] == []
    assert info["hip_runtime"]["error"] == \
        "hipRuntimeGetVersion: failed to dlopen 'libamdhip64.so'"


def test_installed_hip_python_is_in_the_stated_range():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    try:
        installed = metadata.version("hip-python")
    except metadata.PackageNotFoundError:
        pytest.skip("hip-python is not installed")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    stated = [requirements.Requirement(r) for r in project["project"]["dependencies"]]
    hip_python, = [r for r in stated if r.name == "hip-python"]
    assert hip_python.specifier.contains(installed), (installed, str(hip_python.specifier))
    assert all(hip_python.specifier.contains(v) for v in ("6.4.4.555.40", "10.0.0.0.1.2"))


def test_bench_transfer_reports_both_layouts_against_the_copy(capsys):
    code, result = run_json(capsys, "bench", "--transfer", "--backend", "host", "--iters", "2")
    assert code == 0 and "cache" not in result  # asked for alone
    consecutive, scattered = result["transfer"]
    for row in (consecutive, scattered):
        assert row["transport"] == "ipc" and row["blocks"] == 128
        assert row["bytes"] == 128 * 16 * 8 * 2 * 8 * 128 * 2  # blocks, tokens, layers, K/V, ...
        assert row["transfer_gb_per_s"] > 0 and row["copy_gb_per_s"] > 0
        assert row["import_gb_per_s"] <= row["transfer_gb_per_s"]
        assert row["pct_of_copy"] == pytest.approx(
            100 * row["transfer_gb_per_s"] / row["copy_gb_per_s"])
    assert (consecutive["spans"], scattered["spans"]) == (2 * 8, 128 * 2 * 8)


def test_bench_transfer_ends_with_the_error_its_sender_process_raised():
    """A sender that fails (here: a device the host backend lacks) ends the run at once,
    naming its error, instead of leaving the receiver waiting for the benchmark's timeout."""
    from rocmforge_raw.bench_transfer import bench_transfer
    from rocmforge_raw.runtime import get_backend

    with pytest.raises(RuntimeError, match=r"(?s)the sender process failed.*device 1 does"):
        bench_transfer(get_backend("host"), 1, "ipc", 1)
