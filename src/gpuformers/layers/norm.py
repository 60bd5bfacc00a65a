"""RMSNorm, the normalisation of the llama family.

Computed in float32 and cast back, like transformers, so that bfloat16 models give the same numbers.
`kernel_layer_name` marks the layer for `use_kernels=True` (a fused Triton kernel may replace its forward).

Offers: RMSNorm, add_rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.kernels.mapping import use_kernel_function


class RMSNorm(nn.Module):
    kernel_layer_name = "RMSNorm"

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        input_dtype = hidden_states.dtype
        if input_dtype == torch.float32 and weight.dtype == torch.float32:
            # One fused op; the same arithmetic as below when nothing needs upcasting.
            return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@use_kernel_function("AddRMSNorm")  # use_kernels=True: one Triton kernel reads both inputs and writes both outputs
def add_rms_norm(hidden_states: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + hidden_states), residual + hidden_states): the residual add of a decoder layer fused with
    the normalisation that follows it."""
    summed = residual + hidden_states
    return norm(summed), summed

