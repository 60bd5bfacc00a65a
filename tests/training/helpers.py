"""Small builders shared by the training tests: fixed random rows, gradient capture, tiny arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


REPO = Path(__file__).resolve().parents[2]


def torchrun(module: str, *args: str, processes: int = 2) -> None:
    """`python -m module args` in `processes` processes under torchrun (one thread each, this checkout's code);
    fails the test with the end of their output when one of them fails."""
    launch(["torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"], module, *args)


def accelerate_launch(options: list[str], module: str, *args: str, processes: int = 2) -> None:
    """The same under `accelerate launch OPTIONS` (its own environment for the processes, e.g. --use_deepspeed)."""
    launch(["accelerate.commands.launch", f"--num_processes={processes}", "--num_machines=1", "--mixed_precision=no",
            "--dynamo_backend=no", *options], module, *args)


def launch(launcher: list[str], module: str, *args: str) -> None:
    """`python -m LAUNCHER... -m module args`, one thread per process, this checkout's code; fails the test with
    the end of the output when a process fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", *launcher, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
