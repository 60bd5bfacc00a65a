"""The LoRA layer: a frozen linear layer plus a trainable low-rank update (LoraLinear, on the LoraLayer base that
dora.py's DoraLinear and embedding.py's LoraEmbedding share too).

The frozen layer is an nn.Linear, a Conv1D-style layer whose weight is stored (in, out) (GPT-2's: fan_in_fan_out,
merged transposed) or, for QLoRA, a quantized linear layer (bitsandbytes 4-bit / 8-bit, WeightOnlyLinear). Over a
quantized layer the LoRA layer does what peft's bitsandbytes LoRA layers do:

    adapters' dtype   the 4-bit layer's compute dtype, a WeightOnlyLinear's compute dtype, torch's default dtype
                      over an int8 bitsandbytes weight; float32 instead of float16 / bfloat16 (autocast_adapter_dtype)
    forward           base_layer(x) + (B(A(dropout(x in the adapters' dtype))) * scaling in the output's dtype)
    merge / unmerge   dequantize, add (subtract) B @ A * scaling, quantize again: lossy, as peft's

lora_model.py's LoraModel puts these layers in place of a model's target layers.

Offers: LoraLayer, LoraLinear, quantized_linear_types, adapter_dtype_and_device (the adapters' dtype and device
over a base layer, as peft picks them), broken_adapter_error (the error of a merge that gives NaN or inf).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from gpuformers.layers.linear import is_fan_in_fan_out
from gpuformers.lora.config import LoraConfig


def quantized_linear_types() -> tuple[type, ...]:
    """The quantized linear layers LoRA wraps besides nn.Linear: WeightOnlyLinear, and gpuformers' bitsandbytes
    layers when bitsandbytes is imported (a model that holds them has imported it; asking costs no import)."""
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    if "bitsandbytes" not in sys.modules:
        return (WeightOnlyLinear,)
    from gpuformers.quantization.bnb_layers import BnbLinear4bit, BnbLinear8bitLt

    return WeightOnlyLinear, BnbLinear4bit, BnbLinear8bitLt



def adapter_dtype_and_device(base_layer: nn.Module, autocast_adapter_dtype: bool) -> tuple[torch.dtype, torch.device]:
    """peft's choice (tuners_utils._move_adapter_to_device_of_base_layer, then cast_adapter_dtype): the compute
    dtype of a 4-bit layer, else the weight's dtype when it is a float (nn.Linear), else torch's default dtype (an
    int8 bitsandbytes weight); a WeightOnlyLinear counts as a Linear of its compute dtype. float16 / bfloat16 then
    become float32 with autocast_adapter_dtype (stable AdamW updates). The device is the stored weight's."""
    weight = getattr(base_layer, "weight", None)
    if weight is None:  # WeightOnlyLinear: int qweight, compute dtype in .dtype
        weight, dtype = base_layer.qweight, base_layer.dtype
    elif getattr(base_layer, "compute_dtype", None) is not None:
        dtype = base_layer.compute_dtype
    else:
        dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
    if autocast_adapter_dtype and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return dtype, weight.device


class LoraLayer(nn.Module):
    """The base of the LoRA layers: a frozen `base_layer` plus an update that is off while `disabled`, folded into
    the base weight by merge() (then `merged`) and taken out by unmerge()."""

    def adapter_parameters(self) -> list[nn.Parameter]:
        """The layer's own trained tensors (lora_A, lora_B, DoRA's magnitude, lora_embedding_A / _B): what
        enable_adapters / disable_adapters switch."""
        return [p for n, p in self.named_parameters() if not n.startswith("base_layer.")]

    # The base layer's parameters read through the wrapper, as code written for the wrapped layer expects.
    @property
    def weight(self) -> nn.Parameter:
        return self.base_layer.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.base_layer.bias  # an nn.Embedding has none: AttributeError, as on the layer itself

    def _add_to_base_weight(self, delta: torch.Tensor, safe_merge: bool) -> None:
        """merge() into a float base weight: add `delta` (the weight's shape) in place; with safe_merge, first check
        that the sum is finite (else ValueError, the weight untouched)."""
        if safe_merge and not torch.isfinite(self.base_layer.weight + delta).all():
            raise broken_adapter_error()
        self.base_layer.weight.add_(delta)


class LoraLinear(LoraLayer):
    """A frozen linear layer (nn.Linear or a quantized one) plus a trainable low-rank update:
    y = base_layer(x) + B(A(dropout(x))) * scaling."""

    def __init__(self, base_layer: nn.Module, config: LoraConfig, autocast_adapter_dtype: bool = True):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.r, self.lora_alpha, self.scaling = config.r, config.lora_alpha, config.scaling
        dtype, device = adapter_dtype_and_device(base_layer, autocast_adapter_dtype)
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, config.r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(config.r, self.out_features, bias=False, device=device, dtype=dtype)
        self.merged = False
        self.disabled = False
        self.reset_lora_parameters(config.init_lora_weights)

    # Read from the base layer at each use: model.dequantize() may swap a quantized base for a float one.
    @property
    def fan_in_fan_out(self) -> bool:
        """The base weight is (in, out): merges add the update transposed."""
        return is_fan_in_fan_out(self.base_layer)

    @property
    def quantized(self) -> bool:
        return type(self.base_layer) is not nn.Linear and not self.fan_in_fan_out

    @torch.no_grad()
    def reset_lora_parameters(self, init_lora_weights: bool | str) -> None:
        """True: A as nn.Linear's default (kaiming uniform, a=sqrt(5)), B zeros, so the model starts unchanged.
        "gaussian": A normal with std 1/r, B zeros. False: both random (for tests; the model changes)."""
        if init_lora_weights is False:
            nn.init.kaiming_uniform_(self.lora_B.weight, a=math.sqrt(5))
        else:
            nn.init.zeros_(self.lora_B.weight)
        if init_lora_weights == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.r)
        else:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged or self.disabled:
            return result
        if not self.quantized:
            update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
            # Added in the adapter's precision (float32 over a bf16 base) and rounded once, as peft does.
            return (result + update * self.scaling).to(result.dtype)
        # peft's bitsandbytes layers: under autocast the adapters run as autocast says; otherwise in their own
        # dtype, and the update is rounded to the output's dtype before the sum.
        if torch.is_autocast_enabled():
            return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))) * self.scaling
        return result + update.to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling (out, in): what merging adds to the base weight; in the base weight's dtype for an
        nn.Linear, in float32 for a quantized layer (added to the dequantized weight before quantizing again)."""
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling
        return delta if self.quantized else delta.to(self.base_layer.weight.dtype)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False) -> None:
        if self.merged:
            return
        delta = self.delta_weight()
        if self.quantized:
            self._requantize(delta, safe_merge)
        else:
            self._add_to_base_weight(delta.T if self.fan_in_fan_out else delta, safe_merge)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        if self.quantized:
            self._requantize(-self.delta_weight())
        else:
            delta = self.delta_weight()
            self.base_layer.weight.sub_(delta.T if self.fan_in_fan_out else delta)
        self.merged = False

    def _requantize(self, delta: torch.Tensor, safe_merge: bool = False) -> None:
        """peft's merge into a quantized layer: dequantize, add `delta`, quantize the sum again with the layer's
        own settings (its load_from_checkpoint, as the loader quantizes). Each pass rounds again: lossy."""
        weight = self.base_layer.dequantize().to(delta.dtype) + delta  # (out, in)
        if safe_merge and not torch.isfinite(weight).all():
            raise broken_adapter_error()
        self.base_layer.load_from_checkpoint("weight", weight)

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}"


def broken_adapter_error() -> ValueError:
    return ValueError("merging this LoRA adapter gives NaN or inf weights; the adapter is broken (check its "
                      "training), so it was not merged")
