"""The Trainer under torchrun on the CPU (gloo, 2 processes): DDP, FSDP2 and tensor parallelism train exactly like one
process on the same global batches (logged losses, gradient norms and final weights), and a distributed run resumes
from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer
from tests.training.distributed_worker import DISTRIBUTED_ARGS, EVAL_ROWS, ROWS, argmax_ids, metrics
from tests.training.helpers import make_rows, tiny_args

REPO = Path(__file__).resolve().parents[2]


def torchrun(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.training.distributed_worker", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, progress=False).state_dict()


@pytest.fixture(scope="module")
def single_process(tiny_checkpoint, tmp_path_factory):
    """The reference: one process, batches of 4 (what 2 processes x 1 row x 2 micro-batches add up to)."""
    out = tmp_path_factory.mktemp("single")
    torch.manual_seed(0)
    values = {**DISTRIBUTED_ARGS, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
              "max_steps": 6, "save_strategy": "no"}
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False), tiny_args(out, **values),
                      train_dataset=make_rows(**ROWS), eval_dataset=make_rows(**EVAL_ROWS), compute_metrics=metrics,
                      preprocess_logits_for_metrics=argmax_ids)
    trainer.train()
    losses = {e["step"]: [e["loss"], e["grad_norm"]] for e in trainer.state.log_history if "loss" in e}
    losses.update({f"eval{e['step']}": e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e})
    losses.update({f"metrics{e['step']}": [e["eval_rows"], e["eval_label_sum"], e["eval_accuracy"]]
                   for e in trainer.state.log_history if "eval_loss" in e})
    trainer.preprocess_logits_for_metrics = None
    losses["predictions"] = trainer.predict(make_rows(**EVAL_ROWS)).predictions
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_two_processes_train_like_one(strategy, tiny_checkpoint, single_process, tmp_path):
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy)
    logged = json.loads((tmp_path / "losses.json").read_text())
    expected_losses, expected_weights = single_process
    evals = {k: v for k, v in logged.items() if k.startswith("eval")}
    assert sorted(evals) == ["eval3", "eval6"]  # evaluation mid-run: the loss of the whole eval set ...
    for key, value in evals.items():
        assert value == pytest.approx(expected_losses[key], rel=1e-5)
    # ... with each data-parallel process scoring half of it: 7 rows -> 4 per process (one padding row), batches of
    # 2, in two evaluations and predict(); under tensor parallelism both processes run all 4 batches together
    batches = [int((tmp_path / f"eval_batches_{rank}.json").read_text()) for rank in (0, 1)]
    assert batches == ([12, 12] if strategy == "tp" else [6, 6])
    # compute_metrics saw every row once, in order, whichever process scored it (argmax ids, preprocessed per batch)
    for key in ("metrics3", "metrics6"):
        rows, label_sum, accuracy = logged[key]
        assert [rows, label_sum] == expected_losses[key][:2] and rows == 7
        assert accuracy == pytest.approx(expected_losses[key][2], abs=0.02)
    for rank in (0, 1):  # and predict() gives every process the whole set's logits, in dataset order
        predictions = np.load(tmp_path / f"predictions_{rank}.npy")
        np.testing.assert_allclose(predictions, expected_losses["predictions"], atol=2e-4)
    losses = {int(k): v for k, v in logged.items() if k.isdigit()}
    assert sorted(losses) == list(range(1, 7))
    for step, (loss, grad_norm) in losses.items():
        # the loss and the gradient norm of the global batch (Adam alone would hide a gradient scaled by a constant)
        assert loss == pytest.approx(expected_losses[step][0], rel=1e-5)
        assert grad_norm == pytest.approx(expected_losses[step][1], rel=1e-5)
    got = weights(tmp_path / "final")
    for name, value in expected_weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)
    # checkpoints are written once (by process 0), complete and loadable
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_run_resumes_from_its_checkpoint(strategy, tiny_checkpoint, single_process, tmp_path):
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy, "--stop-at", "3")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy, "--resume")
    got = weights(tmp_path / "final")
    for name, value in single_process[1].items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)
