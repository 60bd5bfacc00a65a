"""ByteDance Seed-OSS (model type "seed_oss", Seed-OSS-36B) = the llama decoder with separate bias flags for q/k/v and
o_proj, and dropout on each branch's output in training. Only those differences live here.

    attention_bias       biases on q_proj, k_proj, v_proj (default on)
    attention_out_bias   a bias on o_proj (default off)
    residual_dropout     dropout on the attention's and the MLP's outputs before each joins the residual stream, in
                         training only (default 0.1), after attention_dropout on the attention weights (default 0.1)
    defaults             head_dim 128, 8 kv heads, pad 1, bos 0, eos 2 (SeedOssConfig's)

In eval the layer is llama's to the number. The modules keep the checkpoint's names, so save_pretrained writes what
transformers reads. use_kernels=True: the branch dropouts sit in the layer, outside the MLP, so the SwiGLU kernel
(which replaces the MLP's forward) keeps them, and the rotary (halves), norm and fused residual-add + norm kernels
compute what the torch layers do. tp_plan="auto" is llama's plan (biases split with their projection; o_proj's
bias added once, after the sum).

Offers: SeedOssConfig, SeedOssDecoderLayer, SeedOssForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from gpuformers.layers.norm import add_rms_norm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class SeedOssConfig(ModelConfig):
    """Seed-OSS's defaults, attention_out_bias and residual_dropout; no sliding window."""

    family_defaults = {"seed_oss": {"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 524288,
                                    "rms_norm_eps": 1e-6, "attention_bias": True, "attention_dropout": 0.1,
                                    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}}
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

    attention_out_bias: bool = False
    residual_dropout: float = 0.1

    @property
    def o_bias(self) -> bool:
        return bool(self.attention_out_bias)  # attention_bias is q/k/v's only


class SeedOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer; in training each branch's output goes through dropout before the residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.residual_dropout = float(config.residual_dropout)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        if not (self.training and self.residual_dropout):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                   cache_position)
        input_norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        normed, hidden_states = add_rms_norm(F.dropout(attn_out, self.residual_dropout, training=True), hidden_states,
                                             self.post_attention_layernorm)
        return hidden_states + F.dropout(mlp(normed), self.residual_dropout, training=True)


class SeedOssForCausalLM(LlamaForCausalLM):
    config_class = SeedOssConfig
    decoder_layer_class = SeedOssDecoderLayer
