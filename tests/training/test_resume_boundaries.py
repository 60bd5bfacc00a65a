"""Exact resume, dropout on, from a checkpoint at every kind of boundary: the end of an epoch (save_strategy="epoch",
and a step-save on an epoch's last step), a gradient-accumulation boundary inside an epoch, and the last step: the
resumed run logs the losses of the uninterrupted one and ends with its weights, bit for bit.

10 rows in batches of 2 are 5 batches an epoch; with 2 micro-batches a step that is 3 steps an epoch, the third of
one batch; 3 epochs are 9 steps. At an epoch boundary the uninterrupted run saves before the next epoch's
DataLoader draws its workers' seed from the global generator, inside an epoch after it: a resume must restore the
saved RNG state at that same point."""

from __future__ import annotations

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer
from tests.training.helpers import make_rows, tiny_args

ROWS = make_rows(10, seed=3)
ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=9, lr_scheduler_type="cosine",
            warmup_steps=2)
SAVES = {"epoch": dict(save_strategy="epoch"), "steps": dict(save_strategy="steps", save_steps=1)}


def _trainer(checkpoint, output_dir, save: str) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    for module in model.modules():  # dropout draws from the global RNG: the resume must restore it where it was
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return Trainer(model, tiny_args(output_dir, **ARGS, **SAVES[save]), train_dataset=ROWS)


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


@pytest.fixture(scope="module")
def one_thread():
    # with several threads, CPU backward kernels that add into shared rows may sum in another order from run to run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def straight(tiny_checkpoint, tmp_path_factory, one_thread):
    """The uninterrupted runs, one per save strategy, with their checkpoints."""
    runs = {}
    for save in SAVES:
        trainer = _trainer(tiny_checkpoint, tmp_path_factory.mktemp(f"straight-{save}"), save)
        trainer.train()
        runs[save] = trainer
    return runs


@pytest.mark.parametrize("save, step", [
    ("epoch", 3), ("epoch", 6),  # save_strategy="epoch": the end of epochs 1 and 2
    ("steps", 3),  # a step-save on the last step of epoch 1
    ("steps", 1), ("steps", 5),  # gradient-accumulation boundaries inside epochs 1 and 2
    ("steps", 9),  # the last step: nothing is left to train
])
def test_resume_from_any_boundary_gives_the_uninterrupted_losses_and_weights(straight, tiny_checkpoint, tmp_path,
                                                                              save, step):
    reference = straight[save]
    checkpoint = f"{reference.args.output_dir}/checkpoint-{step}"
    resumed = _trainer(tiny_checkpoint, tmp_path, save)
    assert resumed.train(resume_from_checkpoint=checkpoint).global_step == 9
    ours, theirs = _losses(resumed), _losses(reference)
    assert sorted(ours) == list(range(1, 10))
    assert [ours[s] for s in range(step + 1, 10)] == [theirs[s] for s in range(step + 1, 10)]
    for (name, p), q in zip(resumed.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p, q), name
