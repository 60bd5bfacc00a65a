"""Crash-safe checkpoint rotation: a crash while save_total_limit deletes a checkpoint never leaves a checkpoint-N
that looks complete and is not; a folder left half-deleted all the same (by an earlier gpuformers or by
transformers' rotation: trainer_state.json but no weights, say) is recognised as incomplete, skipped with a warning by
resume_from_checkpoint=True and as the best checkpoint, refused by name when passed as the checkpoint, and removed by
the next rotation."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer
from gpuformers.training import checkpoint as ckpt
from tests.training.helpers import make_rows, tiny_args
from tests.training.test_best_model import _ours

ROWS = make_rows(16, seed=2)
ARGS = dict(max_steps=4, save_strategy="steps", save_steps=1)  # batches of 4: 4 steps, a checkpoint after each
WHOLE = {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}


def _trainer(checkpoint, output_dir, **overrides) -> Trainer:
    return Trainer(AutoModelForCausalLM.from_pretrained(checkpoint, progress=False),
                   tiny_args(output_dir, **{**ARGS, **overrides}), train_dataset=ROWS)


@pytest.fixture(scope="module")
def straight(tiny_checkpoint, tmp_path_factory):
    """An uninterrupted run and its checkpoint-1 .. checkpoint-4, all kept; one thread, for bit-exact weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = _trainer(tiny_checkpoint, tmp_path_factory.mktemp("straight"))
    trainer.train()
    yield trainer
    torch.set_num_threads(threads)


def _same_weights(trainer, reference) -> None:
    for (name, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p, q), name


def _copy(reference, out: Path, *steps: int) -> None:
    for step in steps:
        shutil.copytree(Path(reference.args.output_dir) / f"checkpoint-{step}", out / f"checkpoint-{step}")


class Killed(BaseException):
    """The process dying (SIGKILL): no handler runs after it."""


def test_a_kill_while_rotation_deletes_a_checkpoint_leaves_none_that_looks_complete(straight, tiny_checkpoint,
                                                                                     tmp_path, monkeypatch):
    def killed_midway(path, *args, **kwargs):
        # the worst order a real rmtree can take: every file but trainer_state.json deleted, then the kill
        for file in sorted(Path(path).rglob("*")):
            if file.is_file() and file.name != ckpt.STATE_NAME:
                file.unlink()
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    out = tmp_path / "run"
    with pytest.raises(Killed):  # step 3's rotation deletes checkpoint-1
        _trainer(tiny_checkpoint, out, save_total_limit=2).train()
    monkeypatch.undo()

    left = sorted(p for p in out.iterdir() if p.name.startswith("checkpoint-"))
    for folder in left:
        assert WHOLE <= {p.name for p in folder.iterdir()}, folder.name
    assert [p.name for p in ckpt.sorted_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]

    resumed = _trainer(tiny_checkpoint, out, save_total_limit=2)
    resumed.train(resume_from_checkpoint=True)
    assert [p.name for p in ckpt.sorted_checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]  # the next save removed the remains
    _same_weights(resumed, straight)


def test_resume_true_skips_a_half_deleted_checkpoint_with_a_warning(straight, tiny_checkpoint, tmp_path, caplog):
    out = tmp_path / "run"
    _copy(straight, out, 2, 3)
    (out / "checkpoint-3" / "model.safetensors").unlink()  # what an older rotation, killed, leaves
    resumed = _trainer(tiny_checkpoint, out)
    with caplog.at_level(logging.WARNING, logger="gpuformers.training.checkpoint"):
        resumed.train(resume_from_checkpoint=True)  # from checkpoint-2: steps 3 and 4 trained again
    warning = next(r.getMessage() for r in caplog.records if "checkpoint-3" in r.getMessage())
    assert "incomplete" in warning and "no model weights" in warning
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]
    _same_weights(resumed, straight)
    assert ckpt.incomplete_reason(out / "checkpoint-3") is None  # written again, whole


def _half_deleted(folder: Path, gone: str) -> None:
    if gone == "a shard":  # weights in shards, one of them gone: the index names it
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        (folder / gone).unlink()


@pytest.mark.parametrize("gone, reason", [
    ("model.safetensors", "no model weights"), ("a shard", "model-00002-of-00002.safetensors"),
    ("optimizer.pt", "no optimizer.pt"), ("scheduler.pt", "no scheduler.pt"),
    ("trainer_state.json", "no trainer_state.json"),
])
def test_every_half_deleted_folder_is_incomplete_and_refused_by_name(straight, tmp_path, caplog, gone, reason):
    _copy(straight, tmp_path, 2, 3)
    folder = tmp_path / "checkpoint-3"
    _half_deleted(folder, gone)
    assert reason in ckpt.incomplete_reason(folder)
    assert ckpt.sorted_checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]
    with caplog.at_level(logging.WARNING, logger="gpuformers.training.checkpoint"):
        assert ckpt.get_last_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert any("checkpoint-3" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    with pytest.raises(FileNotFoundError, match=f"checkpoint-3 is not a complete training checkpoint.*{reason}"):
        ckpt.load_training_state(folder, model=None)


def test_a_checkpoint_without_an_rng_file_or_saved_without_its_training_state_is_complete(straight, tmp_path):
    _copy(straight, tmp_path, 3)
    folder = tmp_path / "checkpoint-3"
    (folder / "rng_state.pth").unlink()  # both Trainers resume without it (from another number of processes, say)
    assert ckpt.incomplete_reason(folder) is None
    for name in ("optimizer.pt", "scheduler.pt"):  # as save_only_model=True writes it
        (folder / name).unlink()
    assert ckpt.incomplete_reason(folder) is None
    assert ckpt.sorted_checkpoints(tmp_path) == [folder]


def test_a_half_deleted_best_checkpoint_is_forgotten_on_resume_and_removed(tiny_checkpoint, tmp_path, caplog):
    # tests/training/test_best_model.py's data: the best evaluation is step 3's; save_total_limit=2 keeps it
    _ours(tiny_checkpoint, tmp_path, max_steps=5).train()
    assert [p.name for p in ckpt.sorted_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-5"]
    (tmp_path / "checkpoint-3" / "model.safetensors").unlink()
    resumed = _ours(tiny_checkpoint, tmp_path, max_steps=6)  # step 6 is no better than step 3
    with caplog.at_level(logging.WARNING):
        assert resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-5").global_step == 6
    assert any("best checkpoint" in r.getMessage() and "checkpoint-3" in r.getMessage() for r in caplog.records)
    assert resumed.state.best_model_checkpoint is None
    # nothing was loaded at the end: the weights are step 6's, and the rotation removed the remains of checkpoint-3
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-6", progress=False).state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, last[name]), name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-5",
                                                                                             "checkpoint-6"]
