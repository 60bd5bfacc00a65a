"""load_best_model_at_end, metric_for_best_model and EarlyStoppingCallback: the same best checkpoint, the same stop
step and the same weights at the end as transformers' Trainer on the same data; the best checkpoint survives the
rotation and a resume, the early-stopping count too (saved in transformers' "stateful_callbacks" shape); the argument
checks transformers makes.

The data makes the best evaluation fall mid-run: the eval rows alternate 5 9 5 9 ..., the first 8 training rows
(steps 1-2, batches of 4 in order) too, the rest repeat 5 (after a 5 comes a 5, not a 9). The eval loss falls until
step 3 (Adam's momentum carries on for a step), then rises.

Under torchrun (DDP, FSDP2, tensor parallelism: 2 CPU processes) this file is also the worker:
`torchrun --nproc_per_node=2 -m tests.training.test_best_model CHECKPOINT OUTPUT_DIR STRATEGY`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import (DataCollatorForCausalLM, EarlyStoppingCallback, Trainer, TrainerCallback,
                                 TrainingArguments)
from gpuformers.training.callbacks import (TrainerControl, TrainerState, callback_states,
                                          restore_callback_states)
from tests.training.helpers import tiny_args

REPO = Path(__file__).resolve().parents[2]

TRAIN = [{"input_ids": [5, 9] * (3 + i % 2)} for i in range(8)] + [{"input_ids": [5] * (6 + i % 4)} for i in range(32)]
EVAL = [{"input_ids": [5, 9] * (3 + i)} for i in range(4)]  # one batch: transformers' per-batch mean is ours too
# an evaluation and a checkpoint at every step, 2 checkpoints kept; 8 steps unless stopped early
COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=8, max_steps=8, learning_rate=3e-2,
              lr_scheduler_type="constant", optim="adamw_torch", seed=0, train_sampling_strategy="sequential",
              eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=2,
              load_best_model_at_end=True, logging_steps=1, report_to="none", disable_tqdm=True)


def _ours(folder, out, callbacks=(), **overrides) -> Trainer:
    return Trainer(AutoModelForCausalLM.from_pretrained(folder, progress=False),
                   tiny_args(out, use_cpu=True, **{**COMMON, **overrides}), train_dataset=TRAIN, eval_dataset=EVAL,
                   data_collator=DataCollatorForCausalLM(pad_token_id=0), callbacks=list(callbacks))


class KeptCheckpoints(TrainerCallback):
    """The checkpoint folders left after each save (and its rotation)."""

    def __init__(self):
        self.kept = []

    def on_save(self, args, state, control, **kwargs):
        self.kept.append(sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*")))


def _evals(trainer) -> dict[int, float]:
    return {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """transformers' Trainer and ours, each with EarlyStoppingCallback(patience=2) and load_best_model_at_end."""
    import transformers

    out = tmp_path_factory.mktemp("best")
    theirs = transformers.Trainer(
        transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32),
        transformers.TrainingArguments(output_dir=str(out / "hf"), use_cpu=True, **COMMON), train_dataset=TRAIN,
        eval_dataset=EVAL, data_collator=DataCollatorForCausalLM(pad_token_id=0),
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)])
    theirs.train()
    ours = _ours(tiny_checkpoint, out / "ours", [EarlyStoppingCallback(early_stopping_patience=2)])
    ours.train()
    return theirs, ours, out


def test_best_checkpoint_is_the_middle_one_as_in_transformers(runs):
    theirs, ours, out = runs
    evals = _evals(ours)
    assert min(evals, key=evals.get) == 3 and evals[3] < evals[2] and evals[3] < evals[4]
    assert evals == pytest.approx(_evals(theirs), rel=1e-5)
    assert ours.state.best_model_checkpoint == str(out / "ours" / "checkpoint-3")
    assert theirs.state.best_model_checkpoint == str(out / "hf" / "checkpoint-3")
    assert ours.state.best_global_step == theirs.state.best_global_step == 3
    assert ours.state.best_metric == pytest.approx(theirs.state.best_metric, rel=1e-5)
    assert ours.state.best_metric == pytest.approx(evals[3])
    # the rotation (save_total_limit=2) kept the best checkpoint beside the newest, as transformers' did
    kept = sorted(p.name for p in (out / "ours").glob("checkpoint-*"))
    assert kept == sorted(p.name for p in (out / "hf").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-5"]
    # each checkpoint's trainer_state.json names the best checkpoint at the time it was written
    for step in (3, 5):
        saved = json.loads((out / "ours" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert saved["best_model_checkpoint"] == str(out / "ours" / "checkpoint-3")
        assert saved["best_metric"] == pytest.approx(evals[3]) and saved["best_global_step"] == 3


def test_early_stopping_stops_at_the_step_transformers_stops_at(runs):
    theirs, ours, _ = runs
    # evaluations at 1, 2, 3 (best), 4 and 5 (worse twice: patience 2) -> stop at step 5 of 8
    assert ours.state.global_step == theirs.state.global_step == 5
    assert sorted(_evals(ours)) == [1, 2, 3, 4, 5]


def test_the_best_weights_are_loaded_at_the_end(runs):
    theirs, ours, out = runs
    best = AutoModelForCausalLM.from_pretrained(out / "ours" / "checkpoint-3", progress=False).state_dict()
    last = AutoModelForCausalLM.from_pretrained(out / "ours" / "checkpoint-5", progress=False).state_dict()
    theirs_weights = dict(theirs.model.named_parameters())
    for name, value in ours.model.state_dict().items():
        assert torch.equal(value, best[name]), name
        torch.testing.assert_close(value, theirs_weights[name].detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.equal(best[name], last[name]) for name in best)  # (so loading the best changed something)


def test_resume_keeps_the_best_checkpoint_and_loads_it_at_the_end(runs, tiny_checkpoint, tmp_path):
    _, _, out = runs
    shutil.copytree(out / "ours", tmp_path, dirs_exist_ok=True)
    # resumed from step 5 without early stopping: step 6's evaluation is worse than step 3's
    trainer = _ours(tiny_checkpoint, tmp_path, max_steps=6)
    trainer.train(resume_from_checkpoint=tmp_path / "checkpoint-5")
    assert trainer.state.global_step == 6
    assert trainer.state.best_model_checkpoint == str(out / "ours" / "checkpoint-3")  # as recorded before
    saved = TrainerState.load_from_json(tmp_path / "checkpoint-6" / "trainer_state.json")
    assert saved.best_global_step == 3 and saved.best_metric == trainer.state.best_metric
    best = AutoModelForCausalLM.from_pretrained(out / "ours" / "checkpoint-3", progress=False).state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, best[name]), name


class StopAt(TrainerCallback):
    """Ends the run after `step` (its evaluation and checkpoint included), as an interruption would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def test_a_resumed_run_stops_early_at_the_step_an_uninterrupted_run_stops_at(runs, tiny_checkpoint, tmp_path):
    _, uninterrupted, _ = runs
    # stopped after step 4, one evaluation worse than step 3's: checkpoint-4 records the patience count 1
    _ours(tiny_checkpoint, tmp_path, [EarlyStoppingCallback(early_stopping_patience=2), StopAt(4)]).train()
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 1}
    # By default (transformers' too) the callbacks start afresh: the count restarts at 0 and the run goes on to
    # step 6. restore_callback_states_from_checkpoint=True takes the count back (and the saved patience, over the 5
    # given now): step 5's evaluation is the second worse one in a row, so it stops there, as the uninterrupted run.
    for restore, stop in ((False, 6), (True, 5)):
        callback = EarlyStoppingCallback(early_stopping_patience=2 if not restore else 5)
        resumed = _ours(tiny_checkpoint, tmp_path / str(restore), [callback],
                        restore_callback_states_from_checkpoint=restore)
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
        assert resumed.state.global_step == stop, restore
        assert callback.early_stopping_patience_counter == 2 and callback.early_stopping_patience == 2
    assert uninterrupted.state.global_step == 5
    assert _evals(resumed) == pytest.approx(_evals(uninterrupted), rel=1e-5)


def test_a_second_train_call_trains_again_after_a_stop(tiny_checkpoint, tmp_path):
    """As transformers' on_train_begin: the stop asked during the first train() does not end the second at once."""
    stop = StopAt(2)
    trainer = _ours(tiny_checkpoint, tmp_path, [stop], load_best_model_at_end=False, eval_strategy="no",
                    save_strategy="no")
    trainer.train()
    assert trainer.state.global_step == 2
    trainer.remove_callback(stop)
    trainer.train()
    assert trainer.state.global_step == 8


def test_callback_states_are_saved_as_transformers_saves_them(runs):
    """Each checkpoint's trainer_state.json has transformers' "stateful_callbacks" entry, key for key, and
    transformers reads the file; transformers' callback restores itself from ours, and ours from transformers'."""
    import transformers

    _, _, out = runs
    for step in (3, 5):
        ours_path, theirs_path = (out / run / f"checkpoint-{step}" / "trainer_state.json" for run in ("ours", "hf"))
        ours, theirs = TrainerState.load_from_json(ours_path), TrainerState.load_from_json(theirs_path)
        # transformers' Trainer reads the whole file (its TrainerState takes no unknown key)
        assert transformers.TrainerState.load_from_json(ours_path).stateful_callbacks == ours.stateful_callbacks
        assert set(ours.stateful_callbacks) == set(theirs.stateful_callbacks) == {"EarlyStoppingCallback",
                                                                                   "TrainerControl"}
        assert ours.stateful_callbacks["EarlyStoppingCallback"] == theirs.stateful_callbacks["EarlyStoppingCallback"]
        assert ours.stateful_callbacks["EarlyStoppingCallback"]["attributes"] == {
            "early_stopping_patience_counter": {3: 0, 5: 2}[step]}
        # the same keys; should_log and should_evaluate differ (transformers' handler clears them in on_log and
        # on_evaluate, ours after the save), which no resume reads
        ours_control, theirs_control = (s.stateful_callbacks["TrainerControl"] for s in (ours, theirs))
        assert {k: set(v) for k, v in ours_control.items()} == {k: set(v) for k, v in theirs_control.items()}
        for flag in ("should_training_stop", "should_epoch_stop", "should_save"):
            assert ours_control["args"][flag] == theirs_control["args"][flag], flag
        restored = transformers.EarlyStoppingCallback.from_state(ours.stateful_callbacks["EarlyStoppingCallback"])
        assert restored.early_stopping_patience_counter == {3: 0, 5: 2}[step]
        control = transformers.TrainerControl.from_state(ours.stateful_callbacks["TrainerControl"])
        assert control.should_training_stop == (step == 5)
        callback = EarlyStoppingCallback(early_stopping_patience=2)
        restore_callback_states([callback, TrainerCallback()], theirs.stateful_callbacks)
        assert callback.early_stopping_patience_counter == {3: 0, 5: 2}[step]


def test_callback_states_of_several_callbacks_of_one_class_and_of_absent_ones(caplog):
    first, second = EarlyStoppingCallback(3), EarlyStoppingCallback(4)
    first.early_stopping_patience_counter, second.early_stopping_patience_counter = 1, 2
    states = callback_states([first, TrainerCallback(), second, TrainerControl(should_training_stop=True)])
    assert [entry["attributes"] for entry in states["EarlyStoppingCallback"]] == [
        {"early_stopping_patience_counter": 1}, {"early_stopping_patience_counter": 2}]
    assert states["TrainerControl"] == {"args": {"should_training_stop": True, "should_epoch_stop": False,
                                                 "should_save": False, "should_evaluate": False,
                                                 "should_log": False}, "attributes": {}}
    again = [EarlyStoppingCallback(5), EarlyStoppingCallback(6)]
    restore_callback_states(again, {**states, "SomeoneElsesCallback": {"args": {}, "attributes": {"n": 1}}})
    # the saved patience and counts come back in order, as transformers' rebuilt callbacks would have them
    assert [(c.early_stopping_patience, c.early_stopping_patience_counter) for c in again] == [(3, 1), (4, 2)]
    rebuilt = EarlyStoppingCallback.from_state(states["EarlyStoppingCallback"][1])  # transformers' way: all of it
    assert (rebuilt.early_stopping_patience, rebuilt.early_stopping_patience_counter) == (4, 2)
    assert "SomeoneElsesCallback (ignored)" in caplog.text


def test_save_total_limit_1_keeps_only_the_best_checkpoint_at_the_end(tiny_checkpoint, tmp_path):
    # 4 steps, step 3 the best: while training the newest and the best stay, at the end the best alone
    trainer = _ours(tiny_checkpoint, tmp_path, max_steps=4, save_total_limit=1, callbacks=[KeptCheckpoints()])
    trainer.train()
    assert trainer.state.best_global_step == 3
    assert trainer.callback_handler.callbacks[-1].kept == [["checkpoint-1"], ["checkpoint-2"], ["checkpoint-3"],
                                                           ["checkpoint-3", "checkpoint-4"]]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


def test_save_strategy_best_saves_each_new_best_as_transformers(tiny_checkpoint, tmp_path):
    import transformers

    values = {**COMMON, "max_steps": 5, "save_strategy": "best", "save_total_limit": None}
    theirs = transformers.Trainer(
        transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32),
        transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **values), train_dataset=TRAIN,
        eval_dataset=EVAL, data_collator=DataCollatorForCausalLM(pad_token_id=0))
    theirs.train()
    ours = _ours(tiny_checkpoint, tmp_path / "ours", **values)
    ours.train()
    # the eval loss falls at steps 1, 2 and 3 and rises at 4 and 5: a checkpoint at each new best only
    saved = sorted(p.name for p in (tmp_path / "ours").glob("checkpoint-*"))
    assert saved == sorted(p.name for p in (tmp_path / "hf").glob("checkpoint-*")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert ours.state.best_model_checkpoint == str(tmp_path / "ours" / "checkpoint-3")
    with pytest.raises(ValueError, match='save_strategy="best" saves when an evaluation beats the best metric'):
        _ours(tiny_checkpoint, tmp_path, load_best_model_at_end=False, save_strategy="best")


def test_a_metric_greater_is_better_and_the_eval_prefix_rule(tiny_checkpoint, tmp_path):
    """metric_for_best_model="perplexity" (no "eval_" prefix) defaults to greater_is_better=True, as in
    transformers: the checkpoint with the *highest* perplexity is then the best."""
    trainer = _ours(tiny_checkpoint, tmp_path, max_steps=3, metric_for_best_model="perplexity")
    trainer.train()
    assert trainer.args.greater_is_better is True
    perplexities = {e["step"]: e["eval_perplexity"] for e in trainer.state.log_history if "eval_perplexity" in e}
    worst = max(perplexities, key=perplexities.get)
    assert trainer.state.best_global_step == worst != 3
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{worst}")


def test_early_stopping_counts_like_transformers_with_a_threshold():
    import transformers

    sequence = [1.0, 0.96, 0.97, 0.80, 0.79, 0.78, 0.77]  # eval losses; threshold 0.05: 0.04 better is not enough
    stops = []
    for module in (transformers, None):
        callback = (transformers.EarlyStoppingCallback if module else EarlyStoppingCallback)(
            early_stopping_patience=3, early_stopping_threshold=0.05)
        args = (module.TrainingArguments if module else TrainingArguments)(
            output_dir="unused", load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps")
        state = module.TrainerState() if module else TrainerState()
        control = module.TrainerControl() if module else TrainerControl()
        counters = []
        for value in sequence:
            callback.on_evaluate(args, state, control, metrics={"eval_loss": value})
            counters.append((callback.early_stopping_patience_counter, control.should_training_stop))
            if state.best_metric is None or value < state.best_metric:  # what the Trainer does after on_evaluate
                state.best_metric = value
        stops.append(counters)
    assert stops[0] == stops[1]
    assert stops[1] == [(0, False), (1, False), (2, False), (0, False), (1, False), (2, False), (3, True)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(eval_strategy="steps", save_strategy="epoch"), 'eval_strategy is "steps" and save_strategy is "epoch"'),
    (dict(eval_strategy="steps", eval_steps=3, save_steps=4), "save_steps=4 is not a multiple of eval_steps=3"),
    (dict(eval_strategy="steps", eval_steps=0.3, save_steps=10), "a ratio and a step count cannot guarantee"),
    (dict(eval_strategy="epoch", save_strategy="no"), 'eval_strategy is "epoch" and save_strategy is "no"'),
])
def test_argument_checks_refuse_what_transformers_refuses(kwargs, match):
    import transformers

    with pytest.raises(ValueError, match="load_best_model_at_end"):
        transformers.TrainingArguments(output_dir="unused", load_best_model_at_end=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        TrainingArguments(load_best_model_at_end=True, **kwargs)


def test_accepted_settings_and_defaults_equal_transformers():
    import transformers

    for kwargs in (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=2, save_steps=6),
                   dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.3),
                   dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.25, save_steps=10),
                   dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch"),
                   dict(metric_for_best_model="eval_accuracy"), dict(metric_for_best_model="eval_loss"),
                   dict(metric_for_best_model="bleu", greater_is_better=False), dict()):
        ours = TrainingArguments(**kwargs)
        theirs = transformers.TrainingArguments(output_dir="unused", **kwargs)
        assert (ours.metric_for_best_model, ours.greater_is_better) == \
            (theirs.metric_for_best_model, theirs.greater_is_better), kwargs


def test_missing_metric_and_missing_eval_dataset_say_what_to_do(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                tiny_args(tmp_path, **COMMON), train_dataset=TRAIN)
    trainer = _ours(tiny_checkpoint, tmp_path, max_steps=2, metric_for_best_model="accuracy")
    with pytest.raises(KeyError, match="metric_for_best_model 'accuracy' \\(eval_accuracy\\) is not among"):
        trainer.train()
    with pytest.raises(ValueError, match="EarlyStoppingCallback needs evaluations"):
        _ours(tiny_checkpoint, tmp_path, callbacks=[EarlyStoppingCallback()], load_best_model_at_end=False,
              eval_strategy="no", metric_for_best_model="loss").train()


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_the_best_weights_are_loaded_under_torchrun(strategy, runs, tiny_checkpoint, tmp_path):
    """2 processes on the global batches of the single-process run: the same best checkpoint and stop step, and
    the weights at the end are the best checkpoint's, loaded into the replicas, the FSDP2 shards or the
    tensor-parallel slices."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "tests.training.test_best_model", str(tiny_checkpoint), str(tmp_path), strategy],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"global_step": 5, "best_model_checkpoint": str(tmp_path / "checkpoint-3")}
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", progress=False).state_dict()
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-3", progress=False).state_dict()
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-5", progress=False).state_dict()
    single = runs[1].model.state_dict()  # the single-process run's best weights
    for name, value in final.items():
        assert torch.equal(value, best[name]), name
        # Adam at lr 3e-2 turns float-order differences into up to ~1e-3 (tensor parallelism), still far from the
        # last checkpoint's weights (0.06 away)
        torch.testing.assert_close(value, single[name], rtol=0, atol=1e-2, msg=name)
    assert max(float((last[name] - single[name]).abs().max()) for name in last) > 0.05


def _worker(checkpoint: str, output_dir: str, strategy: str) -> None:
    """One process of test_the_best_weights_are_loaded_under_torchrun's run: batches of 2 rows per process (of 4
    under tensor parallelism, where both processes take the whole batch)."""
    from gpuformers.distributed import exit_process

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False,
                                                 tp_plan="auto" if strategy == "tp" else None)
    values = {**COMMON, "per_device_train_batch_size": 4 if strategy == "tp" else 2, "use_cpu": True,
              **({"fsdp": "full_shard"} if strategy == "fsdp" else {})}
    trainer = Trainer(model, tiny_args(output_dir, **values), train_dataset=TRAIN, eval_dataset=EVAL,
                      data_collator=DataCollatorForCausalLM(pad_token_id=0),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    trainer.save_model(Path(output_dir) / "final")
    if trainer.args.process_index == 0:
        (Path(output_dir) / "result.json").write_text(json.dumps({
            "global_step": trainer.state.global_step, "best_model_checkpoint": trainer.state.best_model_checkpoint}))
    exit_process()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
