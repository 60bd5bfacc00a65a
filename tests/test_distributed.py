"""Data-parallel training under torchrun on the CPU (gloo): DDP and FSDP2 through gpuformers.distributed give the
weights of one process training on the whole batch (tests/distributed_worker.py does the training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuformers import distributed

WORKER = Path(__file__).with_name("distributed_worker.py")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_like_one(strategy, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), strategy, str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["keys_equal"]
    for loss, ref in zip(result["losses"], result["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=1e-5)
    assert result["weight_diff"] < 1e-5
    assert result["restored_states"] == 24  # every parameter's AdamW state came back from its gathered form


def test_single_process_needs_no_group(monkeypatch):
    import torch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.world_size() == 1 and distributed.is_main_process()
    assert distributed.init_distributed(torch.device("cpu")) is False
    assert float(distributed.all_reduce_sum(3, torch.device("cpu"))) == 3.0
    with pytest.raises(RuntimeError, match="init_distributed"):
        distributed.wrap_model(torch.nn.Linear(2, 2), "ddp", torch.device("cpu"))
    with pytest.raises(ValueError, match="'zero3' is not one of"):
        distributed.wrap_model(torch.nn.Linear(2, 2), "zero3", torch.device("cpu"))


def test_world_size_without_torchrun_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.init_distributed(torch.device("cpu"))
