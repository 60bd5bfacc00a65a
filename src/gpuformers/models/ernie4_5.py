"""Baidu ERNIE 4.5 dense (model type "ernie4_5", ERNIE-4.5-0.3B) = the llama decoder with rotary on interleaved
pairs, turned in float32, and one bias flag for every projection. Only those differences live here.

    rotary      every dim of each head, as neighbour pairs (x_2i, x_2i+1) turned by frequency i (GLM's layout,
                glm4.py, with partial factor 1), not llama's halves; q and k are turned in float32 with float32
                cos / sin and cast back, so bfloat16 and float16 round as transformers does
    use_bias    config.json's one flag: biases on q/k/v/o_proj and gate/up/down_proj alike (read into
                attention_bias and mlp_bias, written back as use_bias)
    attention   no dropout on the attention weights whatever config.json says, as transformers' Ernie4_5Attention
    defaults    head_dim 128, 2 kv heads, rope_theta 500000, tied embeddings (Ernie4_5Config's)

The layer, MLP and norms are llama's, and the modules keep the checkpoint's names, so save_pretrained writes what
transformers reads. use_kernels=True: the rotary kernel turns halves, and the interleaved rotary here never calls it
(it stays in torch); the norms, the fused residual-add + norm and the SwiGLU MLP (biases included) take their
kernels. tp_plan="auto" is llama's plan: each process turns its own heads, the rotary is per head.

Offers: Ernie4_5Config, Ernie4_5RotaryEmbedding, Ernie4_5Attention, Ernie4_5DecoderLayer, Ernie4_5ForCausalLM.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuformers.models.config import ModelConfig
from gpuformers.models.glm4 import PairRotaryEmbedding, apply_interleaved_rotary
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Ernie4_5Config(ModelConfig):
    """ERNIE 4.5's defaults; use_bias read into attention_bias and mlp_bias; no sliding window."""

    family_defaults = {"ernie4_5": {"num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
                                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
                                    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_bias": False}}
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "attention_bias",
                     "mlp_bias", "attention_dropout")

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        # one flag for every projection: the llama modules read it as attention_bias (q/k/v/o) and mlp_bias
        data["attention_bias"] = data["mlp_bias"] = data.pop("use_bias")
        return data

    def _check_family(self) -> None:
        super()._check_family()
        if self.attention_bias != self.mlp_bias:
            raise ValueError(f"ERNIE 4.5 has one use_bias for every projection, but this config has attention_bias="
                             f"{self.attention_bias} and mlp_bias={self.mlp_bias}; build it with "
                             f"ModelConfig.from_dict({{..., 'use_bias': ...}})")

    @property
    def use_bias(self) -> bool:
        return self.attention_bias

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["use_bias"] = self.use_bias
        return out


class Ernie4_5RotaryEmbedding(PairRotaryEmbedding):
    """PairRotaryEmbedding's tables (batch, seq, head_dim), in float32 whatever the model's dtype."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The tables take x's device and dtype only: an empty float32 tensor on that device asks for float32.
        return super().forward(x.new_empty(0, dtype=torch.float32), position_ids)


class Ernie4_5Attention(LlamaAttention):
    """Llama's attention (biases from use_bias) with the interleaved rotary turned in float32, and no attention
    dropout."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_dropout = 0.0

    def position_qk(self, q, k, position_embeddings):
        q, k = self.project_qk(q, k)
        cos, signed_sin = position_embeddings  # float32 pair tables, (batch, seq, head_dim)
        dtype = q.dtype  # (.float() and .to() return the tensor itself in a float32 model)
        # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
        return (apply_interleaved_rotary(q.transpose(1, 2).float(), cos, signed_sin).to(dtype),
                apply_interleaved_rotary(k.transpose(1, 2).float(), cos, signed_sin).to(dtype))


class Ernie4_5DecoderLayer(LlamaDecoderLayer):
    attention_class = Ernie4_5Attention


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    config_class = Ernie4_5Config
    decoder_layer_class = Ernie4_5DecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary_emb = Ernie4_5RotaryEmbedding(config)
