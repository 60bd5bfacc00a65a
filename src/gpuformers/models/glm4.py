"""Zhipu GLM-4 (model types "glm" and "glm4") = the llama decoder with a fused MLP, rotary on interleaved pairs of
half of each head, and (glm4 only) norms on both branch outputs. Only those differences live here.

    glm  (GLM-4-9B-chat-hf):       h = h + attn(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))
    glm4 (GLM-4-0414, GLM-Z1):     h = h + post_self_attn_layernorm(attn(input_layernorm(h)))
                                   h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))
    mlp.gate_up_proj   hidden -> 2 * intermediate in one matmul, gate the first half (Phi-3's MLP)
    attention          q/k/v biases when attention_bias (default on), never one on o_proj
    rotary             the first r = int(head_dim * partial_rotary_factor) dims of each head (factor 0.5 by
                       default), turned as pairs of neighbours, not as two halves:

        llama (halves):      (x_0 .. x_{r/2-1}) with (x_{r/2} .. x_{r-1}), pair i = (x_i, x_{i+r/2})
        GLM (interleaved):   pair i = (x_{2i}, x_{2i+1}), both turned by frequency i; x_r .. pass through

                       PairRotaryEmbedding lays cos and sin out for the pairs once per forward, so a layer's
                       rotation is a pair swap, two products and a sum.

The two model types are one family: transformers' GlmConfig and Glm4Config have the same fields and defaults, and the
modules keep the checkpoint's names, so save_pretrained writes what transformers reads.

use_kernels=True: the rotary kernel turns halves, and the interleaved rotary here never calls it (it stays in torch);
the fused MLP keeps its torch forward (the SwiGLU kernel's adapter reads gate_proj and up_proj); the norms and the
fused residual-add + post_attention_layernorm (after post_self_attn_layernorm in glm4) take their kernels.
Not supported: tp_plan="auto" (the llama plan splits gate_proj / up_proj and makes down_proj row-parallel: with the
fused gate_up_proj left whole, down_proj would get whole inputs).

Offers: Glm4Config, pair_tables, PairRotaryEmbedding, apply_interleaved_rotary, GlmAttention, GlmDecoderLayer,
Glm4DecoderLayer, GlmForCausalLM, Glm4ForCausalLM.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuformers.layers.norm import RMSNorm, add_rms_norm
from gpuformers.layers.rotary import RotaryEmbedding
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from gpuformers.models.phi3 import Phi3MLP

# transformers' GlmConfig / Glm4Config values for the fields a config.json may omit (GLM-4-9B's).
_GLM_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
                 "rms_norm_eps": 1.5625e-07, "attention_bias": True, "partial_rotary_factor": 0.5,
                 "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}


class Glm4Config(ModelConfig):
    """The config of both model types: GLM's defaults (half of each head rotated, q/k/v biases), no sliding window,
    no bias on o_proj."""

    family_defaults = {"glm": _GLM_DEFAULTS, "glm4": _GLM_DEFAULTS}
    partial_rotary = True
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "mlp_bias")

    @property
    def o_bias(self) -> bool:
        return False  # attention_bias is q/k/v's only: transformers' GLM o_proj never has one

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # transformers 4.x's GlmConfig / Glm4Config read the factor at the top level (5.x: in rope_parameters).
        out["partial_rotary_factor"] = self.rope_parameters.get("partial_rotary_factor", 1.0)
        return out


def pair_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's cos, sin (..., rotary_dim), each frequency's value twice as (f_0 .. f_{r/2-1}, f_0 ..
    f_{r/2-1}), -> the same laid out for neighbour pairs: cos (c_0, c_0, c_1, c_1, ...) and sin with each pair's
    first entry negated (-s_0, s_0, -s_1, s_1, ...)."""
    pairs = cos.shape[-1] // 2
    cos, sin = cos[..., :pairs], sin[..., :pairs]
    return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2)


class PairRotaryEmbedding(RotaryEmbedding):
    """position_ids (batch, seq) -> pair_tables(cos, sin), each (batch, seq, rotary_dim): made once per forward for
    every layer (the rope types are RotaryEmbedding's)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pair_tables(*super().forward(x, position_ids))


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) with its first rotary_dim dims turned as neighbour pairs (x_2i, x_2i+1) by
    frequency i; cos, signed_sin (batch, seq, rotary_dim) from pair_tables.

    transformers computes x * cos + (-x_1, x_0, -x_3, x_2, ...) * sin; the sign moves onto sin here, which changes
    no number (every dtype), and the pair swap is one flip."""
    rot = cos.shape[-1]
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # (batch, 1, seq, rotary_dim)
    x_rot = x[..., :rot]
    swapped = x_rot.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)  # (x_1, x_0, x_3, x_2, ...), a new tensor
    if torch.is_grad_enabled():
        turned = x_rot * cos + swapped * signed_sin
    else:  # the same sum, the second product and the sum in place: fewer allocations in decoding
        turned = (x_rot * cos).add_(swapped.mul_(signed_sin))
    return turned if rot == x.shape[-1] else torch.cat((turned, x[..., rot:]), dim=-1)


class GlmAttention(LlamaAttention):
    """Llama's attention (biases from the config: q/k/v only) with GLM's interleaved partial rotary."""

    def position_qk(self, q, k, position_embeddings):
        q, k = self.project_qk(q, k)
        cos, signed_sin = position_embeddings  # pair_tables, (batch, seq, rotary_dim)
        # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
        return (apply_interleaved_rotary(q.transpose(1, 2), cos, signed_sin),
                apply_interleaved_rotary(k.transpose(1, 2), cos, signed_sin))


class GlmDecoderLayer(LlamaDecoderLayer):
    """The llama layer with GLM's attention and the fused gate_up MLP (model type "glm")."""

    attention_class = GlmAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = Phi3MLP(config.hidden_size, config.intermediate_size)


class Glm4DecoderLayer(GlmDecoderLayer):
    """GLM's layer with each branch's output normalised before it joins the residual (model type "glm4")."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, attn_out_norm, mlp, mlp_out_norm = self.input_layernorm, self.self_attn, self.post_self_attn_layernorm, self.mlp, self.post_mlp_layernorm
        attn_out = attn_out_norm(
            attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position))
        # residual add + the MLP's input norm: still one fused kernel with use_kernels=True
        normed, hidden_states = add_rms_norm(attn_out, hidden_states, self.post_attention_layernorm)
        return hidden_states + mlp_out_norm(mlp(normed))


class GlmForCausalLM(LlamaForCausalLM):
    config_class = Glm4Config
    decoder_layer_class = GlmDecoderLayer
    tp_plan_auto = None  # the llama plan splits gate_proj / up_proj, which GLM fuses (module doc)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary_emb = PairRotaryEmbedding(config)


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer_class = Glm4DecoderLayer
