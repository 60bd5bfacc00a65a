"""Resuming across Trainers: ours continues from a checkpoint-N written by transformers' Trainer exactly as
transformers' own resume does (the same losses, learning rates, gradient norms and final weights), transformers'
Trainer continues from ours the same way (LoRA runs with peft included, and our checkpoints written before the empty
no-decay group was kept still resume), and what cannot be resumed (DeepSpeed and FSDP folders, another optimizer's or
scheduler's state, another set of trainable parameters) is refused with the file and the reason.

Every run: 22 rows in batches of 2, 2 accumulated per optimizer step (6 steps an epoch, the last over a single
batch), a random order, attention dropout 0.1 (so the restored RNG state matters), 8 steps, interrupted after the
checkpoint of step 3 (mid-epoch)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainerCallback
from tests.training.helpers import make_rows, tiny_args

ROWS = make_rows(22, seed=1)
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=8, learning_rate=3e-3,
              warmup_steps=2, weight_decay=0.1, optim="adamw_torch", seed=0, train_sampling_strategy="random",
              save_strategy="steps", save_steps=3, logging_steps=1, report_to="none", disable_tqdm=True)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class StopAt(TrainerCallback):
    """Ends the run after `step` and its checkpoint, as an interruption would (works in transformers' Trainer too)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def _with_dropout(model):
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return model


def _theirs(folder, out, callbacks=(), **overrides):
    import transformers

    model = _with_dropout(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, **{**COMMON, **overrides})
    return transformers.Trainer(model, args, train_dataset=ROWS, data_collator=DataCollatorForCausalLM(pad_token_id=0),
                                callbacks=list(callbacks))


def _ours(folder, out, callbacks=(), **overrides) -> Trainer:
    model = _with_dropout(AutoModelForCausalLM.from_pretrained(folder, progress=False))
    return Trainer(model, tiny_args(out, use_cpu=True, **{**COMMON, **overrides}), train_dataset=ROWS,
                   data_collator=DataCollatorForCausalLM(pad_token_id=0), callbacks=list(callbacks))


def _theirs_lora(folder, out, callbacks=()):
    """transformers' Trainer over a peft LoRA model: no bias or norm to train, so an empty no-decay group."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, **{**COMMON, "learning_rate": 3e-2})
    return transformers.Trainer(model, args, train_dataset=ROWS, callbacks=list(callbacks),
                                data_collator=DataCollatorForCausalLM(pad_token_id=0))


def _ours_lora(folder, out) -> Trainer:
    from gpuformers.lora import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, progress=False), LoraConfig(**LORA))
    return Trainer(model, tiny_args(out, use_cpu=True, **{**COMMON, "learning_rate": 3e-2}), train_dataset=ROWS,
                   data_collator=DataCollatorForCausalLM(pad_token_id=0))


def _logged(trainer) -> dict[int, tuple[float, float, float]]:
    return {e["step"]: (e["loss"], e["learning_rate"], e["grad_norm"]) for e in trainer.state.log_history
            if "loss" in e}


def _trained(model) -> dict[str, torch.Tensor]:
    """The trained parameters by name, peft's adapter names without their ".default" (as ours name them)."""
    return {name.replace(".default", ""): p for name, p in model.named_parameters() if p.requires_grad}


def _group_sizes(checkpoint: Path) -> list[int]:
    return [len(group["params"]) for group in torch.load(checkpoint / "optimizer.pt")["param_groups"]]


def _assert_same_run(run, reference) -> None:
    """The same steps logged (1-3 from the checkpoint's history, 4-8 after the resume) and the same trained weights
    at the end."""
    assert run.state.global_step == reference.state.global_step == 8
    logged, expected = _logged(run), _logged(reference)
    assert sorted(logged) == sorted(expected) == list(range(1, 9))
    for step in expected:
        assert logged[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    weights, expected_weights = _trained(run.model), _trained(reference.model)
    assert weights.keys() == expected_weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_weights[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_resume_from_a_transformers_checkpoint_continues_as_transformers_does(schedule, tiny_checkpoint, tmp_path):
    _theirs(tiny_checkpoint, tmp_path / "hf", [StopAt(3)], lr_scheduler_type=schedule).train()
    checkpoint = tmp_path / "hf" / "checkpoint-3"
    assert (checkpoint / "training_args.bin").is_file() and not (checkpoint / "training_args.json").exists()
    theirs = _theirs(tiny_checkpoint, tmp_path / "hf-resumed", lr_scheduler_type=schedule)
    theirs.train(resume_from_checkpoint=str(checkpoint))
    ours = _ours(tiny_checkpoint, tmp_path / "ours", lr_scheduler_type=schedule)
    ours.train(resume_from_checkpoint=checkpoint)
    _assert_same_run(ours, theirs)
    # our checkpoints after the resume are whole ones of ours
    assert (tmp_path / "ours" / "checkpoint-6" / "training_args.json").is_file()


def test_transformers_resumes_from_our_checkpoint_as_we_do(tiny_checkpoint, tmp_path):
    _ours(tiny_checkpoint, tmp_path / "ours", [StopAt(3)], lr_scheduler_type="cosine").train()
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    theirs = _theirs(tiny_checkpoint, tmp_path / "hf-resumed", lr_scheduler_type="cosine")
    theirs.train(resume_from_checkpoint=str(checkpoint))  # its own loading: rng_state.pth, optimizer.pt, ...
    ours = _ours(tiny_checkpoint, tmp_path / "ours-resumed", lr_scheduler_type="cosine")
    ours.train(resume_from_checkpoint=checkpoint)
    _assert_same_run(ours, theirs)


def test_a_lora_run_of_transformers_and_peft_resumes_as_transformers_does(tiny_checkpoint, tmp_path):
    """transformers' optimizer.pt and scheduler.pt have an empty no-decay group (LoRA trains no bias or norm), as
    ours do."""
    pytest.importorskip("peft")
    _theirs_lora(tiny_checkpoint, tmp_path / "hf", [StopAt(3)]).train()
    checkpoint = tmp_path / "hf" / "checkpoint-3"
    assert _group_sizes(checkpoint) == [8, 0]
    resumed = _theirs_lora(tiny_checkpoint, tmp_path / "hf-resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    ours = _ours_lora(tiny_checkpoint, tmp_path / "ours")
    ours.train(resume_from_checkpoint=checkpoint)
    assert len(_trained(ours.model)) == 8
    _assert_same_run(ours, resumed)


@pytest.fixture(scope="module")
def our_lora_run(tiny_checkpoint, tmp_path_factory) -> tuple[Trainer, Path]:
    """Our LoRA run, never interrupted, and its checkpoint-3 (a run stopped after step 3 writes the same one)."""
    out = tmp_path_factory.mktemp("ours-lora")
    trainer = _ours_lora(tiny_checkpoint, out)
    trainer.train()
    return trainer, out / "checkpoint-3"


def test_transformers_resumes_a_lora_run_from_our_checkpoint_as_it_went_on(our_lora_run, tiny_checkpoint, tmp_path):
    """Our optimizer.pt keeps the empty no-decay group, as transformers' does: transformers' Trainer and peft take
    our checkpoint and log the losses, learning rates and gradient norms of our uninterrupted run, to the same
    adapter weights."""
    pytest.importorskip("peft")
    reference, checkpoint = our_lora_run
    assert _group_sizes(checkpoint) == [8, 0]
    theirs = _theirs_lora(tiny_checkpoint, tmp_path / "hf-resumed")
    theirs.train(resume_from_checkpoint=str(checkpoint))
    assert len(_trained(theirs.model)) == 8
    _assert_same_run(theirs, reference)


def test_our_lora_checkpoints_without_the_empty_group_resume_as_the_run_went_on(our_lora_run, tiny_checkpoint,
                                                                                tmp_path):
    """gpuformers' checkpoints before the empty no-decay group was kept have one group fewer in optimizer.pt and one
    value fewer per group in scheduler.pt: the group comes back with the schedule's learning rate, the run goes on
    as the uninterrupted one, and its next checkpoints have both groups."""
    reference, checkpoint = our_lora_run
    old = _copy(checkpoint, tmp_path / "old")
    optimizer = torch.load(checkpoint / "optimizer.pt")
    optimizer["param_groups"] = [group for group in optimizer["param_groups"] if group["params"]]
    torch.save(optimizer, old / "optimizer.pt")
    scheduler = torch.load(checkpoint / "scheduler.pt")
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        scheduler[key] = scheduler[key][:1]
    torch.save(scheduler, old / "scheduler.pt")
    assert _group_sizes(old) == [8]

    resumed = _ours_lora(tiny_checkpoint, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=old)
    _assert_same_run(resumed, reference)
    assert resumed.lr_scheduler.state_dict() == reference.lr_scheduler.state_dict()
    assert ([group["lr"] for group in resumed.optimizer.param_groups]
            == [group["lr"] for group in reference.optimizer.param_groups])
    assert _group_sizes(tmp_path / "resumed" / "checkpoint-6") == [8, 0]


def test_an_optimizer_without_the_empty_group_resumes_from_a_lora_checkpoint(our_lora_run, tiny_checkpoint,
                                                                             tmp_path):
    """An optimizer passed to the Trainer over the adapter weights alone, which is our decay group: the saved empty
    group and its scheduler values are left out, and the run goes on as the uninterrupted one."""
    reference, checkpoint = our_lora_run
    trainer = _ours_lora(tiny_checkpoint, tmp_path / "own")
    weights = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.optimizer = torch.optim.AdamW(weights, lr=3e-2, weight_decay=COMMON["weight_decay"])
    trainer.train(resume_from_checkpoint=checkpoint)
    assert len(trainer.optimizer.param_groups) == len(trainer.lr_scheduler.base_lrs) == 1
    _assert_same_run(trainer, reference)


@pytest.fixture(scope="module")
def hf_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """checkpoint-3 of transformers' Trainer (linear schedule), to copy and alter."""
    out = tmp_path_factory.mktemp("hf")
    _theirs(tiny_checkpoint, out, [StopAt(3)]).train()
    return out / "checkpoint-3"


def _copy(checkpoint: Path, folder: Path) -> Path:
    """A copy of `checkpoint` to alter, as folder/checkpoint-N."""
    return Path(shutil.copytree(checkpoint, folder / checkpoint.name))


def test_the_rng_state_of_each_process_and_only_numpy_globals_are_read(hf_checkpoint, tiny_checkpoint, tmp_path):
    """transformers under torchrun writes rng_state_<process>.pth: process 0's is restored, as from rng_state.pth
    (with dropout, a resume without it goes elsewhere). The file is read with weights_only=True, allowing NumPy's
    state and nothing else."""
    def resumed_losses(checkpoint, name):
        trainer = _ours(tiny_checkpoint, tmp_path / name)
        trainer.train(resume_from_checkpoint=checkpoint)
        return _logged(trainer)

    reference = resumed_losses(hf_checkpoint, "reference")
    per_process = _copy(hf_checkpoint, tmp_path / "a")
    (per_process / "rng_state.pth").rename(per_process / "rng_state_0.pth")
    assert resumed_losses(per_process, "per-process") == reference
    without = _copy(hf_checkpoint, tmp_path / "b")
    (without / "rng_state.pth").unlink()
    assert resumed_losses(without, "without")[4] != reference[4]

    unsafe = _copy(hf_checkpoint, tmp_path / "c")
    state = torch.load(hf_checkpoint / "rng_state.pth", weights_only=False)
    torch.save({**state, "extra": Path("/")}, unsafe / "rng_state.pth")  # a global beyond NumPy's
    with pytest.raises(pickle.UnpicklingError, match="pathlib"):
        _ours(tiny_checkpoint, tmp_path / "unsafe").train(resume_from_checkpoint=unsafe)


def _adafactor_state(tiny_checkpoint) -> dict:
    """transformers' Adafactor over the two weight-decay groups after one step: what optim="adafactor" saves."""
    from transformers.optimization import Adafactor

    from gpuformers.training.optim import decay_parameter_names

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    decay = decay_parameter_names(model)
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == wanted]}
              for wanted in (True, False)]
    optimizer = Adafactor(groups, lr=1e-3, scale_parameter=False, relative_step=False)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    return optimizer.state_dict()


def test_what_cannot_be_resumed_is_refused_with_the_file_and_the_reason(hf_checkpoint, tiny_checkpoint, tmp_path):
    def refused(alter, match):
        checkpoint = _copy(hf_checkpoint, tmp_path / alter.__name__)
        alter(checkpoint)
        with pytest.raises(ValueError, match=match):
            _ours(tiny_checkpoint, tmp_path / "out").train(resume_from_checkpoint=checkpoint)

    def deepspeed(folder):
        (folder / "global_step3").mkdir()
        (folder / "latest").write_text("global_step3")

    def fsdp(folder):
        (folder / "pytorch_model_fsdp_0").mkdir()

    def adafactor(folder):
        torch.save(_adafactor_state(tiny_checkpoint), folder / "optimizer.pt")

    def plateau(folder):
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=1.0))
        torch.save(scheduler.state_dict(), folder / "scheduler.pt")

    refused(deepspeed, "global_step3: .* is a DeepSpeed checkpoint")
    refused(fsdp, "pytorch_model_fsdp_0: .* under FSDP")
    refused(adafactor, r"optimizer.pt holds the state of another optimizer \(per parameter: .*exp_avg_sq_col")
    refused(plateau, r"scheduler.pt holds the state of another kind of scheduler than LambdaLR \(.*patience")

    # another set of trainable parameters (the embeddings frozen): the optimizer's groups differ in size
    trainer = _ours(tiny_checkpoint, tmp_path / "frozen")
    trainer.model.get_input_embeddings().weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"optimizer.pt holds \[16, 9\] parameters per group, the optimizer has "
                                         r"\[15, 9\]"):
        trainer.train(resume_from_checkpoint=hf_checkpoint)
