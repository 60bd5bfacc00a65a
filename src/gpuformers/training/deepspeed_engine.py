"""The DeepSpeed strategy of the Trainer: its engine made (deepspeed.initialize) around the model, the optimizer and the
scheduler, and its checkpoints and whole weights, in DeepSpeed's own layout.

    ZeRO-1   optimizer states sharded over the processes          (Adam: 12 bytes/param -> 12/N, +4 for fp32 weights)
    ZeRO-2   + gradients sharded (reduce-scattered)                 2 or 4 bytes/param of gradients -> /N
    ZeRO-3   + parameters sharded, gathered per layer in the forward and backward (the whole model never on one
             device)
    offload_optimizer / offload_param: the shards in host memory (or NVMe), the optimizer stepping there

The Trainer's loop stays its own: for each micro-batch the forward through the engine, engine.backward (with the
accumulation boundary set on the last micro-batch, so gradients are reduced once per optimizer step), then
engine.step(), which clips (the config's gradient_clipping), steps the optimizer and the scheduler and zeroes the
gradients. The loss is the Trainer's (over the step's target tokens), not divided again by DeepSpeed
(scale_wrt_gas=False).

The optimizer is the config's "optimizer" section when it has one (DeepSpeed builds it), else the Trainer's
(TrainingArguments.optim, or the one passed to the Trainer; under offload_optimizer the Trainer's Adam / AdamW becomes
DeepSpeed's CPU Adam with the same settings, as accelerate does); the scheduler likewise ("scheduler", else
lr_scheduler_type built on the optimizer DeepSpeed steps).

Checkpoints: checkpoint-N/global_stepN/ holds DeepSpeed's sharded states (one optimizer-state file per process, and
the model states), written by every process (engine.save_checkpoint) and read back by engine.load_checkpoint, which
restores the weights, the optimizer's shards and the scheduler. DeepSpeed reads them with pickle
(torch.load(weights_only=False)): resume only from checkpoints your own runs wrote.

Offers: init_process_group, initialize, save_checkpoint, load_checkpoint, whole_state_dict, is_deepspeed_checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from gpuformers import distributed
from gpuformers.training.deepspeed_config import DeepSpeedConfig, require_deepspeed

logger = logging.getLogger(__name__)


def init_process_group(device: torch.device, timeout_s: float, backend: str | None) -> None:
    """DeepSpeed runs over torch.distributed's default group even in one process: join torchrun's group, or make a
    group of this process alone (an in-memory store: no port, no launcher) when it was started without one."""
    import torch.distributed as dist

    if distributed.init_distributed(device, timeout_s, backend=backend) or dist.is_initialized():
        return
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asserts that a launcher set it
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))


def initialize(model: torch.nn.Module, config: DeepSpeedConfig, optimizer, make_optimizer: Callable,
               make_scheduler: Callable, scheduler, num_training_steps: int, warmup_steps: int):
    """deepspeed.initialize over the model -> (engine, the optimizer it steps, its scheduler). `optimizer` /
    `scheduler`: the ones given to the Trainer (or None); `make_optimizer()` builds the Trainer's optimizer,
    `make_scheduler(optimizer)` the Trainer's scheduler over a torch optimizer."""
    deepspeed = require_deepspeed()
    config.finalize(model, num_training_steps, warmup_steps)
    if config.has_optimizer and optimizer is not None:
        raise ValueError("the DeepSpeed config has an optimizer section and the Trainer was given an optimizer "
                         "(optimizers=(...)); keep one of them")
    if config.has_scheduler and scheduler is not None:
        raise ValueError("the DeepSpeed config has a scheduler section and the Trainer was given a scheduler "
                         "(optimizers=(..., scheduler)); keep one of them")
    settings = dict(config.config)
    if not config.has_optimizer:
        offload = str(config.get("zero_optimization.offload_optimizer.device", "none")).lower() not in ("none", "")
        if optimizer is None:
            optimizer = make_optimizer()
            if offload and settings.get("zero_force_ds_cpu_optimizer", True):
                optimizer = _cpu_adam(optimizer)
        # DeepSpeed vouches for its own optimizers under ZeRO; torch's AdamW (the Trainer's) works with every stage
        settings["zero_allow_untested_optimizer"] = True
    settings.setdefault("steps_per_print", 2**31)  # the Trainer logs; DeepSpeed's own progress lines are noise
    # a scheduler given to the Trainer stands; else the Trainer's kind is built over the torch optimizer DeepSpeed
    # steps (a callable: DeepSpeed calls it with that optimizer), unless the config names its own
    if scheduler is None and not config.has_scheduler:
        scheduler = make_scheduler
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=model, optimizer=None if config.has_optimizer else optimizer, lr_scheduler=scheduler,
        model_parameters=[p for p in model.parameters() if p.requires_grad] if config.has_optimizer else None,
        config=settings)
    return engine, ds_optimizer, ds_scheduler


def _cpu_adam(optimizer):
    """ZeRO-Offload steps the optimizer on the CPU, where DeepSpeed takes only its own vectorised CPU Adam (it refuses
    another unless the config sets zero_force_ds_cpu_optimizer false): the Trainer's Adam / AdamW becomes a
    DeepSpeedCPUAdam with the same groups and settings, as accelerate does. DeepSpeed compiles it (C++) at its first
    use, about a minute. Another optimizer is left as it is, for DeepSpeed to refuse with its reason."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional: ZeRO-Offload needs deepspeed anyway

    defaults = optimizer.defaults
    groups = [{"params": group["params"], "lr": group["lr"], "weight_decay": group["weight_decay"]}
              for group in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                            weight_decay=defaults["weight_decay"], adamw_mode=type(optimizer) is torch.optim.AdamW)


def _tag(step: int) -> str:
    return f"global_step{step}"


def save_checkpoint(engine, folder: Path, step: int) -> None:
    """DeepSpeed's sharded states into folder/global_step<step>/ (and folder/latest); every process writes its own
    shards, so every process must call it."""
    engine.save_checkpoint(str(folder), tag=_tag(step))


def is_deepspeed_checkpoint(folder: str | os.PathLike) -> bool:
    return any(Path(folder).glob("global_step*"))


def load_checkpoint(engine, folder: str | os.PathLike) -> None:
    """Weights, optimizer shards and scheduler back from checkpoint-N's global_stepN/ (every process)."""
    folder = Path(folder)
    tags = sorted(folder.glob("global_step*"))
    if not tags:
        raise ValueError(f"{folder} holds no DeepSpeed states (global_step*/): it was written without deepspeed=... "
                         "or with save_only_model=True; resume it as it was written, or start a new DeepSpeed run "
                         "from its weights (from_pretrained)")
    if len(tags) > 1:
        raise ValueError(f"{folder} holds several DeepSpeed states {[t.name for t in tags]}; keep one")
    path, _ = engine.load_checkpoint(str(folder), tag=tags[0].name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise ValueError(f"DeepSpeed could not load {tags[0]} (see its log above)")


def whole_state_dict(engine, config: DeepSpeedConfig) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on process 0 for save_pretrained (an empty dict elsewhere), gathered from every
    process under ZeRO-3 (a collective: every process calls it); None under ZeRO-3 without
    stage3_gather_16bit_weights_on_model_save, where there is nothing whole to write. Under ZeRO-1/2 every process
    holds the whole module, whose own state_dict is returned."""
    if not config.is_zero3:
        return engine.module.state_dict()
    if not config.gathers_weights_on_save:
        return None
    # accelerate's get_state_dict calls the same engine method: DeepSpeed has no public one that returns the dict
    state = engine._zero3_consolidated_16bit_state_dict()
    return state if state is not None else {}


def write_sharded_model(engine, folder: Path) -> None:
    """save_model under ZeRO-3 without gathering: DeepSpeed's checkpoint in `folder` (every process), from which
    DeepSpeed's zero_to_fp32.py (written beside it) rebuilds the whole weights."""
    logger.warning("stage3_gather_16bit_weights_on_model_save is off in the DeepSpeed config, so the ZeRO-3 weights "
                   "are not gathered: %s gets DeepSpeed's sharded checkpoint instead of model.safetensors; run its "
                   "zero_to_fp32.py to rebuild the weights, or set the option to true", folder)
    for stale in folder.glob("global_step*"):
        if distributed.is_main_process():
            shutil.rmtree(stale, ignore_errors=True)
    distributed.barrier()
    engine.save_checkpoint(str(folder), tag="global_step_final")
