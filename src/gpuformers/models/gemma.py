"""Google's Gemma, Gemma 2 and Gemma 3 (text): the llama decoder with the differences below. Only those live here.

    embeddings * sqrt(hidden_size)            rounded to the model dtype first, as transformers does (GemmaModel.embed)
    RMSNorm: x / rms(x) * (1 + weight)         in float32, cast back after the weight (GemmaRMSNorm; weights start at 0)
    MLP: down(gelu_tanh(gate(x)) * up(x))      hidden_act (Gemma) / hidden_activation (Gemma 2, 3)

    Gemma 2 and 3 also:
    h = h + post_attention_layernorm(attn(input_layernorm(h)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    scores = q @ k^T / sqrt(query_pre_attn_scalar)
    sliding-window layers between global ones (layer_types: Gemma 2 every other layer, Gemma 3 five in six)

    Gemma 2:  scores = 50 * tanh(scores / 50)   attn_logit_softcapping, before the mask (eager only: see below)
              logits = 30 * tanh(logits / 30)   final_logit_softcapping (Gemma2ForCausalLM.compute_logits; Gemma 3
                                                applies it too when set, which Google's checkpoints do not)
    Gemma 3:  q_norm, k_norm (GemmaRMSNorm over head_dim) before rotary; one rope per layer type: sliding layers
              rotate with rope_local_base_freq (10k), global ones with rope_parameters (1M, maybe linear scaling)

Soft-capping the attention scores cannot run through torch's SDPA (nothing sits between the scores and the
softmax), so a Gemma 2 model attends with "eager", as transformers chooses for it: asking for "sdpa" gives "eager",
the engine's paged backends compute the cap with eager too (engine/paged_attention.py), and the backends that would
drop it (flash_attention_2/3, flex_attention, triton) are refused by name. Gemma 3's configs carry
attn_logit_softcapping (null in Google's checkpoints) but transformers does not apply it, and neither do we.

use_kernels=True: Gemma's norm and MLP are not llama's, so the RMSNorm / SwiGLU / AddRMSNorm kernels are not used
(no kernel_layer_name, no fused residual add); rotary's kernel is. A final soft-cap keeps training off the fused LM-head +
loss paths, which would skip it (logits_are_head_output). tp_plan="auto" takes the llama plan, which fits.

Offers: GemmaConfig, Gemma2Config, Gemma3TextConfig, GemmaRMSNorm, GemmaMLP, GemmaDecoderLayer, Gemma2Attention,
Gemma2DecoderLayer, Gemma3Attention, Gemma3DecoderLayer, LayerTypeRotaryEmbedding, GemmaModel, GemmaForCausalLM,
Gemma2ForCausalLM, Gemma3ForCausalLM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.mlp import GatedMLP
from gpuformers.layers.rotary import RotaryEmbedding
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


@dataclasses.dataclass
class GemmaConfig(ModelConfig):
    """Gemma's defaults and the fields that change its numbers, as transformers reads them: the MLP's activation
    (hidden_act; its original releases say "gelu", meaning the tanh approximation) and, refused, the bidirectional
    variant (EmbeddingGemma), which is not a causal LM. Every layer attends globally."""

    family_defaults = {"gemma": {"vocab_size": 256000, "max_position_embeddings": 8192, "num_key_value_heads": 16,
                                 "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "pad_token_id": 0,
                                 "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True}}
    activation_field: ClassVar[str] = "hidden_act"  # where config.json names the MLP's activation
    absent_fields = ("use_sliding_window", "max_window_layers", "sliding_window", "layer_types")

    use_bidirectional_attention: bool | None = None  # EmbeddingGemma's: refused (_check_gemma)

    @property
    def mlp_activation(self) -> str:
        return self.hidden_act

    def _check_family(self) -> None:
        if self.hidden_act == "gelu":
            self.hidden_act = "gelu_pytorch_tanh"
        self._check_gemma()

    def _check_gemma(self) -> None:
        activation = self.mlp_activation
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"{self.activation_field} {activation!r} is not supported for "
                                      f"{self.model_type}; supported: gelu_pytorch_tanh, gelu")
        if self.use_bidirectional_attention:
            raise NotImplementedError(f"use_bidirectional_attention=True ({self.model_type}, as in EmbeddingGemma) is "
                                      f"not supported: gpuformers runs causal LMs; set it to false or null")


@dataclasses.dataclass
class Gemma2Config(GemmaConfig):
    """Gemma's, with the MLP's activation in hidden_activation, query_pre_attn_scalar and the soft-caps, and
    sliding-window layers between global ones: every other layer slides."""

    family_defaults = {"gemma2": {"vocab_size": 256000, "max_position_embeddings": 8192, "num_key_value_heads": 4,
                                  "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "pad_token_id": 0,
                                  "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
                                  "sliding_window": 4096}}
    activation_field = "hidden_activation"
    absent_fields = ("use_sliding_window", "max_window_layers")

    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256  # scores are scaled by its inverse square root
    final_logit_softcapping: float | None = 30.0  # None: no cap
    attn_logit_softcapping: float | None = 50.0

    @property
    def mlp_activation(self) -> str:
        return self.hidden_activation

    def _global_layer_interval(self) -> int:
        """One layer in this many attends globally (the last of each group); the others slide."""
        return 2

    def _check_family(self) -> None:
        self._check_gemma()  # hidden_act is not read here, so a "gelu" stays as written

    def _fill_layer_types(self) -> None:
        if self.layer_types is None:
            every = self._global_layer_interval()
            self.layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                                for i in range(self.num_hidden_layers)]


@dataclasses.dataclass
class Gemma3TextConfig(Gemma2Config):
    """Gemma 2's, with five sliding layers in every six (sliding_window_pattern), no soft-caps by default, and one
    rope per layer type: rope_parameters for the global layers, the default rope at rope_local_base_freq for the
    sliding ones."""

    family_defaults = {"gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072,
                                       "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
                                       "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
                                       "tie_word_embeddings": True, "sliding_window": 4096,
                                       "rope_theta": 1_000_000.0}}

    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    rope_local_base_freq: float = 10_000.0  # the sliding layers' rope_theta
    sliding_window_pattern: int = 6  # one global layer in this many

    def _global_layer_interval(self) -> int:
        return self.sliding_window_pattern

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        """transformers 5 writes rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}; older
        config.json files rope_theta and rope_scaling for the full-attention layers and rope_local_base_freq for the
        sliding ones. Either way -> rope_parameters: the full-attention layers' rope (checked as every family's),
        rope_local_base_freq: the sliding layers' base (their rope is the default one)."""
        data = super()._prepare_dict(data)
        rope = data.get("rope_parameters")
        if isinstance(rope, dict) and {"full_attention", "sliding_attention"} & set(rope):
            sliding = rope.get("sliding_attention") or {}
            if sliding.get("rope_type", "default") != "default":
                raise NotImplementedError(f"Gemma 3 sliding-attention layers with rope_type {sliding['rope_type']!r} "
                                          f"are not supported; only the default rope (rope_theta) is")
            data["rope_parameters"] = dict(rope.get("full_attention") or {})
            if "rope_theta" in sliding:
                data["rope_local_base_freq"] = sliding["rope_theta"]
        return data

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["rope_parameters"] = {  # transformers 5 reads one rope per layer type
            "full_attention": dict(self.rope_parameters),
            "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
        }
        return out


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32 and cast back at the end (llama's RMSNorm casts before the weight).
    No kernel_layer_name: use_kernels' RMSNorm kernel computes x * weight, which is not this."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(hidden_states)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaMLP(GatedMLP):
    """down(act(gate(x)) * up(x)) with act the tanh-approximated GELU (or the exact one for hidden_activation
    "gelu" in Gemma 2 / 3). No kernel_layer_name: use_kernels' SwiGLU kernel computes silu."""

    kernel_layer_name = None

    def __init__(self, config: GemmaConfig):
        super().__init__(config.hidden_size, config.intermediate_size, bias=False)
        self.approximate = "tanh" if config.mlp_activation == "gelu_pytorch_tanh" else "none"  # checked in GemmaConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        return down_proj(F.gelu(gate_proj(x), approximate=self.approximate) * up_proj(x))


class GemmaDecoderLayer(nn.Module):
    """Gemma: h = h + attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)), with Gemma's norm and MLP.
    The residual add is not fused with the norm (use_kernels' AddRMSNorm computes llama's norm)."""

    attention_class = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, post_norm, mlp = self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp
        hidden_states = hidden_states + attn(input_norm(hidden_states), position_embeddings, attention_mask,
                                             past_key_values, cache_position)
        return hidden_states + mlp(post_norm(hidden_states))


class Gemma2Attention(LlamaAttention):
    """Scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped by attn_logit_softcapping (when set)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.attn_logit_softcapping = config.attn_logit_softcapping

    # The backend is stored as given (set_attn_implementation, training/packing.py's wrapper) and read with this
    # layer's soft-cap bound, so LlamaAttention.forward passes it without knowing about it.
    @property
    def attention_fn(self):
        cap = self.__dict__.get("attn_logit_softcapping")
        return self._backend if cap is None else functools.partial(self._backend, softcap=cap)

    @attention_fn.setter
    def attention_fn(self, fn):
        self._backend = fn


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Each branch normalised on its way in and on its way out (post_attention_layernorm normalises the attention
    output here, not the MLP input)."""

    attention_class = Gemma2Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, post_attn_norm, pre_mlp_norm, mlp, post_mlp_norm = self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.pre_feedforward_layernorm, self.mlp, self.post_feedforward_layernorm
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values,
                        cache_position)
        hidden_states = hidden_states + post_attn_norm(attn_out)
        return hidden_states + post_mlp_norm(mlp(pre_mlp_norm(hidden_states)))


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention without the soft-cap, with q_norm / k_norm over each head before rotary, and the rope of
    this layer's type (the model hands every layer both)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attn_logit_softcapping = None  # transformers' Gemma 3 never passes it to attention
        self.layer_type = config.layer_types[layer_idx]
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_qk(self, q, k):
        # q, k: (batch, seq, heads, head_dim); the norms run over head_dim.
        q_norm, k_norm = self.q_norm, self.k_norm
        return q_norm(q), k_norm(k)

    def position_qk(self, q, k, position_embeddings):
        return super().position_qk(q, k, position_embeddings[self.layer_type])


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class LayerTypeRotaryEmbedding(nn.Module):
    """Gemma 3's rotary: one RotaryEmbedding per layer type. position_ids (batch, seq) -> {layer type: (cos, sin)},
    each (batch, seq, head_dim); global layers use rope_parameters, sliding ones the default rope at
    rope_local_base_freq."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        sliding = dataclasses.replace(config, rope_parameters={"rope_type": "default",
                                                               "rope_theta": config.rope_local_base_freq})
        self.full_attention = RotaryEmbedding(config)
        self.sliding_attention = RotaryEmbedding(sliding)
        self.layer_types = sorted(set(config.layer_types))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: getattr(self, name)(x, position_ids) for name in self.layer_types}


class GemmaModel(LlamaModel):
    """The llama stack with Gemma's final norm, scaled embeddings and (Gemma 3) one rope per layer type."""

    def __init__(self, config: ModelConfig, layer_class=GemmaDecoderLayer):
        super().__init__(config, layer_class)
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.model_type == "gemma3_text":
            self.rotary_emb = LayerTypeRotaryEmbedding(config)
        self._embed_scales: dict[torch.dtype, float] = {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Embeddings passed in (inputs_embeds) are not scaled, as in transformers, where the scale lives inside
        # embed_tokens.
        embeds = self.embed_tokens(input_ids)
        return embeds * self._embed_scale(embeds.dtype)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to `dtype`, as transformers multiplies by it (55.4256 is 55.5 in bfloat16)."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = torch.tensor(self.config.hidden_size**0.5).to(dtype).item()
        return scale


class GemmaForCausalLM(LlamaForCausalLM):
    config_class = GemmaConfig
    decoder_model_class = GemmaModel
    decoder_layer_class = GemmaDecoderLayer
    # LlamaForCausalLM's tp_plan_auto (the llama plan) fits: the same projection names, and the norms (Gemma 3's
    # q_norm / k_norm as Qwen3's) are whole in every process.


class Gemma2ForCausalLM(GemmaForCausalLM):
    config_class = Gemma2Config
    decoder_layer_class = Gemma2DecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.final_logit_softcapping = config.final_logit_softcapping
        self.attn_logit_softcapping = self.model.layers[0].self_attn.attn_logit_softcapping  # None in Gemma 3

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    @property
    def logits_are_head_output(self) -> bool:
        return self.final_logit_softcapping is None  # Gemma 3 mostly: then training may fuse head and loss

    def set_attn_implementation(self, name: str) -> None:
        """As PreTrainedModel's; a model that soft-caps its attention scores runs "eager" for "sdpa" (as transformers
        picks for Gemma 2) and refuses the backends that would drop the cap."""
        if self.attn_logit_softcapping is not None:
            name = {"sdpa": "eager", "paged|sdpa": "paged|eager"}.get(name, name)
            if name not in ("eager", "paged|eager"):
                raise NotImplementedError(
                    f"attn_implementation={name!r} does not apply attn_logit_softcapping="
                    f"{self.attn_logit_softcapping} ({self.config.model_type} soft-caps its attention scores); use "
                    f"'eager' (or 'sdpa', which runs eager for this model)"
                )
        super().set_attn_implementation(name)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    config_class = Gemma3TextConfig
    decoder_layer_class = Gemma3DecoderLayer
