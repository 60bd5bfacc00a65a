"""Several processes training one model under torchrun: the process group, DDP and FSDP2, and the few collectives
the Trainer needs.

    torchrun --nproc_per_node=N train.py      (sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

`init_distributed(device)` joins the group torchrun describes: NCCL when the device is a GPU (each process on
cuda:LOCAL_RANK), gloo on the CPU (which is how the tests run it), or the `backend` asked for (TrainingArguments
.ddp_backend: one of BACKENDS). `wrap_model` then makes the model data-parallel:

    "ddp"    DistributedDataParallel: every process holds the whole model; gradients are averaged in the backward.
             `DDPOptions` (TrainingArguments.ddp_*) pass DDP's own arguments: find_unused_parameters (a
             mixture-of-experts model leaves the experts no token was routed to out of the backward),
             bucket_cap_mb, broadcast_buffers, static_graph.
    "fsdp"   FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer (the classes the model lists in
             `no_split_modules`), then the root, is sharded over the processes; a layer's parameters are gathered
             just before it runs and freed after, gradients are reduce-scattered. Tied weights (embeddings and the
             LM head) stay in the root group together. `FSDPOptions` (TrainingArguments.fsdp / fsdp_config) choose:

             reshard_after_forward=False   parameters stay gathered from the forward to the backward (ZeRO-2:
                                           "shard_grad_op"), one all-gather per step instead of two
             hybrid_shard                  a 2-D mesh (replicate, shard): parameters sharded over dp_shard_size
                                           processes (a node: LOCAL_WORLD_SIZE), replicated across those groups,
                                           gradients reduce-scattered inside a group then all-reduced across
             cpu_offload                   sharded parameters, gradients and optimizer state live on the CPU
                                           (CPUOffloadPolicy): the optimizer steps there, copies go to the GPU
                                           for each layer's forward and backward
             mixed_precision               MixedPrecisionPolicy: the dtype parameters are gathered in, gradients
                                           reduced in and outputs cast to

Both average gradients over the processes, so a loss normalised by the tokens of the *global* batch must be
multiplied by the world size before the backward to give the gradients of one big batch (the Trainer does that).
Checkpoints are written by process 0 from full (gathered) state dicts; every process must call the gathering
functions, since they are collectives.

DeepSpeed ZeRO-3 (training/deepspeed_engine.py) may also build the model already partitioned: `TrainingArguments(
deepspeed=<a stage-3 config>)` made before `from_pretrained` registers its config here (`set_zero3_init`, held by
weak reference: in force while the arguments live, as transformers holds its HfDeepSpeedConfig), and from_pretrained
(models/load_steps.py) reads it (`zero3_init`): the model is built inside deepspeed.zero.Init, each process keeping
its partition of every parameter. It lives here, below models, since models may not import training.

Offers: BACKENDS, world_size, rank, is_main_process, process_device, check_backend, init_distributed, DDPOptions,
FSDPOptions, wrap_model, hybrid_mesh, ZeroInit, set_zero3_init, zero3_init,
gradient_sync, all_reduce_sum, all_reduce_min, gather_to_main, barrier, exit_process, full_model_state_dict,
load_full_model_state_dict, full_optimizer_state_dict, load_full_optimizer_state_dict, unwrap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import weakref
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "fsdp")
BACKENDS = ("nccl", "gloo", "mpi")  # torch's own process-group backends
# transformers' other ddp_backend values, each for an accelerator gpuformers does not run on
_OTHER_BACKENDS = {"xccl": "Intel GPUs", "hccl": "Ascend NPUs", "cncl": "Cambricon MLUs", "mccl": "Moore Threads GPUs"}


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main_process() -> bool:
    return rank() == 0


def process_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK under torchrun (cuda:0 alone) when a GPU is visible, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from gpuformers.device import resolve_device

    local_rank, count = max(int(os.environ.get("LOCAL_RANK", 0)), 0), torch.cuda.device_count()
    if local_rank >= count:  # more processes on this machine than GPUs: one GPU per process
        raise RuntimeError(f"process LOCAL_RANK={local_rank} has no GPU of its own: {count} GPU(s) are visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)')!s}); start at "
                           f"most {count} processes per machine (torchrun --nproc_per_node={count}, or "
                           f"--tensor-parallel-size {count}), or make more GPUs visible")
    return resolve_device(f"cuda:{local_rank}")


def check_backend(backend: str | None, device: torch.device) -> None:
    """Refuse a process-group backend (TrainingArguments.ddp_backend) that is unknown or cannot serve `device`;
    None (NCCL on GPUs, gloo on the CPU) always passes."""
    if backend is None:
        return
    if backend in _OTHER_BACKENDS:
        raise ValueError(f'ddp_backend "{backend}" is for {_OTHER_BACKENDS[backend]}, which gpuformers does not train '
                         f'on; use "nccl" on NVIDIA GPUs or "gloo" on the CPU (or None to pick)')
    if backend not in BACKENDS:
        raise ValueError(f'ddp_backend "{backend}" is not one of: {", ".join(BACKENDS)} (or None: nccl on GPUs, '
                         "gloo on the CPU)")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f'ddp_backend "nccl" needs GPUs, but the processes train on {device} (no GPU is visible, or '
                         'use_cpu=True); use "gloo" (or None)')
    if backend == "mpi" and not (dist.is_available() and dist.is_mpi_available()):
        raise ValueError('ddp_backend "mpi" needs a torch built with MPI, which this one is not; use "nccl" on GPUs '
                         'or "gloo" (or None)')


def init_distributed(device: torch.device, timeout_s: float = 1800, single: bool = False,
                     cpu_offload: bool = False, backend: str | None = None) -> bool:
    """Join torchrun's process group (once); False when this is a single process. `single`: join it even when
    torchrun started one process (tensor parallelism over one process, as when trying a script with
    --nproc_per_node=1). `cpu_offload` (FSDP2 offloading to the CPU): on GPUs, gloo beside NCCL for the collectives
    over CPU tensors (the gradient norm and the checkpoints' gathering of offloaded states). `backend`: one of
    BACKENDS (None: NCCL on GPUs, gloo on the CPU)."""
    if world_size() <= 1 and not (single and "RANK" in os.environ):
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
    if dist.is_initialized():
        return True
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} is not set: start the "
                           "processes with torchrun (torchrun --nproc_per_node=N script.py)")
    check_backend(backend, device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":  # NCCL reduces CUDA tensors only: gloo takes the CPU ones when states are offloaded
        dist.init_process_group("cuda:nccl,cpu:gloo" if cpu_offload else "nccl", device_id=device, timeout=timeout)
    else:  # gloo and MPI take CPU and CUDA tensors alike
        dist.init_process_group(backend, timeout=timeout)
    return True


@dataclasses.dataclass(frozen=True)
class ZeroInit:
    """A DeepSpeed ZeRO-3 config in force for building models (deepspeed.zero.Init): `config`, the DeepSpeed config
    dict; `device`, where each process computes (its partitions live there, or where the config offloads them);
    `join()`, joining the process group DeepSpeed partitions over (the Trainer's, so that the Trainer finds it made)."""

    config: dict
    device: torch.device
    join: Callable[[], None]


_zero3_init: weakref.ref | None = None  # -> the ZeroInit in force, kept alive by its owner (TrainingArguments)


def set_zero3_init(settings: ZeroInit | None) -> None:
    """Make `settings` the ZeRO-3 config that from_pretrained builds models under, for as long as its owner keeps it
    (a weak reference); None: build models whole again. The last one set wins, as in transformers."""
    global _zero3_init
    _zero3_init = None if settings is None else weakref.ref(settings)


def zero3_init() -> ZeroInit | None:
    """The ZeRO-3 config in force for building models (set_zero3_init), or None."""
    return None if _zero3_init is None else _zero3_init()


@dataclasses.dataclass(frozen=True)
class DDPOptions:
    """DistributedDataParallel's own arguments (TrainingArguments.ddp_find_unused_parameters, ddp_bucket_cap_mb,
    ddp_broadcast_buffers, ddp_static_graph; model_setup.ddp_options applies transformers' defaults). None leaves
    DDP's default."""

    find_unused_parameters: bool = False
    bucket_cap_mb: int | None = None
    broadcast_buffers: bool | None = None
    static_graph: bool | None = None

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class FSDPOptions:
    """How "fsdp" shards the model (TrainingArguments builds it from fsdp and fsdp_config; see the module docstring).
    `mixed_precision` maps param_dtype / reduce_dtype / output_dtype to dtype names ("bfloat16"); `layer_classes`
    replaces the model's no_split_modules as the classes sharded one by one."""

    reshard_after_forward: bool = True
    hybrid_shard: bool = False
    dp_shard_size: int | None = None  # hybrid_shard: processes sharing one copy (None: LOCAL_WORLD_SIZE)
    cpu_offload: bool = False
    mixed_precision: dict[str, str] | None = None
    layer_classes: tuple[str, ...] | None = None


def wrap_model(model: torch.nn.Module, strategy: str, device: torch.device,
               fsdp_options: FSDPOptions | None = None, ddp_options: DDPOptions | None = None) -> torch.nn.Module:
    """The model made data-parallel over the group by `strategy` ("ddp" as `ddp_options` say, or "fsdp" as
    `fsdp_options` say, full sharding by default); see the module docstring. FSDP2 moves the parameters to the mesh's
    device itself, one sharded group (a layer) at a time, keeping this process's shard: a model given on the CPU is
    never whole on the GPU."""
    if strategy not in STRATEGIES:
        raise ValueError(f"distributed strategy {strategy!r} is not one of {STRATEGIES}")
    if not dist.is_initialized():
        raise RuntimeError("wrap_model needs the process group: call init_distributed(device) first (under torchrun)")
    if strategy == "ddp":
        if fsdp_options is not None:
            raise ValueError("fsdp_options were given with strategy 'ddp'; pass strategy='fsdp' to use them")
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       **(ddp_options or DDPOptions()).kwargs())
    if ddp_options is not None:
        raise ValueError("ddp_options were given with strategy 'fsdp'; pass strategy='ddp' to use them")
    from torch.distributed.fsdp import fully_shard

    options = fsdp_options or FSDPOptions()
    layers = _layers_to_shard(model, options.layer_classes)
    kwargs = _fully_shard_kwargs(options, device)
    # output_dtype casts the root's outputs only: a layer's output feeds the next layer, gathered in param_dtype
    layer_kwargs = {**kwargs, "mp_policy": dataclasses.replace(kwargs["mp_policy"], output_dtype=None)}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=options.reshard_after_forward, **layer_kwargs)
    # the root keeps FSDP2's default (its parameters stay gathered after the forward: the backward starts with them)
    fully_shard(model, **kwargs)
    return model


def _layers_to_shard(model: torch.nn.Module, layer_classes: tuple[str, ...] | None) -> list[torch.nn.Module]:
    from gpuformers.layers.blocks import decoder_layers

    if layer_classes is None:
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"fsdp: {type(model).__name__} names no decoder layer class (no_split_modules) to "
                             "shard one by one; use ddp for this model, or name the classes in "
                             "fsdp_config['transformer_layer_cls_to_wrap']")
        return layers
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    found = {type(m).__name__ for m in layers}
    if missing := [name for name in layer_classes if name not in found]:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"fsdp_config['transformer_layer_cls_to_wrap'] names {missing}, which "
                         f"{type(model).__name__} does not contain; its module classes are {present}")
    return layers


def _fully_shard_kwargs(options: FSDPOptions, device: torch.device) -> dict:
    """fully_shard's mesh, offload_policy and mp_policy for `options` (offload_policy omitted when left at its
    default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = {"mp_policy": MixedPrecisionPolicy()}
    if options.hybrid_shard:
        kwargs["mesh"] = hybrid_mesh(device, options.dp_shard_size)
    else:
        # on `device`'s type: fully_shard's default mesh is on the machine's accelerator (CUDA wherever a GPU is
        # visible), which would move a model trained on the CPU (use_cpu=True) to cuda:0 in every process
        kwargs["mesh"] = init_device_mesh(device.type, (dist.get_world_size(),))
    if options.cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        if device.type != "cpu" and "cpu:" not in dist.get_backend_config():
            raise RuntimeError(f"CPU offload puts the sharded states on the CPU, but the process group "
                               f"({dist.get_backend_config()}) has no backend for CPU tensors; start it with "
                               "init_distributed(device, cpu_offload=True) (NCCL and gloo)")

        # pinned CPU memory makes the host <-> GPU copies asynchronous; there is nothing to pin for without a GPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if options.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(**{k: getattr(torch, v)
                                                      for k, v in options.mixed_precision.items()})
    return kwargs


def hybrid_mesh(device: torch.device, dp_shard_size: int | None = None):
    """The (replicate, shard) DeviceMesh of hybrid sharding: consecutive groups of `dp_shard_size` processes
    (default LOCAL_WORLD_SIZE, one node under torchrun) each hold one sharded copy of the model."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shard = dp_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shard < 1 or world % shard:
        raise ValueError(f"hybrid_shard: {world} processes cannot be split in groups of dp_shard_size={shard}; set "
                         f"fsdp_config['dp_shard_size'] to a divisor of {world} (the processes per node)")
    return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself under a DDP wrapper (FSDP2 shards the model in place: it is its own unwrapped self)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Within: backward passes average gradients over the processes only if `enabled` (off for all but the last
    micro-batch of an accumulated step: one exchange per optimizer step). A DeepSpeed engine is told that the
    micro-batch is (or is not) its accumulation boundary."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    elif _is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "set_gradient_accumulation_boundary"):  # a DeepSpeed engine: reduces at its boundary
        model.set_gradient_accumulation_boundary(enabled)
        yield
    else:
        yield


def all_reduce_sum(value: float | int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum of `value` over all processes, as a float64 tensor on `device` (a copy; the input is untouched)."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over all processes (the value itself in a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def gather_to_main(value):
    """Every process's `value` (any picklable object), in rank order, on process 0 and None elsewhere; [value] in a
    single process. A collective: every process must call it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)  # NCCL: through this process's GPU (set by init_distributed)
    return gathered


def exit_process(code: int = 0) -> NoReturn:
    """End a torchrun process whose work is done: flush the output, leave the process group and exit at once,
    skipping the interpreter's teardown. That teardown aborts about one gloo process in twenty-five on this project's
    CI machine ("terminate called without an active exception" in torch's C++ runtime, after every output was
    written), which torchrun then reports as a failed run."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors on process 0 (an empty dict elsewhere) when it is sharded
    by FSDP2 or split by tensor parallelism (tensor_parallel.py); a collective then: every process must call it."""
    model = unwrap(model)
    if not _has_dtensors(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from gpuformers.tensor_parallel import gather_local_splits

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Weights split as plain tensors (the MoE experts under tensor parallelism) come out as this process's slice
    return gather_local_splits(model, state)


def _has_dtensors(model: torch.nn.Module) -> bool:
    """Sharded by FSDP2 or split by tensor parallelism: some parameters are DTensors."""
    from torch.distributed.tensor import DTensor

    return _is_fsdp(model) or any(isinstance(p, DTensor) for p in model.parameters())


def load_full_model_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy whole weights (every process passes all of them) into a model whose parameters may be DTensors, each
    process keeping its part; the model's tied weights may be absent from `state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = unwrap(model)
    tied = set(getattr(model, "tied_weights", {}) or {})
    missing = [k for k in model.state_dict() if k not in state and k not in tied]
    unexpected = [k for k in state if k not in model.state_dict()]
    if missing or unexpected:
        raise ValueError(f"the weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                         "resume with the model the checkpoint was trained from")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with whole (gathered) tensors, keyed like optimizer.state_dict(); a collective under
    FSDP2 and tensor parallelism (process 0 gets the values)."""
    model = unwrap(model)
    if not _has_dtensors(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state written by full_optimizer_state_dict (each process passes the whole state; FSDP2 and tensor
    parallelism keep their parts)."""
    model = unwrap(model)
    if not _has_dtensors(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
