"""The training loop: the loss falls, one step's gradients equal transformers' Trainer's, accumulation is exact,
evaluation, callbacks, logs and the model saved at the end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainerCallback
from tests.training.helpers import GradientRecorder, make_rows, tiny_args


def _model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False)


def test_loss_falls_on_a_fixed_dataset(tiny_checkpoint, tmp_path):
    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, max_steps=16, learning_rate=1e-2,
                      lr_scheduler_type="constant", eval_strategy="steps", eval_steps=8),
                      train_dataset=make_rows(8), eval_dataset=make_rows(8))
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 16 and result.global_step == 16
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [step for step, _ in evals] == [8, 16] and evals[1][1] < evals[0][1]
    # the JSONL log holds one line per logged step, in order
    lines = [json.loads(line) for line in (tmp_path / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == list(range(1, 17))
    assert lines[-1]["train_tokens_per_second"] > 0


def test_one_step_gradients_equal_transformers_trainer(tiny_checkpoint, tmp_path):
    import transformers

    rows = make_rows(8)
    collator = DataCollatorForCausalLM(pad_token_id=0)  # the same batches for both trainers
    common = dict(per_device_train_batch_size=8, max_steps=1, learning_rate=1e-3, weight_decay=0.1,
                  optim="adamw_torch", seed=0, train_sampling_strategy="sequential", report_to="none",
                  save_strategy="no", logging_steps=1, disable_tqdm=True)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs_grads = GradientRecorder()
    theirs = transformers.Trainer(theirs_model, transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, **common), train_dataset=rows, data_collator=collator,
        callbacks=[theirs_grads])
    theirs.train()

    ours_grads = GradientRecorder()
    ours = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path / "ours", use_cpu=True, **common),
                   train_dataset=rows, data_collator=collator, callbacks=[ours_grads])
    ours.train()

    (hf,), (gf,) = theirs_grads.steps, ours_grads.steps
    assert hf.keys() == gf.keys()
    for name in hf:
        torch.testing.assert_close(gf[name], hf[name], rtol=1e-5, atol=1e-7, msg=name)
    hf_loss = next(e["loss"] for e in theirs.state.log_history if "loss" in e)
    gf_loss = next(e["loss"] for e in ours.state.log_history if "loss" in e)
    assert gf_loss == pytest.approx(hf_loss, rel=1e-5)
    # the optimizer step too: same decay groups, same AdamW, same first learning rate
    theirs_params = dict(theirs_model.named_parameters())
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p, theirs_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_accumulation_4x2_equals_one_batch_of_8(tiny_checkpoint, tmp_path):
    rows = make_rows(8, seed=3)
    grads = []
    for batch, accum in ((8, 1), (2, 4)):
        recorder = GradientRecorder()
        trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path / f"{batch}x{accum}", max_steps=1,
                          per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                          train_sampling_strategy="sequential"), train_dataset=rows, callbacks=[recorder])
        trainer.train()
        grads.append(recorder.steps[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_evaluate_gives_token_weighted_loss_and_perplexity(tiny_checkpoint, tmp_path):
    rows = make_rows(5, seed=7)
    model = _model(tiny_checkpoint)
    trainer = Trainer(model, tiny_args(tmp_path, per_device_eval_batch_size=2), eval_dataset=rows)
    metrics = trainer.evaluate()
    # reference: every row alone, summed token losses over all target tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            total += float(model(ids, labels=ids, num_items_in_batch=1).loss)
            count += ids.shape[1] - 1
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    prediction = trainer.predict(rows)
    assert prediction.predictions.shape == (5, max(len(r["input_ids"]) for r in rows), 128)
    assert prediction.metrics["test_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)



def test_methods_a_subclass_overrides_reach_evaluation_and_checkpoints(tiny_checkpoint, tmp_path):
    """evaluate() and the loop's saves run through the Trainer's own compute_loss and _save_checkpoint (its Evaluator
    and Checkpointer are given them), so a subclass's overrides, as transformers users write them, are honoured; so
    is a preprocess_logits_for_metrics set after the Trainer was made."""
    saves = []

    class Doubled(Trainer):
        def compute_loss(self, model, inputs, num_items_in_batch=None, return_outputs=False):
            loss, outputs = super().compute_loss(model, inputs, num_items_in_batch, return_outputs=True)
            return (2 * loss, outputs) if return_outputs else 2 * loss

        def _save_checkpoint(self):
            saves.append(self.state.global_step)
            return super()._save_checkpoint()

    rows = make_rows(5, seed=7)
    args = tiny_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, per_device_eval_batch_size=2)
    plain = Trainer(_model(tiny_checkpoint), args, eval_dataset=rows).evaluate()["eval_loss"]
    trainer = Doubled(_model(tiny_checkpoint), args, train_dataset=make_rows(8), eval_dataset=rows)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(2 * plain, rel=1e-6)
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    assert trainer.predict(rows).predictions.ndim == 2  # (rows, seq) token ids, not (rows, seq, vocab) logits
    trainer.train()
    assert saves == [1, 2] and (tmp_path / "checkpoint-2" / "trainer_state.json").exists()

def test_callbacks_see_the_hooks_in_order_and_can_stop_training(tiny_checkpoint, tmp_path):
    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append("train_begin")

        def on_step_begin(self, args, state, control, **kwargs):
            self.events.append("step_begin")

        def on_substep_end(self, args, state, control, **kwargs):
            self.events.append("substep_end")

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append("step_end")
            if state.global_step == 2:
                control.should_training_stop = True

        def on_train_end(self, args, state, control, **kwargs):
            self.events.append("train_end")

    recorder = Recorder()
    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, max_steps=10, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2), train_dataset=make_rows(16), callbacks=[recorder])
    assert trainer.train().global_step == 2
    assert recorder.events == ["train_begin"] + ["step_begin", "substep_end", "step_end"] * 2 + ["train_end"]


def test_save_model_is_loadable_by_us_and_by_transformers(tiny_checkpoint, tmp_path):
    import transformers

    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, max_steps=2), train_dataset=make_rows(8))
    trainer.train()
    trainer.save_model(tmp_path / "final")
    ids = torch.tensor([make_rows(1, seed=9)[0]["input_ids"]])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids).logits
        ours = _model(tmp_path / "final")(ids).logits
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()(ids).logits
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(theirs, expected, rtol=1e-4, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_checkpoint, tmp_path):
    grads = []
    for checkpointing in (False, True):
        recorder = GradientRecorder()
        Trainer(_model(tiny_checkpoint), tiny_args(tmp_path / str(checkpointing), max_steps=1,
                gradient_checkpointing=checkpointing, train_sampling_strategy="sequential"),
                train_dataset=make_rows(4), callbacks=[recorder]).train()
        grads.append(recorder.steps[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_bf16_autocast_trains_on_the_cpu(tiny_checkpoint, tmp_path):
    trainer = Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, max_steps=3, bf16=True, use_cpu=True),
                      train_dataset=make_rows(8))
    assert trainer.args.mixed_precision == torch.bfloat16
    assert math.isfinite(trainer.train().training_loss)


def test_tensorboard_without_its_package_says_how_to_install_it(tiny_checkpoint, tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Trainer(_model(tiny_checkpoint), tiny_args(tmp_path, report_to="tensorboard"))


@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipped, then within the limit (no multiplication by 1)
def test_trainer_clipping_equals_torch_clip_grad_norm(max_norm):
    from gpuformers.training.trainer import clip_grad_norm

    generator = torch.Generator().manual_seed(0)
    ours, theirs = ([torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in (5, 7)]
                    for _ in range(2))
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=generator)
        b.grad = a.grad.clone()
    norm = clip_grad_norm(ours + [torch.nn.Parameter(torch.ones(2))], max_norm)  # one without a gradient
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)
    assert bool(norm > max_norm) is (max_norm == 0.5)
