"""Optimizers as transformers' Trainer builds them from TrainingArguments (optim, optim_args), and gradient clipping.

- Weight decay applies to every weight except biases and norm weights (transformers' name rule: "bias",
  "layernorm", "rmsnorm", a module called "norm" or ending in "_norm"), so two parameter groups.
- optim, with the arguments transformers' Trainer gives each (lr is learning_rate everywhere):

    adamw_torch_fused (default)   torch AdamW, one fused kernel for all parameters (CUDA and CPU); betas, eps
    adamw_torch, _foreach         torch AdamW, per parameter / foreach (foreach: gpuformers only)
    adafactor                     Adafactor below: transformers' with scale_parameter=False, relative_step=False
    sgd                           torch SGD; optim_args momentum, dampening, nesterov
    adagrad                       torch Adagrad; optim_args lr_decay, eps
    rmsprop                       torch RMSprop; optim_args momentum, alpha, eps, centered
    adamw_bnb_8bit = adamw_8bit   bitsandbytes AdamW, 8-bit state; betas, eps
    paged_adamw_32bit, _8bit      the same, paged (CUDA; the CPU runs it unpaged)
    lion_32bit, lion_8bit,        bitsandbytes Lion; betas = (adam_beta1, adam_beta2)
    paged_lion_32bit, _8bit
    rmsprop_bnb (32-bit), rmsprop_bnb_8bit, rmsprop_bnb_32bit    bitsandbytes RMSprop; optim_args as rmsprop's
    ademamix (32-bit), ademamix_8bit, paged_ademamix_32bit, _8bit    bitsandbytes AdEMAMix; optim_args beta1,
                                  beta2, beta3, alpha, eps, t_alpha, t_beta3

  optim_args is transformers' "key=value,key=value" string; a key the optimizer does not take is refused (transformers
  ignores it), and so is weight_decay, which the parameter groups override in both Trainers: set
  TrainingArguments.weight_decay. The 8-bit bitsandbytes optimizers keep embeddings' state in 32 bits, as
  transformers does. bitsandbytes' optimizers run on the CPU too (tested with bitsandbytes 0.50, bit for bit as
  transformers' Trainer builds them).
- Gradient clipping as torch's clip_grad_norm_, also over a tensor-parallel model's mix of split (DTensor) and
  whole gradients.
- Learning-rate schedules are in schedules.py (build_scheduler is re-exported here for the Trainer).

Offers: decay_parameter_names, optimizer_class_and_kwargs, build_optimizer, parse_optim_args, Adafactor,
build_scheduler, clip_grad_norm.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from gpuformers.training.schedules import build_scheduler  # noqa: F401  (the Trainer builds both from here)

# transformers' rule for which parameters skip weight decay
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the trainable parameters that get weight decay: not biases, not norm or LayerNorm weights."""
    layer_norm_params = {f"{module_name}.{name}".lstrip(".") for module_name, module in model.named_modules()
                         if isinstance(module, nn.LayerNorm) for name, _ in module.named_parameters(recurse=False)}
    return {name for name, p in model.named_parameters()
            if p.requires_grad and name not in layer_norm_params and not _NO_DECAY.search(name.lower())}


def parse_optim_args(text: str | None) -> dict[str, str]:
    """transformers' optim_args: "momentum=0.9, nesterov=True" -> {"momentum": "0.9", "nesterov": "True"}."""
    if not text:
        return {}
    options = {}
    for item in text.replace(" ", "").split(","):
        key, equals, value = item.partition("=")
        if not key or not equals or "=" in value:
            raise ValueError(f'optim_args "{text}" has "{item}", not key=value; write e.g. "momentum=0.9,alpha=0.95"')
        options[key] = value
    return options


class _Options:
    """optim_args for one optimizer: each read converts its value; what no one read is refused at the end."""

    def __init__(self, optim: str, options: dict[str, str]):
        self.optim, self.options, self.known = optim, dict(options), []
        if "weight_decay" in self.options:
            raise ValueError(f'optim_args weight_decay={self.options["weight_decay"]} is overridden by the '
                             f"weight-decay parameter groups (in transformers' Trainer too): set "
                             f"TrainingArguments.weight_decay")

    def take(self, kwargs: dict, convert, *names: str) -> None:
        for name in names:
            self.known.append(name)
            if name in self.options:
                raw = self.options.pop(name)
                try:
                    kwargs[name] = convert(raw)
                except ValueError:
                    raise ValueError(f'optim_args {name}="{raw}" is not a {convert.__name__}') from None

    def get(self, name: str, convert, default):
        kwargs = {}
        self.take(kwargs, convert, name)
        return kwargs.get(name, default)

    def finish(self) -> None:
        if self.options:
            takes = f"takes {', '.join(self.known)}" if self.known else "takes none"
            raise ValueError(f'optim_args {sorted(self.options)} are not understood by optim "{self.optim}" (it '
                             f"{takes})")


def _flag(text: str) -> bool:
    return text.lower() in ("true", "1", "yes")


def _torch_optimizer(args, options: _Options, params):
    kwargs = {"lr": args.learning_rate}
    if args.optim.startswith("adamw_torch"):
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if args.optim == "adamw_torch_fused" and all(p.device.type in ("cuda", "cpu") for p in params):
            kwargs["fused"] = True  # one kernel over all parameters (torch has a fused CPU AdamW too)
        elif args.optim == "adamw_torch_foreach":
            kwargs["foreach"] = True
        return torch.optim.AdamW, kwargs
    if args.optim == "sgd":
        options.take(kwargs, float, "momentum", "dampening")
        options.take(kwargs, _flag, "nesterov")
        return torch.optim.SGD, kwargs
    if args.optim == "adagrad":
        options.take(kwargs, float, "lr_decay", "eps")
        return torch.optim.Adagrad, kwargs
    options.take(kwargs, float, "momentum", "alpha", "eps")  # rmsprop
    options.take(kwargs, _flag, "centered")
    return torch.optim.RMSprop, kwargs


def _adafactor(args, options: _Options, params):
    return Adafactor, {"lr": args.learning_rate}


def _bitsandbytes(args, options: _Options, params):
    try:
        import bitsandbytes.optim as bnb
    except ImportError:
        raise ImportError(f'optim "{args.optim}" is a bitsandbytes optimizer: pip install bitsandbytes') from None
    name, kwargs = args.optim, {"lr": args.learning_rate}
    adam = (args.adam_beta1, args.adam_beta2)
    if "rmsprop" in name:  # transformers passes these as strings, which bitsandbytes refuses: converted here
        options.take(kwargs, float, "momentum", "alpha", "eps")
        options.take(kwargs, _flag, "centered")
        kind = bnb.RMSprop
    elif "ademamix" in name:
        betas = tuple(options.get(beta, float, default) for beta, default in
                      (("beta1", args.adam_beta1), ("beta2", args.adam_beta2), ("beta3", 0.9999)))
        kwargs.update(betas=betas, alpha=options.get("alpha", float, 5.0), eps=options.get("eps", float,
                                                                                           args.adam_epsilon))
        options.take(kwargs, int, "t_alpha", "t_beta3")
        kind = bnb.AdEMAMix
    elif "lion" in name:
        kwargs["betas"] = adam
        kind = bnb.Lion
    else:
        kwargs.update(betas=adam, eps=args.adam_epsilon)
        kind = bnb.AdamW
    kwargs["optim_bits"] = 8 if "8bit" in name else 32
    if kind is not bnb.RMSprop:  # bitsandbytes' RMSprop has no paged form
        kwargs["is_paged"] = "paged" in name
    return kind, kwargs


# optim -> (TrainingArguments, optim_args, parameters) -> (optimizer class, its keyword arguments)
_BUILDERS = {
    **dict.fromkeys(("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "sgd", "adagrad", "rmsprop"),
                    _torch_optimizer),
    "adafactor": _adafactor,
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "lion_32bit",
                     "lion_8bit", "paged_lion_32bit", "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit",
                     "rmsprop_bnb_32bit", "ademamix", "ademamix_8bit", "paged_ademamix_32bit",
                     "paged_ademamix_8bit"), _bitsandbytes),
}


def optimizer_class_and_kwargs(args, params: list[nn.Parameter] = ()) -> tuple[type, dict]:
    """The optimizer class and keyword arguments (but the parameters) for TrainingArguments' optim and optim_args,
    as transformers' Trainer.get_optimizer_cls_and_kwargs gives them."""
    if args.optim not in _BUILDERS:
        raise ValueError(f'optim "{args.optim}" is not one of: {", ".join(_BUILDERS)}')
    options = _Options(args.optim, parse_optim_args(getattr(args, "optim_args", None)))
    kind, kwargs = _BUILDERS[args.optim](args, options, list(params))
    options.finish()
    return kind, kwargs


def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """The optimizer TrainingArguments ask for, over two groups: with and without weight decay. A group stays when
    it is empty (a LoRA model's no-decay group: no bias or norm to train), as in transformers' Trainer, so that its
    optimizer.pt and scheduler.pt have the same groups as ours and each Trainer resumes from the other's."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad is False everywhere)")
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [part for group in groups for part in _split_dtensors(group)]
    kind, kwargs = optimizer_class_and_kwargs(args, [p for _, p in params])
    if kwargs.get("optim_bits") == 8:
        # bitsandbytes' 8-bit state is too coarse for embeddings (transformers' Trainer keeps theirs in 32 bits)
        from bitsandbytes.optim import GlobalOptimManager

        manager = GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return kind(groups, **kwargs)


# transformers' Adafactor keeps RMS too (for scale_parameter): read and ignored
_ADAFACTOR_STATE = {"step", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"}
# transformers' Adafactor settings as its Trainer fixes them (beta1: no first moment)
_FIXED = {"beta1": None, "scale_parameter": False, "relative_step": False, "warmup_init": False}


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern, 2018) as transformers' Trainer runs it for optim="adafactor": transformers'
    Adafactor with the learning rate given (relative_step=False, so the schedule drives it), no scaling by the
    weights' RMS (scale_parameter=False, so no warmup_init either) and no first moment (beta1=None).

    Per parameter, the running mean of the squared gradient (+ eps) is kept in full for a vector and, for a matrix
    (rows, cols), as its row means (rows,) and column means (cols,), whose product over the mean of the row means
    estimates it. Its decay is 1 - step**decay_rate (the past weighs more as steps go). The update, the gradient over
    the estimate's square root, is scaled down to an RMS of clip_threshold at most, then by lr; decoupled weight
    decay takes lr * weight_decay * weight. bfloat16 / float16 weights are updated in float32 and copied back.
    The state has transformers' names (step, exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq)."""

    def __init__(self, params, lr: float, eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8, weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Adafactor lr {lr} is negative")
        # transformers' group settings, the ones fixed here included (eps[1] is scale_parameter's floor), so that
        # each Trainer resumes the other's optimizer.pt
        super().__init__(params, {"lr": lr, "eps": tuple(eps), "clip_threshold": clip_threshold,
                                  "decay_rate": decay_rate, "weight_decay": weight_decay, **_FIXED})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuses another optimizer's state (a checkpoint of an AdamW run), which would fail at the first step."""
        kept = set().union(*(entry.keys() for entry in state_dict["state"].values()))
        if kept - _ADAFACTOR_STATE or any(key not in group for group in state_dict["param_groups"]
                                          for key in self.defaults):
            raise ValueError(f"this optimizer state is not Adafactor's (per parameter: {sorted(kept)}): resume with "
                             f"the optim the checkpoint was trained with")
        changed = {key: group[key] for group in state_dict["param_groups"] for key in _FIXED
                   if group[key] != _FIXED[key]}
        if changed:
            raise ValueError(f"this Adafactor state has {changed}, which transformers' Trainer never sets and "
                             f"gpuformers' Adafactor does not do ({_FIXED})")
        super().load_state_dict(state_dict)

    def _update(self, param: torch.Tensor, group: dict) -> None:
        grad = param.grad.float()
        weight = param.float()  # param itself when it is float32
        state = self.state[param]
        factored = grad.dim() >= 2
        if not state:
            state["step"] = 0
            if factored:
                state["exp_avg_sq_row"] = grad.new_zeros(grad.shape[:-1])
                state["exp_avg_sq_col"] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
        else:  # load_state_dict cast the state to the weight's dtype; the arithmetic stays float32, as transformers'
            state.update({key: value.float() for key, value in state.items() if torch.is_tensor(value)})
        state["step"] += 1
        keep = 1.0 - state["step"] ** group["decay_rate"]
        squared = grad**2 + group["eps"][0]
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(keep).add_(squared.mean(dim=-1), alpha=1.0 - keep)
            col.mul_(keep).add_(squared.mean(dim=-2), alpha=1.0 - keep)
            # 1 / sqrt(row x col / mean(row)), (..., rows, 1) x (..., 1, cols)
            inverse_root = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1) * col.unsqueeze(-2).rsqrt()
            update = inverse_root.mul_(grad)
        else:
            state["exp_avg_sq"].mul_(keep).add_(squared, alpha=1.0 - keep)
            update = state["exp_avg_sq"].rsqrt().mul_(grad)
        rms = update.norm(2) / update.numel() ** 0.5
        update.div_((rms / group["clip_threshold"]).clamp_(min=1.0)).mul_(group["lr"])
        if group["weight_decay"]:
            weight.add_(weight, alpha=-group["weight_decay"] * group["lr"])
        weight.sub_(update)
        if weight is not param:
            param.copy_(weight)


def _split_dtensors(group: dict) -> list[dict]:
    """A tensor-parallel model's split weights are DTensors and its other weights plain tensors; torch's foreach and
    fused optimizers take a group of one kind only, so a mixed group becomes two with the same settings."""
    from torch.distributed.tensor import DTensor

    split = [p for p in group["params"] if isinstance(p, DTensor)]
    if not split or len(split) == len(group["params"]):
        return [group]
    return [{**group, "params": split}, {**group, "params": [p for p in group["params"] if not isinstance(p, DTensor)]}]


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
    squares = None
    if sharded:  # (none when every split gradient is replicated: nothing to sum, and get_total_norm([]) is a CPU
        # tensor that an NCCL all-reduce would refuse)
        squares = torch.nn.utils.get_total_norm(sharded).square()
        torch.distributed.all_reduce(squares, group=group)
    if whole:
        own = torch.nn.utils.get_total_norm(whole).square()
        squares = own if squares is None else squares + own
    total_norm = squares.sqrt()
    coefficient = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if total_norm.device.type != "cpu" or bool(coefficient < 1.0):
        torch._foreach_mul_(sharded + whole, coefficient)
    return total_norm
