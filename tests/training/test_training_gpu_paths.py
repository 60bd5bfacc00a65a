"""Training paths that matter on GPUs under torchrun, checked on the CPU: every process's RNG state is checkpointed
(each draws its own dropout masks from its own generators, on its own GPU), so that a DDP run with dropout resumes
exactly; and FSDP2 shards a model trained on the CPU over a CPU mesh, also where a GPU is visible. The same file is
the torchrun worker of the resume test:
`torchrun --nproc_per_node=2 -m tests.training.test_training_gpu_paths CHECKPOINT OUTPUT_DIR [--resume]`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer
from gpuformers.training import checkpoint as ckpt
from gpuformers.training.callbacks import TrainerState
from gpuformers.training.model_setup import check_trainable
from tests.training.helpers import make_rows, tiny_args, torchrun

# 2 processes x 1 row x 2 micro-batches: each process's rows have their own lengths, so its dropout draws differ
RESUME_ARGS = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=4, save_steps=2,
                   save_strategy="steps", lr_scheduler_type="constant", use_cpu=True)
ROWS = dict(count=16, seed=4)


def test_a_checkpoint_keeps_the_rng_state_of_every_process(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(ckpt.capture_rng_state())
    path = ckpt.save_training_checkpoint(tmp_path, 3, model=model, state=TrainerState(), rng_states=states)
    assert sorted(p.name for p in path.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    for index, expected in enumerate(states):
        rng = ckpt.load_training_state(path, model=None, process_index=index)["rng"]
        assert torch.equal(rng["cpu"], expected["cpu"])



@pytest.mark.distributed
def test_ddp_with_dropout_resumes_exactly(tiny_checkpoint, tmp_path):
    """Before, process 0 alone wrote rng_state.pth and every process restored it: process 1 went on with process
    0's generators (on GPUs, with its own GPU's generator reset), and its dropout masks, so the losses, changed."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun("tests.training.test_training_gpu_paths", str(tiny_checkpoint), str(straight))
    checkpoint = straight / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    first, second = (torch.load(checkpoint / f"rng_state_{i}.pth", weights_only=True)["cpu"] for i in (0, 1))
    assert not torch.equal(first, second)  # the processes' generators really went apart
    resumed.mkdir()
    shutil.copytree(checkpoint, resumed / checkpoint.name)
    torchrun("tests.training.test_training_gpu_paths", str(tiny_checkpoint), str(resumed), "--resume")
    expected = json.loads((straight / "losses.json").read_text())
    got = json.loads((resumed / "losses.json").read_text())
    assert sorted(got) == ["1", "2", "3", "4"]  # 1-2 from the checkpoint's log, 3-4 trained after the resume
    for step in ("3", "4"):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step



def test_fsdp_on_the_cpu_stays_on_the_cpu_where_a_gpu_is_visible(tiny_checkpoint, one_process_group, monkeypatch):
    """use_cpu=True on a GPU machine (the CPU tests of this suite on a GPU box): fully_shard's default mesh is on the
    machine's accelerator, which moved every process's model to cuda:0 under a gloo group."""
    from gpuformers.distributed import wrap_model

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))  # as on a GPU machine
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    wrap_model(model, "fsdp", torch.device("cpu"))
    for weight in (model.model.layers[0].mlp.gate_proj.weight, model.lm_head.weight):
        assert weight.device_mesh.device_type == "cpu" and weight.device.type == "cpu"


def test_fp16_refuses_float16_trainable_weights_and_takes_float32(tiny_checkpoint):
    """fp16 mixed precision keeps float32 weights (its scaler refuses float16 gradients at the first step, after the
    model and data have been set up): a float16 model is refused when the Trainer is made. (fp16 needs a GPU, so the
    arguments here are a stand-in saying fp16.)"""
    from types import SimpleNamespace

    fp16 = SimpleNamespace(mixed_precision=torch.float16, deepspeed_config=None)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype="float32", progress=False)
    check_trainable(model, fp16, tensor_parallel=False)
    model.model.norm.half()
    with pytest.raises(ValueError, match=r"fp16=True .* but model\.norm\.weight is float16: load the model with "
                                         r"dtype=torch\.float32"):
        check_trainable(model, fp16, tensor_parallel=False)
    model.model.norm.weight.requires_grad_(False)  # frozen float16 weights (LoRA's base) get no gradient to unscale
    check_trainable(model, fp16, tensor_parallel=False)


def test_clipping_a_tensor_parallel_model_whose_split_gradients_are_all_replicated(one_process_group, monkeypatch):
    """Split gradients that are all replicated DTensors (a row-wise layer's bias) beside plain ones: nothing to sum
    over the processes. The all-reduce of get_total_norm([]) (a CPU tensor) would fail on NCCL."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from gpuformers.training.optim import clip_grad_norm

    mesh = init_device_mesh("cpu", (1,))
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))
    replicated.grad = distribute_tensor(torch.tensor([3.0, 0.0, 0.0]), mesh, [Replicate()])
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.grad = torch.tensor([0.0, 4.0])
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kwargs: reduced.append(tensor))
    norm = clip_grad_norm([replicated, plain], max_norm=1.0)
    assert reduced == [] and float(norm) == pytest.approx(5.0)
    assert plain.grad.tolist() == pytest.approx([0.0, 0.8], rel=1e-5)
    assert replicated.grad.to_local().tolist() == pytest.approx([0.6, 0.0, 0.0], rel=1e-5)


def _worker() -> None:
    import argparse

    from gpuformers.distributed import exit_process

    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("output_dir")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, progress=False)
    for module in model.modules():  # dropout draws from each process's own generator
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    trainer = Trainer(model, tiny_args(args.output_dir, **RESUME_ARGS), train_dataset=make_rows(**ROWS))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.args.process_index == 0:
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        (Path(args.output_dir) / "losses.json").write_text(json.dumps(losses))
    exit_process()


if __name__ == "__main__":
    _worker()
