"""The sparse mixture-of-experts block of Qwen3-MoE: a router picks top_k experts per token, each a gated MLP.

    router:  probs = softmax(hidden @ gate.weight.T) in float32; top_k of them per token (renormalised to sum 1
             when norm_topk_prob), cast back to the model dtype
    experts: out[t] = sum over the token's experts e of  weight[t, e] * down_e(silu(gate_e(x_t)) * up_e(x_t))

It stands where a decoder layer's `mlp` stands and takes the same (batch, seq, hidden) input. The experts are a
ModuleList of GatedMLP (checkpoint keys mlp.experts.{e}.{gate,up,down}_proj.weight, as on the Hub) and run one after
the other over the tokens routed to them, in expert order, summed with index_add_: transformers' "eager" experts,
the same numbers. With use_kernels=True (kernel layer "SparseMoeBlock") inference runs the experts as two grouped
Triton GEMMs instead (kernels/moe.py), which keep the expert weights stacked in one buffer that the expert
Parameters are slices of; training keeps this forward.

Offers: TopKRouter, SparseMoeBlock.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.mlp import GatedMLP


class TopKRouter(nn.Module):
    """Router logits -> (top_k weights, top_k expert ids) per token. Not an nn.Linear, so that quantization and
    LoRA's "all-linear" leave it alone, as they leave transformers' router."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden) -> router logits (tokens, experts), weights (tokens, top_k), expert ids (tokens, top_k)."""
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class SparseMoeBlock(nn.Module):
    kernel_layer_name = "SparseMoeBlock"

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(x)
        out = torch.zeros_like(x)
        # Which experts got tokens (a host sync, as in transformers): only those run.
        for expert in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)
