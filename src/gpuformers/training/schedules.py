"""Learning-rate schedules: transformers' lr_scheduler_type names, as multipliers of the peak rate per optimizer step.

Each schedule is a function of the optimizer step (0-based), the warmup steps and the training steps, plus its
lr_scheduler_kwargs; a LambdaLR multiplies every group's learning rate by it, so a checkpoint's scheduler.pt is
LambdaLR's state (the step count) and resumes on the same curve. Warmup rises linearly from 0 unless said otherwise.

    linear                     1 -> 0 in a straight line
    cosine                     half a cosine 1 -> 0 (num_cycles=0.5 waves)
    cosine_with_restarts       num_cycles (1) hard restarts, each a half cosine 1 -> 0
    polynomial                 (1 - progress)**power from the peak to lr_end (1e-7), then lr_end
    constant                   1, no warmup
    constant_with_warmup       1 after the warmup
    inverse_sqrt               1 / sqrt((step + timescale - warmup) / timescale), timescale = warmup (or 10,000)
    cosine_with_min_lr         cosine down to min_lr (or min_lr_rate x the peak) instead of 0
    cosine_warmup_with_min_lr  the same, one step ahead: the warmup starts at 1/warmup (or warmup_lr_rate) and
                               reaches the peak at its last step, the cosine reaches min_lr at the last step
    warmup_stable_decay        warmup, num_stable_steps at the peak (default: what warmup and num_decay_steps leave),
                               num_decay_steps down to min_lr_ratio x the peak, then that; warmup_type and decay_type
                               each "linear", "cosine" or "1-sqrt"

reduce_lr_on_plateau is torch's ReduceLROnPlateau (its arguments are the lr_scheduler_kwargs; no warmup, as in
transformers): the learning rate stays until the evaluation metric (metric_for_best_model, "eval_loss" by default)
stops improving, so the Trainer steps it after each evaluation instead of after each optimizer step
(`steps_on_metric`). greedy (transformers' GreedyLR) is refused (arguments.py).

Offers: SCHEDULE_KWARGS, build_scheduler, steps_on_metric.
"""

from __future__ import annotations

import math
from functools import partial

import torch


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _linear(step, *, warmup, total):
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _half_cosine(progress: float, num_cycles: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))


def _cosine(step, *, warmup, total, num_cycles, min_lr_rate=0.0):
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, _half_cosine(progress, num_cycles) * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step, *, warmup, total, num_cycles):
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step, *, warmup, total, lr_end, power, peak):
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / peak
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return ((peak - lr_end) * remaining**power + lr_end) / peak  # LambdaLR multiplies by the peak again


def _constant(step, *, warmup, total):
    return 1.0


def _constant_with_warmup(step, *, warmup, total):
    return _warmup(step, warmup) if step < warmup else 1.0


def _inverse_sqrt(step, *, warmup, total, timescale):
    if step < warmup:
        return _warmup(step, warmup)
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


def _cosine_warmup_with_min_lr(step, *, warmup, total, num_cycles, min_lr_rate, warmup_lr_rate):
    # transformers' variant counts one step ahead of _cosine: the peak at the warmup's last step, not after it
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, warmup)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    return max(0.0, _half_cosine(progress, num_cycles) * (1 - min_lr_rate) + min_lr_rate)


_SHAPES = {  # progress in [0, 1) -> factor in [0, 1], rising for a warmup
    "linear": (lambda p: p, lambda p: 1.0 - p),
    "cosine": (lambda p: 0.5 * (1.0 - math.cos(math.pi * p)), None),  # the decay's cosine takes num_cycles
    "1-sqrt": (lambda p: 1.0 - math.sqrt(1.0 - p), lambda p: 1.0 - math.sqrt(p)),
}


def _warmup_stable_decay(step, *, warmup, total, num_decay_steps, num_stable_steps, warmup_type, decay_type,
                         min_lr_ratio, num_cycles):
    if step < warmup:
        shape = _SHAPES[warmup_type][0](step / max(1, warmup))
    elif step < warmup + num_stable_steps:
        return 1.0
    elif step < warmup + num_stable_steps + num_decay_steps:
        progress = (step - warmup - num_stable_steps) / max(1, num_decay_steps)
        shape = (_half_cosine(progress, num_cycles) if decay_type == "cosine"
                 else _SHAPES[decay_type][1](progress))
    else:
        return min_lr_ratio
    return max(0.0, shape * (1.0 - min_lr_ratio) + min_lr_ratio)


# lr_scheduler_type -> (factor, its lr_scheduler_kwargs with their defaults)
_SCHEDULES = {
    "linear": (_linear, {}),
    "cosine": (_cosine, {"num_cycles": 0.5}),
    "cosine_with_restarts": (_cosine_with_restarts, {"num_cycles": 1}),
    "polynomial": (_polynomial, {"lr_end": 1e-7, "power": 1.0}),
    "constant": (_constant, {}),
    "constant_with_warmup": (_constant_with_warmup, {}),
    "inverse_sqrt": (_inverse_sqrt, {"timescale": None}),
    "cosine_with_min_lr": (_cosine, {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None}),
    "cosine_warmup_with_min_lr": (_cosine_warmup_with_min_lr, {"num_cycles": 0.5, "min_lr": None,
                                                               "min_lr_rate": None, "warmup_lr_rate": None}),
    "warmup_stable_decay": (_warmup_stable_decay, {"num_decay_steps": None, "num_stable_steps": None,
                                                   "warmup_type": "linear", "decay_type": "cosine",
                                                   "min_lr_ratio": 0.0, "num_cycles": 0.5}),
}
# torch's ReduceLROnPlateau arguments (all but the optimizer)
_PLATEAU_KWARGS = ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps")
SCHEDULE_KWARGS = {**{kind: tuple(defaults) for kind, (_, defaults) in _SCHEDULES.items()},
                   "reduce_lr_on_plateau": _PLATEAU_KWARGS}


def _settle(kind: str, settings: dict, warmup: int, total: int, peak: float) -> dict:
    """The kwargs a schedule's factor takes, from lr_scheduler_kwargs: checked, and rates made from learning rates."""
    if "min_lr" in settings:  # cosine_with_min_lr, cosine_warmup_with_min_lr: one of the two, as a ratio
        min_lr, min_lr_rate = settings.pop("min_lr"), settings["min_lr_rate"]
        if (min_lr is None) == (min_lr_rate is None):
            raise ValueError(f'lr_scheduler_type "{kind}" needs exactly one of min_lr or min_lr_rate in '
                             f"lr_scheduler_kwargs, not {'both' if min_lr is not None else 'neither'} "
                             f'(e.g. {{"min_lr_rate": 0.1}})')
        if min_lr is not None:
            settings["min_lr_rate"] = min_lr / peak
    if kind == "polynomial":
        if not peak > settings["lr_end"]:
            raise ValueError(f'lr_scheduler_type "polynomial" decays to lr_end={settings["lr_end"]}, which must be '
                             f"below the learning_rate {peak}")
        settings["peak"] = peak
    if kind == "inverse_sqrt" and settings["timescale"] is None:
        settings["timescale"] = warmup or 10_000
    if kind == "warmup_stable_decay":
        if settings["num_decay_steps"] is None:
            raise ValueError('lr_scheduler_type "warmup_stable_decay" needs num_decay_steps in lr_scheduler_kwargs '
                             '(e.g. {"num_decay_steps": 100}): the steps from the peak down to min_lr_ratio')
        for name in ("warmup_type", "decay_type"):
            if settings[name] not in _SHAPES:
                raise ValueError(f'{name} "{settings[name]}" is not one of: {", ".join(_SHAPES)}')
        if settings["num_stable_steps"] is None:
            settings["num_stable_steps"] = total - warmup - settings["num_decay_steps"]
    return settings


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int,
                    **kwargs) -> torch.optim.lr_scheduler.LRScheduler:
    """A LambdaLR stepping once per optimizer step (for reduce_lr_on_plateau a ReduceLROnPlateau, stepped on the
    evaluation metric), as transformers' get_scheduler(kind, optimizer, warmup, total,
    scheduler_specific_kwargs=kwargs) builds it; `kwargs` are lr_scheduler_kwargs."""
    if kind not in SCHEDULE_KWARGS:
        raise ValueError(f'lr_scheduler_type "{kind}" is not one of: {", ".join(SCHEDULE_KWARGS)}')
    defaults = SCHEDULE_KWARGS[kind]
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        takes = f"takes {', '.join(defaults)}" if defaults else "takes none"
        raise ValueError(f'lr_scheduler_kwargs {unknown} are not understood by lr_scheduler_type "{kind}" (it '
                         f"{takes})")
    if kind == "reduce_lr_on_plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
    factor, defaults = _SCHEDULES[kind]
    settings = _settle(kind, {**defaults, **kwargs}, warmup, total, optimizer.defaults["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(factor, warmup=warmup, total=total, **settings))


def steps_on_metric(scheduler) -> bool:
    """Whether the scheduler steps on an evaluation metric (after each evaluation) rather than once per optimizer
    step."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
