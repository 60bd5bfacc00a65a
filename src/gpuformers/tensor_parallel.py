"""Tensor parallelism under torchrun: each process holds a slice of every decoder layer's weights.

    torchrun --nproc_per_node=2 script.py      with   from_pretrained(model_id, tp_plan="auto")

The llama family's plan (the one transformers writes for these models), over one mesh of all the processes:

    q_proj, k_proj, v_proj, gate_proj, up_proj    "colwise": output features split, each process computes its
                                                  own attention heads and its own part of the MLP's hidden layer
    o_proj, down_proj                             "rowwise": input features split, partial outputs summed (one
                                                  all-reduce per attention and one per MLP)
    q_norm, k_norm (Qwen3)                        "replicated_with_grad_allreduce": whole in every process, but
                                                  each process applies them to its own heads only, so their
                                                  gradients are summed over the processes in the backward
    embeddings, norms, lm_head                    whole in every process (every process gets the full logits)

The decoder code does not change: a layer's heads are read from the width of its local q/k/v output, so each
process attends over num_attention_heads / tp_size heads and num_key_value_heads / tp_size key-value heads, and its
KV cache holds only those. Every process runs the same generate() on the same input and gets the same tokens.

from_pretrained loads the checkpoint into CPU memory first and then moves each split weight to the process's GPU
one at a time, keeping only its slice there: a GPU holds its share of the decoder plus the whole embeddings, norms
and LM head, never the whole model (the CPU holds it for a moment).

Training: the Trainer trains a tensor-parallel model when every process feeds it the same batches (the processes
split the model, not the data). The split weights are DTensors, the others plain tensors: the optimizer takes them
in separate parameter groups (optim.py) and gradient clipping adds up the split gradients' norms over the processes
(optim.clip_grad_norm); checkpoints gather the whole model and optimizer state and resume into the slices.

What is not here yet (each raises NotImplementedError naming it): tp_size below the number of processes (tensor
parallel inside data parallel, also with FSDP2), fp16 training (bf16 works), CUDA graphs under it, and quantized or
LoRA layers in one. save_pretrained gathers the slices and process 0 writes the whole checkpoint; the engine runs
when every process makes the same calls (engine/manager.py agrees on the KV cache size), or with process 0 taking
the requests and the others following it (engine/lockstep.py; how `gpuformers serve --tensor-parallel-size` runs).

Offers: TP_STYLES, LLAMA_TP_PLAN, check_tp_size, apply_tensor_parallel, is_tensor_parallel, refuse.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn

TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",  # Qwen3; other models have none
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}


def is_tensor_parallel(model: nn.Module) -> bool:
    """True once apply_tensor_parallel ran on the model (its split weights are DTensors, even over one process)."""
    return getattr(model, "tp_plan", None) is not None


def check_tp_size(config, tp_size: int) -> None:
    """Heads and the MLP's hidden width must split evenly over tp_size processes."""
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    uneven = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if uneven:
        raise ValueError(f"tensor parallelism over {tp_size} processes needs {', '.join(uneven)} to be divisible by "
                         f"{tp_size}; run with a number of processes that divides them")


def apply_tensor_parallel(model: nn.Module, tp_plan="auto", tp_size: int | None = None, device=None):
    """Split `model`'s decoder layers over the processes (see the module doc); returns the device mesh.

    tp_plan: "auto" (the llama family's plan above) or a dict module-name pattern (fnmatch, "*" for a layer index)
    -> one of TP_STYLES. device: where this process computes (default: where the model is). A model still on
    the CPU moves there slice by slice: each split weight goes over whole, is cut, and only this process's slice
    stays, so the device never holds the whole model. Needs the process group (torchrun)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs several processes: start the script with torchrun "
                           "(torchrun --nproc_per_node=N script.py)")
    world = dist.get_world_size()
    tp_size = world if tp_size is None else tp_size
    if tp_size != world:
        raise NotImplementedError(f"tp_size={tp_size} with {world} processes (tensor parallel inside data parallel) "
                                  f"is not supported yet: use tp_size={world}, one slice per process")
    plan = _resolve_plan(model, tp_plan)
    check_tp_size(model.config, tp_size)
    for name, style in plan.items():
        layer = model.get_submodule(name)
        if style != "replicated_with_grad_allreduce" and type(layer) is not nn.Linear:
            raise NotImplementedError(f"tensor parallelism over {name} ({type(layer).__name__}) is not supported: "
                                      "only plain nn.Linear layers are split (no quantized or LoRA layers yet)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    mesh = init_device_mesh(device.type, (tp_size,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items() if style in styles})
    model.to(device)  # the rest, whole: embeddings, norms, lm_head, rotary buffers
    if tp_size > 1:
        group = mesh.get_group()
        for name, style in plan.items():
            if style == "replicated_with_grad_allreduce":
                for param in model.get_submodule(name).parameters():
                    param.register_hook(functools.partial(_sum_over, group))
    model.tp_size, model.tp_plan, model.device_mesh = tp_size, plan, mesh
    return mesh


def _sum_over(group, grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: this process's part of the gradient -> the sum over the group's processes."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _resolve_plan(model: nn.Module, tp_plan) -> dict[str, str]:
    """The plan as {module name: style}, every pattern matched by at least one nn module (in "auto", the
    replicated_with_grad_allreduce patterns may match none: not every model has q/k norms)."""
    optional = set()
    if tp_plan == "auto":
        tp_plan = LLAMA_TP_PLAN
        optional = {pattern for pattern, style in tp_plan.items() if style == "replicated_with_grad_allreduce"}
    if not isinstance(tp_plan, dict):
        raise ValueError(f'tp_plan={tp_plan!r}: pass "auto" or a dict of module-name patterns -> "colwise" / '
                         f'"rowwise"')
    names = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in tp_plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}]={style!r} is not one of {TP_STYLES}")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched and pattern not in optional:
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                             f"(module names look like model.layers.0.self_attn.q_proj)")
        plan.update(dict.fromkeys(matched, style))
    return plan


def refuse(model: nn.Module, feature: str) -> None:
    """NotImplementedError naming `feature` for a tensor-parallel model."""
    if is_tensor_parallel(model):
        raise NotImplementedError(f"{feature} on a tensor-parallel model (tp_plan) is not supported yet; load the "
                                  "model without tp_plan for it")

