"""Mixtral = Mistral's decoder with a sparse mixture-of-experts block (layers/moe.py) in place of every MLP.

    block_sparse_moe:  gate (router, num_local_experts rows) -> softmax in float32 -> top num_experts_per_tok,
                       always renormalised to sum 1, kept in float32 -> experts.{e}: w2(silu(w1(x)) * w3(x)),
                       summed with those weights

Only Mixtral's differences live here: the checkpoint names (model.layers.{i}.block_sparse_moe.gate.weight and
block_sparse_moe.experts.{e}.w1/w2/w3.weight, the Hub's layout and what transformers 5's save_pretrained writes by
default; transformers fuses the experts into 3-D tensors in memory), every layer sparse, router_jitter_noise (training
only, as in transformers), and its tensor-parallel plan (MIXTRAL_TP_PLAN: every expert split). The router, the
experts' loop, the fused kernel (use_kernels=True) and training with output_router_logits (the load-balancing aux
loss, router_aux_loss_coef) are Qwen3-MoE's, whose forward Mixtral inherits: transformers computes both families'
aux loss with the same function. Attention is Mistral's: a sliding window on every layer when config.sliding_window
is set.

transformers' fused in-memory layout, which its save_pretrained writes with save_original_format=False, for an
offloaded model or with an adapter (mlp.gate.weight, mlp.experts.gate_up_proj (experts, 2 * intermediate, hidden):
w1 rows then w3 rows, mlp.experts.down_proj), loads too: MIXTRAL_FAN_OUT renames the router and cuts the experts
into w1 / w3 / w2 as they stream in (loading/fan_out.py).

Offers: MixtralConfig, MixtralExpert, MixtralSparseMoeBlock, MixtralDecoderLayer, MixtralForCausalLM, MIXTRAL_TP_PLAN,
MIXTRAL_FAN_OUT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.moe import SparseMoeBlock
from gpuformers.layers.norm import add_rms_norm
from gpuformers.loading.fan_out import FanOut, fused_experts
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer
from gpuformers.models.qwen3_moe import Qwen3MoeForCausalLM
from gpuformers.tensor_parallel import LLAMA_TP_PLAN


@dataclass
class MixtralConfig(ModelConfig):
    """Mistral's attention (no window unless sliding_window is set) and the MoE fields."""

    family_defaults = {"mixtral": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096 * 32,
                                   "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8}}
    absent_fields = ("use_sliding_window", "max_window_layers", "layer_types")

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0  # training only: the block's input times uniform noise in [1 -/+ this]

    @property
    def num_experts(self) -> int:
        """num_local_experts, under the name the MoE forward shared with Qwen3-MoE reads."""
        return self.num_local_experts

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data.pop("num_experts", None)  # not MixtralConfig's: num_local_experts counts the experts
        return super()._prepare_dict(data)

    def _fill_layer_types(self) -> None:
        self._slide_every_layer()


class MixtralExpert(nn.Module):
    """One expert, the gated MLP under Mixtral's checkpoint names: w1 = gate, w3 = up, w2 = down."""

    kernel_layer_name = "SwiGLUMLP"

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    # The gated MLP's names for the same Linears (whatever replaced them: quantized, LoRA), which the fused MoE and
    # SwiGLU kernels read; read-only, so that the Linears keep one name in the state dict.
    gate_proj = property(lambda self: self.w1)
    up_proj = property(lambda self: self.w3)
    down_proj = property(lambda self: self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1, self.w2, self.w3
        return w2(F.silu(w1(x)) * w3(x))


class MixtralSparseMoeBlock(SparseMoeBlock):
    """SparseMoeBlock with Mixtral's experts, always-renormalised top-k weights and, in training, router jitter:
    the block's input (router and experts alike) multiplied by uniform noise in [1 - jitter, 1 + jitter]."""

    expert_class = MixtralExpert

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, norm_topk_prob=True)
        self.gate.float32_weights = True
        self.jitter_noise = config.router_jitter_noise
        if not 0 <= self.jitter_noise < 1:
            raise ValueError(f"router_jitter_noise={self.jitter_noise} must be in [0, 1) (0 turns it off)")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        return super().forward(hidden_states)


class MixtralDecoderLayer(LlamaDecoderLayer):
    """The llama layer with the sparse block under its checkpoint name, block_sparse_moe, instead of `mlp`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.mlp
        self.block_sparse_moe = MixtralSparseMoeBlock(config)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, moe = self.input_layernorm, self.self_attn, self.block_sparse_moe
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        normed, hidden_states = add_rms_norm(attn_out, hidden_states, self.post_attention_layernorm)
        return hidden_states + moe(normed)


# The llama plan's attention, and the experts split as Qwen3-MoE's are (see tensor_parallel.py): each expert's w1 and
# w3 by output features, w2 by input features, as plain tensors, and the block's summed output all-reduced once.
MIXTRAL_TP_PLAN = {
    **{name: style for name, style in LLAMA_TP_PLAN.items() if name.startswith("model.layers.*.self_attn.")
       and name.endswith("_proj")},
    "model.layers.*.block_sparse_moe.experts.*.w1": "local_colwise",
    "model.layers.*.block_sparse_moe.experts.*.w3": "local_colwise",
    "model.layers.*.block_sparse_moe.experts.*.w2": "local_rowwise",
    "model.layers.*.block_sparse_moe": "allreduce",
}


# transformers' fused layout (module doc) -> our block_sparse_moe names
MIXTRAL_FAN_OUT = (*fused_experts("model.layers.*.block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
                   FanOut("model.layers.*.mlp.gate.weight", ("model.layers.*.block_sparse_moe.gate.weight",)))


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's forward (router logits, aux loss) over Mixtral's decoder layers."""

    config_class = MixtralConfig
    decoder_layer_class = MixtralDecoderLayer
    tp_plan_auto = MIXTRAL_TP_PLAN
    checkpoint_fan_out = MIXTRAL_FAN_OUT
