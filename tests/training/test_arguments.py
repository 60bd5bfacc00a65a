"""TrainingArguments (defaults, device, precision choice, clear errors) and the optimizer / schedule builders."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpuformers.training import TrainingArguments
from gpuformers.training.optim import build_optimizer, build_scheduler, decay_parameter_names


def test_defaults_are_transformers_defaults():
    import transformers

    theirs = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = TrainingArguments()
    shared = [f.name for f in dataclasses.fields(TrainingArguments) if f.name in theirs and f.name not in
              ("output_dir", "report_to", "logging_strategy", "eval_strategy", "save_strategy", "warmup_steps")]
    assert len(shared) > 40
    for name in shared:
        assert getattr(ours, name) == theirs[name], name
    assert ours.output_dir == "trainer_output" and ours.report_to == [] and ours.warmup_steps == 0


def test_device_and_precision_on_the_cpu():
    args = TrainingArguments(bf16="auto")
    assert args.device == torch.device("cpu") and args.n_gpu == 0 and args.world_size == 1
    assert args.mixed_precision is None  # "auto" means float32 on the CPU
    assert TrainingArguments(bf16=True, use_cpu=True).mixed_precision == torch.bfloat16


@pytest.mark.parametrize("capability, expected", [((9, 0), torch.bfloat16), ((7, 5), torch.float16)])
def test_auto_precision_follows_the_gpu_capability(monkeypatch, capability, expected):
    for name, value in {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                        "get_device_capability": lambda *a: capability,
                        "get_device_name": lambda *a: "Fake GPU"}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    args = TrainingArguments(bf16="auto")
    assert args.device == torch.device("cuda", 0) and args.n_gpu == 1
    assert args.mixed_precision == expected
    assert TrainingArguments(fp16="auto").mixed_precision == expected
    if capability < (8, 0):
        with pytest.raises(ValueError, match="compute capability 7.5\\) has no bfloat16"):
            TrainingArguments(bf16=True)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"learning_rate": -1e-4}, ValueError, "learning_rate -0.0001 is negative"),
    ({"bf16": True, "fp16": True}, ValueError, "both set"),
    ({"fp16": True}, ValueError, "fp16=True needs a CUDA GPU"),
    ({"bf16": "yes"}, ValueError, "bf16='yes' is not one of"),
    ({"lr_scheduler_type": "polynomial"}, ValueError, "is not one of: linear, cosine"),
    ({"optim": "lion"}, ValueError, 'optim "lion" is not one of'),
    ({"save_strategy": "sometimes"}, ValueError, 'save_strategy "sometimes" is not one of: no, steps, epoch'),
    ({"fsdp": "shard_grad_op offload"}, NotImplementedError, r"fsdp options \['shard_grad_op', 'offload'\]"),
    ({"per_device_train_batch_size": 0}, ValueError, "per_device_train_batch_size 0 must be"),
])
def test_bad_arguments_are_refused_with_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingArguments(**kwargs)


def test_torchrun_environment_picks_the_strategy(monkeypatch):
    assert TrainingArguments().distributed_strategy is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = TrainingArguments(fsdp="full_shard auto_wrap")
    assert (args.distributed_strategy, args.world_size, args.process_index) == ("fsdp", 2, 1)
    assert TrainingArguments().distributed_strategy == "ddp"


def test_warmup_ratio_and_steps():
    assert TrainingArguments(warmup_steps=0.1).get_warmup_steps(95) == 10
    assert TrainingArguments(warmup_ratio=0.25).get_warmup_steps(8) == 2
    assert TrainingArguments(warmup_steps=7).get_warmup_steps(100) == 7


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_equal_transformers(kind):
    import transformers

    def rates(scheduler_factory):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = scheduler_factory(optimizer)
        out = []
        for _ in range(12):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    ours = rates(lambda opt: build_scheduler(opt, kind, warmup=3, total=10))
    theirs = rates(lambda opt: transformers.get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=10))
    assert ours == pytest.approx(theirs)


def test_weight_decay_skips_norms_and_biases_like_transformers():
    import transformers

    from tests.fixtures.checkpoints import hf_config

    model = transformers.AutoModelForCausalLM.from_config(hf_config("qwen2"))  # qwen2: q/k/v biases
    theirs = set(transformers.Trainer.get_decay_parameter_names(None, model))
    ours = decay_parameter_names(model)
    assert ours == theirs and not any("norm" in n or n.endswith("bias") for n in ours)
    optimizer = build_optimizer(model, TrainingArguments(weight_decay=0.1, use_cpu=True))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
