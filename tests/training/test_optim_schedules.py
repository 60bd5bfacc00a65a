"""Every lr_scheduler_type and optim of transformers' Trainer: the same learning rate at every step as transformers'
get_scheduler, the same optimizer class and arguments as its get_optimizer_cls_and_kwargs, the same weights after the
same gradients as the optimizer its Trainer builds (Adafactor, torch's and bitsandbytes' on the CPU), the same
weights after 3 Trainer steps, a resume that continues on the same curve; names and kwargs that cannot work are
refused with the name."""

from __future__ import annotations

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.training import DataCollatorForCausalLM, Trainer, TrainingArguments
from gpuformers.training.arguments import OPTIMIZERS, REFUSED, SCHEDULERS
from gpuformers.training.optim import Adafactor, build_optimizer, optimizer_class_and_kwargs, parse_optim_args
from gpuformers.training.schedules import SCHEDULE_KWARGS, build_scheduler
from tests.training.helpers import make_rows, tiny_args

PEAK, WARMUP, TOTAL = 0.5, 5, 25
SCHEDULES = [
    ("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}), ("constant", {}), ("constant_with_warmup", {}),
    ("cosine_with_restarts", {}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}), ("polynomial", {"power": 2.0, "lr_end": 1e-3}),
    ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 7}),
    ("cosine_with_min_lr", {"min_lr": 0.05}), ("cosine_with_min_lr", {"min_lr_rate": 0.1, "num_cycles": 1}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 0.05, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 8}),
    ("warmup_stable_decay", {"num_decay_steps": 6, "num_stable_steps": 5, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 10, "warmup_type": "1-sqrt", "decay_type": "linear",
                             "num_cycles": 1.0}),
]


def _rates(make, steps: int = TOTAL + 3, peak: float = PEAK) -> list[float]:
    """The learning rate of each optimizer step, a few past the end too."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("warmup", [WARMUP, 0])
@pytest.mark.parametrize(("kind", "kwargs"), SCHEDULES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SCHEDULES)])
def test_learning_rate_at_every_step_equals_transformers(kind, kwargs, warmup):
    import transformers

    ours = _rates(lambda opt: build_scheduler(opt, kind, warmup, TOTAL, **kwargs))
    theirs = _rates(lambda opt: transformers.get_scheduler(kind, opt, num_warmup_steps=warmup,
                                                           num_training_steps=TOTAL,
                                                           scheduler_specific_kwargs=dict(kwargs)))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-12, (ours, theirs)
    assert len(set(ours)) > 1 or kind.startswith("constant")  # the test can tell schedules apart


def test_every_transformers_name_is_supported_or_refused_by_name():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    from gpuformers.training.optim import _BUILDERS

    assert set(SCHEDULE_KWARGS) == set(SCHEDULERS) and set(_BUILDERS) == set(OPTIMIZERS)
    assert {s.value for s in SchedulerType} <= set(SCHEDULERS) | set(REFUSED)
    assert {o.value for o in OptimizerNames} <= set(OPTIMIZERS) | set(REFUSED)
    for field, name, reason in (("lr_scheduler_type", "greedy", "GreedyLR"),
                                ("optim", "adamw_torch_xla", "TPUs"), ("optim", "adamw_torch_4bit", "torchao"),
                                ("optim", "galore_adamw", "galore")):
        with pytest.raises(ValueError, match=f'{field} "{name}" is not supported by gpuformers: .*{reason}'):
            TrainingArguments(**{field: name})


@pytest.mark.parametrize(("kind", "kwargs", "match"), [
    ("linear", {"num_cycles": 2}, r"\['num_cycles'\] are not understood by lr_scheduler_type \"linear\" "
                                  r"\(it takes none\)"),
    ("cosine", {"num_cycle": 2}, r"\['num_cycle'\] .* \"cosine\" \(it takes num_cycles\)"),
    ("cosine_with_min_lr", {}, "needs exactly one of min_lr or min_lr_rate .* not neither"),
    ("cosine_warmup_with_min_lr", {"min_lr": 0.1, "min_lr_rate": 0.1}, "exactly one .* not both"),
    ("polynomial", {"lr_end": 1.0}, "lr_end=1.0, which must be below the learning_rate 0.5"),
    ("warmup_stable_decay", {}, "needs num_decay_steps"),
    ("warmup_stable_decay", {"num_decay_steps": 5, "decay_type": "exp"}, 'decay_type "exp" is not one of: linear'),
    ("greedy", {}, 'lr_scheduler_type "greedy" is not one of'),
    ("reduce_lr_on_plateau", {"min_lrs": 0.1}, r"\[.min_lrs.\] .* \"reduce_lr_on_plateau\" \(it takes mode, factor"),
])
def test_bad_schedule_kwargs_are_refused_by_name(kind, kwargs, match):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    with pytest.raises(ValueError, match=match):
        build_scheduler(optimizer, kind, WARMUP, TOTAL, **kwargs)


# optim -> optim_args; None: the same class and arguments as transformers' Trainer (Adafactor: its own class)
OPTIM_ARGS = {"adamw_torch": None, "adamw_torch_fused": None, "adafactor": None, "adagrad": "lr_decay=0.01, eps=1e-9",
              "rmsprop": "momentum=0.9,alpha=0.95,eps=1e-7,centered=True", "sgd": "momentum=0.9,nesterov=True",
              "adamw_bnb_8bit": None, "adamw_8bit": None, "paged_adamw_32bit": None, "paged_adamw_8bit": None,
              "lion_32bit": None, "lion_8bit": None, "paged_lion_32bit": None, "paged_lion_8bit": None,
              "rmsprop_bnb": None, "rmsprop_bnb_8bit": None, "rmsprop_bnb_32bit": None,
              "ademamix": "beta3=0.999,alpha=4,t_alpha=100", "ademamix_8bit": None, "paged_ademamix_32bit": None,
              "paged_ademamix_8bit": None}


def _hf_args(tmp_path, **values):
    import transformers

    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **values)


def test_optimizer_class_and_arguments_equal_transformers(tmp_path):
    import transformers

    assert set(OPTIM_ARGS) == set(OPTIMIZERS) - {"adamw_torch_foreach"}  # foreach: gpuformers' own name
    common = dict(learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
    for optim, optim_args in OPTIM_ARGS.items():
        ours = optimizer_class_and_kwargs(TrainingArguments(optim=optim, optim_args=optim_args, **common))
        theirs = transformers.Trainer.get_optimizer_cls_and_kwargs(_hf_args(tmp_path, optim=optim,
                                                                            optim_args=optim_args, **common))
        if optim == "adafactor":
            assert ours == (Adafactor, {"lr": 3e-3})
            assert theirs[1] == {"lr": 3e-3, "scale_parameter": False, "relative_step": False}
        else:
            assert ours == theirs, optim
    # transformers hands bitsandbytes' RMSprop its optim_args as strings, which it refuses; ours are numbers
    kind, kwargs = optimizer_class_and_kwargs(TrainingArguments(optim="rmsprop_bnb", optim_args="alpha=0.9,centered=1"))
    assert kind.__module__.startswith("bitsandbytes") and kwargs["alpha"] == 0.9 and kwargs["centered"] is True


def _grads(model, generator) -> None:
    for _, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=generator) * 0.1


@pytest.mark.parametrize("optim", ["adafactor", "adagrad", "rmsprop", "sgd", "adamw_8bit", "paged_adamw_32bit",
                                   "lion_8bit", "paged_lion_32bit", "rmsprop_bnb_8bit", "ademamix_8bit"])
def test_weights_after_the_same_gradients_equal_the_optimizer_transformers_trainer_builds(tiny_checkpoint, tmp_path,
                                                                                         optim):
    """Each optimizer alone (the gradients given), so that a difference is the optimizer's only: bit for bit."""
    import transformers

    values = dict(optim=optim, optim_args=OPTIM_ARGS.get(optim), learning_rate=3e-3, weight_decay=0.1)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs = transformers.Trainer(theirs_model, _hf_args(tmp_path, **values)).create_optimizer()
    ours_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    ours = build_optimizer(ours_model, TrainingArguments(use_cpu=True, **values))
    assert type(ours).__name__ == type(theirs).__name__
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups]
    for seed in range(3):
        for model, optimizer in ((theirs_model, theirs), (ours_model, ours)):
            _grads(model, torch.Generator().manual_seed(seed))
            optimizer.step()
    theirs_params = dict(theirs_model.named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False).named_parameters())
    for name, p in ours_model.named_parameters():
        assert torch.equal(p, theirs_params[name]) and not torch.equal(p, initial[name]), name


def test_adafactor_equals_transformers_on_bfloat16_vectors_and_3d_weights_across_a_reload():
    from transformers.optimization import Adafactor as TheirAdafactor

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in ((7,), (5, 6), (3, 4, 5))]
    ours = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    theirs = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    ours_optimizer = Adafactor(ours, lr=0.01, weight_decay=0.05)
    theirs_optimizer = TheirAdafactor(theirs, lr=0.01, weight_decay=0.05, scale_parameter=False, relative_step=False)
    for step in range(4):
        if step == 2:  # each resumes the other's state (which comes back cast to bfloat16)
            ours_state, theirs_state = ours_optimizer.state_dict(), theirs_optimizer.state_dict()
            ours_optimizer.load_state_dict(theirs_state)
            theirs_optimizer.load_state_dict(ours_state)
        for params, optimizer in ((ours, ours_optimizer), (theirs, theirs_optimizer)):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.dim())).to(torch.bfloat16)
            optimizer.step()
    for a, b, w in zip(ours, theirs, weights):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b) and not torch.equal(a, w.to(torch.bfloat16))
    assert set(ours_state["state"][1]) == {"step", "exp_avg_sq_row", "exp_avg_sq_col"}  # factored: (5,) and (6,)
    adamw = torch.optim.AdamW(ours)
    adamw.step()
    with pytest.raises(ValueError, match=r"not Adafactor's \(per parameter: \['exp_avg', 'exp_avg_sq', 'step'\]\)"):
        ours_optimizer.load_state_dict(adamw.state_dict())


@pytest.mark.parametrize(("optim", "optim_args"), [("adafactor", None), ("adagrad", "lr_decay=0.01"),
                                                   ("rmsprop", "momentum=0.9,centered=True")])
def test_weights_after_3_steps_equal_transformers_trainer(tiny_checkpoint, tmp_path, optim, optim_args):
    import transformers

    rows = make_rows(12)
    collator = DataCollatorForCausalLM(pad_token_id=0)
    common = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=3e-3, weight_decay=0.1, optim=optim,
                  optim_args=optim_args, warmup_steps=1, lr_scheduler_type="cosine_with_min_lr",
                  lr_scheduler_kwargs={"min_lr_rate": 0.1}, seed=0, train_sampling_strategy="sequential",
                  save_strategy="no", logging_steps=1, disable_tqdm=True)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    theirs = transformers.Trainer(theirs_model, _hf_args(tmp_path / "hf", **common), train_dataset=rows,
                                  data_collator=collator)
    theirs.train()
    ours = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                   tiny_args(tmp_path / "ours", use_cpu=True, **common), train_dataset=rows, data_collator=collator)
    ours.train()
    rates = [[e["learning_rate"] for e in t.state.log_history if "loss" in e] for t in (theirs, ours)]
    assert rates[0] == rates[1]
    theirs_params = dict(theirs_model.named_parameters())
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p, theirs_params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("schedule", "kwargs", "optim"), [
    ("warmup_stable_decay", {"num_decay_steps": 3, "decay_type": "1-sqrt"}, "adafactor"),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-4}, "adamw_8bit")])
def test_resume_continues_the_schedule_and_the_optimizer_exactly(tiny_checkpoint, tmp_path, schedule, kwargs, optim):
    import transformers

    def run(folder, resume=None):
        trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                          tiny_args(folder, max_steps=6, warmup_steps=2, save_strategy="steps", save_steps=3,
                                    optim=optim, lr_scheduler_type=schedule, lr_scheduler_kwargs=kwargs,
                                    use_cpu=True), train_dataset=make_rows(24))
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "loss" in e}

    whole, rates = run(tmp_path / "whole")
    resumed, resumed_rates = run(tmp_path / "resumed", resume=tmp_path / "whole" / "checkpoint-3")
    expected = _rates(lambda opt: transformers.get_scheduler(schedule, opt, num_warmup_steps=2, num_training_steps=6,
                                                             scheduler_specific_kwargs=dict(kwargs)),
                      steps=6, peak=3e-3)
    assert list(rates.values()) == expected and resumed_rates == rates  # steps 1-3 from the checkpoint's state
    resumed_params = dict(resumed.model.named_parameters())
    for name, p in whole.model.named_parameters():
        assert torch.equal(p, resumed_params[name]), name


@pytest.mark.parametrize(("optim", "optim_args", "match"), [
    ("sgd", "momentum=0.9,betas=0.5", r"optim_args \['betas'\] are not understood by optim \"sgd\" \(it takes "
                                      r"momentum, dampening, nesterov\)"),
    ("adamw_torch", "eps=1e-6", r"\['eps'\] .* \"adamw_torch\" \(it takes none\)"),
    ("rmsprop", "alpha=high", 'optim_args alpha="high" is not a float'),
    ("adagrad", "weight_decay=0.1", "weight_decay=0.1 is overridden .* set TrainingArguments.weight_decay"),
    ("sgd", "momentum:0.9", 'optim_args "momentum:0.9" has "momentum:0.9", not key=value'),
])
def test_bad_optim_args_are_refused_by_name(optim, optim_args, match):
    with pytest.raises(ValueError, match=match):
        optimizer_class_and_kwargs(TrainingArguments(optim=optim, optim_args=optim_args))


def test_optim_args_parse_as_transformers():
    from transformers.trainer_optimizer import _parse_optim_args

    for text in (None, "", "momentum=0.9", "momentum = 0.9, nesterov=True,  alpha=0.5"):
        assert parse_optim_args(text) == _parse_optim_args(text)
