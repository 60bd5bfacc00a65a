"""Tensor parallelism under torchrun: each process holds a slice of every decoder layer's weights.

    torchrun --nproc_per_node=2 script.py      with   from_pretrained(model_id, tp_plan="auto")

The llama family's plan (the one transformers writes for these models), over one mesh of all the processes:

    q_proj, k_proj, v_proj, gate_proj, up_proj    "colwise": output features split, each process computes its
                                                  own attention heads and its own part of the MLP's hidden layer
    o_proj, down_proj                             "rowwise": input features split, partial outputs summed (one
                                                  all-reduce per attention and one per MLP)
    experts.*.gate_proj, up_proj / down_proj      "local_colwise" / "local_rowwise" (Qwen3-MoE): each expert split
                                                  as the dense MLP is, as plain tensors, and the sparse block's
                                                  summed output all-reduced once ("allreduce" on the block)
    q_norm, k_norm (Qwen3)                        "replicated_with_grad_allreduce": whole in every process, but
                                                  each process applies them to its own heads only, so their
                                                  gradients are summed over the processes in the backward
    embeddings, norms, lm_head                    whole in every process (every process gets the full logits)

Other families name their own plans (a model class's tp_plan_auto). Two more styles serve them:

    "packed_colwise"     a layer whose output is `packed_parts` equal parts concatenated (GPT-2's c_attn: q | k | v):
                         each part split column-wise on its own, so a process holds [q_r | k_r | v_r] (its heads of
                         each); the weight is a DTensor sharded with torch's _StridedShard, so gathering it (save,
                         checkpoints) gives the checkpoint's layout back
    Conv1D layers        weights stored (in, out) (transformers' Conv1D; `fan_in_fan_out = True` on the layer's
                         class): "colwise" splits weight dim 1, "rowwise" dim 0, the transpose of nn.Linear's

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
parallel inside data parallel, also with FSDP2), fp16 training (bf16 works), training a split MoE model, CUDA graphs
under it, and quantized or LoRA layers in one. save_pretrained gathers the slices (the experts' plain ones too) and
process 0 writes the whole checkpoint; the engine runs when every process makes the same calls (engine/manager.py
agrees on the KV cache size), or with process 0 taking the requests and the others following it (engine/lockstep.py;
how `gpuformers serve --tensor-parallel-size` runs).

Offers: TP_STYLES, LLAMA_TP_PLAN, check_tp_size, apply_tensor_parallel, is_tensor_parallel, has_local_splits,
gather_local_splits, refuse.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn

TP_STYLES = ("colwise", "rowwise", "packed_colwise", "replicated_with_grad_allreduce", "local_colwise", "local_rowwise",
             "allreduce")
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
    # Qwen3-MoE's sparse blocks: every expert split as the dense MLP is, but as plain tensors, and the block's summed
    # output all-reduced once (not once per expert)
    "model.layers.*.mlp.experts.*.gate_proj": "local_colwise",
    "model.layers.*.mlp.experts.*.up_proj": "local_colwise",
    "model.layers.*.mlp.experts.*.down_proj": "local_rowwise",
    "model.layers.*.mlp": "allreduce",  # kept only for modules holding local_rowwise layers (the sparse blocks)
}
_LINEAR_STYLES = ("colwise", "rowwise", "packed_colwise", "local_colwise", "local_rowwise")
_DTENSOR_STYLES = ("colwise", "rowwise", "packed_colwise")  # split by torch's parallelize_module


def is_tensor_parallel(model: nn.Module) -> bool:
    """True once apply_tensor_parallel ran on the model (its split weights are DTensors, even over one process)."""
    return getattr(model, "tp_plan", None) is not None


def check_tp_size(config, tp_size: int) -> None:
    """Heads and the MLP's hidden width must split evenly over tp_size processes."""
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    # The MoE families' fields, where the config's class has them (Mixtral's experts are intermediate_size wide)
    if getattr(config, "num_experts", 0) and getattr(config, "moe_intermediate_size", None) is not None:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    if getattr(config, "shared_expert_intermediate_size", None) is not None:  # Qwen2-MoE's, split as a dense MLP
        sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
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
    from torch.distributed.tensor.parallel import parallelize_module

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
        conv1d = _fan_in_fan_out(layer) and style in _DTENSOR_STYLES
        if style in _LINEAR_STYLES and type(layer) is not nn.Linear and not conv1d:
            raise NotImplementedError(f"tensor parallelism over {name} ({type(layer).__name__}) is not supported: "
                                      "only plain nn.Linear and Conv1D layers are split (no quantized or LoRA layers "
                                      "yet)")
        parts = getattr(layer, "packed_parts", 1)
        if style == "packed_colwise" and (not isinstance(parts, int) or parts < 2):
            raise ValueError(f"tp_plan: {name} is 'packed_colwise' but its layer declares no packed outputs "
                             f"(packed_parts={parts!r}); use 'colwise', or set packed_parts on the layer")
        if style == "local_rowwise" and layer.bias is not None:
            raise NotImplementedError(f"{name}: a local_rowwise layer with a bias is not supported (the bias would be "
                                      "added once per process)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda":
        from gpuformers.device import resolve_device

        # Before the mesh and the first NCCL call: parallelize_module moves each weight to the *current* GPU
        # (`.to("cuda")`), and NCCL binds its communicator to it. A process group joined without set_device (a
        # script's own init_process_group) leaves every process on cuda:0: every slice there, the rest on its GPU.
        device = resolve_device(device)  # "cuda" -> cuda:LOCAL_RANK
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (tp_size,))
    parallelize_module(model, mesh, {name: _parallel_style(model.get_submodule(name), style)
                                     for name, style in plan.items() if style in _DTENSOR_STYLES})
    rank = dist.get_rank()
    for name, style in plan.items():
        if style in ("local_colwise", "local_rowwise"):
            _split_locally(model.get_submodule(name), 0 if style == "local_colwise" else 1, rank, tp_size, device)
    model.to(device)  # the rest, whole: embeddings, norms, lm_head, rotary buffers
    if tp_size > 1:
        group = mesh.get_group()
        for name, style in plan.items():
            if style == "replicated_with_grad_allreduce":
                for param in model.get_submodule(name).parameters():
                    param.register_hook(functools.partial(_sum_over, group))
            elif style == "allreduce":
                model.get_submodule(name).register_forward_hook(functools.partial(_sum_output, group))
    model.tp_size, model.tp_plan, model.device_mesh = tp_size, plan, mesh
    return mesh


def _fan_in_fan_out(layer: nn.Module) -> bool:
    """The layer stores its weight (in, out), the transpose of an nn.Linear's (transformers' Conv1D): its class says
    so with `fan_in_fan_out = True` (a LoRA wrapper's instance attribute of that name does not count)."""
    return getattr(type(layer), "fan_in_fan_out", False) is True


def _parallel_style(layer: nn.Module, style: str):
    """The ParallelStyle that splits `layer`: torch's ColwiseParallel / RowwiseParallel for an nn.Linear; for a
    Conv1D (weight (in, out)) the same with the weight's other dims, and for "packed_colwise" each packed part sharded
    on its own."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    conv1d = _fan_in_fan_out(layer)
    if style != "packed_colwise" and not conv1d:
        return ColwiseParallel() if style == "colwise" else RowwiseParallel()
    colwise, rowwise = _styles()
    out_dim = 1 if conv1d else 0  # the output features' dim of the weight
    if style == "rowwise":
        return rowwise(weight=Shard(1 - out_dim), bias=Replicate())
    if style == "colwise":
        return colwise(weight=Shard(out_dim), bias=Shard(0))
    # _StridedShard(dim, split_factor=parts): the dim cut into `parts` chunks, each chunk sharded over the processes
    # and a process's shards of every chunk side by side: [q_r | k_r | v_r] of q | k | v
    parts = layer.packed_parts
    return colwise(weight=_StridedShard(out_dim, split_factor=parts), bias=_StridedShard(0, split_factor=parts))


@functools.cache
def _styles():
    """ColwiseParallel and RowwiseParallel with the weight's and bias's placements given, for any layer that
    computes with `weight` and `bias` (a Conv1D, a packed layer); classes made on first use, as torch.distributed's
    tensor-parallel module is imported only when a model is split."""
    from torch.distributed.tensor import distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def partition(placements: dict):
        def partition_fn(name, module, mesh):
            for attr, placement in placements.items():
                param = getattr(module, attr, None)
                if param is not None:
                    module.register_parameter(attr, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                                 requires_grad=param.requires_grad))
        return partition_fn

    class Colwise(ColwiseParallel):
        """The output goes back as this process's columns as they are: a packed output is _StridedShard, which
        ColwiseParallel would redistribute to Shard(-1), moving data between the processes."""

        def __init__(self, weight, bias):
            super().__init__()
            self.partition_fn = partition({"weight": weight, "bias": bias})

        def _apply(self, module, device_mesh):
            prepare_input = functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
            return distribute_module(module, device_mesh, self.partition_fn, prepare_input,
                                     lambda mod, outputs, mesh: outputs.to_local())

    class Rowwise(RowwiseParallel):
        def __init__(self, weight, bias):
            super().__init__()
            self.partition_fn = partition({"weight": weight, "bias": bias})
            self.desired_input_layouts = self.input_layouts  # Shard(-1): the column-parallel layer's output

        def _apply(self, module, device_mesh):
            prepare_input = functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
            prepare_output = functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
            return distribute_module(module, device_mesh, self.partition_fn, prepare_input, prepare_output)

    return Colwise, Rowwise


def _split_locally(layer: nn.Linear, dim: int, rank: int, tp_size: int, device: torch.device) -> None:
    """Keep this process's slice of `layer`'s weight (and a column split's bias) along `dim` as a plain tensor on
    `device`; the parameter is marked with the dim (`_tp_local_dim`) so that saving can gather the whole weight."""
    size = layer.weight.shape[dim] // tp_size
    for attr, split in (("weight", dim), ("bias", 0 if dim == 0 else None)):
        value = getattr(layer, attr)
        if value is None or split is None:
            continue
        piece = value.detach().narrow(split, rank * size, size)
        local = nn.Parameter(torch.empty(piece.shape, dtype=piece.dtype, device=device).copy_(piece),
                             requires_grad=value.requires_grad)
        local._tp_local_dim = split
        setattr(layer, attr, local)
    if dim == 0:
        layer.out_features = size
    else:
        layer.in_features = size


def _sum_output(group, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: a module's partial output (its local_rowwise layers' share) -> the sum over the processes.
    Inference only: the sum has no backward (training such a model is refused)."""
    import torch.distributed as dist

    dist.all_reduce(output, group=group)
    return output


def has_local_splits(model: nn.Module) -> bool:
    """Whether some weights are split as plain tensors (local_colwise / local_rowwise: the MoE experts)."""
    return any(hasattr(p, "_tp_local_dim") for p in model.parameters())


def gather_local_splits(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a full state dict, on process 0) with each locally split weight replaced by the whole weight; a
    collective: every process calls it, in the same parameter order."""
    from torch.distributed.tensor import DTensor, Shard

    for name, param in model.named_parameters():
        dim = getattr(param, "_tp_local_dim", None)
        if dim is not None:
            whole = DTensor.from_local(param.detach(), model.device_mesh, [Shard(dim)], run_check=False).full_tensor()
            if state:
                state[name] = whole.cpu()
    return state


def _sum_over(group, grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: this process's part of the gradient -> the sum over the group's processes."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _resolve_plan(model: nn.Module, tp_plan) -> dict[str, str]:
    """The plan as {module name: style}, every pattern matched by at least one nn module ("auto" serves several
    model types: each matches some of its patterns). An "allreduce" module must hold local_rowwise layers (their
    partial outputs are what it sums); in "auto", the matches that hold none (a dense MLP) are dropped."""
    auto = tp_plan == "auto"
    if auto:
        # a model class names its own plan (tp_plan_auto), None when none is written for it yet
        tp_plan = getattr(type(model), "tp_plan_auto", LLAMA_TP_PLAN)
        if tp_plan is None:
            raise NotImplementedError(f'tp_plan="auto" for {type(model).__name__} is not supported yet (no tensor-'
                                      f'parallel plan is written for its layers); load it without tp_plan')
    if not isinstance(tp_plan, dict):
        raise ValueError(f'tp_plan={tp_plan!r}: pass "auto" or a dict of module-name patterns -> "colwise" / '
                         f'"rowwise"')
    names = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in tp_plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}]={style!r} is not one of {TP_STYLES}")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched and not auto:  # "auto" covers several model types: each matches some of its patterns
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                             f"(module names look like model.layers.0.self_attn.q_proj)")
        plan.update(dict.fromkeys(matched, style))
    local_rows = [name for name, style in plan.items() if style == "local_rowwise"]
    for name in [name for name, style in plan.items() if style == "allreduce"]:
        if not any(row.startswith(name + ".") for row in local_rows):
            if not auto:
                raise ValueError(f"tp_plan: {name} is 'allreduce' but holds no 'local_rowwise' layer: its output is "
                                 "not a partial sum, and summing it over the processes would multiply it")
            del plan[name]
    if not any(style in _LINEAR_STYLES for style in plan.values()):
        raise ValueError(f"tp_plan={tp_plan if not auto else 'auto'!r} splits no linear layer of "
                         f"{type(model).__name__}")
    return plan


def refuse(model: nn.Module, feature: str) -> None:
    """NotImplementedError naming `feature` for a tensor-parallel model."""
    if is_tensor_parallel(model):
        raise NotImplementedError(f"{feature} on a tensor-parallel model (tp_plan) is not supported yet; load the "
                                  "model without tp_plan for it")

