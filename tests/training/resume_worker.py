"""A training run in its own process, for the resume tests: `python -m tests.training.resume_worker CHECKPOINT
OUTPUT_DIR [--kill-at-save STEP]`. With --kill-at-save, the process SIGKILLs itself right after checkpoint-STEP is
written, as a power cut or the OOM killer would: no cleanup, no atexit, no flush."""

from __future__ import annotations

import argparse
import os
import signal

import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer, TrainerCallback
from tests.training.helpers import make_rows, tiny_args

RESUME_ARGS = dict(max_steps=20, save_steps=10, save_strategy="steps", per_device_train_batch_size=2,
                   lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.01)
ROWS = dict(count=16, seed=5)  # 8 steps per epoch: the resume at step 10 lands mid-epoch 2


class KillAtSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def build_trainer(checkpoint, output_dir, callbacks=()):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    for module in model.modules():  # dropout draws from the global RNG: an exact resume must restore it
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return Trainer(model, tiny_args(output_dir, **RESUME_ARGS), train_dataset=make_rows(**ROWS),
                   callbacks=list(callbacks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("output_dir")
    parser.add_argument("--kill-at-save", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the test's own runs: bit-exact comparisons need one thread (see the test)
    callbacks = [KillAtSave(args.kill_at_save)] if args.kill_at_save else []
    build_trainer(args.checkpoint, args.output_dir, callbacks).train()


if __name__ == "__main__":
    main()
