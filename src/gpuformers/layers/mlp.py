"""The gated MLP of the llama family: down(silu(gate(x)) * up(x)).

A mixture-of-experts block stands in the same place of a decoder layer (its `mlp` attribute) and takes the
same (batch, seq, hidden) input, so a MoE family only swaps this module.

Offers: GatedMLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn



class GatedMLP(nn.Module):
    kernel_layer_name = "SwiGLUMLP"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        return down_proj(F.silu(gate_proj(x)) * up_proj(x))
