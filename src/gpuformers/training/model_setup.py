"""How the Trainer readies a model: the checks that refuse what it cannot train (yet), gradient checkpointing, and
the data-parallel wrapping (DDP / FSDP2) that the first train() puts around it (or the first evaluate() or predict(),
for FSDP2: the Trainer leaves a model that FSDP2 will shard where it was loaded, and FSDP2 moves only this process's
shards to the GPU).

Each refusal names what was asked and what to do instead: NotImplementedError for what is not done yet (a model
spread by device_map, tensor parallelism with FSDP2, MoE or fp16), ValueError for what cannot be trained (quantized
linear layers without LoRA adapters, float16 weights under fp16=True).

Offers: check_trainable, enable_gradient_checkpointing, ddp_options, wrap_for_training.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpuformers import distributed
from gpuformers.device import mapped_devices
from gpuformers.training import checkpoint as ckpt
from gpuformers.training.arguments import TrainingArguments


def check_trainable(model, args: TrainingArguments, tensor_parallel: bool) -> None:
    """Refuse a model spread over devices, a tensor-parallel model with what tensor parallelism cannot train yet,
    float16 trainable weights under fp16 mixed precision, and a quantized model without LoRA adapters."""
    placed = mapped_devices(model)
    if len(placed) > 1:  # spread over devices by device_map: moving it would undo that
        raise NotImplementedError(f"the model is spread over {sorted(placed)} by device_map; the Trainer trains a "
                                  "model on one device for now: load it with device_map=None or one device")
    if tensor_parallel:
        _check_tensor_parallel_args(args, model)
    # (DeepSpeed keeps float32 master weights of float16 ones itself: no gradient scaler of ours to refuse them)
    if args.mixed_precision == torch.float16 and args.deepspeed_config is None:
        half = next((name for name, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16),
                    None)
        if half is not None:  # the scaler refuses to unscale float16 gradients, at the first optimizer step
            raise ValueError(f"fp16=True trains float32 weights under autocast with a gradient scaler, but {half} "
                             f"is float16: load the model with dtype=torch.float32 (not dtype=\"auto\" on a float16 "
                             f"checkpoint), or use bf16=True on a GPU that has it (Ampere or newer)")
    if getattr(model, "is_quantized", False) and args.deepspeed_config is not None:
        raise NotImplementedError("DeepSpeed with a quantized model (QLoRA) is not supported yet; train it without "
                                  "deepspeed (one GPU, DDP or FSDP2), or load the model without quantization_config")
    if getattr(model, "is_quantized", False) and not _has_lora(model):
        raise ValueError("the model's linear layers are quantized and cannot be trained: attach LoRA adapters "
                         "to train it (get_peft_model(model, LoraConfig(...)): QLoRA), or train the model loaded "
                         "without quantization_config")


def _check_tensor_parallel_args(args: TrainingArguments, model) -> None:
    from gpuformers.tensor_parallel import has_local_splits

    if has_local_splits(model):
        raise NotImplementedError("training a tensor-parallel mixture-of-experts model is not supported yet (its "
                                  "experts' outputs are summed over the processes without a backward); train it "
                                  "without tp_plan (FSDP2: fsdp='full_shard'), or serve and generate with it")
    if args.deepspeed_config is not None:
        raise NotImplementedError("DeepSpeed with a tensor-parallel model (loaded with tp_plan) is not supported; "
                                  "load the model without tp_plan (ZeRO-3 shards the parameters), or drop deepspeed")
    if args.fsdp:
        raise NotImplementedError(f"fsdp={args.fsdp!r} with a tensor-parallel model (2-D parallelism: FSDP2 across "
                                  "tensor-parallel groups) is not supported yet; drop fsdp, or load the model "
                                  "without tp_plan")
    if args.mixed_precision == torch.float16:
        raise NotImplementedError("fp16=True with a tensor-parallel model is not supported (the gradient scaler "
                                  "cannot unscale split gradients); use bf16=True")


def _has_lora(model) -> bool:
    from gpuformers.lora.layers import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def enable_gradient_checkpointing(model: torch.nn.Module, checkpoint_kwargs: dict | None) -> None:
    """Recompute decoder layers' activations in the backward pass instead of keeping them, as transformers' Trainer
    asks the model: gradient_checkpointing_kwargs' every_n_layers and offload go to activation_checkpointing_enable,
    the rest to torch.utils.checkpoint (use_reentrant=False unless said)."""
    kwargs = {"use_reentrant": False, **(checkpoint_kwargs or {})}
    layers = {"every_n_layers": kwargs.pop("every_n_layers", 1), "offload": kwargs.pop("offload", False)}
    if hasattr(model, "activation_checkpointing_enable"):  # gpuformers' models (and LoRA's), transformers 5's
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **layers)
    elif hasattr(model, "gradient_checkpointing_enable"):  # older transformers models
        if layers != {"every_n_layers": 1, "offload": False}:
            raise NotImplementedError(f"gradient_checkpointing_kwargs {layers} need a model with "
                                      f"activation_checkpointing_enable, which {type(model).__name__} lacks; drop them")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        from gpuformers.layers.blocks import checkpoint_decoder_layers

        checkpoint_decoder_layers(model, "gradient_checkpointing", **layers, **kwargs)


def ddp_options(model: torch.nn.Module, args: TrainingArguments) -> distributed.DDPOptions:
    """DistributedDataParallel's arguments from args.ddp_*, with transformers' default for find_unused_parameters:
    False under activation checkpointing (reentrant checkpointing marks a parameter ready twice: transformers PR
    4659), True otherwise (a mixture-of-experts step leaves experts without tokens out of the backward, which DDP
    without it fails on at the next step). Unlike transformers, a LoRA-wrapped model counts as the model it wraps
    (transformers passes True for every model that is not its PreTrainedModel, checkpointed or not)."""
    from gpuformers.models.modeling import PreTrainedModel

    find_unused = args.ddp_find_unused_parameters
    if find_unused is None:
        # a LoRA PeftModel -> the model it wraps
        base = model if isinstance(model, PreTrainedModel) else getattr(model, "get_base_model", lambda: model)()
        if isinstance(base, PreTrainedModel):
            find_unused = not (base.is_activation_checkpointing or args.activation_checkpointing)
        else:
            find_unused = True
    return distributed.DDPOptions(find_unused_parameters=find_unused, bucket_cap_mb=args.ddp_bucket_cap_mb,
                                  broadcast_buffers=args.ddp_broadcast_buffers, static_graph=args.ddp_static_graph)


def wrap_for_training(model: torch.nn.Module, args: TrainingArguments, tensor_parallel: bool,
                      resume_from_checkpoint: str | os.PathLike | None) -> torch.nn.Module:
    """The model made data-parallel as args.distributed_strategy says (DDP, FSDP2), or the model itself in one
    process and for a tensor-parallel model (its processes all take the same batches)."""
    if resume_from_checkpoint and args.distributed_strategy == "fsdp":
        # whole weights go in before the model is sharded
        ckpt.load_model_weights_in_place(model, Path(resume_from_checkpoint))
    strategy = None if tensor_parallel else args.distributed_strategy
    if strategy == "ddp":
        return distributed.wrap_model(model, strategy, args.device, ddp_options=ddp_options(model, args))
    return distributed.wrap_model(model, strategy, args.device, args.fsdp_options) if strategy else model
