"""Checkpoints: exact resume after a real SIGKILL, crash-safe writes, rotation, and the files on disk."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuformers.training import checkpoint as ckpt
from gpuformers.training.callbacks import TrainerState
from tests.training.helpers import make_rows, tiny_args
from tests.training.resume_worker import build_trainer

REPO = Path(__file__).resolve().parents[2]


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_resume_after_sigkill_replays_steps_11_to_20_exactly(tiny_checkpoint, tmp_path):
    # One thread here and in the worker: with several, CPU backward kernels that add into shared rows (the embedding
    # gradient) may sum in a different order from run to run and differ in the last bit, which is not a resume bug.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _resume_after_sigkill(tiny_checkpoint, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _resume_after_sigkill(tiny_checkpoint, tmp_path):
    straight = build_trainer(tiny_checkpoint, tmp_path / "straight")
    straight.train()

    killed_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.training.resume_worker", str(tiny_checkpoint),
                           str(killed_dir), "--kill-at-save", "10"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [p.name for p in ckpt.sorted_checkpoints(killed_dir)] == ["checkpoint-10"]

    resumed = build_trainer(tiny_checkpoint, killed_dir)
    resumed.train(resume_from_checkpoint=True)

    ours, reference = _losses(resumed), _losses(straight)
    assert sorted(ours) == list(range(1, 21))  # steps 1-10 come from the checkpoint's log history
    assert [ours[s] for s in range(11, 21)] == [reference[s] for s in range(11, 21)]
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p, q), name
    for key, value in straight.optimizer.state_dict()["state"].items():
        assert torch.equal(resumed.optimizer.state_dict()["state"][key]["exp_avg"], value["exp_avg"])


def test_crash_during_a_checkpoint_write_leaves_the_previous_one_intact_and_resumable(tiny_checkpoint, tmp_path,
                                                                                     monkeypatch):
    out = tmp_path / "run"
    overrides = dict(max_steps=10, save_steps=5, save_strategy="steps", per_device_train_batch_size=2)
    rows = make_rows(12, seed=2)
    from gpuformers import AutoModelForCausalLM
    from gpuformers.training import Trainer

    def trainer(folder):
        return Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                       tiny_args(folder, **overrides), train_dataset=rows)

    real_capture = ckpt.capture_rng_state
    calls = []

    def crash_on_second_save():
        calls.append(1)
        if len(calls) == 2:  # model and optimizer of checkpoint-10 are written; the rest is not
            raise OSError("disk full (injected)")
        return real_capture()

    monkeypatch.setattr(ckpt, "capture_rng_state", crash_on_second_save)
    with pytest.raises(OSError, match="injected"):
        trainer(out).train()
    monkeypatch.undo()

    first = out / "checkpoint-5"
    before = _digest(first)
    assert ckpt.get_last_checkpoint(out) == first
    assert not (out / "checkpoint-10").exists()
    leftovers = [p for p in out.iterdir() if p.name.startswith(".tmp-checkpoint-10")]
    assert leftovers and (leftovers[0] / "model.safetensors").is_file()  # the crash really was mid-write

    resumed = trainer(out)
    resumed.train(resume_from_checkpoint=True)
    assert _digest(first) == before
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir())  # the next save cleaned up
    assert [p.name for p in ckpt.sorted_checkpoints(out)] == ["checkpoint-5", "checkpoint-10"]
    straight = trainer(tmp_path / "straight")
    straight.train()
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_files_rotation_and_transformers_loading(tiny_checkpoint, tmp_path):
    import transformers

    trainer = build_trainer(tiny_checkpoint, tmp_path)
    trainer.args.max_steps, trainer.args.save_steps, trainer.args.save_total_limit = 6, 2, 2
    trainer.train()
    names = [p.name for p in ckpt.sorted_checkpoints(tmp_path)]
    assert names == ["checkpoint-4", "checkpoint-6"]
    last = tmp_path / "checkpoint-6"
    for file in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                 "trainer_state.json", "training_args.json"):
        assert (last / file).is_file(), file
    state = TrainerState.load_from_json(last / "trainer_state.json")
    assert state.global_step == 6 and len([e for e in state.log_history if "loss" in e]) == 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(last)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(dict(hf.named_parameters())[name], p)
    # every .pt file loads with weights_only=True
    for file in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.load(last / file, weights_only=True)
    # resuming from the final checkpoint has nothing left to do
    again = build_trainer(tiny_checkpoint, tmp_path)
    again.args.max_steps = 6
    assert again.train(resume_from_checkpoint=last).global_step == 6
    assert not any("loss" in e and e["step"] > 6 for e in again.state.log_history)


def test_resume_from_a_folder_that_is_not_a_checkpoint_says_so(tiny_checkpoint, tmp_path):
    trainer = build_trainer(tiny_checkpoint, tmp_path)
    with pytest.raises(FileNotFoundError, match="not a complete training checkpoint"):
        trainer.train(resume_from_checkpoint=tmp_path)
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
