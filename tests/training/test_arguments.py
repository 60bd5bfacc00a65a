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
    ({"lr_scheduler_type": "exponential"}, ValueError, "is not one of: linear, cosine"),
    ({"optim": "lion"}, ValueError, 'optim "lion" is not one of'),
    ({"save_strategy": "sometimes"}, ValueError, 'save_strategy "sometimes" is not one of: no, steps, epoch'),
    ({"per_device_train_batch_size": 0}, ValueError, "per_device_train_batch_size 0 must be"),
])
def test_bad_arguments_are_refused_with_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingArguments(**kwargs)


@pytest.mark.parametrize("fsdp, fsdp_config", [
    ("full_shard", None), ("shard_grad_op", None), ("full_shard offload", None),
    ("shard_grad_op offload auto_wrap", None),
    (["full_shard", "auto_wrap"], None), (True, {"fsdp_reshard_after_forward": "false", "cpu_offload": True}),
    (True, {"reshard_after_forward": True, "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}),
])
def test_fsdp_options_mean_what_they_mean_in_transformers(monkeypatch, fsdp, fsdp_config):
    import transformers

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # transformers sets it: restored after the test
    theirs = transformers.TrainingArguments(output_dir="out", fsdp=fsdp, fsdp_config=dict(fsdp_config or {}),
                                            use_cpu=True).fsdp_plugin_args
    ours = TrainingArguments(fsdp=fsdp, fsdp_config=dict(fsdp_config or {})).fsdp_options
    assert ours.reshard_after_forward == theirs["reshard_after_forward"]
    assert ours.cpu_offload == theirs.get("cpu_offload", False)
    assert not ours.hybrid_shard and ours.layer_classes is None and ours.mixed_precision is None


@pytest.mark.parametrize("fsdp, fsdp_config, expected", [
    ("hybrid_shard", None, {"hybrid_shard": True, "reshard_after_forward": True}),
    ("hybrid_shard_zero2 offload", {"dp_shard_size": 4},
     {"hybrid_shard": True, "reshard_after_forward": False, "cpu_offload": True, "dp_shard_size": 4}),
    (True, {"fsdp_offload_params": "true"}, {"cpu_offload": True}),  # accelerate's name, with its prefix
    (True, {"transformer_layer_cls_to_wrap": "Qwen3DecoderLayer"}, {"layer_classes": ("Qwen3DecoderLayer",)}),
    (True, {"auto_wrap_policy": "no_wrap"}, {"layer_classes": ()}),
    (True, {"mixed_precision_policy": "bf16"},
     {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "output_dtype": "bfloat16"}}),
    (True, {"mixed_precision_policy": {"param_dtype": "bf16", "reduce_dtype": "torch.float32"}},
     {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}),
])
def test_fsdp_options_beyond_transformers_fsdp2(fsdp, fsdp_config, expected):
    from gpuformers.distributed import FSDPOptions

    got = TrainingArguments(fsdp=fsdp, fsdp_config=fsdp_config).fsdp_options
    assert got == FSDPOptions(**expected)


def test_fsdp_config_from_a_json_file_and_activation_checkpointing(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_activation_checkpointing": true, "fsdp_reshard_after_forward": false}')
    args = TrainingArguments(fsdp=True, fsdp_config=str(path))
    assert args.fsdp_options.reshard_after_forward is False
    assert args.gradient_checkpointing is True  # FSDP's name for it
    assert args.fsdp_config == {"fsdp_activation_checkpointing": True, "fsdp_reshard_after_forward": False}
    assert TrainingArguments().fsdp_options is None


@pytest.mark.parametrize("fsdp, fsdp_config, error, match", [
    ("full_shard shard_grad_op", None, ValueError, r"strategies \['full_shard', 'shard_grad_op'\]; keep one"),
    ("no_shard", None, ValueError, "that is DDP.*drop fsdp"),
    ("zero3", None, ValueError, r"fsdp options \['zero3'\] are not among: full_shard, shard_grad_op"),
    ("shard_grad_op", {"reshard_after_forward": True}, ValueError, "means reshard_after_forward=False"),
    ("full_shard offload", {"cpu_offload": False}, ValueError, "CPU offload is both asked for and refused"),
    (True, {"cpu_offload": True, "offload_params": False}, ValueError, "CPU offload is both asked for and refused"),
    ("full_shard", {"dp_shard_size": 2}, ValueError, "add 'hybrid_shard'"),
    ("hybrid_shard", {"dp_shard_size": 0}, ValueError, "dp_shard_size=0 must be a whole number >= 1"),
    (True, {"fsdp_backward_prefetch": "BACKWARD_PRE"}, ValueError, r"\['backward_prefetch'\] are FSDP1 settings"),
    (True, {"reshard_after_forwrd": False}, ValueError, r"keys \['reshard_after_forwrd'\] are not understood"),
    (True, {"version": 1}, ValueError, "FSDP2 only; drop version or set it to 2"),
    (None, {"cpu_offload": True}, ValueError, "fsdp is off; pass fsdp=True"),
    (True, {"reshard_after_forward": "maybe"}, ValueError, "reshard_after_forward='maybe' is not a yes/no value"),
    (True, {"mixed_precision_policy": "fp64"}, ValueError, "dtype 'fp64' is not one of: bf16"),
    (True, {"auto_wrap_policy": "NO_WRAP", "transformer_layer_cls_to_wrap": ["X"]}, ValueError, "drop one of them"),
    (True, {"auto_wrap_policy": "SIZE_BASED_WRAP"}, NotImplementedError, "use TRANSFORMER_BASED_WRAP"),
    (True, {"state_dict_type": "SHARDED_STATE_DICT"}, NotImplementedError, "FULL_STATE_DICT"),
    (True, {"cpu_ram_efficient_loading": True}, NotImplementedError, "cpu_ram_efficient_loading=True"),
])
def test_fsdp_combinations_that_make_no_sense_are_refused(fsdp, fsdp_config, error, match):
    with pytest.raises(error, match=match):
        TrainingArguments(fsdp=fsdp, fsdp_config=fsdp_config)


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
