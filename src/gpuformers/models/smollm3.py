"""SmolLM3 = the llama decoder with rotary left out on some layers (NoPE). Only that difference lives here.

config.json's `no_rope_layers` holds one flag per layer, in transformers' convention: 1 = the layer rotates q and k,
0 = a NoPE layer that attends without positions (by default every fourth layer; SmolLM3Config fills the list in,
and with use_sliding_window those NoPE layers are the sliding-window ones).

Offers: SmolLM3Config, SmolLM3Attention, SmolLM3DecoderLayer, SmolLM3ForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class SmolLM3Config(ModelConfig):
    """no_rope_layers filled in from no_rope_layer_interval, and the layer types that follow from it."""

    family_defaults = {"smollm3": {"max_position_embeddings": 32768, "num_key_value_heads": 4,
                                   "rope_theta": 2000000.0, "tie_word_embeddings": True, "bos_token_id": 128000,
                                   "eos_token_id": 128001, "pad_token_id": 128004}}
    absent_fields = ("max_window_layers",)

    no_rope_layers: list[int] | None = None  # one 0/1 per layer (1: rotary); None: from no_rope_layer_interval
    no_rope_layer_interval: int = 4  # every n-th layer is NoPE

    def _fill_layer_types(self) -> None:
        """As transformers does: a NoPE layer every no_rope_layer_interval layers unless no_rope_layers says
        otherwise, and with use_sliding_window the NoPE layers are the sliding ones."""
        rope_layers = self.no_rope_layers
        if rope_layers is None:
            interval = self.no_rope_layer_interval
            rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
            self.no_rope_layers = rope_layers
        if len(rope_layers) < self.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(rope_layers)} entries but num_hidden_layers is "
                             f"{self.num_hidden_layers}; give one 0/1 per layer (1 = the layer uses rotary)")
        if self.layer_types is None:
            slide = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = ["sliding_attention" if slide and not rope_layers[i] else "full_attention"
                                for i in range(self.num_hidden_layers)]
        # transformers' masks slide on every "sliding_attention" layer, whatever use_sliding_window says.
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null; set sliding_window")



class SmolLM3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.use_rope = bool(config.no_rope_layers[layer_idx])

    def position_qk(self, q, k, position_embeddings):
        if self.use_rope:
            return super().position_qk(q, k, position_embeddings)
        # NoPE: (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim), positions come from the mask alone
        return q.transpose(1, 2), k.transpose(1, 2)


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_class = SmolLM3Attention


class SmolLM3ForCausalLM(LlamaForCausalLM):
    config_class = SmolLM3Config
    decoder_layer_class = SmolLM3DecoderLayer
