"""Optimizers and learning-rate schedules, as transformers' Trainer builds them.

- Weight decay applies to every weight except biases and norm weights (transformers' name rule: "bias",
  "layernorm", "rmsnorm", a module called "norm" or ending in "_norm"), so two parameter groups.
- AdamW is fused ("adamw_torch_fused", the default: one kernel for all parameters, on CUDA and on the CPU),
  "adamw_torch_foreach" or the plain per-parameter loop ("adamw_torch").
- Gradient clipping as torch's clip_grad_norm_, also over a tensor-parallel model's mix of split (DTensor) and
  whole gradients.
- Schedules are multipliers of the peak learning rate over optimizer steps (LambdaLR), warmup rising linearly
  from 0: linear (decay to 0), cosine (half a cosine to 0), constant, constant_with_warmup.

Offers: decay_parameter_names, build_optimizer, build_scheduler, schedule_factor, clip_grad_norm.
"""

from __future__ import annotations

import math
import re
from functools import partial

import torch
from torch import nn

# transformers' rule for which parameters skip weight decay
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the trainable parameters that get weight decay: not biases, not norm or LayerNorm weights."""
    layer_norm_params = {f"{module_name}.{name}".lstrip(".") for module_name, module in model.named_modules()
                         if isinstance(module, nn.LayerNorm) for name, _ in module.named_parameters(recurse=False)}
    return {name for name, p in model.named_parameters()
            if p.requires_grad and name not in layer_norm_params and not _NO_DECAY.search(name.lower())}


def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """The optimizer TrainingArguments ask for, over two groups: with and without weight decay."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad is False everywhere)")
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    groups = [part for group in groups for part in _split_dtensors(group)]
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    kwargs = {}
    if args.optim == "adamw_torch_fused" and all(p.device.type in ("cuda", "cpu") for _, p in params):
        kwargs["fused"] = True  # one kernel over all parameters (torch has a fused CPU AdamW too)
    elif args.optim == "adamw_torch_foreach":
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, **kwargs)


def _split_dtensors(group: dict) -> list[dict]:
    """A tensor-parallel model's split weights are DTensors and its other weights plain tensors; torch's foreach and
    fused optimizers take a group of one kind only, so a mixed group becomes two with the same settings."""
    from torch.distributed.tensor import DTensor

    split = [p for p in group["params"] if isinstance(p, DTensor)]
    if not split or len(split) == len(group["params"]):
        return [group]
    return [{**group, "params": split}, {**group, "params": [p for p in group["params"] if not isinstance(p, DTensor)]}]


def schedule_factor(step: int, *, kind: str, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if kind != "constant" and step < warmup:
        return step / max(1, warmup)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
    raise ValueError(f'lr_scheduler_type "{kind}" is not one of: linear, cosine, constant, constant_with_warmup')


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int,
                    **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping once per optimizer step. `kwargs` are lr_scheduler_kwargs (num_cycles for cosine)."""
    unknown = set(kwargs) - {"num_cycles"}
    if unknown:
        raise ValueError(f"lr_scheduler_kwargs {sorted(unknown)} are not understood; only num_cycles (cosine) is")
    factor = partial(schedule_factor, kind=kind, warmup=warmup, total=total, **kwargs)
    factor(0)  # check the kind now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (same norm, same clipped gradients), less the multiplication of every
    gradient by 1 when the norm is already within max_norm: a pass over all gradients that changes no bit. Checked
    on the CPU only (on a GPU the check would wait for the device). Returns the norm before clipping.
    A tensor-parallel model's gradients are split DTensors beside whole tensors, which torch's clipping cannot mix:
    the split ones' squared norms are summed over the processes, and every gradient is scaled in place."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    split = [g for g in grads if isinstance(g, DTensor)]
    if split and len(split) < len(grads):
        return _clip_tensor_parallel(grads, max_norm)
    total_norm = torch.nn.utils.get_total_norm(grads)
    if (type(total_norm) is torch.Tensor and total_norm.device.type == "cpu"  # not a DTensor (FSDP2)
            and bool(max_norm / (total_norm + 1e-6) >= 1.0)):
        return total_norm
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


def _clip_tensor_parallel(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    sharded, whole, group = [], [], None
    for grad in grads:
        if isinstance(grad, DTensor) and any(p.is_shard() for p in grad.placements):
            sharded.append(grad.to_local())
            group = grad.device_mesh.get_group()
        else:  # a plain tensor, or a replicated DTensor (a row-wise layer's bias): the same in every process
            whole.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    squares = torch.nn.utils.get_total_norm(sharded).square()
    torch.distributed.all_reduce(squares, group=group)
    if whole:
        squares = squares + torch.nn.utils.get_total_norm(whole).square()
    total_norm = squares.sqrt()
    coefficient = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if total_norm.device.type != "cpu" or bool(coefficient < 1.0):
        torch._foreach_mul_(sharded + whole, coefficient)
    return total_norm
