"""What a user on a real GPU machine meets, simulated: --gpus inside a CUDA_VISIBLE_DEVICES a scheduler already set,
MIG instances, a torch build without kernels for the GPU, torch without PCI fields, a driver too old for torch's
CUDA, a CPU-only torch on driver 580. FakeCuda (tests/test_device.py) stands in for torch.cuda; one test puts a fake
nvidia-smi on PATH and runs `gpuformers doctor` in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gpuformers import cli
from gpuformers.device import arch_supported, gpu_info, select_gpus
from gpuformers.doctor import doctor
from tests.test_device import GIB, FakeCuda, checks, four_gpus, report_for, smi_report

# torch.cuda.get_arch_list() of a CUDA 13.0 build and of a CUDA 12.6 build
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_110", "sm_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


class ArchCuda(FakeCuda):
    def __init__(self, gpus, arch_list):
        super().__init__(gpus)
        self.arch_list = arch_list

    def get_arch_list(self):
        return self.arch_list


# ------------------------------------------------------------------------- --gpus inside an existing selection


@pytest.mark.parametrize("existing, chosen, visible", [
    ("4,5,6,7", "5,7", "5,7"),  # SLURM gave this job 4-7 (no device cgroup): pick within them
    ("GPU-8a1b2c3d-1111", "GPU-8a1b", "GPU-8a1b"),  # a UUID abbreviation of one in the list
    ("", "0", "0"),  # "" hides every GPU: an explicit --gpus may bring them back
    ("-1", "1", "1"),
])
def test_gpus_within_an_existing_cuda_visible_devices(existing, chosen, visible):
    environ = {"CUDA_VISIBLE_DEVICES": existing}
    select_gpus(chosen, environ=environ, cuda=FakeCuda())
    assert environ["CUDA_VISIBLE_DEVICES"] == visible and environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_gpus_outside_an_existing_cuda_visible_devices_is_refused(monkeypatch, capsys):
    # before: CUDA_VISIBLE_DEVICES=0,1 silently replaced the job's 4,5: the run landed on another job's GPUs
    environ = {"CUDA_VISIBLE_DEVICES": "4,5"}
    monkeypatch.setattr(os, "environ", environ)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--gpus", "0,5", "env"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "picks 0, outside CUDA_VISIBLE_DEVICES='4,5'" in err and "choose among 4,5" in err
    assert environ == {"CUDA_VISIBLE_DEVICES": "4,5"}
    with pytest.raises(ValueError, match="picks 1, outside"):  # an index is not a UUID: same form, or unset it
        select_gpus("1", environ={"CUDA_VISIBLE_DEVICES": "GPU-8a1b"}, cuda=FakeCuda())


# ------------------------------------------------------------------------------------------------------- MIG


def test_doctor_accepts_mig_instances_in_cuda_visible_devices():
    # nvidia-smi --query-gpu lists whole GPUs (GPU-... UUIDs); a MIG- UUID is never among them
    for visible in ("MIG-5c4a9d2e-0a1b-5f6c-8d7e-123456789abc", "MIG-GPU-0018/1/0"):
        findings = doctor(report_for(four_gpus([0]), {"CUDA_VISIBLE_DEVICES": visible, "GPUFORMERS_GPUS": visible}))
        assert "CUDA_VISIBLE_DEVICES" not in checks(findings, "fail"), findings
    findings = doctor(report_for(four_gpus([0]), {"CUDA_VISIBLE_DEVICES": "GPU-ffff", "GPUFORMERS_GPUS": "GPU-ffff"}))
    assert "no GPU has a UUID starting with GPU-ffff" in checks(findings, "fail")["CUDA_VISIBLE_DEVICES"].message


FAKE_SMI = """#!/bin/sh
# the fields gpuformers asks for, of one H200 split into MIG instances
echo "0, 00000000:19:00.0, GPU-4e2b1a3c-1111-2222-3333-444455556666, NVIDIA H200, 143771, 140000, 580.65.06"
"""


def test_doctor_with_a_fake_nvidia_smi_on_path_accepts_a_mig_uuid(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": "MIG-5c4a9d2e-0a1b-5f6c-8d7e-123456789abc"}
    done = subprocess.run([sys.executable, "-m", "gpuformers", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    findings = json.loads(done.stdout)
    assert not [f for f in findings if f["check"] == "CUDA_VISIBLE_DEVICES" and f["level"] == "fail"], findings
    # this machine's torch is a CPU build: with driver 580 the fix names the CUDA 13.0 wheels
    torch_check = next(f for f in findings if f["check"] == "torch")
    if torch_check["level"] == "fail":
        assert "whl/cu130" in torch_check["fix"] and "driver 580.65.06" in torch_check["fix"]


# ------------------------------------------------------------------------------ torch builds and the driver


@pytest.mark.parametrize("capability, arch_list, supported", [
    ((7, 0), CU130, False),  # V100 on a cu130 wheel: CUDA 13 dropped Volta
    ((7, 0), CU126, True),
    ((8, 9), CU130, True),  # L40S runs the sm_86 cubin
    ((9, 0), ["sm_90a"], True), ((9, 0), ["sm_80", "compute_80"], True),  # PTX compiles for newer GPUs
    ((10, 0), ["sm_90a"], False), ((6, 1), ["sm_70", "compute_70"], False),
    ((9, 0), [], None),
])
def test_arch_supported(capability, arch_list, supported):
    assert arch_supported(capability, arch_list) is supported


def test_doctor_fails_on_a_gpu_this_torch_has_no_kernels_for():
    # before: is_available() is True, so doctor said ok and only warned "no bfloat16"; every kernel then fails
    v100 = [SimpleNamespace(name="Tesla V100-SXM2-32GB", major=7, minor=0, total_memory=32 * GIB, pci_domain_id=0,
                            pci_bus_id=0x86, pci_device_id=0, uuid="GPU-0086")]
    found = checks(doctor(report_for(ArchCuda(v100, CU130), torch="2.11.0+cu130", torch_cuda="13.0")), "fail")
    assert "cuda:0 Tesla V100-SXM2-32GB is sm_70" in found["capability"].message
    assert "sm_75 sm_80" in found["capability"].message and "cu126" in found["capability"].fix
    h200 = [SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 * GIB, pci_domain_id=0,
                            pci_bus_id=0x19, pci_device_id=0, uuid="GPU-0019")]
    assert not checks(doctor(report_for(ArchCuda(h200, CU130), torch_cuda="13.0")), "fail")


def test_env_joins_on_the_uuid_when_torch_has_no_pci_fields():
    # torch without pci_bus_id on its device properties; str(props.uuid) has no "GPU-" prefix
    old_torch = [SimpleNamespace(name=n, major=cc[0], minor=cc[1], total_memory=80 * GIB, uuid=f"{bus:04x}")
                 for n, cc, bus in ([("NVIDIA A100-SXM4-80GB", (8, 0), 0xAF), ("NVIDIA GeForce RTX 3090", (8, 6), 0x18)])]
    assert [g.uuid for g in gpu_info(FakeCuda(old_torch))] == ["GPU-00af", "GPU-0018"]
    report = report_for(FakeCuda(old_torch))
    assert [g["nvidia_smi_index"] for g in report["gpus"]] == [3, 0]  # before: [None, None], "?" in `env`


def test_doctor_names_the_driver_and_the_wheel_when_the_driver_is_too_old():
    too_old = replace(smi_report(), driver="570.86.10")
    found = checks(doctor(report_for(FakeCuda(), nvidia=lambda: too_old, torch_cuda="13.0")), "fail")
    assert "driver 570.86.10 is too old for torch's CUDA 13.0, which needs driver >= 580" in found["CUDA"].fix
    assert "whl/cu128" in found["CUDA"].fix
    # a new enough driver: the cause is elsewhere (the container, the error CUDA gives)
    found = checks(doctor(report_for(FakeCuda(), torch_cuda="12.6")), "fail")
    assert "update the NVIDIA driver" in found["CUDA"].fix and "too old for" not in found["CUDA"].fix


def test_cpu_only_torch_fix_names_the_wheel_for_the_driver():
    new_driver = replace(smi_report(), driver="580.65.06")
    found = checks(doctor(report_for(FakeCuda(), nvidia=lambda: new_driver, torch_cuda=None)), "fail")
    assert "whl/cu130" in found["torch"].fix  # before: always cu126


def test_doctor_warns_about_gpus_other_processes_fill_and_gpus_triton_cannot_use():
    busy = four_gpus([0, 1], full={1})
    busy.gpus[0] = SimpleNamespace(**{**vars(busy.gpus[0]), "total_memory": 80 * GIB})
    busy.mem_get_info = lambda i: (3 * GIB, 80 * GIB) if i == 0 else FakeCuda.mem_get_info(busy, i)
    memory = [f.message for f in doctor(report_for(busy)) if f.check == "memory"]
    assert memory == ["cuda:0 NVIDIA GeForce RTX 3090 (nvidia-smi 0): only 3.00 GiB of 80.00 GiB free: other "
                      "processes use it", "cuda:1 NVIDIA A100-SXM4-80GB (nvidia-smi 1): free memory unknown (CUDA "
                      "could not create a context: full, or in exclusive mode)"]
    p100 = [SimpleNamespace(name="Tesla P100-PCIE-16GB", major=6, minor=0, total_memory=16 * GIB, pci_domain_id=0,
                            pci_bus_id=0x18, pci_device_id=0, uuid="GPU-0018")]
    warned = checks(doctor(report_for(FakeCuda(p100))), "warn")["capability"].message
    assert "no Triton kernels and no torch.compile (Triton needs 7.0)" in warned
    assert "Triton" not in checks(doctor(report_for(four_gpus([2]))), "warn")["capability"].message  # V100: 7.0
