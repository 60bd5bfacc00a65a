"""The Trainer under torchrun on the CPU (gloo, 2 processes): DDP, FSDP2 (full sharding, shard_grad_op, hybrid
sharding on a 1 x 2 and a 2 x 1 mesh, CPU offload) and tensor parallelism train exactly like one process on the same
global batches (logged losses, gradient norms and final weights), and a distributed run resumes from its checkpoint.
Each configuration is a named entry of distributed_worker.RUNS."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer
from tests.training.distributed_worker import DISTRIBUTED_ARGS, EVAL_ROWS, ROWS, argmax_ids, metrics
from tests.training import helpers
from tests.training.helpers import make_rows, tiny_args



def layout(mesh: list[int], offload: str, gathered_after_forward: bool) -> dict:
    placements = ["S(0)"] if len(mesh) == 1 else ["R", "S(0)"]  # hybrid: replicated over dim 0, sharded over dim 1
    return {"mesh": mesh, "placements": placements, "offload": offload,
            "gathered_after_forward": gathered_after_forward}


# How each FSDP2 run must hold a decoder layer (distributed_worker.RecordLayout), so that an option silently ignored
# (which would train the same numbers) fails
LAYOUTS = {
    "fsdp": layout([2], "OffloadPolicy", gathered_after_forward=False),
    "shard_grad_op": layout([2], "OffloadPolicy", gathered_after_forward=True),
    "hybrid_shard": layout([1, 2], "OffloadPolicy", gathered_after_forward=False),
    "hybrid_shard_zero2_offload": layout([2, 1], "CPUOffloadPolicy", gathered_after_forward=True),
    "offload": layout([2], "CPUOffloadPolicy", gathered_after_forward=False),
}


def torchrun(*args: str) -> None:
    helpers.torchrun("tests.training.distributed_worker", *args)


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "shard_grad_op", "hybrid_shard", "offload"])
def test_two_processes_train_like_one(strategy, tiny_checkpoint, single_process, tmp_path):
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy)
    assert json.loads((tmp_path / "layout.json").read_text()) == LAYOUTS.get(strategy)
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


# hybrid_shard_zero2_offload: a 2 x 1 mesh (replicas all-reduce their gradients), parameters kept gathered after the
# forward, everything offloaded to the CPU: the 2-D, offloaded states are gathered into the checkpoint and loaded back
@pytest.mark.parametrize("strategy", ["fsdp", "tp", "hybrid_shard_zero2_offload"])
def test_run_resumes_from_its_checkpoint(strategy, tiny_checkpoint, single_process, tmp_path):
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy, "--stop-at", "3")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    assert json.loads((tmp_path / "layout.json").read_text()) == LAYOUTS.get(strategy)
    torchrun(str(tiny_checkpoint), str(tmp_path), strategy, "--resume")
    assert json.loads((tmp_path / "layout.json").read_text()) == LAYOUTS.get(strategy)
    expected_losses, expected_weights = single_process
    logged = json.loads((tmp_path / "losses.json").read_text())
    losses = {int(k): v for k, v in logged.items() if k.isdigit()}
    assert sorted(losses) == list(range(1, 7))  # steps 1-3 from the checkpoint's log, 4-6 after the resume
    for step, (loss, grad_norm) in losses.items():
        assert loss == pytest.approx(expected_losses[step][0], rel=1e-5)
        assert grad_norm == pytest.approx(expected_losses[step][1], rel=1e-5)
    got = weights(tmp_path / "final")
    for name, value in expected_weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)



def test_wrap_model_applies_the_other_options(tiny_checkpoint, one_process_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from gpuformers.distributed import FSDPOptions, wrap_model

    cpu = torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": "float32"}
    wrap_model(model, "fsdp", cpu, FSDPOptions(mixed_precision=bf16, layer_classes=("GatedMLP",)))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FSDPModule) and not isinstance(layer, FSDPModule)  # the classes named, not the layer
    seen = []
    layer.mlp.gate_proj.register_forward_hook(lambda module, inputs, output: seen.append(module.weight.dtype))
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32  # gathered in bfloat16, output cast back
    with pytest.raises(ValueError, match=r"names \['Block'\], which Qwen3ForCausalLM does not contain"):
        wrap_model(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False), "fsdp", cpu,
                   FSDPOptions(layer_classes=("Block",)))
    with pytest.raises(ValueError, match="1 processes cannot be split in groups of dp_shard_size=2"):
        wrap_model(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False), "fsdp", cpu,
                   FSDPOptions(hybrid_shard=True, dp_shard_size=2))
    with pytest.raises(ValueError, match="fsdp_options were given with strategy 'ddp'"):
        wrap_model(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False), "ddp", cpu, FSDPOptions())
    # on GPUs, offloaded states need a CPU backend beside NCCL (the Trainer asks init_distributed for it)
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(RuntimeError, match=r"no backend for CPU tensors.*init_distributed\(device, cpu_offload=True"):
        wrap_model(torch.nn.Linear(2, 2), "fsdp", torch.device("cuda"), FSDPOptions(cpu_offload=True, layer_classes=()))
