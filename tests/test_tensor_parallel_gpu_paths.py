"""Tensor parallelism's CUDA-only choices, checked on the CPU with torch.cuda and the process group faked: which GPU
a process selects before the mesh, the dtype its GPU decides, and the error when a machine has fewer GPUs than
processes. The collectives themselves run in tests/test_tensor_parallel.py (gloo) and on GPUs (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.device_mesh

from gpuformers.tensor_parallel import apply_tensor_parallel
from tests.fixtures.checkpoints import make_checkpoint, rewrite_config


class _Stop(Exception):
    """Raised by a fake to end the call once what the test looks at has happened."""


def _fake_gpus(monkeypatch, count: int, capability=(9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # nothing called set_device yet
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


@pytest.mark.parametrize("device", ["cuda:1", "cuda"])
def test_each_process_selects_its_gpu_before_the_mesh(device, tmp_path, monkeypatch):
    # A script that joined the group itself (init_process_group("nccl"), no set_device) leaves every process on
    # cuda:0, where parallelize_module would put every process's slices
    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))

    def init_device_mesh(device_type, shape, **kwargs):
        calls.append(("mesh", device_type))
        raise _Stop

    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", init_device_mesh)
    with pytest.raises(_Stop):
        apply_tensor_parallel(model, device=device)
    assert calls == [("set_device", torch.device("cuda", 1)), ("mesh", "cuda")]


def test_the_dtype_is_decided_by_the_gpu_not_the_cpu_it_loads_on(tmp_path, monkeypatch):
    # A bfloat16 checkpoint on GPUs without bfloat16 (2x T4): float16, as device_map="cuda" loads it
    import gpuformers.loading.weights
    import gpuformers.models.load_steps
    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama")
    rewrite_config(tmp_path, dtype="bfloat16", torch_dtype="bfloat16")
    _fake_gpus(monkeypatch, 2, capability=(7, 5))
    monkeypatch.setattr(gpuformers.models.load_steps, "_tensor_parallel_device",
                        lambda *args: torch.device("cuda", 1))
    loaded = {}

    def load_weights(model, files, dtype, device, **kwargs):
        loaded.update(dtype=dtype, device=device)
        raise _Stop

    monkeypatch.setattr(gpuformers.loading.weights, "load_weights", load_weights)
    with pytest.warns(UserWarning, match="no bfloat16 support"), pytest.raises(_Stop):
        AutoModelForCausalLM.from_pretrained(tmp_path, tp_plan="auto", progress=False)
    assert loaded == {"dtype": torch.float16, "device": torch.device("cpu")}  # read on the CPU, then split


def test_more_processes_than_gpus_says_how_many_to_start(monkeypatch):
    from gpuformers.distributed import process_device

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert process_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 has no GPU of its own: 2 GPU\(s\) are visible .*"
                                           r"--nproc_per_node=2"):
        process_device()
