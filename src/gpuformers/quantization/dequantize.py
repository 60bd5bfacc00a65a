"""`model.dequantize(dtype=None)`, transformers' method: every quantized layer of a loaded model turned back into the
float layer it stands for, and the model then an unquantized one (no quantization_config; it saves so).

    WeightOnlyLinear (weight-only, GPTQ / AWQ / compressed-tensors kept packed)   -> nn.Linear
    bitsandbytes 4-bit / 8-bit layers                                            -> nn.Linear
    FP8Linear (FineGrainedFP8Config(dequantize=False))                           -> nn.Linear
    a layer quantized from a Conv1D-style layer (GPT-2's c_attn, ...)            -> that layer again, weight (in, out)
    gpt-oss's MXFP4 experts kept packed                                          -> their float parameters

The weights are each layer's own `dequantize()` (what its forward multiplies by), cast to `dtype` (default: the
dtype the model loaded in), one layer at a time on the layer's device: peak memory is the dequantized model plus one
layer. The values are the quantized ones, so the model computes what it computed before (in `dtype`), not what the
checkpoint held before quantization. The usual use is QLoRA: train adapters over a quantized base, then dequantize
and merge them (`merge_and_unload`) into a float model; LoRA layers around quantized layers keep wrapping their new
float base layer.

Offers: dequantize_model.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuformers.layers.blocks import replace_submodule
from gpuformers.layers.linear import is_fan_in_fan_out
from gpuformers.quantization.mxfp4 import unpack_experts

ORIGINAL = "_original_module"  # the float layer a quantized layer replaced (meta), kept out of the module tree


def remember_original(quantized: nn.Module, original: nn.Module) -> None:
    """Keep `original` (the float layer `quantized` replaced, on the meta device) so that dequantize_model can give
    it back, with its class and settings (a Conv1D's layout, GPT-2's packed_parts); not a submodule, not saved."""
    quantized.__dict__[ORIGINAL] = original.to("meta")


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Dequantize `model` in place (module doc) and return it."""
    if not getattr(model, "is_quantized", False):
        raise ValueError(f"{type(model).__name__} is not quantized (it has no quantization_config): there is nothing "
                         f"to dequantize; load it with quantization_config=... first")
    dtype = dtype or model.dtype
    layer_types = _quantized_layer_types()
    # The new weights train as the model's other weights do: frozen under an adapter (QLoRA), else not.
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    trainable = embeddings is None or embeddings.weight.requires_grad
    unpack_experts(model, dtype, trainable)
    for name, module in list(model.named_modules()):
        if isinstance(module, layer_types):
            replace_submodule(model, name, _float_layer(module, dtype, trainable))
    model.quantization_config = None
    model.config.extra.pop("quantization_config", None)
    return model


def _quantized_layer_types() -> tuple[type, ...]:
    import sys

    from gpuformers.quantization.fp8 import FP8Linear
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    types = (WeightOnlyLinear, FP8Linear)
    if "bitsandbytes" in sys.modules:  # a model holding its layers has imported it; asking costs no import
        from gpuformers.quantization.bnb_layers import BnbLinear4bit, BnbLinear8bitLt

        types += (BnbLinear4bit, BnbLinear8bitLt)
    return types


def _float_layer(layer: nn.Module, dtype: torch.dtype, trainable: bool) -> nn.Module:
    """The float layer for a quantized one: its remembered original class (module doc), or an nn.Linear."""
    weight = layer.dequantize().to(dtype)  # (out_features, in_features)
    bias = getattr(layer, "bias", None)
    new = layer.__dict__.get(ORIGINAL)
    if new is None:
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    if is_fan_in_fan_out(new):
        weight = weight.T.contiguous()  # the Conv1D layout, (in, out)
    new.weight = nn.Parameter(weight, requires_grad=trainable)
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=trainable)
    return new
