"""train_sampling_strategy="group_by_length" (or transformers 4's group_by_length=True): every epoch's batches are
transformers' Trainer's (the same rows in the same order, for the same seed), under torchrun each process's share is
the one accelerate deals it, rows of similar length share a batch with the longest batch first, a length column is
read where the dataset has one, and a resumed run replays the same batches.

Run as `torchrun --nproc_per_node=2 -m tests.training.test_group_by_length CHECKPOINT OUTPUT_DIR`, this file is one
process of the distributed check: it writes the rows each of its batches held to OUTPUT_DIR/batches_RANK.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainerCallback, TrainingArguments
from gpuformers.training.sampling import length_grouped_batches, sequence_lengths
from tests.training.helpers import make_rows, tiny_args

REPO = Path(__file__).resolve().parents[2]
ROWS = make_rows(37, seed=2, low=3, high=30)  # 37: the last batch is short, and under torchrun padded
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2, max_steps=-1,
              train_sampling_strategy="group_by_length", seed=5, learning_rate=1e-3, optim="adamw_torch",
              report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, remove_unused_columns=False)


class RecordingCollator:
    """Pads as DataCollatorForCausalLM and remembers which rows (by their "row" number) made each batch."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.pad = DataCollatorForCausalLM(pad_token_id=0)

    def __call__(self, rows):
        self.batches.append([row["row"] for row in rows])
        return self.pad([{"input_ids": row["input_ids"]} for row in rows])


def numbered(rows):
    return [{**row, "row": i} for i, row in enumerate(rows)]


def _ours(folder, out, rows, callbacks=(), **overrides):
    collator = RecordingCollator()
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    trainer = Trainer(model, tiny_args(out, use_cpu=True, **{**COMMON, **overrides}), train_dataset=rows,
                      data_collator=collator, callbacks=list(callbacks))
    return trainer, collator


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def test_both_epochs_batches_equal_transformers_trainer(tiny_checkpoint, tmp_path):
    import transformers

    theirs_collator = RecordingCollator()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs = transformers.Trainer(model, transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                                                        **COMMON),
                                  train_dataset=numbered(ROWS), data_collator=theirs_collator)
    theirs.train()
    ours, ours_collator = _ours(tiny_checkpoint, tmp_path / "ours", numbered(ROWS))
    ours.train()
    assert len(ours_collator.batches) == 2 * 19
    assert ours_collator.batches == theirs_collator.batches
    assert _losses(ours) == pytest.approx(_losses(theirs), rel=1e-5)


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_process_share_is_accelerates(drop_last):
    """transformers' sampler, batched and dealt out by accelerate's BatchSamplerShard as in a 2-process run (checked
    once against transformers' Trainer under torchrun: the same lists)."""
    from accelerate.data_loader import BatchSamplerShard
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = [len(row["input_ids"]) for row in ROWS]
    for epoch in (0, 1):
        generator = torch.Generator().manual_seed(5)
        for _ in range(epoch + 1):  # what the Trainer's global generator does before each epoch's permutation
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            sampler = list(LengthGroupedSampler(4, lengths=lengths, generator=generator))
        for rank in (0, 1):
            batches = torch.utils.data.BatchSampler(sampler, 2, drop_last)
            expected = list(BatchSamplerShard(batches, num_processes=2, process_index=rank))
            assert length_grouped_batches(lengths, 2, 4, 5, epoch, 2, rank, drop_last) == expected


def test_rows_of_similar_length_share_a_batch_longest_first():
    lengths = torch.randint(1, 1000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    order = [i for batch in length_grouped_batches(lengths, 4, 8, seed=1, epoch=3) for i in batch]
    assert sorted(order) == list(range(2000))
    assert lengths[order[0]] == max(lengths)  # the first batch is the longest
    megabatch = 50 * 8  # min(50, 2000 // (4 * 8)) groups of 8 rows
    for start in range(0, 2000, megabatch):
        chunk = [lengths[i] for i in order[start:start + megabatch]]
        assert chunk[1:] == sorted(chunk[1:], reverse=True)
    padding = sum(max(lengths[i] for i in order[s:s + 4]) * 4 - sum(lengths[i] for i in order[s:s + 4])
                  for s in range(0, 2000, 4))
    assert padding < 0.1 * sum(lengths)  # a random order pads about a third


class Columns:
    """A datasets.Dataset-like table: rows by index, whole columns by name."""

    def __init__(self, rows, lengths):
        self.rows, self.column_names, self.lengths = rows, ["input_ids", "length"], lengths

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        return self.lengths if key == "length" else self.rows[key]


def test_length_column_is_read_and_rows_without_ids_are_refused():
    rows = make_rows(12, seed=4)
    assert sequence_lengths(rows) == [len(row["input_ids"]) for row in rows]
    assert sequence_lengths(Columns(rows, list(range(12)))) == list(range(12))
    with pytest.raises(ValueError, match='no "input_ids" and the dataset no "length" column'):
        sequence_lengths([{"text": "hi"}])
    assert TrainingArguments(output_dir="o", group_by_length=True).train_sampling_strategy == "group_by_length"
    with pytest.raises(ValueError, match="contradicts"):
        TrainingArguments(output_dir="o", group_by_length=True, train_sampling_strategy="sequential")


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def test_resume_in_the_second_epoch_replays_its_batches(tiny_checkpoint, tmp_path):
    values = dict(save_strategy="steps", save_steps=13)  # 19 batches, 10 steps an epoch: 13 is mid-epoch 2
    whole, whole_batches = _ours(tiny_checkpoint, tmp_path / "whole", numbered(ROWS), **values)
    whole.train()
    _ours(tiny_checkpoint, tmp_path / "cut", numbered(ROWS), [StopAt(13)], **values)[0].train()
    resumed, resumed_batches = _ours(tiny_checkpoint, tmp_path / "cut", numbered(ROWS), **values)
    resumed.train(resume_from_checkpoint=True)
    assert resumed_batches.batches == whole_batches.batches[19 + 3 * 2:]
    assert _losses(resumed) == pytest.approx(_losses(whole), rel=1e-6)


def test_two_processes_take_accelerates_shares(tiny_checkpoint, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.training.test_group_by_length", str(tiny_checkpoint), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lengths = [len(row["input_ids"]) for row in ROWS]
    for rank in (0, 1):
        expected = [b for epoch in (0, 1) for b in length_grouped_batches(lengths, 2, 4, 5, epoch, 2, rank)]
        assert json.loads((tmp_path / f"batches_{rank}.json").read_text()) == expected


if __name__ == "__main__":  # one process of test_two_processes_take_accelerates_shares
    torch.set_num_threads(1)
    trainer, collator = _ours(sys.argv[1], sys.argv[2], numbered(ROWS))
    trainer.train()
    Path(sys.argv[2], f"batches_{trainer.args.process_index}.json").write_text(json.dumps(collator.batches))
    from gpuformers.distributed import exit_process

    exit_process()  # skip the interpreter teardown that aborts some gloo processes (see exit_process)
