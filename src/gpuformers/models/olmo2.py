"""AllenAI OLMo 2 = the llama decoder with its norms moved onto the branch outputs, and q/k normalised over the
whole projection. Only those differences live here.

    llama:  h = h + attn(input_layernorm(h));          h = h + mlp(post_attention_layernorm(h))
    OLMo 2: h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h))
    attention: q = q_norm(q_proj(h)), k = k_norm(k_proj(h)), each RMSNorm over all heads at once
               (num_heads * head_dim), before the split into heads and rotary

There is no add followed by a norm, so the fused residual-add + RMSNorm is never called. Because q_norm reduces over
every head, splitting q_proj / k_proj by heads across processes (the llama tensor-parallel plan) would normalise each
process's heads on their own: tp_plan="auto" is refused until a plan that gathers q and k is written.

Offers: Olmo2Config, Olmo2RMSNorm, Olmo2Attention, Olmo2DecoderLayer, Olmo2ForCausalLM.
"""

from __future__ import annotations


import torch

from gpuformers.layers.norm import RMSNorm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Olmo2Config(ModelConfig):
    """OLMo 2's defaults; no sliding window."""

    family_defaults = {"olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "pad_token_id": 1,
                                 "eos_token_id": 50279}}
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")



class Olmo2RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32, before the cast back (llama casts first): the same numbers in
    float32, transformers' rounding in bfloat16 and float16."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return super().forward(hidden_states)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = Olmo2RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def project_qk(self, q, k):
        # q (batch, seq, heads, head_dim): the norm runs over heads * head_dim, as over q_proj's output
        q_norm, k_norm = self.q_norm, self.k_norm
        return q_norm(q.flatten(2)).view_as(q), k_norm(k.flatten(2)).view_as(k)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.input_layernorm  # the checkpoint has none: OLMo 2 normalises the branch outputs instead
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        attn, mlp, attn_norm, mlp_norm = self.self_attn, self.mlp, self.post_attention_layernorm, self.post_feedforward_layernorm
        hidden_states = hidden_states + attn_norm(
            attn(hidden_states, position_embeddings, attention_mask, past_key_values, cache_position))
        return hidden_states + mlp_norm(mlp(hidden_states))


class Olmo2ForCausalLM(LlamaForCausalLM):
    config_class = Olmo2Config
    decoder_layer_class = Olmo2DecoderLayer
    tp_plan_auto = None  # the llama plan splits q_proj / k_proj by heads, which q_norm / k_norm reduce over

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.norm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
