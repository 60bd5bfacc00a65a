"""IBM Granite (3.x) = the llama decoder with four scalars from config.json. Only those live here.

    embeddings  * embedding_multiplier          (LlamaModel.embed)
    h = h + attn(input_layernorm(h))  * residual_multiplier
    h = h + mlp(post_attention_layernorm(h)) * residual_multiplier
    scores = q @ k^T * attention_multiplier     (in place of 1 / sqrt(head_dim))
    logits = lm_head(h) / logits_scaling         (LlamaForCausalLM.compute_logits)

The branch is scaled before the residual add, so the add + post-attention norm stays the one fused call (and the
fused Triton kernel under use_kernels=True sees the already scaled branch). Training never fuses the LM head with the
loss (logits_are_head_output is False): that would skip the division by logits_scaling.

Offers: GraniteConfig, GraniteAttention, GraniteDecoderLayer, GraniteModel, GraniteForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuformers.layers.norm import add_rms_norm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass
class GraniteConfig(ModelConfig):
    """The four scalars (module doc), with their defaults; no sliding window."""

    family_defaults = {"granite": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048}}
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0


class GraniteAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.scaling = float(config.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_class = GraniteAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        normed, hidden_states = add_rms_norm(attn_out * self.residual_multiplier, hidden_states,
                                             self.post_attention_layernorm)
        return hidden_states + mlp(normed) * self.residual_multiplier


class GraniteModel(LlamaModel):
    def __init__(self, config: ModelConfig, layer_class=GraniteDecoderLayer):
        super().__init__(config, layer_class)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, output_hidden_states=False, cache_position=None):
        # Embeddings passed in are scaled too, as transformers does (prompt tuning passes embed_tokens' output).
        if inputs_embeds is not None:
            inputs_embeds = inputs_embeds * self.embedding_multiplier
        return super().forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                               output_hidden_states, cache_position)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    config_class = GraniteConfig
    decoder_model_class = GraniteModel
    decoder_layer_class = GraniteDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) / self.logits_scaling
