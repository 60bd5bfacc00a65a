"""DeepSpeed ZeRO and `accelerate launch` under the Trainer, on the CPU (DeepSpeed's CPU accelerator, gloo):

- `accelerate launch --multi_gpu` (DDP) and `accelerate launch --use_deepspeed --zero_stage 2` (2 processes, the
  environment alone asking for DeepSpeed) of the same script, and a ZeRO-3 run from a DeepSpeed config under
  torchrun, train exactly like one process on the same global batches (losses, gradient norms, evaluation, final
  weights), and their checkpoints hold DeepSpeed's sharded states;
- the ZeRO-3 run stopped at its checkpoint and resumed equals the uninterrupted run, and its save_model output (the
  weights gathered) loads in transformers with equal logits; its first run's model is built partitioned by
  from_pretrained (the ZeRO-3 TrainingArguments made first: deepspeed.zero.Init), each process holding half of every
  parameter, the partitions together the checkpoint's weights;
- in one process, that registration's lifetime, the partitioned model training like the one loaded whole (float32,
  bf16), from_config's partitioned model drawing the whole one's weights, and what is refused under it (device_map, quantization, tp_plan, GGUF, an adapter folder, evaluate() before train());
- in one process (a process group of one, made by the Trainer): ZeRO-1, ZeRO-2, and ZeRO-3 offloading parameters and
  optimizer to the CPU, train like no DeepSpeed, and load_best_model_at_end loads the best checkpoint's states;
  ZeRO-3 with the config's own optimizer and scheduler, and save_model without
  stage3_gather_16bit_weights_on_model_save writing DeepSpeed's shards; a LoRA model under ZeRO-3 trains like
  without DeepSpeed and saves the same adapter;
- the config's "auto" values, its contradictions with the arguments, accelerate's DeepSpeed, FSDP and mixed-precision
  variables, and the missing package;
- ZeRO-2 in bf16 trains and resumes to the same losses, on the CPU and (gpu-marked) on one GPU.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from gpuformers import AutoModelForCausalLM, distributed
from gpuformers.training import TrainingArguments
from tests.training import helpers
from tests.training.test_distributed_trainer import single_process, weights  # noqa: F401 (a fixture)

pytest.importorskip("deepspeed")

ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
ACCELERATE_VARIABLES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
                        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                        "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION",
                        "FSDP_VERSION", "FSDP_SHARDING_STRATEGY", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS",
                        "FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_environment():
    """The launcher's variables unset during each test, and every variable as it was after it: also those the Trainer
    sets for DeepSpeed (LOCAL_RANK=0 in one process, DS_ACCELERATOR=cpu on the CPU), which would make later tests'
    accelerate (under transformers' Trainer) and DeviceMesh believe they run under a launcher. A ZeRO-3 config that
    a test's arguments registered for from_pretrained ends with the test (a Trainer's reference cycles may keep the
    arguments alive until the garbage collector runs: transformers' tests unset theirs likewise)."""
    saved = {name: os.environ.pop(name, None) for name in ACCELERATE_VARIABLES + ("LOCAL_RANK", "DS_ACCELERATOR")}
    yield
    distributed.set_zero3_init(None)
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def assert_trains_like_one_process(logged: dict, expected: dict, steps: range) -> None:
    losses = {int(k): v for k, v in logged.items() if k.isdigit()}
    assert sorted(losses) == list(steps)
    for step, (loss, grad_norm) in losses.items():
        assert loss == pytest.approx(expected[step][0], rel=1e-5, abs=1e-5)
        assert grad_norm == pytest.approx(expected[step][1], rel=1e-5, abs=1e-5)


def deepspeed_states(checkpoint) -> list[str]:
    return sorted(p.name for p in (checkpoint / checkpoint.name.replace("checkpoint-", "global_step")).iterdir())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("options, strategy", [(["--multi_gpu"], "ddp"),
                                               (["--use_deepspeed", "--zero_stage=2"], "deepspeed")])
def test_accelerate_launch_trains_like_one_process(options, strategy, tiny_checkpoint, single_process, tmp_path):
    """The same script (the worker's "accelerate" run: no strategy in its arguments) under accelerate launch: DDP, or
    DeepSpeed ZeRO-2 from the launcher's environment alone."""
    helpers.accelerate_launch(options, "tests.training.distributed_worker", str(tiny_checkpoint), str(tmp_path),
                              "accelerate")
    expected_losses, expected_weights = single_process
    logged = json.loads((tmp_path / "losses.json").read_text())
    assert_trains_like_one_process(logged, expected_losses, range(1, 7))
    for key in ("eval3", "eval6"):
        assert logged[key] == pytest.approx(expected_losses[key], rel=1e-5)
    got = weights(tmp_path / "final")
    for name, value in expected_weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)
    if strategy == "deepspeed":  # DeepSpeed really ran, ZeRO-2: an optimizer-state shard per process, the model once
        assert deepspeed_states(tmp_path / "checkpoint-3") == [
            "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    else:
        assert (tmp_path / "checkpoint-3" / "optimizer.pt").is_file()
        assert not list((tmp_path / "checkpoint-3").glob("global_step*"))
    processes = [json.loads((tmp_path / f"process_{rank}.json").read_text()) for rank in (0, 1)]
    assert processes == [[True, True, 2, strategy], [False, False, 2, strategy]]
    assert (tmp_path / "first.txt").read_text() == "0\n1\n"  # main_process_first: process 0 ran the block first


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_resumes_exactly_and_saves_whole_weights(tiny_checkpoint, single_process, tmp_path):
    """The first run's model is built partitioned by from_pretrained (its ZeRO-3 TrainingArguments made first:
    deepspeed.zero.Init), the resumed run's loaded whole and partitioned by DeepSpeed's engine: both train like one
    process (as the ZeRO-3 runs without zero.Init of the other tests do)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    helpers.torchrun("tests.training.distributed_worker", str(tiny_checkpoint), str(tmp_path), "zero3",
                     "--stop-at", "3", "--zero-init")
    checkpoint = load_file(tiny_checkpoint / "model.safetensors")
    held = [json.loads((tmp_path / f"partitions_{rank}.json").read_text()) for rank in (0, 1)]
    for name, value in checkpoint.items():
        for partitions in held:  # each process holds half of every parameter (rounded up), nothing whole
            shape, numel, local, own_shape = partitions[name]
            assert (shape, numel, local, own_shape) == (list(value.shape), value.numel(), -(-value.numel() // 2), [0])
    whole = sum(v.numel() for v in checkpoint.values())
    assert sum(local for _, _, local, _ in held[0].values()) <= whole // 2 + len(checkpoint)
    gathered = load_file(tmp_path / "gathered.safetensors")  # the partitions together are the checkpoint's weights
    assert sorted(gathered) == sorted(checkpoint)
    for name, value in checkpoint.items():
        torch.testing.assert_close(gathered[name], value, atol=0, rtol=0)
    expected_losses, expected_weights = single_process
    assert_trains_like_one_process(json.loads((tmp_path / "losses.json").read_text()), expected_losses, range(1, 4))
    # ZeRO-3: parameters sharded too, so every process writes its own model and optimizer states
    assert deepspeed_states(tmp_path / "checkpoint-3") == [
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")]
    helpers.torchrun("tests.training.distributed_worker", str(tiny_checkpoint), str(tmp_path), "zero3", "--resume")
    # steps 1-3 from the checkpoint's log, 4-6 after the resume: the uninterrupted run's numbers
    assert_trains_like_one_process(json.loads((tmp_path / "losses.json").read_text()), expected_losses, range(1, 7))
    got = weights(tmp_path / "final")  # save_model gathered the ZeRO-3 shards into whole weights
    for name, value in expected_weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([[3, 17, 42, 99, 5, 64]])
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "final", progress=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-4, rtol=0)


# --- the config and the launcher's environment, in this process -------------------------------------------------


def test_auto_values_are_filled_from_the_arguments(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                  "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}},
              "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = TrainingArguments(tmp_path, deepspeed=str(path), per_device_train_batch_size=3,
                             gradient_accumulation_steps=4, learning_rate=2e-4, adam_beta2=0.95, weight_decay=0.1,
                             max_grad_norm=0.5, bf16=True, warmup_steps=0.1)
    ds = args.deepspeed_config
    assert args.distributed_strategy == "deepspeed" and ds.is_zero3 and args.deepspeed == str(path)
    assert ds.config["train_micro_batch_size_per_gpu"] == 3 and ds.config["gradient_accumulation_steps"] == 4
    assert ds.config["train_batch_size"] == 2 * 3 * 4 and ds.config["gradient_clipping"] == 0.5
    assert ds.config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert ds.config["bf16"] == {"enabled": True}
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"hidden_size": 64})()
    ds.finalize(model, num_training_steps=50, warmup_steps=args.get_warmup_steps(50))
    assert ds.config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 5,
                                                "total_num_steps": 50}
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert ds.config["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_a_config_that_contradicts_the_arguments_names_both_values(tmp_path):
    config = {**ZERO3, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.3}
    with pytest.raises(ValueError) as error:
        TrainingArguments(tmp_path, deepspeed=config, per_device_train_batch_size=2, max_grad_norm=1.0)
    message = str(error.value)
    assert "train_micro_batch_size_per_gpu=4 but TrainingArguments per_device_train_batch_size=2" in message
    assert "gradient_clipping=0.3 but TrainingArguments max_grad_norm=1.0" in message
    ds = TrainingArguments(tmp_path, deepspeed={**ZERO3, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_num_steps": 7}}}, warmup_steps=3).deepspeed_config
    with pytest.raises(ValueError, match="warmup_num_steps=7 but TrainingArguments warmup_steps=3"):
        ds.finalize(torch.nn.Linear(2, 2), num_training_steps=10, warmup_steps=3)
    with pytest.raises(ValueError, match="deepspeed and fsdp='full_shard' were both given"):
        TrainingArguments(tmp_path, deepspeed=ZERO3, fsdp="full_shard")
    with pytest.raises(NotImplementedError, match="torch_compile=True under DeepSpeed"):
        TrainingArguments(tmp_path, deepspeed=ZERO3, torch_compile=True)
    from gpuformers.training.model_setup import check_trainable

    class Quantized(torch.nn.Linear):
        is_quantized = True

    with pytest.raises(NotImplementedError, match="DeepSpeed with a quantized model"):
        check_trainable(Quantized(2, 2), TrainingArguments(tmp_path, deepspeed=ZERO3), tensor_parallel=False)


def test_without_deepspeed_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` fails as on an install without it
    with pytest.raises(ImportError, match=r"gpuformers\[deepspeed\]"):
        TrainingArguments(tmp_path, deepspeed=ZERO3)


def test_accelerate_deepspeed_plugin_variables(monkeypatch, tmp_path, caplog):
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
                        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
                        "ACCELERATE_MIXED_PRECISION": "bf16"}.items():
        monkeypatch.setenv(name, value)
    args = TrainingArguments(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    assert distributed.zero3_init().config is args.deepspeed_config.config  # from_pretrained builds it partitioned
    ds = args.deepspeed_config
    assert args.distributed_strategy == "deepspeed" and args.mixed_precision == torch.bfloat16
    assert ds.is_zero3 and ds.offloads and ds.gathers_weights_on_save
    assert ds.config["train_micro_batch_size_per_gpu"] == 2 and ds.config["gradient_accumulation_steps"] == 3
    assert ds.config["bf16"] == {"enabled": True}
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")  # accelerate's zero3_init_flag off: loaded whole
    assert TrainingArguments(tmp_path).deepspeed_config.is_zero3 and distributed.zero3_init() is None
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    with caplog.at_level("WARNING"):
        TrainingArguments(tmp_path)
    assert "ACCELERATE_DEEPSPEED_ZERO3_INIT applies to ZeRO stage 3 only" in caplog.text
    # accelerate's deepspeed_config_file: the file's values stand, the other variables fill its "auto" ones only
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    ds = TrainingArguments(tmp_path, gradient_accumulation_steps=3).deepspeed_config
    assert ds.zero_stage == 1 and ds.config["gradient_accumulation_steps"] == 3
    # the arguments' own deepspeed=... wins over the launcher's plugin; without batch keys it takes the arguments'
    ds = TrainingArguments(tmp_path, deepspeed={"zero_optimization": {"stage": 2}}, per_device_train_batch_size=2,
                           gradient_accumulation_steps=5).deepspeed_config
    assert ds.zero_stage == 2
    assert (ds.config["train_micro_batch_size_per_gpu"], ds.config["gradient_accumulation_steps"]) == (2, 5)


def test_accelerate_fsdp_plugin_variables(monkeypatch, tmp_path):
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
                        "FSDP_OFFLOAD_PARAMS": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen3DecoderLayer", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    args = TrainingArguments(tmp_path)
    assert args.distributed_strategy == "fsdp" and args.fsdp == "shard_grad_op offload"
    options = args.fsdp_options
    assert (options.reshard_after_forward, options.cpu_offload, options.layer_classes) == (
        False, True, ("Qwen3DecoderLayer",))
    # FSDP1's variables (accelerate's default version) name the same strategies; NO_WRAP is accelerate's default
    for name in ("FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS", "FSDP_AUTO_WRAP_POLICY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "4")  # HYBRID_SHARD
    options = TrainingArguments(tmp_path).fsdp_options
    assert (options.hybrid_shard, options.reshard_after_forward, options.layer_classes) == (True, True, ())
    assert TrainingArguments(tmp_path, fsdp="full_shard").fsdp_options.hybrid_shard is False  # the arguments win


def test_accelerate_mixed_precision_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert TrainingArguments(tmp_path).mixed_precision == torch.bfloat16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(NotImplementedError, match="ACCELERATE_MIXED_PRECISION='fp8'"):
        TrainingArguments(tmp_path)


# --- one process, in this process (DeepSpeed over a process group of one) -------------------------------------------


@pytest.fixture
def deepspeed_here():
    """DeepSpeed in this test process: its CPU op build skipped (distributed_worker); afterwards the group it ran over
    left, DeepSpeed's process-wide record of that group, of its communication backend and of its accelerator dropped
    (so that another test can run it over a new group); clean_environment restores the variables."""
    import deepspeed.accelerator.real_accelerator
    import deepspeed.comm.comm
    import deepspeed.utils.groups
    import torch.distributed as dist

    from tests.training.distributed_worker import skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    # the accelerator DeepSpeed picked (CPU or CUDA) is chosen again by the next test that runs it
    deepspeed.accelerator.real_accelerator.ds_accelerator = None
    groups = deepspeed.utils.groups
    for name, value in list(vars(groups).items()):  # its private caches of groups, back to their values at import
        if name == "mesh_device" or (name.startswith("_") and name.isupper()
                                     and isinstance(value, (dict, type(None), dist.ProcessGroup))):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    deepspeed.comm.comm.cdb = None


def test_lora_under_zero3_trains_and_saves_its_adapter(tiny_checkpoint, tmp_path, deepspeed_here):
    from safetensors.torch import load_file

    from gpuformers.lora import LoraConfig, get_peft_model
    from gpuformers.training import Trainer

    zero3 = {**ZERO3, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    losses, adapters = {}, {}
    for name, extra in (("plain", {}), ("zero3", {"deepspeed": zero3})):
        torch.manual_seed(0)  # the same LoRA initialisation
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        trainer = Trainer(model, helpers.tiny_args(tmp_path / name, max_steps=3, learning_rate=3e-2, **extra),
                          train_dataset=helpers.make_rows(16))
        trainer.train()
        losses[name] = [v for e in trainer.state.log_history if "loss" in e for v in (e["loss"], e["grad_norm"])]
        trainer.save_model(tmp_path / name / "final")  # the adapter alone, gathered from the ZeRO-3 shards
        adapters[name] = load_file(tmp_path / name / "final" / "adapter_model.safetensors")
    assert losses["zero3"] == pytest.approx(losses["plain"], rel=1e-5)
    assert sorted(adapters["zero3"]) == sorted(adapters["plain"])
    for key, value in adapters["plain"].items():
        torch.testing.assert_close(adapters["zero3"][key], value, atol=1e-5, rtol=1e-5)


def test_one_process_zero1_2_and_3_offload_train_like_no_deepspeed(tiny_checkpoint, tmp_path, deepspeed_here):
    from safetensors.torch import load_file

    from gpuformers.training import Trainer

    values = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                  gradient_accumulation_steps=2, per_device_train_batch_size=2, warmup_steps=1,
                  load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    # ZeRO-3 with the parameters and the optimizer offloaded to the CPU, torch's AdamW stepping there (DeepSpeed's own
    # CPU Adam, which the Trainer's AdamW becomes by default, is a C++ build of minutes on CI's machine)
    offload = {**ZERO3, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    runs = {}
    for name, extra in (("plain", {}), ("zero1", {"deepspeed": {**ZERO3, "zero_optimization": {"stage": 1}}}),
                        ("zero2", {"deepspeed": {**ZERO3, "zero_optimization": {"stage": 2}}}),
                        ("zero3_offload", {"deepspeed": offload})):
        trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                          helpers.tiny_args(tmp_path / name, **values, **extra), train_dataset=helpers.make_rows(16),
                          eval_dataset=helpers.make_rows(4, seed=5))
        trainer.train()
        runs[name] = trainer
    history = {name: [v for e in t.state.log_history if "loss" in e for v in (e["loss"], e["grad_norm"])]
               for name, t in runs.items()}
    assert history["zero1"] == pytest.approx(history["plain"], rel=1e-5)
    assert history["zero2"] == pytest.approx(history["plain"], rel=1e-5)
    assert history["zero3_offload"] == pytest.approx(history["plain"], rel=1e-5)
    assert runs["zero3_offload"].model_wrapped.zero_cpu_offload()
    zero2 = runs["zero2"]
    assert zero2.model_wrapped.zero_optimization_stage() == 2
    # greater_is_better on the loss: the worse checkpoint, step 2, is the best and is loaded back into the engine
    assert zero2.state.best_model_checkpoint.endswith("checkpoint-2")
    # (read from the file: from_pretrained would build it partitioned, zero3_offload's ZeRO-3 arguments being alive)
    best = load_file(tmp_path / "zero2" / "checkpoint-2" / "model.safetensors")
    for name, value in zero2.model.state_dict().items():
        torch.testing.assert_close(value, best[name])


def test_zero3_with_the_config_optimizer_saves_shards_without_gathering(tiny_checkpoint, tmp_path, deepspeed_here,
                                                                         caplog):
    from gpuformers.training import Trainer

    config = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                                  "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}}}
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                      helpers.tiny_args(tmp_path, deepspeed=config, max_steps=3), train_dataset=helpers.make_rows(12))
    trainer.train()
    engine = trainer.model_wrapped
    assert type(engine.basic_optimizer) is torch.optim.AdamW and type(trainer.lr_scheduler).__name__ == "WarmupLR"
    assert engine.zero_optimization_stage() == 3
    with caplog.at_level("WARNING"):
        trainer.save_model(tmp_path / "final")
    folder = tmp_path / "final"
    assert "stage3_gather_16bit_weights_on_model_save is off" in caplog.text
    assert not (folder / "model.safetensors").exists() and (folder / "config.json").is_file()
    assert (folder / "zero_to_fp32.py").is_file() and (folder / "global_step_final").is_dir()
    with pytest.raises(ValueError, match="an optimizer section and the Trainer was given an optimizer"):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
        Trainer(model, helpers.tiny_args(tmp_path, deepspeed=config, max_steps=1),
                train_dataset=helpers.make_rows(4),
                optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None)).train()


def test_zero3_arguments_made_first_build_the_model_partitioned(tiny_checkpoint, tmp_path, deepspeed_here):
    """In one process: made before from_pretrained, ZeRO-3 arguments register their config for as long as they live
    (a weak reference, as in transformers), and from_pretrained builds the model under deepspeed.zero.Init with the
    checkpoint's weights, which trains like the model loaded whole; what cannot be built partitioned is refused by
    name; other arguments end it."""
    import deepspeed
    from safetensors.torch import load_file

    from gpuformers.training import Trainer

    args = helpers.tiny_args(tmp_path / "init", deepspeed=ZERO3, max_steps=3)
    assert distributed.zero3_init() is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    checkpoint = load_file(tiny_checkpoint / "model.safetensors")
    weight = model.lm_head.weight
    assert weight.shape == (0,) and tuple(weight.ds_shape) == tuple(checkpoint["lm_head.weight"].shape)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, value in model.named_parameters():
            torch.testing.assert_close(value, checkpoint[name], atol=0, rtol=0)
    refused = {"device_map": dict(device_map="cpu"), "quantization_config": dict(quantization_config={
        "load_in_8bit": True}), "tp_plan": dict(tp_plan="auto"), "gguf_file": dict(gguf_file="model.gguf")}
    for name, keywords in refused.items():
        with pytest.raises(NotImplementedError, match=f"{name}=.* while a DeepSpeed ZeRO-3 config is in force"):
            AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False, **keywords)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_checkpoint)}))
    with pytest.raises(NotImplementedError, match="LoRA adapter folder .* while a DeepSpeed ZeRO-3 config"):
        AutoModelForCausalLM.from_pretrained(adapter, progress=False)
    # a classifier from the causal LM's checkpoint: its missing score drawn whole (N(0, 0.02)), then partitioned
    from gpuformers import AutoModelForSequenceClassification

    score = AutoModelForSequenceClassification.from_pretrained(tiny_checkpoint, num_labels=3, progress=False).score
    assert score.weight.shape == (0,)
    with deepspeed.zero.GatheredParameters([score.weight]):
        assert score.weight.shape == (3, 64) and 0.01 < score.weight.std().item() < 0.03

    trainer = Trainer(model, args, train_dataset=helpers.make_rows(12), eval_dataset=helpers.make_rows(4, seed=5))
    with pytest.raises(NotImplementedError, match=r"evaluate\(\) before train\(\) on a model that from_pretrained"):
        trainer.evaluate()  # no engine yet to gather the parameters
    # trains like the model loaded whole: in float32, and in bf16 (built in the config's bf16, not the load's float32)
    made = {("float32", "partitioned"): trainer}  # the model and arguments above
    for name, extra in (("float32", {}), ("bf16", {"bf16": True})):
        losses = {}
        for load in ("partitioned", "whole"):
            trainer = made.get((name, load))
            if trainer is None:
                distributed.set_zero3_init(None)  # (ends the registration: a model loaded now is whole)
                if load == "partitioned":
                    args = helpers.tiny_args(tmp_path / name / load, deepspeed=ZERO3, max_steps=3, **extra)
                    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
                    assert model.lm_head.weight.ds_tensor.dtype == torch.bfloat16
                else:
                    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
                    args = helpers.tiny_args(tmp_path / name / load, deepspeed=ZERO3, max_steps=3, **extra)
                trainer = Trainer(model, args, train_dataset=helpers.make_rows(12))
            trainer.train()
            losses[load] = [v for e in trainer.state.log_history if "loss" in e for v in (e["loss"], e["grad_norm"])]
        assert len(losses["whole"]) == 6
        assert losses["partitioned"] == pytest.approx(losses["whole"], rel=1e-5, abs=1e-5), name

    held = helpers.tiny_args(tmp_path, deepspeed=ZERO3)
    assert distributed.zero3_init() is held._zero3_init
    # from_config builds partitioned too, drawing what the whole model draws from the same seed
    torch.manual_seed(0)
    drawn = AutoModelForCausalLM.from_config(model.config)
    assert drawn.lm_head.weight.shape == (0,)
    distributed.set_zero3_init(None)
    torch.manual_seed(0)
    expected = AutoModelForCausalLM.from_config(model.config).state_dict()
    with deepspeed.zero.GatheredParameters(list(drawn.parameters())):
        for name, value in drawn.state_dict().items():
            torch.testing.assert_close(value, expected[name], atol=0, rtol=0)
    distributed.set_zero3_init(held._zero3_init)
    del held
    assert distributed.zero3_init() is None  # the arguments are gone: models load whole again
    kept = helpers.tiny_args(tmp_path, deepspeed=ZERO3)
    helpers.tiny_args(tmp_path, deepspeed={**ZERO3, "zero_optimization": {"stage": 2}})  # the last one made wins
    assert kept.deepspeed_config.is_zero3 and distributed.zero3_init() is None
    assert AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False).lm_head.weight.shape == (128, 64)


# --- on a GPU (scripts/gpu_check.sh) -------------------------------------------------------------------------------


def zero2_bf16_trains_and_resumes(tiny_checkpoint, tmp_path, device: str) -> None:
    from gpuformers.training import Trainer
    from tests.training.distributed_worker import StopAt

    config = {**ZERO3, "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}

    def train(folder, stop_at=None, resume=None):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype="float32", device_map=device,
                                                     progress=False)
        args = helpers.tiny_args(folder, deepspeed=config, bf16=True, max_steps=6, save_strategy="steps",
                                 save_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                                 use_cpu=device == "cpu")
        trainer = Trainer(model, args, train_dataset=helpers.make_rows(24),
                          callbacks=[StopAt(stop_at)] if stop_at else [])
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}

    whole, expected = train(tmp_path / "whole")
    engine = whole.model_wrapped
    assert engine.bfloat16_enabled() and engine.zero_optimization_stage() == 2
    assert next(whole.model.parameters()).dtype == torch.bfloat16  # DeepSpeed holds bf16 weights, fp32 masters
    assert next(whole.model.parameters()).device.type == device
    assert all(torch.isfinite(torch.tensor(list(expected.values()))))
    train(tmp_path / "stopped", stop_at=3)
    assert (tmp_path / "stopped" / "checkpoint-3" / "global_step3").is_dir()
    _, resumed = train(tmp_path / "stopped", resume=True)
    assert sorted(resumed) == list(range(1, 7))
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-3)


def test_zero2_bf16_trains_and_resumes_on_the_cpu(tiny_checkpoint, tmp_path, deepspeed_here):
    zero2_bf16_trains_and_resumes(tiny_checkpoint, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero2_bf16_trains_and_resumes_on_one_gpu(tiny_checkpoint, tmp_path, deepspeed_here):
    zero2_bf16_trains_and_resumes(tiny_checkpoint, tmp_path, "cuda")
