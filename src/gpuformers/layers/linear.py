"""Kinds of linear layer that the code outside a model tells apart (LoRA wrapping, quantization, merging).

A layer that stores its weight transposed, (in_features, out_features), as transformers' Conv1D and GPT-2's
GPT2Conv1D do, marks its class with `fan_in_fan_out = True`: LoRA wraps it as a Linear and merges the transposed
update into it (peft's fan_in_fan_out), and quantization reads its weight transposed.

Offers: is_fan_in_fan_out.
"""

from __future__ import annotations

from torch import nn


def is_fan_in_fan_out(module: nn.Module) -> bool:
    """Whether `module` is a linear layer whose weight is stored (in_features, out_features) (module doc)."""
    return getattr(type(module), "fan_in_fan_out", False) is True
