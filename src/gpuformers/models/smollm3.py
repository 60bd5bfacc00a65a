"""SmolLM3 = the llama decoder with rotary left out on some layers (NoPE). Only that difference lives here.

config.json's `no_rope_layers` holds one flag per layer, in transformers' convention: 1 = the layer rotates q and k,
0 = a NoPE layer that attends without positions (by default every fourth layer; ModelConfig fills the list in, and
with use_sliding_window those NoPE layers are the sliding-window ones).

Offers: SmolLM3Attention, SmolLM3DecoderLayer, SmolLM3ForCausalLM.
"""

from __future__ import annotations

from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.use_rope = bool(config.extra["no_rope_layers"][layer_idx])

    def position_qk(self, q, k, position_embeddings):
        if self.use_rope:
            return super().position_qk(q, k, position_embeddings)
        # NoPE: (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim), positions come from the mask alone
        return q.transpose(1, 2), k.transpose(1, 2)


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_class = SmolLM3Attention


class SmolLM3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = SmolLM3DecoderLayer
    no_split_modules = ("SmolLM3DecoderLayer",)
