"""Mistral's Ministral families: the llama decoder (no biases, SwiGLU, llama's RMSNorm) with the differences below.

    ministral  (Ministral-8B-Instruct-2410): each layer attends as its layer_types entry says, sliding_attention
               (the last sliding_window keys) or full_attention; without layer_types, Mistral's rule (every layer
               slides when sliding_window is set; with it null every layer attends globally, where transformers'
               forward fails for want of a window)
    ministral3 (Ministral 3, the text decoder of Mistral3ForConditionalGeneration): Mistral's attention (one window
               on every layer when sliding_window is set; null by default), yarn rope by default, and the queries
               scaled after rotary by a temperature that grows with the position (Llama 4's):

                   q = q * (1 + beta * log(1 + floor(position / original_max_position_embeddings)))

               beta = rope_parameters["llama_4_scaling_beta"]; the scale is 1 below original_max_position_embeddings
               (16384 in Mistral's checkpoints) and the keys are never scaled. Ministral3RotaryEmbedding computes it
               once per forward from position_ids, beside cos and sin, so generate(), the static cache and the
               engine, which all pass positions, scale exactly as transformers does.

transformers' configs have no attention_bias or mlp_bias for these families and their modules no biases, whatever
config.json says: both are read as false and not written back. A ministral3 config.json's layer_types is ignored, as
transformers ignores it (it warns).

use_kernels=True: every kernel computes these layers (llama's RMSNorm, SwiGLU, fused add + norm, halves rotary, the
fused LM-head loss); the query temperature is applied after the rotary kernel, in torch. tp_plan="auto" takes the
llama plan, which fits: the same projection names, and the temperature is the same for every head.

Offers: MinistralConfig, Ministral3Config, Ministral3RotaryEmbedding, Ministral3Attention, Ministral3DecoderLayer,
MinistralForCausalLM, Ministral3ForCausalLM.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuformers.layers.rotary import RotaryEmbedding
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MinistralConfig(ModelConfig):
    """Ministral's defaults and its layer_types, read as written (Mistral's rule when absent)."""

    family_defaults = {"ministral": {"vocab_size": 32000, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                                     "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                                     "sliding_window": 4096}}
    absent_fields = ("use_sliding_window", "max_window_layers", "attention_bias", "mlp_bias")

    def _check_family(self) -> None:
        super()._check_family()
        self.attention_bias = self.mlp_bias = False  # transformers builds these families without biases

    def _fill_layer_types(self) -> None:
        if self.layer_types is None:
            self._slide_every_layer()
        elif "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null; set sliding_window "
                             "or make those layers full_attention")


class Ministral3Config(MinistralConfig):
    """Ministral 3's defaults (head_dim 128 and Mistral's yarn rope with llama_4_scaling_beta when config.json has no
    rope_parameters), Mistral's sliding rule, and the two rope values the query temperature reads, checked."""

    family_defaults = {"ministral3": {"vocab_size": 131072, "num_key_value_heads": 8, "head_dim": 128,
                                      "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "pad_token_id": 11,
                                      "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None}}
    absent_fields = MinistralConfig.absent_fields + ("layer_types",)

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        if not data.get("rope_parameters") and not data.get("rope_scaling"):
            # transformers' default, which also wins over a top-level rope_theta
            data["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 16384,
                                       "max_position_embeddings": data["max_position_embeddings"],
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                       "llama_4_scaling_beta": 0.1}
        return data

    def _fill_layer_types(self) -> None:
        self._slide_every_layer()

    def _check_rope(self) -> None:
        super()._check_rope()  # sets original_max_position_embeddings for yarn, as transformers does
        missing = [key for key in ("llama_4_scaling_beta", "original_max_position_embeddings")
                   if self.rope_parameters.get(key) is None]
        if missing:
            raise ValueError(f"ministral3 scales its queries by position with rope_parameters' llama_4_scaling_beta "
                             f"and original_max_position_embeddings; rope_parameters {self.rope_parameters} lacks "
                             f"{', '.join(missing)}: add them to config.json (Mistral's are 0.1 and 16384)")


class Ministral3RotaryEmbedding(RotaryEmbedding):
    """position_ids (batch, seq) -> (cos, sin, query_scale): the rotary tables and the queries' temperature
    (batch, 1, seq, 1), in the model dtype."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = super().forward(x, position_ids)
        rope = self.config.rope_parameters
        # in float32 from the integer positions, then cast, as transformers computes it
        periods = torch.floor(position_ids.float() / rope["original_max_position_embeddings"])
        scale = 1 + rope["llama_4_scaling_beta"] * torch.log(1 + periods)
        return cos, sin, scale[:, None, :, None].to(x.dtype)


class Ministral3Attention(LlamaAttention):
    def position_qk(self, q, k, position_embeddings):
        cos, sin, query_scale = position_embeddings
        q, k = super().position_qk(q, k, (cos, sin))  # (batch, heads, seq, head_dim)
        return q * query_scale, k


class Ministral3DecoderLayer(LlamaDecoderLayer):
    attention_class = Ministral3Attention


class MinistralForCausalLM(LlamaForCausalLM):
    """Ministral: the llama decoder, sliding or full attention per layer (LlamaAttention reads the layer's window)."""

    config_class = MinistralConfig


class Ministral3ForCausalLM(LlamaForCausalLM):
    config_class = Ministral3Config
    decoder_layer_class = Ministral3DecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary_emb = Ministral3RotaryEmbedding(config)
