"""Qwen3 = the llama decoder + an RMSNorm over each head of q and k before rotary. Only that difference lives here.

Offers: Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM.
"""

from __future__ import annotations

from gpuformers.layers.norm import RMSNorm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_qk(self, q, k):
        # q, k: (batch, seq, heads, head_dim); the norm runs over head_dim.
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
