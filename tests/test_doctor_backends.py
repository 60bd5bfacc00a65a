"""`gpuformers env` / `doctor`: each attention backend and kernel set, judged for the first visible GPU (or the
CPU), says whether it can run and why not (package missing, GPU too old, Triton missing)."""

from __future__ import annotations

from gpuformers import cli
from gpuformers.doctor import doctor, env_report
from gpuformers.layers import flash_attention
from tests.test_device import FakeCuda, _gpu


def _backends(cuda, monkeypatch, installed=(), triton="3.7.1", environ=None):
    monkeypatch.setattr(flash_attention, "_installed", lambda module: module in installed)
    report = env_report(cuda=cuda, probe_nvidia=lambda: None, environ=environ or {},
                        versions={"torch": "2.13.0", "torch_cuda": "12.6", "triton": triton, "flash_attn": None})
    return report, {b["name"]: b for b in report["backends"]}


def test_on_an_h100_with_flash_attn_cute_fa4_runs_and_fa3_needs_its_package(monkeypatch):
    h100 = FakeCuda([_gpu("NVIDIA H100 80GB HBM3", (9, 0), 0x18)])
    report, backends = _backends(h100, monkeypatch, installed={"flash_attn", "flash_attn.cute"})
    assert backends["flash_attention_4"]["runs"] and backends["flash_attention_2"]["runs"]
    assert backends["flash_attention_4"]["where"] == "cuda:0 (9.0)"
    fa3 = backends["flash_attention_3"]
    assert not fa3["runs"] and "flash_attn_interface package is not installed" in fa3["why"]
    assert "falls back to 'triton'" in fa3["why"]
    assert backends["triton"]["runs"] and backends["use_kernels=True (Triton: RMSNorm, SwiGLU, rotary, losses, MoE)"]["runs"]
    lines = {f.message for f in doctor(report) if f.check == "attention"}
    assert "flash_attention_4 runs on cuda:0 (9.0)" in lines
    text = cli.format_env(report)
    assert "Backends and kernels on cuda:0 (9.0):" in text
    assert any(line.split()[:3] == ["attention", "flash_attention_4", "yes"] for line in text.splitlines())


def test_an_old_gpu_and_missing_triton_say_why(monkeypatch):
    v100 = FakeCuda([_gpu("Tesla V100-SXM2-32GB", (7, 0), 0x86)])
    _, backends = _backends(v100, monkeypatch, installed={"flash_attn", "flash_attn.cute"}, triton=None)
    assert "needs a Hopper or Blackwell GPU" in backends["flash_attention_4"]["why"]
    assert "this one is 7.0" in backends["flash_attention_4"]["why"]
    assert "needs an Ampere or newer GPU" in backends["flash_attention_2"]["why"]
    assert not backends["triton"]["runs"] and "pip install 'gpuformers[kernels]'" in backends["triton"]["why"]
    p100 = FakeCuda([_gpu("Tesla P100", (6, 0), 0x3B)])
    _, backends = _backends(p100, monkeypatch)
    assert "Triton needs compute capability 7.0" in backends["triton"]["why"]


def test_on_the_cpu_only_the_torch_backends_run(monkeypatch):
    report, backends = _backends(FakeCuda(), monkeypatch)
    assert backends["sdpa"]["runs"] and backends["eager"]["runs"] and backends["sdpa"]["where"] == "the CPU"
    assert not backends["triton"]["runs"] and "TRITON_INTERPRET=1" in backends["triton"]["why"]
    assert "flash_attn.cute package is not installed" in backends["flash_attention_4"]["why"]
    _, interpreted = _backends(FakeCuda(), monkeypatch, environ={"TRITON_INTERPRET": "1"})
    assert interpreted["triton"]["runs"]
    assert {f.level for f in doctor(report) if f.check in ("attention", "kernels")} <= {"ok", "info"}
