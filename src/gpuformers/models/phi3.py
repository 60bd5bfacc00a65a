"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini) = the llama decoder with fused projections and partial rotary.

    self_attn.qkv_proj  (hidden -> (heads + 2 kv_heads) * head_dim): q, k and v in one matmul, split by heads
    mlp.gate_up_proj    (hidden -> 2 * intermediate): gate and up in one matmul, gate the first half
    partial_rotary_factor < 1 (Phi-4-mini: 0.75): rotary turns the first int(head_dim * factor) dims of each head,
                        the rest pass through
    longrope (Phi-3.5, "su" in old configs): layers/rotary.py; original_max_position_embeddings is read from the
                        top level of config.json (Phi3Config), as transformers' Phi3Config does
    sliding_window      on every layer when set (as Mistral)
    resid_pdrop         dropout on each residual branch, in training only; embd_pdrop is in config.json but no
                        transformers version applies it, and neither do we

The modules keep the checkpoint's names, so save_pretrained writes what transformers reads. When a longrope sequence
grows past original_max_position_embeddings during generate(), the keys cached with the short factors are dropped
and the whole sequence is recomputed once with the long ones, as transformers does (cache_must_be_rebuilt; Llama's
longrope keeps its cache in both libraries). The continuous batching engine does not recompute: a batch that holds a
sequence past that length runs on the long factors over whatever its cache holds (docs/engine.md).

Not supported: tp_plan="auto" (the llama plan splits q/k/v and gate/up, not the fused layers); use_kernels=True
leaves the fused MLP in torch (the SwiGLU kernel's adapter reads gate_proj and up_proj) and swaps the rest.

Offers: Phi3Config, Phi3MLP, Phi3Attention, Phi3DecoderLayer, Phi3ForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.rotary import apply_rotary_pos_emb, rotary_dim
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class Phi3Config(ModelConfig):
    """Mistral's layer types, partial rotary, and its own rope spelling and to_dict; original_max_position_embeddings
    (longrope's pretraining length) and the dropouts."""

    family_defaults = {"phi3": {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
                                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}}
    partial_rotary = True
    absent_fields = ("use_sliding_window", "max_window_layers", "layer_types")

    original_max_position_embeddings: int | None = 4096  # longrope's switch from short_factor to long_factor
    resid_pdrop: float = 0.0  # on each residual branch, in training
    embd_pdrop: float = 0.0  # in config.json, applied by no transformers version (module doc)

    def _fill_layer_types(self) -> None:
        self._slide_every_layer()

    def _normalise_rope(self, rope: dict[str, Any]) -> None:
        """As transformers' Phi3Config: "su" and "yarn" are its old names for longrope, only default and longrope
        exist, and the top-level original_max_position_embeddings (4096 when config.json omits it) wins over
        rope_parameters'."""
        if rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"
        if rope["rope_type"] not in ("default", "longrope"):
            raise ValueError(f"phi3 rope_type {rope['rope_type']!r} is not supported; Phi-3 has default and longrope")
        if rope["rope_type"] == "longrope":
            rope["original_max_position_embeddings"] = self.original_max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # Phi3Config reads partial_rotary_factor at the top level, and transformers 4.x takes a rope_scaling of
        # exactly type, short_factor and long_factor.
        out["partial_rotary_factor"] = self.rope_parameters.get("partial_rotary_factor", 1.0)
        if self.rope_type == "longrope":
            out["rope_scaling"] = {"type": "longrope", "short_factor": self.rope_parameters["short_factor"],
                                   "long_factor": self.rope_parameters["long_factor"]}
        return out


class Phi3MLP(nn.Module):
    """down(silu(gate) * up) with gate and up from one projection: gate_up_proj's output is (gate, up)."""

    # No kernel_layer_name: the SwiGLU kernel's adapter calls gate_proj and up_proj, which this layer has not.

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        gate, up = gate_up_proj(x).chunk(2, dim=-1)  # (..., intermediate) each
        return down_proj(F.silu(gate) * up)


class Phi3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # The checkpoint holds one fused weight; the llama layer's three projections go (on the meta device, where
        # from_pretrained builds, they never held memory).
        del self.q_proj, self.k_proj, self.v_proj
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, width, bias=False)
        # Phi-3 has no biases: transformers' Phi3Attention ignores attention_bias, and so do we.
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_dim = rotary_dim(config)

    def position_qk(self, q, k, position_embeddings):
        if self.rotary_dim == self.head_dim:
            return super().position_qk(q, k, position_embeddings)
        # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim); cos/sin are (batch, seq, rotary_dim).
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rot = self.rotary_dim
        # The slices are views: the rotary kernel (use_kernels, inference) may turn them in place, which the
        # concatenation below reads the same way.
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], *position_embeddings)
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        batch, seq, _ = hidden_states.shape
        qkv_proj, o_proj = self.qkv_proj, self.o_proj
        # (batch, seq, heads + 2 kv_heads, head_dim): q's heads, then k's, then v's
        qkv = qkv_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=2)
        return o_proj(self.attend(q, k, v, position_embeddings, attention_mask, past_key_values, cache_position))


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = Phi3MLP(config.hidden_size, config.intermediate_size)
        self.resid_pdrop = float(config.resid_pdrop)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        if not (self.training and self.resid_pdrop):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                   cache_position)
        # Training with resid_pdrop: each branch's output is dropped out before it joins the residual stream.
        attn_out = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                  past_key_values, cache_position)
        hidden_states = hidden_states + F.dropout(attn_out, self.resid_pdrop, training=True)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + F.dropout(mlp_out, self.resid_pdrop, training=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    config_class = Phi3Config
    decoder_layer_class = Phi3DecoderLayer
    tp_plan_auto = None  # the llama plan names q/k/v and gate/up projections, which Phi-3 fuses

    def cache_must_be_rebuilt(self, past_length: int, length: int) -> bool:
        """transformers' Phi3ForCausalLM.prepare_inputs_for_generation: once the (padded) sequence reaches
        original_max_position_embeddings + 1 tokens while the cache holds at most original_max_position_embeddings,
        the keys cached with longrope's short factors no longer fit the long ones, and the whole sequence is
        recomputed. transformers asks this of any Phi-3; only longrope computes different keys, so only it pays."""
        if self.config.rope_type != "longrope":
            return False
        original = self.config.rope_parameters["original_max_position_embeddings"]
        return past_length <= original < length

