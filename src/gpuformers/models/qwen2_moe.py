"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) = Qwen2's attention with Qwen3-MoE's sparse block plus a shared
expert that every token goes through.

    mlp (sparse layers):  routed  = Qwen3-MoE's block: top num_experts_per_tok of num_experts gated MLPs
                                    (moe_intermediate_size), weights renormalised when norm_topk_prob
                          shared  = sigmoid(shared_expert_gate(x)) * shared_expert(x)
                                    (one gated MLP of shared_expert_intermediate_size; the gate is Linear(hidden, 1))
                          out     = routed + shared
    mlp (dense layers):   a GatedMLP of intermediate_size, for layers in mlp_only_layers or off decoder_sparse_step

Only the differences live here: the shared expert, the q/k/v biases of config.json's qkv_bias (default true; never a
bias on o_proj), transformers' sliding-window rule for this family (with use_sliding_window, the even layers below
max_window_layers slide: the opposite side of Qwen2's rule), its defaults, and its tensor-parallel plan. Checkpoint
keys are what transformers' save_pretrained writes by default and the Hub holds: mlp.gate.weight, mlp.experts.{e}.
{gate,up,down}_proj.weight, mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight; its fused
experts (mlp.experts.gate_up_proj / down_proj) load too, through Qwen3-MoE's checkpoint_fan_out.

The block's own forward is the routed experts only (SparseMoeBlock's, which use_kernels=True swaps for the fused
Triton experts); the decoder layer adds the block's shared_expert_output, so the shared expert counts with or
without the kernel. Router logits and the aux loss (output_router_logits, router_aux_loss_coef) are Qwen3-MoE's,
whose forward this model inherits: transformers computes both families' aux loss with the same function, and the
shared expert takes no part in it.

Offers: Qwen2MoeConfig, Qwen2MoeSparseMoeBlock, Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM, QWEN2_MOE_TP_PLAN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpuformers.layers.mlp import GatedMLP
from gpuformers.layers.moe import SparseMoeBlock
from gpuformers.layers.norm import add_rms_norm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer
from gpuformers.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from gpuformers.tensor_parallel import LLAMA_TP_PLAN


@dataclass
class Qwen2MoeConfig(ModelConfig):
    """Qwen2's fields with the MoE ones and qkv_bias, transformers' Qwen2MoeConfig defaults."""

    family_defaults = {"qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16,
                                     "sliding_window": 4096, "max_window_layers": 28}}

    # The q/k/v projections' biases (o_proj never has one); this field stands in for ModelConfig's derived qkv_bias.
    qkv_bias: bool = True
    num_experts: int = 60  # 0: every layer dense
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408  # each routed expert's
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("mlp_only_layers") is None:  # transformers reads null as no dense-only layer
            data.pop("mlp_only_layers", None)
        return super()._prepare_dict(data)

    @property
    def o_bias(self) -> bool:
        return False

    def _fill_layer_types(self) -> None:
        # transformers writes sliding_window 0 when use_sliding_window is off: no window anywhere then
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            limit = self.max_window_layers if self.max_window_layers is not None else 0
            self.layer_types = ["sliding_attention" if self.sliding_window is not None and i % 2 == 0 and i < limit
                                else "full_attention" for i in range(self.num_hidden_layers)]


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's routed experts (this block's forward) and the gated shared expert (shared_expert_output), which
    the decoder layer adds."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, config.norm_topk_prob)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def shared_expert_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> the shared expert's output scaled per token by its sigmoid gate."""
        shared_expert, shared_expert_gate = self.shared_expert, self.shared_expert_gate
        return torch.sigmoid(shared_expert_gate(hidden_states)) * shared_expert(hidden_states)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """The llama layer (its attention honours qkv_bias through the config) with a Qwen2MoeSparseMoeBlock as `mlp`
    on the sparse layers."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if is_sparse_layer(config, layer_idx):
            self.mlp = Qwen2MoeSparseMoeBlock(config)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        if not isinstance(self.mlp, Qwen2MoeSparseMoeBlock):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, cache_position)
        input_norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        normed, hidden_states = add_rms_norm(attn_out, hidden_states, self.post_attention_layernorm)
        # routed + shared first, then the residual: transformers' order of the sums
        return hidden_states + (mlp(normed) + self.mlp.shared_expert_output(normed))


# The llama plan (attention, the dense layers' MLP) and Qwen3-MoE's split experts with the block's routed sum
# all-reduced once; the shared expert is split as a dense MLP (its rowwise down_proj sums its own output) and its
# one-output gate stays whole, so the block's all-reduce covers the routed experts alone.
QWEN2_MOE_TP_PLAN = {
    **LLAMA_TP_PLAN,
    "model.layers.*.mlp.shared_expert.gate_proj": "colwise",
    "model.layers.*.mlp.shared_expert.up_proj": "colwise",
    "model.layers.*.mlp.shared_expert.down_proj": "rowwise",
}


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's forward (router logits, aux loss) over Qwen2-MoE's decoder layers."""

    config_class = Qwen2MoeConfig
    decoder_layer_class = Qwen2MoeDecoderLayer
    tp_plan_auto = QWEN2_MOE_TP_PLAN
