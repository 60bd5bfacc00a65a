"""Training on a stream (a torch IterableDataset, a plain iterable, a `datasets` IterableDataset): max_steps is
required, batches come in stream order and a pass that ends before max_steps starts the stream over at the next
epoch (set_epoch told), with gradient accumulation the losses are transformers' Trainer's on the same stream, a
resumed run (in the first pass or the second) logs the losses of an uninterrupted one, evaluation reads streams too,
and under torchrun (2 CPU processes, process 0 reading and dealing out the batches) training and evaluation give the
numbers of one process on the global batch.

Run as `torchrun --nproc_per_node=2 -m tests.training.test_iterable_dataset CHECKPOINT OUTPUT_DIR`, this file is one
process of that distributed run: process 0 writes the log history to OUTPUT_DIR/log.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainerCallback
from gpuformers.training.streaming import StreamBatches
from tests.training.helpers import make_rows, tiny_args

REPO = Path(__file__).resolve().parents[2]
ROWS = make_rows(20, seed=6)  # batches of 2, 2 per step: 5 steps a pass, so max_steps=7 reads the stream twice
EVAL_ROWS = make_rows(7, seed=9)  # odd: under torchrun the last group is completed with a repeat
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=7, learning_rate=3e-3,
              warmup_steps=2, weight_decay=0.1, optim="adamw_torch", seed=0, save_strategy="no", logging_steps=1,
              report_to="none", disable_tqdm=True, remove_unused_columns=False)


class Stream(torch.utils.data.IterableDataset):
    """The rows in an order that set_epoch(e) reshuffles, as a shuffled `datasets` IterableDataset does."""

    def __init__(self, rows):
        self.rows, self.epoch = rows, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return (self.rows[i] for i in order)


class Generated:
    """A plain iterable, not a torch dataset: each pass a fresh generator over the same order as Stream."""

    def __init__(self, rows):
        self.stream = Stream(rows)

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self):
        yield from self.stream


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def _ours(folder, out, dataset, callbacks=(), **overrides) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    return Trainer(model, tiny_args(out, use_cpu=True, **{**COMMON, **overrides}), train_dataset=dataset,
                   data_collator=DataCollatorForCausalLM(pad_token_id=0), callbacks=list(callbacks))


def _logged(trainer) -> dict[str, float]:
    """{"loss1": step 1's loss, "grad_norm1": its gradient norm, ...}"""
    return {f"{key}{e['step']}": e[key] for e in trainer.state.log_history if "loss" in e
            for key in ("loss", "grad_norm")}


def test_losses_equal_transformers_trainer_on_the_same_stream(tiny_checkpoint, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs = transformers.Trainer(model, transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                                                        **COMMON),
                                  train_dataset=Stream(ROWS), data_collator=DataCollatorForCausalLM(pad_token_id=0))
    theirs.train()
    expected = _logged(theirs)
    assert len(expected) == 2 * 7
    for dataset in (Stream(ROWS), Generated(ROWS)):
        ours = _ours(tiny_checkpoint, tmp_path / type(dataset).__name__, dataset)
        ours.train()
        assert _logged(ours) == pytest.approx(expected, rel=1e-5), type(dataset).__name__
        assert ours.state.epoch == pytest.approx(theirs.state.epoch) and ours.state.epoch > 1  # a second pass


@pytest.mark.parametrize("rows, drop_last, shares", [
    (11, False, [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 0]]]),  # 10 0: completed with the first row
    (11, True, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
    (13, False, [[[0, 1], [4, 5], [8, 9], [12]], [[2, 3], [6, 7], [10, 11], [0]]]),
])
def test_each_process_takes_the_share_accelerate_dispatches(rows, drop_last, shares):
    """What accelerate's dispatcher gives each of 2 processes for a stream of `rows` numbers in batches of 2 (read
    from a torchrun run of accelerate.prepare); here each share is computed alone, without a process group."""
    for rank, share in enumerate(shares):
        assert list(StreamBatches(range(rows), 2, list, world=2, rank=rank, drop_last=drop_last)) == share


def test_max_steps_is_required_and_an_exhausted_generator_ends_training(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"stream without a length.*set max_steps > 0 \(it is -1\)"):
        _ours(tiny_checkpoint, tmp_path / "a", Stream(ROWS), max_steps=-1, num_train_epochs=1).train()
    once = (row for row in ROWS)  # a generator object: its second pass is empty, so training stops after the first
    trainer = _ours(tiny_checkpoint, tmp_path / "b", once, max_steps=50)
    with pytest.warns(UserWarning, match=r"pass 1 over the stream \(generator\) gave no batch"):
        assert trainer.train().global_step == 5


@pytest.mark.parametrize("stop_at", [3, 6])  # in the first pass, and in the second
def test_resume_logs_the_losses_of_an_uninterrupted_run(stop_at, tiny_checkpoint, tmp_path):
    values = dict(save_strategy="steps", save_steps=3)
    whole = _ours(tiny_checkpoint, tmp_path / "whole", Stream(ROWS), **values)
    whole.train()
    _ours(tiny_checkpoint, tmp_path / "cut", Stream(ROWS), [StopAt(stop_at)], **values).train()
    resumed = _ours(tiny_checkpoint, tmp_path / "cut", Stream(ROWS), **values)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / f"checkpoint-{stop_at}"))
    assert _logged(resumed) == pytest.approx(_logged(whole), rel=1e-6)
    assert resumed.state.epoch == pytest.approx(whole.state.epoch)


def test_evaluating_a_stream_equals_the_list(tiny_checkpoint, tmp_path):
    trainer = _ours(tiny_checkpoint, tmp_path, Stream(ROWS), per_device_eval_batch_size=2)
    listed, streamed = trainer.evaluate(EVAL_ROWS), trainer.evaluate(iter(EVAL_ROWS))
    assert streamed["eval_loss"] == pytest.approx(listed["eval_loss"], rel=1e-6)
    torch.testing.assert_close(trainer.predict(iter(EVAL_ROWS)).predictions, trainer.predict(EVAL_ROWS).predictions)


def test_a_datasets_iterable_dataset_trains_like_the_stream(tiny_checkpoint, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
    ours = _ours(tiny_checkpoint, tmp_path / "datasets", rows, max_steps=4)
    ours.train()
    plain = _ours(tiny_checkpoint, tmp_path / "plain", iter(ROWS), max_steps=4)
    plain.train()
    assert _logged(ours) == pytest.approx(_logged(plain), rel=1e-6)


def test_two_processes_train_and_evaluate_like_one_on_the_global_batch(tiny_checkpoint, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.training.test_iterable_dataset", str(tiny_checkpoint), str(tmp_path / "ddp")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    single = _distributed_run(tiny_checkpoint, tmp_path / "one", per_device_train_batch_size=2)
    logged = json.loads((tmp_path / "ddp" / "log.json").read_text())
    assert [e["step"] for e in logged] == [e["step"] for e in single]
    for ours, one in zip(logged, single):
        assert ours == pytest.approx(one, rel=1e-5, abs=1e-6)


def _distributed_run(folder, out, **overrides) -> list[dict]:
    """22 rows, 1 per process and micro-batch (11 groups a pass: the 6th step of a pass has one micro-batch),
    evaluated on a stream of 7 rows every 3 steps; the logged numbers, times left out."""
    values = dict(per_device_train_batch_size=1, max_steps=8, eval_strategy="steps", eval_steps=3,
                  per_device_eval_batch_size=2, max_grad_norm=1.0)
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(folder, progress=False),
                      tiny_args(out, use_cpu=True, **{**COMMON, **values, **overrides}),
                      train_dataset=Stream(make_rows(22, seed=3)), eval_dataset=Generated(EVAL_ROWS),
                      data_collator=DataCollatorForCausalLM(pad_token_id=0))
    trainer.train()
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
            for e in trainer.state.log_history]


if __name__ == "__main__":  # one process of test_two_processes_train_and_evaluate_like_one_on_the_global_batch
    torch.set_num_threads(1)
    log = _distributed_run(sys.argv[1], sys.argv[2])
    if int(os.environ["RANK"]) == 0:
        Path(sys.argv[2], "log.json").write_text(json.dumps(log))
    from gpuformers.distributed import exit_process

    exit_process()  # skip the interpreter teardown that aborts some gloo processes (see exit_process)
