"""EXAONE 4.0 (LG AI Research) = the llama decoder with OLMo 2's post-norm layer, Qwen3's per-head q/k norm and
hybrid attention whose global layers attend without rotary. Only those differences live here.

    h = h + post_attention_layernorm(attn(h))     no norm on the way in: the branch outputs are normalised
    h = h + post_feedforward_layernorm(mlp(h))    (OLMo 2's layer, with llama's RMSNorm: cast back, then weight)
    attn: q_norm, k_norm over each head (head_dim) after q_proj / k_proj, before rotary (Qwen3's)
    layer_types: sliding-window layers between global ones (EXAONE-4.0-32B: "LLLG", three in four slide)
    rotary: with sliding_window set, only the sliding layers rotate q and k and the global ones are NoPE;
            with sliding_window null (EXAONE-4.0-1.2B, every layer global) every layer rotates

layer_types, where config.json leaves it out: with an integer sliding_window_pattern n every n-th layer is global
(transformers' rule); with a string of L (sliding) and G (global) the string repeats and the last layer is global
(what transformers' documentation says; its code derives layer types from an integer only); with sliding_window
null every layer is global (transformers divides by zero there).

use_kernels=True: the norms are llama's RMSNorm and the MLP is SwiGLU, so those kernels compute the same numbers; a
post-norm layer has no residual add followed by a norm, so the fused add + norm is never called; rotary's kernel runs
on the layers that rotate. tp_plan="auto": the llama plan fits, since q_norm and k_norm work within one head and
each process holds whole heads.

Offers: Exaone4Config, Exaone4Attention, Exaone4DecoderLayer, Exaone4ForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuformers.layers.norm import RMSNorm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaForCausalLM
from gpuformers.models.olmo2 import Olmo2DecoderLayer
from gpuformers.models.qwen3 import Qwen3Attention


@dataclass
class Exaone4Config(ModelConfig):
    """EXAONE 4's defaults, sliding_window_pattern and the layer types it gives; its projections have no biases."""

    family_defaults = {"exaone4": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
                                   "eos_token_id": 2, "num_key_value_heads": 32, "sliding_window": 4096}}
    absent_fields = ("attention_bias", "mlp_bias", "use_sliding_window", "max_window_layers")

    sliding_window_pattern: int | str = 4  # every n-th layer global, or a string of L and G (module doc)

    def _check_family(self) -> None:
        super()._check_family()
        # transformers builds the projections without biases whatever config.json says, so the checkpoint has none
        self.attention_bias = self.mlp_bias = False

    def _fill_layer_types(self) -> None:
        if self.layer_types is None:
            self.layer_types = self._layer_types_from_pattern()
        # transformers' sliding-window mask needs the window, and would raise at the first forward
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null; set sliding_window")

    def _layer_types_from_pattern(self) -> list[str]:
        layers = self.num_hidden_layers
        if self.sliding_window is None:
            return ["full_attention"] * layers
        pattern = self.sliding_window_pattern
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            kinds = {"L": "sliding_attention", "G": "full_attention"}
            return [kinds[pattern[i % len(pattern)]] for i in range(layers - 1)] + ["full_attention"]
        raise ValueError(f"sliding_window_pattern {pattern!r} does not say which layers slide: give a positive "
                         f"integer n (every n-th layer is global), a string of L (sliding) and G (global) such as "
                         f"'LLLG', or layer_types")


class Exaone4Attention(Qwen3Attention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # A hybrid model (sliding_window set) rotates in its sliding layers only: the global ones are NoPE.
        self.use_rope = config.sliding_window is None or config.layer_types[layer_idx] == "sliding_attention"

    def position_qk(self, q, k, position_embeddings):
        if self.use_rope:
            return super().position_qk(q, k, position_embeddings)
        # NoPE: q/k norm only, (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
        q, k = self.project_qk(q, k)
        return q.transpose(1, 2), k.transpose(1, 2)


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_class = Exaone4Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # llama's RMSNorm, which casts back before the weight (OLMo 2's multiplies first): transformers' bfloat16
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Exaone4ForCausalLM(LlamaForCausalLM):
    config_class = Exaone4Config
    decoder_layer_class = Exaone4DecoderLayer
