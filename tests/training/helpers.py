"""Small builders shared by the training tests: fixed random rows, gradient capture, tiny arguments."""

from __future__ import annotations

import torch

from gpuformers.training import TrainerCallback, TrainingArguments


def make_rows(count: int = 16, seed: int = 0, low: int = 5, high: int = 17) -> list[dict]:
    """Rows of random token ids of varied lengths (so that padding and token counting matter)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(0, 128, (n,), generator=generator).tolist()} for n in lengths]


class GradientRecorder(TrainerCallback):
    """Copies every gradient right before each optimizer step (after clipping); works with transformers too."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def tiny_args(output_dir, **overrides) -> TrainingArguments:
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=10,
                  logging_steps=1, save_strategy="no", disable_tqdm=True, optim="adamw_torch", seed=0)
    return TrainingArguments(**{**values, **overrides})
