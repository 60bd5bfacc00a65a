"""lr_scheduler_type="reduce_lr_on_plateau": the rate drops when the evaluation metric stops improving, at the same
steps and to the same values as in transformers' Trainer, and a resume continues from the checkpoint's plateau state;
its arguments arrive as a dict or as JSON text; without evaluation it is refused."""

from __future__ import annotations

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainingArguments
from tests.training.helpers import make_rows, tiny_args

# An improvement must beat the best eval_loss by 10: none after the first evaluation does, so with patience 0 the
# rate halves at every later evaluation (steps 4, 6, 8, 10), whatever the losses do
PLATEAU = dict(lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"factor": 0.5, "patience": 0,
                                                                              "threshold": 10.0,
                                                                              "threshold_mode": "abs"},
               eval_strategy="steps", eval_steps=2, max_steps=10, per_device_train_batch_size=4,
               per_device_eval_batch_size=4, learning_rate=3e-3, seed=0, train_sampling_strategy="sequential",
               logging_steps=1, disable_tqdm=True)


def _rates(trainer) -> dict[int, float]:
    return {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "loss" in e}


def _ours(checkpoint, folder, resume=None, **overrides):
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(checkpoint, progress=False),
                      tiny_args(folder, use_cpu=True, **{**PLATEAU, **overrides}), train_dataset=make_rows(40),
                      eval_dataset=make_rows(8, seed=1), data_collator=DataCollatorForCausalLM(pad_token_id=0))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_rates_and_weights_equal_transformers_trainer(tiny_checkpoint, tmp_path):
    import transformers

    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs = transformers.Trainer(
        theirs_model, transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to="none",
                                                     optim="adamw_torch", save_strategy="no", **PLATEAU),
        train_dataset=make_rows(40), eval_dataset=make_rows(8, seed=1),
        data_collator=DataCollatorForCausalLM(pad_token_id=0))
    theirs.train()
    ours = _ours(tiny_checkpoint, tmp_path / "ours")
    assert _rates(ours) == _rates(theirs)
    assert list(_rates(ours).values()) == [3e-3] * 4 + [1.5e-3] * 2 + [7.5e-4] * 2 + [3.75e-4] * 2
    theirs_params = dict(theirs_model.named_parameters())
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p, theirs_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_resume_continues_from_the_plateau_state(tiny_checkpoint, tmp_path):
    # patience 1: the rate halves at the 3rd evaluation (step 6). checkpoint-4 holds one bad evaluation counted
    # and the best loss: a resume that lost them would count step 6's evaluation as an improvement and not drop.
    kwargs = dict(save_strategy="steps", save_steps=4, lr_scheduler_kwargs='{"factor": "0.5", "patience": "1", '
                                                                           '"threshold": "10", "threshold_mode": "abs"}')
    whole = _ours(tiny_checkpoint, tmp_path / "whole", **kwargs)
    resumed = _ours(tiny_checkpoint, tmp_path / "resumed", resume=tmp_path / "whole" / "checkpoint-4", **kwargs)
    assert list(_rates(whole).values()) == [3e-3] * 6 + [1.5e-3] * 4
    after = [{step: rate for step, rate in _rates(t).items() if step > 4} for t in (whole, resumed)]
    assert after[0] == after[1] and len(after[1]) == 6
    resumed_params = dict(resumed.model.named_parameters())
    for name, p in whole.model.named_parameters():
        assert torch.equal(p, resumed_params[name]), name


def test_arguments_are_checked():
    args = TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch",
                             lr_scheduler_kwargs='{"patience": "3", "threshold_mode": "abs", "verbose": "true"}')
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert args.lr_scheduler_kwargs == {"patience": 3, "threshold_mode": "abs", "verbose": True}
    with pytest.raises(ValueError, match='"reduce_lr_on_plateau" .* needs an eval_strategy'):
        TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau")
    with pytest.raises(ValueError, match="lr_scheduler_kwargs '{patience: 3}' is not JSON"):
        TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch",
                          lr_scheduler_kwargs="{patience: 3}")
    from gpuformers.training.schedules import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"\['verbose'\] are not understood by lr_scheduler_type "
                                         r"\"reduce_lr_on_plateau\" \(it takes mode, factor, patience"):
        build_scheduler(optimizer, "reduce_lr_on_plateau", 0, 10, **args.lr_scheduler_kwargs)
