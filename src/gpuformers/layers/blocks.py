"""A model's decoder layers (its repeated blocks) found by class, and activation checkpointing applied to them.

A model names the classes of its blocks in `decoder_layer_classes` (PreTrainedModel derives it from
`decoder_layer_class`, and `no_split_modules`, their names, from it). Every module that is an instance of one of them
is a decoder layer, a user's subclass swapped into the stack included: the unit that device_map keeps whole, FSDP2
shards one at a time and activation checkpointing recomputes. Nothing here knows a model family.

Offers: decoder_layers, checkpoint_decoder_layers, uncheckpoint_decoder_layers, replace_submodule.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in module order: the modules that are instances of a class in the model's
    `decoder_layer_classes` (none for a model that names none)."""
    classes = tuple(getattr(model, "decoder_layer_classes", ()) or ())
    if not classes:
        return []
    return [m for m in model.modules() if isinstance(m, classes)]


def checkpoint_decoder_layers(model: nn.Module, setting: str, every_n_layers: int = 1, offload: bool = False,
                              **checkpoint_kwargs) -> None:
    """Recompute decoder layers' activations in the backward pass instead of keeping them (torch.utils.checkpoint
    with `checkpoint_kwargs`): every `every_n_layers`-th layer from the first, and with `offload` the inputs a layer
    keeps for its recompute in (pinned) host memory. A layer already wrapped is left as it is. `setting` names the
    option that asked for it, for the error on a model without decoder layers."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{setting}=True but {type(model).__name__} names no decoder layer class "
                         f"(decoder_layer_class); turn {setting} off for this model")
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers!r} must be an int >= 1 (1 checkpoints every layer)")
    for index, layer in enumerate(layers):
        if getattr(layer, "_checkpointed", False) or index % every_n_layers:
            continue
        layer._forward_before_checkpoint = layer.__dict__.get("forward")
        layer.forward = functools.partial(_checkpointed_call, layer.forward, offload, checkpoint_kwargs)
        layer._checkpointed = True


def uncheckpoint_decoder_layers(model: nn.Module) -> None:
    """Undo checkpoint_decoder_layers: each layer keeps its activations again."""
    for layer in decoder_layers(model):
        if getattr(layer, "_checkpointed", False):
            before = layer.__dict__.pop("_forward_before_checkpoint", None)
            if before is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = before
            layer._checkpointed = False


def _checkpointed_call(forward, offload: bool, checkpoint_kwargs: dict, *args, **kwargs):
    # Keyword arguments go in through partial: reentrant checkpointing takes positional ones only.
    run = functools.partial(torch.utils.checkpoint.checkpoint, functools.partial(forward, **kwargs), *args,
                            **checkpoint_kwargs)
    if not offload:
        return run()
    device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
    with torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda"):
        return run()


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in `model` at the dotted path `name` ("model.layers.0.mlp.down_proj"), in place of what was there
    (LoRA wrapping and unwrapping, quantized layers swapped in, dequantized ones swapped back)."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
