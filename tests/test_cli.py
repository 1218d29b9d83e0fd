"""The console script: info, demo, bench --cache, soak (PASS, and FAIL on a planted leak)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import DEVICE

from rocmforge_raw.cli.main import main
from rocmforge_raw.common.workers import WorkerError
from rocmforge_raw.errors import BackendUnavailableError
from rocmforge_raw.runtime import get_backend


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
    (["soak", "--seconds", "4"], "a 4-second soak cannot be judged"),
    (["bench", "--iters", "0"], "argument --iters: 0 is below 1"),
    (["bench", "--cache", "--transport", "ipc", "--backend", "host"],
     "--transport goes with --transfer, which was not given"),
    (["bench", "--from-device", "0", "--transport", "mooncake", "--backend", "host"],
     "--transport and --from-device go with --transfer"),
], ids=["device-99", "negative-seconds", "too-short-to-judge", "zero-iters",
        "transport-without-transfer", "from-device-without-transfer"])
def test_bad_flags_end_in_one_line_and_status_2(argv, words):
    result = subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and words in result.stderr, result.stderr


def test_demo_at_small_size_preempts_checks_and_leaves_nothing_live(capsys):
    code, summary = run_json(capsys, "demo", "--backend", "host", "--scale", "0.3",
                             "--seed", "3")
    assert code == 0 and summary["where"] == "host backend (--backend host)"
    # the host has no device: no device time that would read as a GPU's, and a note saying so
    assert "decode_device_ms_median" not in summary and "decode_host_share_median" not in summary
    assert summary["device_time"].startswith("none: the host backend runs each step on the CPU")
    assert summary["finished"] == summary["requests"] == 36
    assert summary["preemptions"] > 0 and summary["reference_checks_passed"] > 0
    assert summary["live_buffers_after_teardown"] == 0
    assert summary["generated_tokens"] > 0 and summary["peak_blocks"] == summary["cache_blocks"]


def test_bench_cache_reports_a_median(capsys):
    code, result = run_json(capsys, "bench", "--cache", "--backend", "host")
    assert code == 0 and result["cache"]["median_us"] > 0 and result["cache"]["num_seqs"] == 256
    row = result["cache"]
    assert row["met_target"] == (row["median_us"] <= row["target_us"])


@pytest.mark.parametrize("target_us, mark", [(1e-3, "MISSED: "), (1e9, ": met)")])
def test_bench_cache_marks_whether_it_met_its_target(capsys, monkeypatch, target_us, mark):
    from rocmforge_raw.bench import cache

    monkeypatch.setattr(cache, "CACHE_TARGET_US", target_us)
    assert main(["bench", "--cache", "--backend", "host"]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("cache decode")]
    assert mark in line and ("MISSED" in line) == (target_us < 1)


def test_bench_on_the_host_says_why_gpu_rows_are_absent(capsys):
    code, result = run_json(capsys, "bench", "--step", "--attention", "--backend", "host")
    assert code == 0 and "step" not in result and "attention" not in result
    assert set(result["skipped"]) == {"step", "attention"}
    assert all(why.startswith("needs a GPU backend: on the host backend (--backend host)")
               for why in result["skipped"].values())


def soak(tmp_path, *flags, env=None):
    """The soak in a fresh process, as users run it, so the RSS it samples is its own: its
    exit status, its JSON (stdout, which must be nothing else) and its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "rocmforge_raw.cli", "soak", "--backend", "host", "--json",
         "--out", str(tmp_path), *flags], capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})})
    return result.returncode, json.loads(result.stdout), result.stderr


def test_soak_with_a_planted_buffer_leak_says_so_first_fails_and_names_it(tmp_path):
    code, result, err = soak(tmp_path, "--seconds", "10", "--inject-leak")
    assert err.splitlines()[0] == (
        "soak: --inject-leak plants a leak: one 64 KiB buffer of host memory kept every cycle "
        "until the verdict (the progress says how many MiB a second): this run must FAIL")
    assert code == 1 and not result["passed"] and result["verdict"] == "FAIL"
    assert any(r.startswith("live buffers:") and "leaked" in r for r in result["reasons"])


def _unsettled_result(tmp_path):
    from rocmforge_raw.soak.run import SoakResult

    return SoakResult("UNSETTLED", False, ["RSS did not settle within the 12-second run (...): "
                                           "run longer (the default is 60 s)"],
                      cycles=900, samples=13, baseline_live_buffers=0, final_live_buffers=0,
                      warmup_s=None, device_drift_bytes=None, rss_drift_bytes=None,
                      files={"csv": str(tmp_path / "soak.csv")},
                      notes=["plot skipped: matplotlib is not installed (...)"])


def test_a_soak_that_never_settled_is_not_judged_and_exits_2(tmp_path, capsys, monkeypatch):
    from rocmforge_raw.soak import run as soak_module

    monkeypatch.setattr(soak_module, "run_soak", lambda *a: _unsettled_result(tmp_path))
    code = main(["soak", "--backend", "host", "--seconds", "12", "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == 2
    assert out[0] == "soak on host backend (--backend host) for 12 s: not judged"
    assert "  not judged: RSS did not settle within the 12-second run (...): run longer (the " \
           "default is 60 s)" in out
    assert "  plot skipped: matplotlib is not installed (...)" in out
    assert not any("drift" in line and "MiB" in line for line in out)  # no figure it lacks


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


@pytest.mark.parametrize("runtime, advice", [
    ("6.4.43483", "pip install 'hip-python==6.4.*'"),
    ("7.2.1", "pip install 'hip-python==7.2.*'"),
    ("5.2.21153", "No hip-python that this package supports matches HIP 5.2: to use the hip "
                  "backend install ROCm 6.4 or newer"),
])
def test_the_hip_version_warning_says_what_to_install(capsys, monkeypatch, runtime, advice):
    _fake_versions(monkeypatch, runtime, "7.15.26333")
    code, info = run_json(capsys, "info", "--backend", "host")
    assert code == 0 and len(info["warnings"]) == 1 and advice in info["warnings"][0]
    assert ("cuda and host backends do not use HIP" in info["warnings"][0]) == \
        runtime.startswith("5.")


def test_a_hip_status_described_by_its_own_name_is_said_once():
    from rocmforge_raw.errors import DeviceError

    said_once = DeviceError("hipGetDeviceCount", 100, "hipErrorNoDevice", "hipErrorNoDevice")
    assert str(said_once) == "hipGetDeviceCount failed: hipErrorNoDevice (100)"
    described = DeviceError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
    assert str(described) == "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"


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
        pytest.skip("hip-python is not installed (the hip extra brings it)")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    stated = [requirements.Requirement(r) for r in project["project"]["optional-dependencies"]
              ["hip"]]
    hip_python, = [r for r in stated if r.name == "hip-python"]
    assert hip_python.specifier.contains(installed), (installed, str(hip_python.specifier))
    assert all(hip_python.specifier.contains(v) for v in ("6.4.4.555.40", "10.0.0.0.1.2"))


def test_bench_transfer_reports_both_layouts_against_the_copy(capsys):
    code, result = run_json(capsys, "bench", "--transfer", "--backend", "host", "--iters", "2")
    assert code == 0 and "cache" not in result  # asked for alone
    consecutive, scattered = result["transfer"]
    for row in (consecutive, scattered):
        assert row["transport"] == "ipc" and row["blocks"] == 128
        assert (row["sender_device"], row["receiver_device"], row["peer_access"]) == (
            DEVICE, DEVICE, None)
        assert row["bytes"] == 128 * 16 * 8 * 2 * 8 * 128 * 2  # blocks, tokens, layers, K/V, ...
        assert row["transfer_gb_per_s"] > 0 and row["copy_gb_per_s"] > 0
        assert row["import_gb_per_s"] <= row["transfer_gb_per_s"]
        assert 0 < row["host_us"] <= row["import_host_us"]  # the import holds the read
        assert row["pct_of_copy"] == pytest.approx(
            100 * row["transfer_gb_per_s"] / row["copy_gb_per_s"])
    assert (consecutive["spans"], scattered["spans"]) == (2 * 8, 128 * 2 * 8)


def test_bench_transfer_from_another_device_adds_peer_rows_against_a_peer_copy(capsys):
    """The host backend's two logical devices: the sender process on device 1, the
    receiver on device 0, then two caches of this process; each row's copy is a peer copy
    of the same bytes."""
    code, result = run_json(capsys, "bench", "--transfer", "--backend", "host", "--iters", "1",
                            "--device", "0", "--from-device", "1")
    assert code == 0
    rows = result["transfer"]
    assert [(r["transport"], r["layout"]) for r in rows] == [
        ("ipc", "consecutive"), ("ipc", "scattered"), ("peer", "consecutive"),
        ("peer", "scattered")]
    for row in rows:
        assert (row["sender_device"], row["receiver_device"], row["peer_access"]) == (1, 0, True)
        assert row["blocks"] == 128 and row["copy_gb_per_s"] > 0
        assert row["pct_of_copy"] == pytest.approx(
            100 * row["transfer_gb_per_s"] / row["copy_gb_per_s"])
    assert rows[2]["spans"] == 2 * 8 and rows[3]["spans"] == 128 * 2 * 8


def test_bench_transfer_ends_with_the_error_its_sender_process_raised():
    """A sender that fails (here: a device the host backend lacks) ends the run at once,
    naming its error, instead of leaving the receiver waiting for the benchmark's timeout."""
    from rocmforge_raw.bench.transfer import bench_transfer

    absent = get_backend("host").num_devices  # the sender's, in its own process: the same
    with pytest.raises(WorkerError, match=rf"^the sender process failed: .*device {absent}") \
            as failed:
        bench_transfer(get_backend("host"), absent, "ipc", 1)
    assert "Traceback" in failed.value.traceback  # the whole of it kept (and logged)


def test_a_failed_sender_process_ends_the_bench_in_one_line(monkeypatch, capsys):
    """A spawned process's failure (``WorkerError``: the sender's traceback already logged)
    is one line of the parser's error, exit status 2, not a traceback of this process."""
    import rocmforge_raw.bench.transfer as transfer

    def failing(*args, **kwargs):
        raise WorkerError("the sender process failed: ValueError: no such thing",
                          "Traceback (most recent call last):\nValueError: no such thing")

    monkeypatch.setattr(transfer, "bench_transfer", failing)
    with pytest.raises(SystemExit) as ended:
        main(["bench", "--transfer", "--backend", "host", "--iters", "1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rocmforge-raw bench: error: the sender process failed: ValueError: no such thing")


# --- what a new user meets first ---------------------------------------------------------------
def cli(*argv, env=None, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_version_is_the_installed_metadata_of_pyproject():
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"rocmforge-raw {metadata.version('rocmforge_raw')}\n"
    import rocmforge_raw
    from rocmforge_raw._version import tree_version

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert rocmforge_raw.__version__ == metadata.version("rocmforge_raw") == \
        tree_version(pyproject)


def test_an_uninstalled_tree_reads_its_version_from_pyproject(tmp_path):
    from rocmforge_raw._version import UNKNOWN, tree_version

    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["x"]\n\n[project]\nname = "rocmforge_raw"\n'
        'version = "1.2.3rc4"\n\n[tool.other]\nversion = "9"\n')
    assert tree_version(tmp_path / "pyproject.toml") == "1.2.3rc4"
    assert tree_version(tmp_path / "missing.toml") == UNKNOWN


def test_help_shows_defaults_and_examples_in_plain_text():
    top = cli("--help").stdout
    assert "``" not in top and "COMMAND --help" in top
    soak_help = cli("soak", "--help", env={"COLUMNS": "200"}).stdout  # unwrapped
    for text in ("(default: 60.0)", "(default: soak-out)", "(default: 8.0)", "(default: 1.0)",
                 "random seed (default: a fresh one each run)", "examples:",
                 "exit status: 0 PASS, 1 FAIL, 2 not judged"):
        assert text in soak_help, text
    for command in ("info", "demo", "bench"):
        assert "examples:\n  rocmforge-raw " + command in cli(command, "--help").stdout


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`rocmforge-raw info --json | head -1`, with the reader gone before anything is
    written: no traceback, the status a SIGPIPE would give."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = cli("info", "--backend", "host", "--json", stdout=write)
    finally:
        os.close(write)
    assert result.returncode == 141 and result.stderr == ""


def test_a_bad_rf_kernels_is_refused_before_any_work():
    result = cli("info", "--backend", "host", env={"RF_KERNELS": "fast"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("rocmforge-raw info: error: RF_KERNELS='fast' is not one of auto, "
                             "prebuilt, jit\n")


def test_verbose_logs_on_stderr_and_json_stays_clean():
    result = cli("info", "--json", "-vv", env={"RF_BACKEND": ""})
    assert result.returncode == 0 and json.loads(result.stdout)["backends"]["host"] == "ok"
    assert "INFO rocmforge_raw.runtime: default backend: " in result.stderr
    quiet = cli("info", "--json", env={"RF_BACKEND": ""})
    assert quiet.stderr == ""


@pytest.mark.parametrize("forced, env, words", [
    ("host", {}, "host backend (--backend host)"),
    (None, {"RF_BACKEND": "host"}, "host backend (RF_BACKEND=host)"),
    (None, {"RF_BACKEND": ""}, "host backend (no GPU answered)"),
])
def test_host_runs_say_why_they_run_on_the_host(monkeypatch, forced, env, words):
    from rocmforge_raw.cli.main import where
    from rocmforge_raw.runtime import get_backend

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert where(get_backend("host"), 0, forced) == words


def test_info_on_a_host_with_no_gpu_says_no_gpu_answered(capsys, monkeypatch):
    from conftest import GPU_BACKENDS

    if GPU_BACKENDS:
        pytest.skip(f"a GPU answers here ({GPU_BACKENDS})")
    monkeypatch.delenv("RF_BACKEND", raising=False)
    assert main(["info"]) == 0
    assert "default backend: host backend (no GPU answered)" in capsys.readouterr().out


def test_every_command_works_with_no_code_objects_and_says_how_to_get_them(
        tmp_path, capsys, monkeypatch):
    """A source install of a fresh clone has no rocmforge_raw/kernels folder at all."""
    from rocmforge_raw.kernels import module

    monkeypatch.setattr(module, "KERNEL_DIR", tmp_path / "kernels")
    code, info = run_json(capsys, "info", "--backend", "host")
    assert code == 0 and info["code_objects"] == []
    assert info["code_objects_note"].startswith("no prebuilt code objects in this install: "
                                                "each kernel is compiled at run time")
    assert "`make kernels`" in info["code_objects_note"]
    assert "install the wheel" not in info["code_objects_note"]  # none is published
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "basic.sm_90.cubin").write_bytes(b"\x7fELF")
    assert run_json(capsys, "info", "--backend", "host")[1]["code_objects_note"] is None


def test_a_kernel_with_no_code_object_and_no_compiler_is_one_line_saying_how(capsys,
                                                                            monkeypatch):
    """A GPU without a fitting code object or a run-time compiler: load_kernels' error, which
    names the arch and `make kernels`, as the command's one line (here raised by the bench)."""
    from rocmforge_raw.cli import bench as cli_bench
    from rocmforge_raw.errors import KernelNotAvailableError

    def missing(*args):
        raise KernelNotAvailableError("no paged_attention code object for cuda arch sm_90 in "
                                      "/x/kernels and run-time compilation failed; build it "
                                      "with `make kernels` (...)")

    monkeypatch.setattr(cli_bench, "run", missing)
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--attention", "--backend", "host"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("rocmforge-raw bench: error: no paged_attention code object for cuda "
                          "arch sm_90") and "`make kernels`" in err


# A binding made unimportable in a fresh process, as on a machine without it.
_WITHOUT = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Absent())
from rocmforge_raw.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("blocked, argv, extra", [
    (("cuda",), ["info", "--backend", "cuda"], "pip install 'rocmforge_raw[cuda]'"),
    (("hip", "rocm"), ["info", "--backend", "hip"], "pip install 'rocmforge_raw[hip]'"),
], ids=["cuda", "hip"])
def test_a_missing_binding_names_the_extra_that_brings_it(blocked, argv, extra):
    result = subprocess.run([sys.executable, "-c", _WITHOUT.format(blocked=blocked, argv=argv)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert extra in result.stderr and "Traceback" not in result.stderr


def test_info_without_hip_python_still_reports_and_names_the_extra():
    code = _WITHOUT.format(blocked=("hip", "rocm"), argv=["info", "--backend", "host",
                                                          "--json"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    info = json.loads(result.stdout)
    assert result.returncode == 0 and info["warnings"] == []
    assert "pip install 'rocmforge_raw[hip]'" in info["backends"]["hip"]
    assert "pip install 'rocmforge_raw[hip]'" in info["hip_runtime"]["error"]


def test_bench_offload_swaps_both_layouts_exactly_against_pinned_copies(capsys):
    code, result = run_json(capsys, "bench", "--offload", "--backend", "host", "--iters", "2")
    assert code == 0 and "cache" not in result  # asked for alone
    consecutive, scattered = result["offload"]
    for row in (consecutive, scattered):
        assert row["blocks"] == 128 and row["verified"] and row["memcpy_only"]
        assert row["bytes"] == 128 * 16 * 8 * 2 * 8 * 128 * 2  # blocks, tokens, layers, K/V, ...
        for way, copy in (("swap_out", "d2h"), ("swap_in", "h2d")):
            assert row[f"{way}_gb_per_s"] > 0 and row[f"{copy}_gb_per_s"] > 0
            assert row[f"{way}_pct"] == pytest.approx(
                100 * row[f"{way}_gb_per_s"] / row[f"{copy}_gb_per_s"])
    assert (consecutive["copies"], scattered["copies"]) == (1, 128)
    code = main(["bench", "--offload", "--backend", "host", "--iters", "1"])
    assert code == 0 and "memcpy between host buffers" in capsys.readouterr().out


def test_demo_reports_multi_turn_prefix_hits_and_swap_traffic(capsys):
    code, summary = run_json(capsys, "demo", "--backend", "host", "--scale", "0.1",
                             "--seed", "5")
    assert code == 0 and summary["turn_checks_passed"] > 0
    assert summary["follow_up_cached_share"] > 0.5 and summary["turn_host_hits"] > 0
    assert summary["turn_swapped_out_blocks"] > 0 and summary["turn_resumed"] > 0
    assert summary["turn_demoted_blocks"] > 0 and summary["turn_copied_bytes"] > 0
    # prefill runs through the multi-token op, in chunks mixed with decodes; the prefix cache
    # served more prompt tokens than were computed
    assert 0 < summary["turn_prefill_tokens"] < summary["turn_cached_prompt_tokens"]
    assert summary["turn_mixed_steps"] > 0
    # the measured saving: the longest conversation's last prompt, whole and past its hit
    assert 0 < summary["prefix_hit_cached_tokens"] < summary["prefix_hit_prompt_tokens"]
    assert summary["prefix_hit_cached_tokens"] % 16 == 0
    assert summary["prefill_whole_ms"] > 0 and summary["prefill_past_hit_ms"] > 0
    assert summary["prefix_hit_saved_ms"] == pytest.approx(
        summary["prefill_whole_ms"] - summary["prefill_past_hit_ms"])


def test_bench_over_mooncake_without_the_engine_says_so_in_one_line(tmp_path):
    """No Mooncake (a package that cannot be imported shadows it): one line naming what to
    install, status 2, before any worker process starts."""
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("raise ImportError('no engine here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-m", "rocmforge_raw.cli", "bench", "--transfer",
                             "--transport", "mooncake", "--backend", "host"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Mooncake's Transfer Engine cannot be loaded (no engine here)" in result.stderr


def test_iterations_past_what_a_heavy_bench_takes_are_capped_and_said():
    from rocmforge_raw.cli.bench import HEAVY_ITERS, _heavy

    lines = []
    assert _heavy(HEAVY_ITERS, "--offload", lines) == HEAVY_ITERS and lines == []
    assert _heavy(HEAVY_ITERS + 30, "--offload", lines) == HEAVY_ITERS
    assert lines == [f"bench --offload: --iters {HEAVY_ITERS + 30} capped at {HEAVY_ITERS} "
                     "(each run times a whole workload)"]
    assert "take at most 20 and say so" in " ".join(cli("bench", "--help").stdout.split())
