"""`rocmforge-raw info`'s next step for each kind of install (rocmforge_raw.cli.nextstep): CPU
only, an NVIDIA GPU the cuda backend cannot use, an AMD GPU the hip backend cannot use, a GPU
without code objects for its arch, a ready one; never "install the wheel" (none is
published)."""

from __future__ import annotations

import json

import pytest

from rocmforge_raw.cli import info as cli_info
from rocmforge_raw.cli.main import main
from rocmforge_raw.cli.nextstep import Machine, next_steps, probe

NO_GPU = {"hip": "no HIP device answers: ...", "cuda": "no CUDA device answers: ...",
          "host": "ok"}
INSTALLED = {"cuda-bindings": "13.0.3", "hip-python": "6.4.4"}
ABSENT = {"cuda-bindings": "not installed", "hip-python": "not installed"}


BARE = Machine()  # no GPU found


def steps(machine=BARE, backends=NO_GPU, devices=(), versions=INSTALLED,
          missing=lambda arch: [], compiler_error=lambda backend: None):
    return next_steps(backends, list(devices), machine, versions, missing, compiler_error)


def test_cpu_only_names_the_host_backend_and_what_each_gpu_needs():
    cpu, nvidia, amd = steps()
    assert cpu.startswith("CPU only: everything runs on the host backend")
    assert nvidia.startswith("for an NVIDIA GPU: install the cuda extra: pip install "
                             "'cuda-python<14,>=13' 'nvidia-cuda-nvrtc<14,>=13' (or pip install "
                             "'.[cuda]' in a clone)")
    assert nvidia.endswith("its cuda-python 13 (CUDA 13.0) needs NVIDIA driver 580.65 or newer")
    assert amd == ("for an AMD GPU: install ROCm 6.4 or newer and the hip-python release "
                   "numbered as it (pip install 'hip-python==6.4.*' for ROCm 6.4)")


def test_an_nvidia_gpu_without_cuda_python_is_told_to_install_the_cuda_extra():
    step, = steps(Machine(nvidia_driver="580.95.05", nvidia_gpus=1), versions=ABSENT)
    assert step.startswith("an NVIDIA GPU is here (driver 580.95.05) but the cuda backend does "
                           "not answer: cuda-python is not installed; install the cuda extra: "
                           "pip install 'cuda-python<14,>=13'")
    assert "update the NVIDIA driver" not in step


def test_an_nvidia_driver_older_than_cuda_13s_floor_is_named():
    step, = steps(Machine(nvidia_driver="575.57.08", nvidia_gpus=1), versions=ABSENT)
    assert step.endswith("but first update the NVIDIA driver: 575.57.08 is older than 580.65, "
                         "the oldest that its cuda-python 13 (CUDA 13.0) runs on")


def test_an_nvidia_gpu_whose_backend_fails_with_cuda_python_says_why():
    backends = {**NO_GPU, "cuda": "no CUDA device answers: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"}
    step, = steps(Machine(nvidia_driver="560.35.03", nvidia_gpus=1), backends)
    assert "(no CUDA device answers: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)" in step
    assert "560.35.03 is older than 580.65" in step


@pytest.mark.parametrize("rocm, advice", [
    ("6.4.1", "pip install 'hip-python==6.4.*' (the hip-python release of ROCm 6.4.1)"),
    ("5.2.3", "ROCm 5.2.3 is older than 6.4, the oldest whose hip-python this package "
              "supports: install ROCm 6.4 or newer and its hip-python"),
    (None, "install ROCm 6.4 or newer and the hip-python release numbered as it"),
], ids=["rocm-6.4", "rocm-5.2", "no-rocm"])
def test_an_amd_gpu_without_hip_python_is_told_the_release_of_its_rocm(rocm, advice):
    step, = steps(Machine(amd_archs=("gfx942", "gfx942"), rocm=rocm), versions=ABSENT)
    assert step.startswith("an AMD GPU is here (gfx942, ") and "hip-python is not installed" in step
    assert advice in step


@pytest.mark.parametrize("backend, arch, compiler", [("cuda", "sm_89", "NVRTC"),
                                                     ("hip", "gfx1201", "hiprtc")])
def test_a_gpu_without_code_objects_for_its_arch_compiles_them_at_first_use(backend, arch,
                                                                           compiler):
    device = {"backend": backend, "index": 0, "arch": arch}
    step, = steps(backends={**NO_GPU, backend: "ok"}, devices=[device],
                  missing=lambda a: ["paged_attention", "prefill"] if a == arch else [])
    assert step.startswith(f"{backend}:0 ({arch}) has no prebuilt code object for "
                           f"paged_attention, prefill: each compiles at run time on first use "
                           f"with {compiler}")
    assert "`make kernels` in a clone builds them ahead" in step and "no run-time" not in step
    failed, = steps(backends={**NO_GPU, backend: "ok"}, devices=[device],
                    missing=lambda a: ["prefill"], compiler_error=lambda b: "NVRTC is absent")
    assert failed.endswith("; but no run-time compiler loads here: NVRTC is absent")


def test_a_gpu_with_every_code_object_is_ready():
    step, = steps(backends={**NO_GPU, "cuda": "ok"},
                  devices=[{"backend": "cuda", "index": 1, "arch": "sm_90"}])
    assert step == ("ready: cuda:1 (sm_90) has prebuilt code objects for every kernel: try "
                    "`rocmforge-raw demo`")


def test_the_machine_is_read_from_the_drivers_files(tmp_path):
    (tmp_path / "sys/module/nvidia").mkdir(parents=True)
    (tmp_path / "sys/module/nvidia/version").write_text("580.65.06\n")
    (tmp_path / "proc/driver/nvidia/gpus/0000:17:00.0").mkdir(parents=True)
    for node, version in (("0", 0), ("1", 90402), ("2", 90010), ("3", 110000)):
        (tmp_path / f"sys/class/kfd/kfd/topology/nodes/{node}").mkdir(parents=True)
        (tmp_path / f"sys/class/kfd/kfd/topology/nodes/{node}/properties").write_text(
            f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 304\n")
    (tmp_path / "opt/rocm-6.4.1/.info").mkdir(parents=True)
    (tmp_path / "opt/rocm-6.4.1/.info/version").write_text("6.4.1-120\n")
    assert probe(tmp_path) == Machine("580.65.06", 1, ("gfx942", "gfx90a", "gfx1100"), "6.4.1")


def test_the_nvidia_driver_version_is_read_from_proc_without_sys(tmp_path):
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build\n")
    assert probe(tmp_path) == Machine("575.57.08", 0, (), None)
    assert probe(tmp_path / "nowhere") == Machine()


def test_a_close_arch_uses_the_code_object_of_its_major(tmp_path, monkeypatch):
    """sm_89 runs sm_80 cubins: not missing; gfx1201 has none."""
    from rocmforge_raw.kernels import module

    monkeypatch.setattr(module, "KERNEL_DIR", tmp_path)
    for kernel in cli_info.KERNELS:
        (tmp_path / f"{kernel}.sm_80.cubin").write_bytes(b"\x7fELF")
    assert cli_info._missing("sm_89") == []
    assert cli_info._missing("gfx1201") == list(cli_info.KERNELS)


def test_info_prints_its_next_steps_and_never_says_to_install_a_wheel(capsys, tmp_path,
                                                                       monkeypatch):
    from rocmforge_raw.kernels import module

    monkeypatch.setattr(module, "KERNEL_DIR", tmp_path / "kernels")  # a fresh clone's install
    assert main(["info", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["next_steps"] and all(isinstance(s, str) for s in result["next_steps"])
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "\nnext step:\n  " in text and "install the wheel" not in text
    note = result["code_objects_note"]
    assert "`make kernels`" in note and "`make wheel` builds a wheel" in note
