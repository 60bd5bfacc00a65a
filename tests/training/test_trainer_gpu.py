"""The Trainer on a CUDA GPU: bf16 chosen by itself, fused AdamW, fp16 with a gradient scaler, torch.compile,
packing. Run by scripts/gpu_check.sh; skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, PackedCollator, Trainer
from tests.training.helpers import make_rows, tiny_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32", device_map="cuda", progress=False)


def test_bf16_auto_trains_on_the_gpu_with_fused_adamw(tiny_checkpoint, tmp_path):
    args = tiny_args(tmp_path, bf16="auto", max_steps=30, optim="adamw_torch_fused", lr_scheduler_type="constant")
    assert args.device.type == "cuda"
    expected = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    assert args.mixed_precision == expected
    trainer = Trainer(_model(tiny_checkpoint), args, train_dataset=make_rows(8))
    trainer.train()
    assert trainer.optimizer.defaults["fused"] is True
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_fp16_uses_a_gradient_scaler(tiny_checkpoint, tmp_path):
    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, fp16=True, max_steps=5), train_dataset=make_rows(8))
    result = trainer.train()
    assert trainer.scaler is not None and math.isfinite(result.training_loss)


def test_torch_compile_trains(tiny_checkpoint, tmp_path):
    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, torch_compile=True, bf16=True, max_steps=4),
                      train_dataset=make_rows(8, low=16, high=17))
    assert math.isfinite(trainer.train().training_loss)


def test_packing_matches_padding_on_the_gpu(tiny_checkpoint, tmp_path):
    rows = make_rows(5, seed=11)
    losses = []
    for name, collator in (("padded", DataCollatorForCausalLM()), ("packed", PackedCollator())):
        trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path / name, max_steps=1, tf32=False,
                          per_device_train_batch_size=5, train_sampling_strategy="sequential"),
                          train_dataset=rows, data_collator=collator)
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_use_kernels_model_trains_to_the_same_losses(tiny_checkpoint, tmp_path):
    losses = {}
    for kernels in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype="float32", device_map="cuda",
                                                     progress=False, use_kernels=kernels)
        trainer = Trainer(model, tiny_args(tmp_path / str(kernels), bf16=True, max_steps=5,
                          train_sampling_strategy="sequential"), train_dataset=make_rows(8))
        trainer.train()
        losses[kernels] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_fp16_refuses_float16_weights_before_training(tiny_checkpoint, tmp_path):
    """The gradient scaler cannot unscale float16 gradients: said up front, with the fix, not at the first step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype="float16", device_map="cuda", progress=False)
    with pytest.raises(ValueError, match=r"fp16=True trains float32 weights .* is float16: load the model with"):
        Trainer(model, tiny_args(tmp_path, fp16=True, max_steps=1), train_dataset=make_rows(8))
