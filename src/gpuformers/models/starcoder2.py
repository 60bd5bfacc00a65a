"""BigCode StarCoder2 (3B, 7B, 15B) = the llama decoder with GPT-style norms and MLP, and biases. Only those
differences live here.

    norms             nn.LayerNorm with a bias (norm_epsilon): input_layernorm, post_attention_layernorm, model.norm
    MLP               c_proj(gelu_tanh(c_fc(x))): not gated (hidden_act gelu_pytorch_tanh)
    biases            on q/k/v/o_proj and c_fc/c_proj when use_bias (every released checkpoint); none on lm_head
    sliding_window    on every layer when set, as Mistral (the released checkpoints: 4096)
    dropouts          in training only, as transformers applies them: embedding_dropout on the embeddings,
                      residual_dropout on each branch before its residual add, attention_dropout on the attention
                      weights (the released configs set all three to 0.1; inference never drops)

config.json says use_bias and norm_epsilon: they are read into the fields the llama modules read (attention_bias and
mlp_bias; rms_norm_eps, here the LayerNorm's epsilon) and written back under StarCoder2's names.

use_kernels=True: the RMSNorm, SwiGLU and fused add + RMSNorm kernels would compute the wrong thing here and are
never used (nn.LayerNorm and Starcoder2MLP declare no kernel_layer_name, and the layer adds its residuals in torch);
the rotary and loss kernels are. tp_plan="auto" splits the llama way with the MLP's names (STARCODER2_TP_PLAN).

Offers: Starcoder2Config, Starcoder2MLP, Starcoder2DecoderLayer, Starcoder2Model, Starcoder2ForCausalLM,
STARCODER2_TP_PLAN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# hidden_act -> F.gelu's `approximate`: the activations transformers' ACT2FN computes as a GELU
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}

# The llama plan with the MLP's names: c_fc's output features split, c_proj's input features (its bias added once,
# after the sum over the processes).
STARCODER2_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.c_fc": "colwise",
    "model.layers.*.mlp.c_proj": "rowwise",
}


@dataclass
class Starcoder2Config(ModelConfig):
    """StarCoder2's defaults and spelling (use_bias, norm_epsilon), its dropouts, Mistral's layer types."""

    family_defaults = {"starcoder2": {"vocab_size": 49152, "num_key_value_heads": 2,
                                      "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
                                      "initializer_range": 0.018042, "norm_epsilon": 1e-5, "bos_token_id": 50256,
                                      "eos_token_id": 50256, "use_bias": True, "tie_word_embeddings": True}}
    absent_fields = ("use_sliding_window", "max_window_layers", "layer_types", "rms_norm_eps", "attention_bias",
                     "mlp_bias")
    field_spelling = {"rms_norm_eps": "norm_epsilon"}

    residual_dropout: float = 0.0  # training only (module doc)
    embedding_dropout: float = 0.0

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        # StarCoder2Config reads only these two: any llama spelling in the file is ignored, as transformers does
        data["rms_norm_eps"] = data.pop("norm_epsilon")
        data["attention_bias"] = data["mlp_bias"] = bool(data.pop("use_bias"))
        return data

    def _check_family(self) -> None:
        if self.hidden_act not in _GELU_APPROXIMATION:
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported for starcoder2; supported: "
                                      f"{', '.join(_GELU_APPROXIMATION)}")
        if self.attention_bias != self.mlp_bias:
            raise ValueError(f"starcoder2 has one use_bias for every projection, but attention_bias="
                             f"{self.attention_bias} and mlp_bias={self.mlp_bias}; set both the same")

    def _fill_layer_types(self) -> None:
        self._slide_every_layer()

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["norm_epsilon"] = self.rms_norm_eps
        out["use_bias"] = self.attention_bias
        return out


class Starcoder2MLP(nn.Module):
    """c_proj(gelu(c_fc(x))): GPT-2's MLP, (..., hidden) -> (..., intermediate) -> (..., hidden)."""

    # No kernel_layer_name: the SwiGLU kernel computes silu(gate) * up, which this layer has not.

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.approximate = _GELU_APPROXIMATION[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_fc, c_proj = self.c_fc, self.c_proj
        return c_proj(F.gelu(c_fc(x), approximate=self.approximate))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """h = h + dropout(attn(input_layernorm(h))); h = h + dropout(mlp(post_attention_layernorm(h)))."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_dropout = float(config.residual_dropout)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        # The llama layer's add + norm is one RMSNorm call (a fused kernel under use_kernels): here two torch steps.
        input_norm, attn, post_norm, mlp = self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        hidden_states = hidden_states + self._drop(attn_out)
        return hidden_states + self._drop(mlp(post_norm(hidden_states)))

    def _drop(self, branch: torch.Tensor) -> torch.Tensor:
        if self.training and self.residual_dropout:
            return F.dropout(branch, self.residual_dropout, training=True)
        return branch


class Starcoder2Model(LlamaModel):
    """The llama stack with a LayerNorm at the end and embedding_dropout on its input in training."""

    def __init__(self, config: ModelConfig, layer_class=Starcoder2DecoderLayer):
        super().__init__(config, layer_class)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.embedding_dropout = float(config.embedding_dropout)

    def _run_layers(self, inputs_embeds, position_ids, masks, past_key_values, cache_position, output_hidden_states):
        # Embeddings passed in are dropped out too, as transformers does (both forward paths come through here).
        if self.training and self.embedding_dropout:
            inputs_embeds = F.dropout(inputs_embeds, self.embedding_dropout, training=True)
        return super()._run_layers(inputs_embeds, position_ids, masks, past_key_values, cache_position,
                                   output_hidden_states)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    config_class = Starcoder2Config
    decoder_model_class = Starcoder2Model
    decoder_layer_class = Starcoder2DecoderLayer
    tp_plan_auto = STARCODER2_TP_PLAN
