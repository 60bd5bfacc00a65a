"""DDP's own arguments, the process-group backend and where FSDP2 finds the model:

- ddp_find_unused_parameters / ddp_bucket_cap_mb / ddp_broadcast_buffers / ddp_static_graph reach
  DistributedDataParallel, with transformers' default for find_unused_parameters (True, False under activation
  checkpointing), so that a mixture-of-experts model whose experts get no token in a step trains under DDP;
- ddp_backend and ddp_timeout reach init_process_group, an unknown backend is refused;
- with fsdp the Trainer leaves the model where it was loaded (FSDP2 puts each process's shards on the device), and
  an evaluate() before train() shards it.

The same file is the torchrun worker of the mixture-of-experts run:
`torchrun --nproc_per_node=2 -m tests.training.test_ddp_options CHECKPOINT OUTPUT_DIR`."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.distributed import DDPOptions, wrap_model
from gpuformers.training import Trainer, TrainingArguments
from gpuformers.training.model_setup import ddp_options
from tests.training.helpers import make_rows, tiny_args, torchrun

# 32 experts, one per token: a row of at most 16 tokens leaves at least 16 experts of each layer without a token
MOE = dict(num_experts=32, num_experts_per_tok=1, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.fixtures.checkpoints import make_checkpoint

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    make_checkpoint(folder, "qwen3_moe", tie_word_embeddings=False, **MOE)
    return folder



@pytest.mark.distributed
def test_moe_trains_under_ddp_with_experts_left_without_tokens(moe_checkpoint, tmp_path):
    """Before, DDP was built without find_unused_parameters: the experts no token was routed to had no gradient, and
    the second step failed ("Expected to have finished reduction in the prior iteration")."""
    torchrun("tests.training.test_ddp_options", str(moe_checkpoint), str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == "gloo" and result["find_unused_parameters"] is True
    assert result["idle_experts"] > 0  # the case this is about really happened
    assert len(result["losses"]) == 3 and all(math.isfinite(loss) for loss in result["losses"])


def test_ddp_options_follow_transformers(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    assert ddp_options(model, tiny_args(tmp_path)).find_unused_parameters is True
    # activation checkpointing (asked for, or already on the model): off, as transformers sets it
    assert ddp_options(model, tiny_args(tmp_path, gradient_checkpointing=True)).find_unused_parameters is False
    model.activation_checkpointing_enable()
    assert ddp_options(model, tiny_args(tmp_path)).find_unused_parameters is False
    assert ddp_options(model, tiny_args(tmp_path, ddp_find_unused_parameters=True)).find_unused_parameters is True
    # a model that is not a PreTrainedModel: on
    assert ddp_options(torch.nn.Linear(2, 2), tiny_args(tmp_path)).find_unused_parameters is True
    options = ddp_options(torch.nn.Linear(2, 2), tiny_args(tmp_path, ddp_find_unused_parameters=False,
                                                         ddp_bucket_cap_mb=5, ddp_broadcast_buffers=False,
                                                         ddp_static_graph=True))
    assert options == DDPOptions(find_unused_parameters=False, bucket_cap_mb=5, broadcast_buffers=False,
                                 static_graph=True)


def test_ddp_options_reach_distributed_data_parallel(one_process_group):
    cpu = torch.device("cpu")
    ddp = wrap_model(torch.nn.Linear(2, 2), "ddp", cpu,
                     ddp_options=DDPOptions(find_unused_parameters=True, bucket_cap_mb=5, broadcast_buffers=False,
                                            static_graph=True))
    assert ddp.find_unused_parameters and not ddp.broadcast_buffers and ddp.static_graph
    assert ddp.bucket_bytes_cap == 5 * 1024 * 1024
    plain = wrap_model(torch.nn.Linear(2, 2), "ddp", cpu)  # DDP's own defaults
    assert not plain.find_unused_parameters and plain.broadcast_buffers and not plain.static_graph
    with pytest.raises(ValueError, match="ddp_options were given with strategy 'fsdp'"):
        wrap_model(torch.nn.Linear(2, 2), "fsdp", cpu, ddp_options=DDPOptions())


@pytest.mark.parametrize("values, match", [
    ({"ddp_backend": "ncll"}, 'ddp_backend "ncll" is not one of: nccl, gloo, mpi'),
    ({"ddp_backend": "nccl", "use_cpu": True}, 'ddp_backend "nccl" needs GPUs, but the processes train on cpu'),
    ({"ddp_backend": "hccl"}, 'ddp_backend "hccl" is for Ascend NPUs'),
    ({"ddp_timeout": 0}, "ddp_timeout 0 must be a number of seconds > 0"),
    ({"ddp_bucket_cap_mb": -1}, "ddp_bucket_cap_mb -1 must be > 0"),
])
def test_bad_ddp_arguments_are_refused(values, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_args(tmp_path, **values)


@pytest.fixture
def two_process_env(monkeypatch):
    """torchrun's environment for process 0 of 2, without the processes."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)


def test_ddp_backend_and_timeout_reach_the_process_group(tiny_checkpoint, tmp_path, two_process_env, monkeypatch):
    """Before, ddp_backend was accepted and ignored: the group was always gloo on the CPU (NCCL on GPUs)."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_mpi_available", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    Trainer(model, tiny_args(tmp_path, ddp_backend="mpi", ddp_timeout=60, use_cpu=True))
    assert calls == [("mpi", {"timeout": datetime.timedelta(seconds=60)})]
    calls.clear()
    Trainer(model, tiny_args(tmp_path, use_cpu=True))  # None: gloo on the CPU
    assert calls == [("gloo", {"timeout": datetime.timedelta(seconds=1800)})]


def test_fsdp_leaves_the_model_where_it_was_loaded(tiny_checkpoint, tmp_path, two_process_env, monkeypatch):
    """Before, the Trainer moved the whole model to the device before FSDP2 sharded it: every GPU held it whole."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: None)
    moved = []
    for fsdp in ("full_shard", None):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
        monkeypatch.setattr(model, "to", lambda *args, _fsdp=fsdp, **kwargs: moved.append(_fsdp) or model)
        trainer = Trainer(model, tiny_args(tmp_path, fsdp=fsdp, use_cpu=True))
        assert trainer.model is model
    assert moved == [None]  # DDP keeps a whole copy per process: moved; FSDP2: left for fully_shard


def test_evaluate_before_train_shards_the_model(tiny_checkpoint, tmp_path, two_process_env, one_process_group):
    """evaluate() before train() under FSDP2 shards the model first (as transformers prepares it there), since the
    Trainer no longer put it on the device; train() then goes on with those shards."""
    from torch.distributed.fsdp import FSDPModule

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    trainer = Trainer(model, tiny_args(tmp_path, fsdp="full_shard", use_cpu=True, max_steps=2,
                                       per_device_eval_batch_size=2),
                      train_dataset=make_rows(8), eval_dataset=make_rows(4, seed=1))
    assert not isinstance(trainer.model, FSDPModule)
    loss = trainer.evaluate()["eval_loss"]
    assert isinstance(trainer.model, FSDPModule) and trainer.model_wrapped is trainer.model and math.isfinite(loss)
    trainer.train()  # on the shards made by evaluate()
    assert trainer.state.global_step == 2 and trainer.evaluate()["eval_loss"] != pytest.approx(loss)


def main() -> None:
    """One process of the mixture-of-experts DDP run (see the module docstring): 3 steps of 1 row per process."""
    import torch.distributed as dist

    from gpuformers.distributed import exit_process
    from gpuformers.layers.moe import SparseMoeBlock

    checkpoint, output_dir = sys.argv[1:3]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    idle = []  # experts of a layer that got no token, per forward
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        block.gate.register_forward_hook(
            lambda module, inputs, output: idle.append(len(module.weight) - len(torch.unique(output[2]))))
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=1, max_steps=3, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, optim="adamw_torch", learning_rate=1e-3, seed=0,
                             use_cpu=True, ddp_backend="gloo")
    trainer = Trainer(model, args, train_dataset=make_rows(8, seed=2))
    trainer.train()
    if dist.get_rank() == 0:
        result = {"backend": dist.get_backend(), "find_unused_parameters": trainer.model_wrapped.find_unused_parameters,
                  "idle_experts": min(idle), "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
        (Path(output_dir) / "result.json").write_text(json.dumps(result))
    exit_process()


if __name__ == "__main__":
    main()
