"""gpuformers.device and gpuformers.doctor without a GPU: dtypes, devices, --gpus, env / doctor on faked GPUs.

FakeCuda stands in for torch.cuda. The 4-GPU machine below has its GPUs on the PCI bus in one order and CUDA's
fastest-first order in another, the case where cuda:i and nvidia-smi's index i name different cards.
"""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from gpuformers import device
from gpuformers.device import (GPUInfo, NvidiaGPU, NvidiaReport, default_dtype, gpu_info, nvidia_gpus, parse_dtype,
                               parse_nvidia_smi, resolve_device, resolve_dtype, select_gpus, visible_devices_problems)
from gpuformers.doctor import doctor, env_report

GIB = 2**30


def _gpu(name: str, cc: tuple[int, int], bus: int, gib: int = 80) -> SimpleNamespace:
    return SimpleNamespace(name=name, major=cc[0], minor=cc[1], total_memory=gib * GIB, pci_domain_id=0,
                           pci_bus_id=bus, pci_device_id=0, uuid=f"GPU-{bus:04x}")


class FakeCuda:
    """The part of torch.cuda that device.py uses."""

    def __init__(self, gpus=(), *, initialized=False, current=0, full=()):
        self.gpus, self.initialized, self.current, self.full = list(gpus), initialized, current, set(full)

    def is_available(self):
        return bool(self.gpus)

    def device_count(self):
        return len(self.gpus)

    def get_device_properties(self, index):
        return self.gpus[index]

    def get_device_capability(self, index):
        return self.gpus[index].major, self.gpus[index].minor

    def mem_get_info(self, index):
        if index in self.full:
            raise RuntimeError("CUDA error: out of memory")
        return self.gpus[index].total_memory - GIB, self.gpus[index].total_memory

    def current_device(self):
        return self.current

    def is_initialized(self):
        return self.initialized

    def init(self):
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040)")


# Physical (PCI bus) order: nvidia-smi 0 = RTX 3090 @18, 1 = A100 @3B, 2 = V100 @86, 3 = A100 @AF.
PHYSICAL = [("NVIDIA GeForce RTX 3090", (8, 6), 0x18), ("NVIDIA A100-SXM4-80GB", (8, 0), 0x3B),
            ("Tesla V100-SXM2-32GB", (7, 0), 0x86), ("NVIDIA A100-SXM4-80GB", (8, 0), 0xAF)]
# CUDA's default FASTEST_FIRST order puts both A100s first: cuda:0..3 = nvidia-smi 1, 3, 0, 2.
FASTEST_FIRST = [1, 3, 0, 2]


def smi_report(physical=PHYSICAL) -> NvidiaReport:
    return NvidiaReport("nvidia-smi", "550.54.15", [
        NvidiaGPU(i, f"00000000:{bus:02X}:00.0", f"GPU-{bus:04x}", name, 80 * GIB, 79 * GIB)
        for i, (name, _, bus) in enumerate(physical)])


def four_gpus(order=FASTEST_FIRST, **kwargs) -> FakeCuda:
    return FakeCuda([_gpu(*PHYSICAL[i]) for i in order], **kwargs)


def report_for(cuda, environ=None, nvidia=smi_report, **versions):
    base = {"torch": "2.13.0", "torch_cuda": "12.6", "triton": "3.4.0", "flash_attn": "2.8.0"}
    return env_report(cuda=cuda, probe_nvidia=nvidia, environ=environ or {}, versions={**base, **versions})


def checks(findings, level):
    return {f.check: f for f in findings if f.level == level}


# ------------------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("text, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32), ("float16", torch.float16),
    ("fp16", torch.float16), ("half", torch.float16), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
    ("torch.float16", torch.float16), (" BF16 ", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    ("auto", "auto"), (None, "auto"),
])
def test_parse_dtype_accepts_the_usual_spellings(text, expected):
    assert parse_dtype(text) == expected


@pytest.mark.parametrize("bad", ["bf17", "int8", "", "torch.float8_e4m3fn", 16])
def test_parse_dtype_error_names_the_value_and_the_choices(bad):
    with pytest.raises(ValueError) as error:
        parse_dtype(bad)
    assert str(error.value) == f'dtype "{bad}" is not one of: auto, float32, float16, bfloat16'


def test_parse_dtype_rejects_integer_torch_dtypes():
    with pytest.raises(ValueError, match="torch.int8 is not a compute dtype"):
        parse_dtype(torch.int8)


def test_default_dtype_follows_compute_capability():
    cuda = four_gpus()  # cuda:0 A100 (8.0), cuda:2 RTX 3090 (8.6), cuda:3 V100 (7.0)
    assert default_dtype(None) == torch.float32
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda:0", cuda=cuda) == torch.bfloat16
    assert default_dtype(2, cuda=cuda) == torch.bfloat16
    assert default_dtype("cuda:3", cuda=cuda) == torch.float16
    # several GPUs: the oldest decides
    assert default_dtype({"model.layers.0": 0, "model.layers.1": 3, "lm_head": "cpu"}, cuda=cuda) == torch.float16
    assert default_dtype({"model.layers.0": 0, "model.layers.1": "disk"}, cuda=cuda) == torch.bfloat16
    assert default_dtype("auto", cuda=cuda) == torch.float16
    assert default_dtype("auto", cuda=FakeCuda()) == torch.float32


def test_resolve_dtype_auto_uses_the_checkpoint_then_the_device():
    cuda = four_gpus()
    assert resolve_dtype(torch.float16, checkpoint_dtype="bfloat16") == torch.float16  # the user's word wins
    assert resolve_dtype("auto", checkpoint_dtype="bfloat16", device="cpu") == torch.bfloat16
    assert resolve_dtype("auto", checkpoint_dtype=torch.float32, device="cuda:0", cuda=cuda) == torch.float32
    assert resolve_dtype("auto", device="cuda:0", cuda=cuda) == torch.bfloat16
    assert resolve_dtype("auto", device="cuda:3", cuda=cuda) == torch.float16
    assert resolve_dtype(None) == torch.float32


def test_resolve_dtype_bfloat16_checkpoint_on_an_old_gpu_becomes_float16_with_a_warning():
    with pytest.warns(UserWarning, match=r"cuda:3 \(compute capability 7.0\) has no bfloat16 support"):
        assert resolve_dtype("auto", checkpoint_dtype="bfloat16", device="cuda:3", cuda=four_gpus()) == torch.float16


def test_resolve_dtype_names_a_checkpoint_dtype_it_cannot_load():
    with pytest.raises(ValueError, match='checkpoint says dtype "float8_e4m3fn"'):
        resolve_dtype("auto", checkpoint_dtype="float8_e4m3fn")


# ----------------------------------------------------------------------------------------------------- devices


def test_resolve_device_accepted_forms():
    cuda = FakeCuda([_gpu(*PHYSICAL[1]), _gpu(*PHYSICAL[3])], current=1)
    cpu, gpu1 = torch.device("cpu"), torch.device("cuda", 1)
    for value in (None, "cpu", " CPU ", torch.device("cpu"), {"": "cpu"}):
        assert resolve_device(value, cuda=cuda) == cpu
    for value in ("cuda", "cuda:1", 1, torch.device("cuda", 1), {"": 1}, {"": "cuda:1"}):
        assert resolve_device(value, cuda=cuda) == gpu1  # "cuda" is the current device, here 1
    assert resolve_device("cuda:0", cuda=cuda) == torch.device("cuda", 0)


def test_resolve_device_names_the_gpu_count():
    with pytest.raises(RuntimeError, match=r"cuda:5 does not exist: 2 CUDA GPU\(s\) are visible \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:5", cuda=FakeCuda([_gpu(*PHYSICAL[1]), _gpu(*PHYSICAL[3])]))


@pytest.mark.parametrize("torch_cuda, visible, fix", [
    (None, None, "CPU-only build"),
    ("12.6", "", "hides every GPU"),
    ("12.6", "-1", "hides every GPU"),
    ("12.6", "0", "driver supports CUDA 12.6"),
])
def test_resolve_device_cuda_without_a_gpu_says_why_and_how_to_fix(monkeypatch, torch_cuda, visible, fix):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset-me")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(RuntimeError) as error:
        resolve_device("cuda", cuda=FakeCuda())
    message = str(error.value)
    assert "no CUDA GPU is visible" in message and fix in message and 'device_map="cpu"' in message
    assert f"CUDA_VISIBLE_DEVICES={'(not set)' if visible is None else repr(visible)}" in message
    assert f"torch.version.cuda={torch_cuda!r}" in message


@pytest.mark.parametrize("bad", ["mps", "gpu", "cuda:x", -1, True, 1.5, torch.device("meta"), {"a": 0, "b": 1}])
def test_resolve_device_rejects_other_forms_listing_the_accepted_ones(bad):
    with pytest.raises(ValueError, match=r'accepted: None, "cpu", "cuda", "cuda:N"'):
        resolve_device(bad, cuda=FakeCuda([_gpu(*PHYSICAL[0])]))


# ------------------------------------------------------------------------------------------------------- --gpus


def test_select_gpus_sets_the_variables_for_this_process():
    environ = {}
    select_gpus(" 1, 0 ", environ=environ, cuda=FakeCuda())
    assert environ == {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "GPUFORMERS_GPUS": "1,0"}
    select_gpus("", environ=environ, cuda=FakeCuda())
    assert environ["CUDA_VISIBLE_DEVICES"] == ""
    select_gpus("GPU-8a1b,2", environ=environ, cuda=FakeCuda())  # "" hid every GPU: --gpus may choose any
    assert environ["CUDA_VISIBLE_DEVICES"] == "GPU-8a1b,2"


@pytest.mark.parametrize("bad", ["a", "0,0", "0;1", "-1", "0,,1"])
def test_select_gpus_rejects_bad_lists(bad):
    environ = {}
    with pytest.raises(ValueError, match=f'--gpus "{bad}" is not a comma-separated list'):
        select_gpus(bad, environ=environ, cuda=FakeCuda())
    assert environ == {}


def test_select_gpus_refuses_once_cuda_is_initialised():
    environ = {}
    with pytest.raises(RuntimeError, match="CUDA is already initialised"):
        select_gpus("0", environ=environ, cuda=FakeCuda(initialized=True))
    assert environ == {}


@pytest.mark.parametrize("value, count, problem", [
    ("0,1", 4, None), ("", 4, None), ("-1", 4, None), ("GPU-0018", 4, None), ("3,1", None, None),
    ("0,7", 4, "entry 7 is past the last GPU (nvidia-smi lists 4: 0 to 3)"),
    ("0,0", 4, "entry 0 appears twice"),
    ("0,x", 4, "entry 'x' is neither a GPU index nor a GPU-/MIG- UUID"),
    ("1,-1", 4, "entry -1 is negative"),
    ("GPU-ffff", 4, "no GPU has a UUID starting with GPU-ffff"),
    ("0,,1", 4, "entry '' is neither"),
])
def test_visible_devices_problems(value, count, problem):
    problems = visible_devices_problems(value, count, tuple(g.uuid for g in smi_report().gpus))
    assert (problems == []) if problem is None else any(p.startswith(problem) for p in problems), problems


# --------------------------------------------------------------------------------------------- GPU discovery


SMI_TEXT = """0, 00000000:18:00.0, GPU-0018, NVIDIA GeForce RTX 3090, 24576, 24000, 550.54.15
1, 00000000:3B:00.0, GPU-003b, NVIDIA A100-SXM4-80GB, 81920, [N/A], 550.54.15
"""


def test_parse_nvidia_smi():
    report = parse_nvidia_smi(SMI_TEXT)
    assert report.driver == "550.54.15" and report.source == "nvidia-smi"
    assert report.gpus[1] == NvidiaGPU(1, "00000000:3B:00.0", "GPU-003b", "NVIDIA A100-SXM4-80GB", 80 * GIB, None)
    assert report.gpus[0].free_memory == 24000 * 2**20


def test_nvidia_gpus_runs_nvidia_smi_when_present(monkeypatch):
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        return SimpleNamespace(returncode=0, stdout=SMI_TEXT)

    report = nvidia_gpus(run=run)
    assert [g.index for g in report.gpus] == [0, 1]
    assert calls[0][0] == "nvidia-smi" and calls[0][1].startswith("--query-gpu=index,pci.bus_id")


def test_nvidia_gpus_falls_back_to_nvml_then_to_none(monkeypatch):
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert nvidia_gpus() is None
    handles = {0: ("0000:af:00.0", b"GPU-00af", b"NVIDIA A100-SXM4-80GB")}
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=handles[h][0])
    nvml.nvmlDeviceGetUUID = lambda h: handles[h][1]
    nvml.nvmlDeviceGetName = lambda h: handles[h][2]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80 * GIB, free=GIB)
    nvml.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    report = nvidia_gpus()
    assert report == NvidiaReport("nvml", "550.54.15", [
        NvidiaGPU(0, "00000000:AF:00.0", "GPU-00af", "NVIDIA A100-SXM4-80GB", 80 * GIB, GIB)])


def test_gpu_info_from_device_properties():
    gpus = gpu_info(four_gpus(full={1}))
    assert gpus[0] == GPUInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB, 79 * GIB, True, "00000000:3B:00.0",
                              "GPU-003b")
    assert gpus[1].free_memory is None  # mem_get_info failed on a full GPU: unknown, not a crash
    assert [g.bf16 for g in gpus] == [True, True, True, False]
    assert gpu_info(FakeCuda()) == []


# --------------------------------------------------------------------------------------------- env and doctor


def test_env_report_joins_cuda_and_nvidia_smi_numbering_on_the_pci_bus():
    report = report_for(four_gpus(), {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    json.dumps(report)  # --json must be able to print it
    assert report["cuda_available"] is True and report["device_count"] == 4
    assert [g["nvidia_smi_index"] for g in report["gpus"]] == FASTEST_FIRST
    assert report["environ"] == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert report["versions"]["driver"] == "550.54.15" and report["nvidia"]["source"] == "nvidia-smi"


def test_env_report_without_gpu_or_nvidia_smi():
    report = report_for(FakeCuda(), nvidia=lambda: None, torch_cuda=None)
    assert (report["cuda_available"], report["device_count"], report["gpus"], report["nvidia"]) == (False, 0, [], None)
    assert report["versions"]["driver"] is None


def test_env_report_survives_a_broken_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    report = env_report(probe_nvidia=lambda: None, environ={})
    assert report["torch_error"].startswith("ModuleNotFoundError: import of torch") and report["gpus"] == []
    assert checks(doctor(report), "fail")["torch"].message.startswith("import torch fails")


def test_doctor_four_gpus_in_fastest_first_order_prints_the_mapping():
    findings = doctor(report_for(four_gpus()))
    warning = checks(findings, "warn")["CUDA_DEVICE_ORDER"]
    assert "(here they differ)" in warning.message and "PCI_BUS_ID" in warning.fix
    assert "cuda:0 -> nvidia-smi 1 -> 00000000:3B:00.0" in warning.message
    assert "cuda:3 -> nvidia-smi 2 -> 00000000:86:00.0 (Tesla V100-SXM2-32GB)" in warning.message
    assert "cuda:3" in checks(findings, "warn")["capability"].message  # the V100: no bf16, no FA2
    assert not checks(findings, "fail")


def test_doctor_is_quiet_about_order_with_pci_bus_id():
    findings = doctor(report_for(four_gpus([0, 1, 2, 3]), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert "CUDA_DEVICE_ORDER" not in checks(findings, "warn")
    # even in PCI order, several GPUs without the variable still get the warning: the next machine may differ
    assert "CUDA_DEVICE_ORDER" in checks(doctor(report_for(four_gpus([0, 1, 2, 3]))), "warn")


def test_doctor_warns_about_an_exported_cuda_visible_devices_but_not_about_gpus():
    exported = doctor(report_for(four_gpus([1, 0]), {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert "export -p" in checks(exported, "warn")["CUDA_VISIBLE_DEVICES"].fix
    flag = doctor(report_for(four_gpus([1, 0]), {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                  "GPUFORMERS_GPUS": "1,0"}))
    assert "CUDA_VISIBLE_DEVICES" not in checks(flag, "warn")
    assert "chosen by --gpus" in checks(flag, "ok")["CUDA_VISIBLE_DEVICES"].message


@pytest.mark.parametrize("visible, level, text", [
    ("0,7", "fail", "entry 7 is past the last GPU"),
    ("0,x", "fail", "neither a GPU index"),
    ("", "warn", "hides every GPU"),
])
def test_doctor_checks_the_cuda_visible_devices_value(visible, level, text):
    findings = doctor(report_for(four_gpus([0]), {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert any(f.level == level and text in f.message for f in findings), findings


def test_doctor_fails_on_a_cpu_only_torch_with_a_gpu_present():
    found = checks(doctor(report_for(FakeCuda(), torch_cuda=None)), "fail")
    assert "CPU-only build" in found["torch"].message and "download.pytorch.org" in found["torch"].fix


def test_doctor_fails_when_the_driver_is_too_old_for_torch():
    found = checks(doctor(report_for(FakeCuda())), "fail")
    assert "driver on your system is too old" in found["CUDA"].message and "12.6" in found["CUDA"].fix


def test_doctor_flags_unknown_device_order_and_missing_packages():
    findings = doctor(report_for(four_gpus([1]), {"CUDA_DEVICE_ORDER": "PCI"}, triton=None, flash_attn=None))
    warned = checks(findings, "warn")
    assert "not a value CUDA knows" in warned["CUDA_DEVICE_ORDER"].message
    assert "pip install triton" in warned["triton"].fix and "flash-attn" in warned["flash_attn"].fix


def test_doctor_on_a_cpu_machine_has_no_failure_or_warning():
    findings = doctor(report_for(FakeCuda(), nvidia=lambda: None, torch_cuda=None, triton=None, flash_attn=None))
    assert {f.level for f in findings} <= {"ok", "info"}
