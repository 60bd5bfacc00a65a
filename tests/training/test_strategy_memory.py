"""What each data-parallel strategy keeps per GPU (training/strategy_memory.py) and `gpuformers fit --train-processes`:
the ZeRO paper's own figures, and the CLI's table and JSON for a Qwen3-0.6B-shaped config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuformers.training.strategy_memory import strategy_memory
from tests.test_fit import QWEN3_0_6B


def test_the_zero_papers_figures():
    # Rajbhandari et al. 2020, figure 1: a 7.5B-parameter model on 64 GPUs, in GB (10^9 bytes)
    rows = {row.strategy: row.total_bytes / 1e9 for row in strategy_memory(7_500_000_000, 64)}
    assert rows == pytest.approx({"ddp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.875}, abs=0.05)
    with pytest.raises(ValueError, match="processes=0 must be >= 1"):
        strategy_memory(10, 0)


def test_fit_prints_the_training_memory_per_strategy(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    command = [sys.executable, "-m", "gpuformers", "fit", str(tmp_path), "--max-memory", "0=80GiB",
               "--train-processes", "8"]
    report = json.loads(subprocess.run(command + ["--json"], capture_output=True, text=True, check=True).stdout)
    parameters = report["parameters"]
    assert 0.59e9 < parameters < 0.61e9  # Qwen3-0.6B, tied embeddings once
    training = {row["strategy"]: row["total_bytes"] for row in report["training"]}
    assert training["ddp"] == 16 * parameters and training["zero3"] == pytest.approx(2 * parameters, rel=1e-6)
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "Training over 8 data-parallel process(es)" in text and "DeepSpeed ZeRO-3; FSDP2 full_shard" in text
