"""label_smoothing_factor, neftune_noise_alpha, include_num_input_tokens_seen, gradient_checkpointing_kwargs and
logging_dir: the same losses, gradients, noise and token counts as transformers' Trainer on the same data."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainerCallback, TrainingArguments
from gpuformers.training.callbacks import TensorBoardCallback
from gpuformers.training.regularizers import label_smoothed_loss
from tests.training.helpers import GradientRecorder, make_rows, tiny_args

COLLATOR = DataCollatorForCausalLM(pad_token_id=0)  # the same batches for both trainers
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3,
              optim="adamw_torch", seed=0, train_sampling_strategy="sequential", report_to="none",
              save_strategy="no", logging_steps=1, disable_tqdm=True, per_device_eval_batch_size=8)


class EmbeddingRecorder(TrainerCallback):
    """What the input embeddings hand on (after NEFTune's hook, added before on_train_begin in both trainers), with
    the ids they embedded and whether the model was training."""

    def __init__(self):
        self.calls: list[tuple[bool, torch.Tensor, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, inputs, output):
            self.calls.append((module.training, inputs[0].detach().clone(), output.detach().clone()))

        model.get_input_embeddings().register_forward_hook(record)


def _run_both(tiny_checkpoint, tmp_path, callbacks=lambda: [], **overrides):
    """transformers' Trainer and ours with the same arguments, data and collator; returns both, trained."""
    import transformers

    values = {**COMMON, **overrides}
    rows, evals = make_rows(8, seed=4), make_rows(8, seed=5)
    theirs = transformers.Trainer(
        transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32),
        transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **values), train_dataset=rows,
        eval_dataset=evals, data_collator=COLLATOR, callbacks=callbacks())
    theirs.train()
    ours = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                   tiny_args(tmp_path / "ours", use_cpu=True, **values), train_dataset=rows, eval_dataset=evals,
                   data_collator=COLLATOR, callbacks=callbacks())
    ours.train()
    return theirs, ours


def _logged(trainer, key: str) -> list:
    return [e[key] for e in trainer.state.log_history if key in e and "train_loss" not in e]  # not the summary


def test_label_smoothed_loss_equals_transformers_label_smoother():
    from transformers.trainer_pt_utils import LabelSmoother

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 50, generator=generator)
    labels = torch.randint(0, 50, (3, 9), generator=generator)
    labels[0, :4] = labels[2, 6:] = -100
    smoother = LabelSmoother(epsilon=0.1)
    for items in (None, 31, torch.tensor(31)):
        expected = smoother({"logits": logits}, labels, shift_labels=True, num_items_in_batch=items)
        torch.testing.assert_close(label_smoothed_loss(logits, labels, 0.1, items), expected, rtol=1e-6, atol=1e-6)
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(label_smoothed_loss(logits, labels, 0.0), plain)  # epsilon 0: the usual loss


def test_label_smoothing_with_accumulation_and_tokens_seen_equal_transformers(tiny_checkpoint, tmp_path):
    """Batches of 2 rows of different lengths, 2 accumulated: the smoothed loss is normalised by the step's target
    tokens (num_items_in_batch), not averaged per micro-batch; the logged losses, the gradients, the eval loss and
    the non-padding tokens seen equal transformers'."""
    recorders = {}

    def callbacks():
        recorders[len(recorders)] = GradientRecorder()
        return [recorders[len(recorders) - 1]]

    theirs, ours = _run_both(tiny_checkpoint, tmp_path, callbacks, label_smoothing_factor=0.1,
                             include_num_input_tokens_seen="non_padding")
    assert _logged(ours, "loss") == pytest.approx(_logged(theirs, "loss"), rel=1e-5)
    for hf, gf in zip(recorders[0].steps, recorders[1].steps, strict=True):
        for name in hf:
            torch.testing.assert_close(gf[name], hf[name], rtol=1e-4, atol=1e-6, msg=name)
    # tokens seen: logged with every log, attention-mask tokens only, as transformers counts them
    seen = _logged(ours, "num_input_tokens_seen")
    assert seen == _logged(theirs, "num_input_tokens_seen") and seen[0] < seen[1] == ours.state.num_input_tokens_seen
    assert ours.state.num_input_tokens_seen == sum(len(r["input_ids"]) for r in make_rows(8, seed=4))
    # the eval loss is smoothed too (one batch: transformers' per-batch mean is the token mean)
    smoothed, their_eval = ours.evaluate()["eval_loss"], theirs.evaluate()["eval_loss"]
    assert smoothed == pytest.approx(their_eval, rel=1e-5)
    ours.args.label_smoothing_factor = 0.0
    assert ours.evaluate()["eval_loss"] < smoothed - 1e-3


def test_neftune_noise_equals_transformers_and_evaluation_is_clean(tiny_checkpoint, tmp_path):
    recorders = {}

    def callbacks():
        recorders[len(recorders)] = EmbeddingRecorder()
        return [recorders[len(recorders) - 1]]

    alpha = 5.0
    theirs, ours = _run_both(tiny_checkpoint, tmp_path, callbacks, neftune_noise_alpha=alpha, max_steps=1,
                             gradient_accumulation_steps=1, eval_strategy="steps", eval_steps=1)
    # one training forward then one evaluation forward in each; the same seed draws the same noise
    (hf_train, _, hf_out), (hf_eval, _, _) = recorders[0].calls
    (train, ids, out), (evaluating, eval_ids, eval_out) = recorders[1].calls
    assert (hf_train, hf_eval, train, evaluating) == (True, False, True, False)
    torch.testing.assert_close(out, hf_out, rtol=0, atol=1e-7)
    assert _logged(ours, "loss") == pytest.approx(_logged(theirs, "loss"), rel=1e-5)
    # the noise: uniform in [-s, s], s = alpha / sqrt(seq * hidden), on every embedded value
    weight = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False).get_input_embeddings().weight
    noise = out - weight.detach()[ids]
    scale = alpha / (out.shape[1] * out.shape[2]) ** 0.5
    assert noise.abs().max() <= scale and noise.abs().max() > 0.99 * scale
    assert abs(noise.mean()) < 0.05 * scale and noise.std() == pytest.approx(scale / 3**0.5, rel=0.05)
    # evaluation embeds without noise, and the hook is gone after training
    torch.testing.assert_close(eval_out, ours.model.get_input_embeddings().weight.detach()[eval_ids], rtol=0, atol=0)
    embeddings = ours.model.get_input_embeddings()
    assert len(embeddings._forward_hooks) == 1  # the recorder's alone
    assert ours.model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


def test_tokens_seen_all_counts_padding_and_no_counts_nothing(tiny_checkpoint, tmp_path):
    rows = make_rows(8, seed=4)
    padded = sum(max(len(r["input_ids"]) for r in rows[i:i + 2]) * 2 for i in range(0, 8, 2))
    for setting, expected in ((True, padded), ("all", padded), ("no", 0)):
        trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                          tiny_args(tmp_path / str(setting), **{**COMMON, "include_num_input_tokens_seen": setting}),
                          train_dataset=rows, data_collator=COLLATOR)
        trainer.train()
        assert trainer.state.num_input_tokens_seen == expected
        assert (_logged(trainer, "num_input_tokens_seen")[-1:] == [expected]) == (setting != "no")


def test_gradient_checkpointing_kwargs_reach_torch_checkpoint(tiny_checkpoint, tmp_path, monkeypatch):
    seen = []
    checkpoint = torch.utils.checkpoint.checkpoint

    def recording_checkpoint(function, *args, **kwargs):
        seen.append(kwargs)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", recording_checkpoint)
    # (name, arguments, what torch.utils.checkpoint gets per call: 2 decoder layers x 2 micro-batches)
    settings = [
        ("plain", {}, []),
        ("default", {"gradient_checkpointing": True}, [{"use_reentrant": False}] * 4),
        ("reentrant", {"gradient_checkpointing": True,
                       "gradient_checkpointing_kwargs": {"use_reentrant": True, "preserve_rng_state": False}},
         [{"use_reentrant": True, "preserve_rng_state": False}] * 4),
        # transformers 5's names; every_n_layers=2: the first layer alone is recomputed
        ("every_2nd", {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}},
         [{"use_reentrant": False}] * 2),
    ]
    grads = {}
    for name, extra, expected in settings:
        seen.clear()
        recorder = GradientRecorder()
        Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                tiny_args(tmp_path / name, **{**COMMON, "max_steps": 1, **extra}), train_dataset=make_rows(8),
                data_collator=COLLATOR, callbacks=[recorder]).train()
        grads[name] = recorder.steps[0]
        assert seen == expected, name
    for name in grads["plain"]:
        for kind in ("default", "reentrant", "every_2nd"):
            torch.testing.assert_close(grads[kind][name], grads["plain"][name], rtol=1e-5, atol=1e-7)


def test_logging_dir_is_where_tensorboard_writes(monkeypatch, tmp_path):
    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir, self.scalars = log_dir, []

        def add_scalar(self, key, value, step):
            self.scalars.append((key, value, step))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    state = types.SimpleNamespace(global_step=3)
    for logging_dir, expected in ((str(tmp_path / "tb"), str(tmp_path / "tb")), (None, str(tmp_path / "runs"))):
        callback = TensorBoardCallback()
        callback.on_log(TrainingArguments(output_dir=str(tmp_path), logging_dir=logging_dir), state, None,
                        logs={"loss": 1.5})
        assert callback.writer.log_dir == expected and callback.writer.scalars == [("train/loss", 1.5, 3)]
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "env"))  # transformers 5's setting
    callback = TensorBoardCallback()
    callback.on_log(TrainingArguments(output_dir=str(tmp_path)), state, None, logs={"loss": 1.5})
    assert callback.writer.log_dir == str(tmp_path / "env")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"label_smoothing_factor": 1.5}, ValueError, r"label_smoothing_factor 1.5 must be in \[0, 1\]"),
    ({"neftune_noise_alpha": -1.0}, ValueError, "neftune_noise_alpha -1.0 is negative"),
    ({"include_num_input_tokens_seen": "some"}, ValueError, "'some' is not one of: 'all'"),
    ({"gradient_checkpointing_kwargs": {"reentrant": True}}, ValueError,
     r"gradient_checkpointing_kwargs \['reentrant'\] are not among: every_n_layers, offload, use_reentrant"),
])
def test_bad_values_are_refused_with_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingArguments(**kwargs)


def test_command_line_forms_are_read_as_transformers_reads_them():
    args = TrainingArguments(gradient_checkpointing_kwargs='{"use_reentrant": false}',
                             include_num_input_tokens_seen=False, logging_dir="logs")
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.include_num_input_tokens_seen == "no" and args.logging_dir == "logs"
    # transformers 5's names win over the older ones, which then mirror them
    args = TrainingArguments(gradient_checkpointing=False, activation_checkpointing=True,
                             activation_checkpointing_kwargs={"offload": True})
    assert args.gradient_checkpointing is True and args.gradient_checkpointing_kwargs == {"offload": True}
