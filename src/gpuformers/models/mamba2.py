"""Mamba2 (state-spaces/mamba2-*, mistralai/Mamba-Codestral-7B and other `Mamba2ForCausalLM` checkpoints): a stack of
Mamba2 mixers with no attention, no positions and no MLP. Only what differs from the llama decoder lives here; the
mixer is layers/mamba2.py, its scan layers/ssd.py, its cache generation/state_cache.py.

    input_ids -> embeddings -> [Mamba2Block x N] -> norm_f -> lm_head -> logits
    Mamba2Block: h = h + mixer(norm(h)), the residual kept in float32 with residual_in_fp32 (the default)

Module names are transformers' (backbone.embeddings, backbone.layers.{i}.norm / .mixer.*, backbone.norm_f, lm_head);
the bare model (Mamba2Model) holds embeddings, layers, norm_f, and each layout loads into the other through rename
rules (checkpoint_fan_out), as do the old mamba_ssm checkpoints' `backbone.embedding.weight`. `model` is the stack
under its llama name, so the llama forward, logits and loss (fused with the head in training) run unchanged.

generate() fills a RecurrentCache (make_cache): greedy, sampling and beam search; assisted decoding, a static cache,
the compiled decode step, the continuous-batching engine and tp_plan="auto" are refused with NotImplementedError.
Position ids are accepted and ignored (a state-space model has no positions): a packed batch (several documents per
row) runs as one sequence per row, its state flowing across the document boundaries.

Offers: Mamba2Config, Mamba2Block, Mamba2Backbone, RecurrentStateLM, Mamba2ForCausalLM, backbone_renames,
MAMBA_MIXER_PARAMETERS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuformers.generation.state_cache import RecurrentCache
from gpuformers.layers.mamba2 import Mamba2Mixer
from gpuformers.layers.norm import RMSNorm
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaForCausalLM
from gpuformers.models.modeling import PreTrainedModel


@dataclass
class Mamba2Config(ModelConfig):
    """transformers' Mamba2Config fields with its defaults. head_dim is the SSM heads' size (num_heads * head_dim =
    expand * hidden_size); intermediate_size is derived (expand * hidden_size) and not written back."""

    family_defaults = {"mamba2": {"vocab_size": 32768, "hidden_size": 4096, "num_hidden_layers": 64, "head_dim": 64,
                                  "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "initializer_range": 0.1}}
    required_fields = ("vocab_size", "hidden_size", "num_hidden_layers")
    absent_fields = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                     "rms_norm_eps", "attention_bias", "mlp_bias", "attention_dropout", "rope_parameters",
                     "sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

    num_heads: int = 128
    state_size: int = 128
    expand: int = 2
    conv_kernel: int = 4
    n_groups: int = 8
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    time_step_limit: list[float] | tuple[float, float] = (0.0, float("inf"))
    # initialisation only (from_config's random weights); read and written back
    time_step_rank: str | int = "auto"
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    rescale_prenorm_residual: bool = False

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        expand, hidden = data.get("expand", 2), data["hidden_size"]
        # the mixer's width; a bad expand or hidden_size is reported by the field checks, not here
        valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (expand, hidden))
        data["intermediate_size"] = expand * hidden if valid else 1
        if data.get("time_step_rank", "auto") == "auto" and valid:  # transformers resolves it so, and writes that
            data["time_step_rank"] = math.ceil(hidden / 16)
        return data

    def _derive_attention_shapes(self) -> None:
        """No attention: nothing to derive, and attention sizes a config.json carries anyway (written by a generic
        tool) are not read, nor written back."""
        self.num_attention_heads = self.num_key_value_heads = None

    def _normalise_sliding_window(self) -> None:
        self.sliding_window, self.layer_types = None, None

    def _check_family(self) -> None:
        if self.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"mamba2 hidden_act {self.hidden_act!r} is not supported; supported: silu")
        if self.expand * self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(f"mamba2: hidden_size * expand ({self.hidden_size} * {self.expand}) must equal num_heads "
                             f"* head_dim ({self.num_heads} * {self.head_dim}), as transformers requires: fix the file")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba2: num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups}): "
                             f"each group's B and C serve num_heads / n_groups heads")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("rope_theta")  # no rotary
        out.pop("rope_scaling", None)
        return out


class Mamba2Block(nn.Module):
    """norm -> mixer -> residual add (module doc)."""

    def __init__(self, config: Mamba2Config, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            layer_idx, config.hidden_size, config.num_heads, config.head_dim, config.state_size, config.n_groups,
            config.conv_kernel, config.chunk_size, config.time_step_limit, config.use_bias, config.use_conv_bias,
            config.layer_norm_epsilon)

    def forward(self, hidden_states, attention_mask, cache):
        # hidden_states (batch, seq, hidden): float32 between blocks with residual_in_fp32, as in transformers
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        mixed = self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)), attention_mask, cache)
        return residual + mixed


class Mamba2Backbone(nn.Module):
    """The stack without the LM head: input_ids -> final hidden states (batch, seq, hidden), in the model's dtype.
    Called as the llama stack is (LlamaModel.forward's arguments); positions and cache_position are not read.
    A hybrid family's stack is this one with its own norm class and layer_masks."""

    norm_class = RMSNorm

    def __init__(self, config: Mamba2Config, layer_class=Mamba2Block):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = self.norm_class(config.hidden_size, eps=config.layer_norm_epsilon)

    def layer_masks(self, attention_mask: torch.Tensor | None, seq: int, cache, device: torch.device):
        """What every layer gets as its mask: here the (batch, seq) padding mask of the new tokens (generate()
        passes one over past and new tokens), which the mixers zero, or None."""
        return attention_mask[:, -seq:] if attention_mask is not None else None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, output_hidden_states=False, cache_position=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embeddings(input_ids)
        masks = self.layer_masks(attention_mask, inputs_embeds.shape[1], past_key_values, inputs_embeds.device)
        hidden_states = inputs_embeds
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, masks, past_key_values)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        hidden_states = self.norm_f(hidden_states).to(inputs_embeds.dtype)
        if output_hidden_states:
            all_hidden[-1] = hidden_states
        return hidden_states, all_hidden


# The mixer's parameters, as named in a layer (layers.{i}.mixer.*)
MAMBA_MIXER_PARAMETERS = ("dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias", "in_proj.weight", "in_proj.bias",
                          "norm.weight", "out_proj.weight", "out_proj.bias")


def backbone_renames(mixer_parameters: tuple[str, ...]) -> tuple[FanOut, ...]:
    """Rules between the causal LM's keys (backbone.*) and the bare model's (no prefix), both ways, for a stack of
    embeddings, layers.{i}.norm, layers.{i}.mixer.<mixer_parameters> and norm_f; and mamba_ssm's old name of the
    embeddings (transformers' Mamba2Model load hook renames it too). A rule applies only to a key the model lacks."""
    names = ["embeddings.weight", "norm_f.weight", "layers.*.norm.weight",
             *(f"layers.*.mixer.{name}" for name in mixer_parameters)]
    return (*(FanOut(name, (f"backbone.{name}",)) for name in names),
            *(FanOut(f"backbone.{name}", (name,)) for name in names),
            FanOut("backbone.embedding.weight", ("backbone.embeddings.weight",)),
            FanOut("embedding.weight", ("embeddings.weight",)))


class RecurrentStateLM:
    """What the causal LMs with mamba layers share (Mamba2, the hybrid families), before LlamaForCausalLM in their
    bases: a RecurrentCache, no rollback, no positions to run out of, and what is not implemented for them."""

    tp_plan_auto = None  # no plan splits the mixer's heads yet
    is_stateful = True  # generation: a RecurrentCache, no rollback; the engine refuses it
    supports_compiled_decode = False  # the decode step reads a Python branch (scan or step) and new state tensors

    def make_cache(self) -> RecurrentCache:
        return RecurrentCache()

    def prompt_length_error(self, prompt_length: int) -> str | None:
        return None  # no rotary positions: no length limit to check

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


class Mamba2ForCausalLM(RecurrentStateLM, LlamaForCausalLM):
    """The stack as `backbone` (transformers' name and keys) and the LM head (module doc)."""

    config_class = Mamba2Config
    decoder_model_class = Mamba2Backbone
    decoder_layer_class = Mamba2Block
    checkpoint_fan_out = backbone_renames(MAMBA_MIXER_PARAMETERS)
    position_limit = None  # no positions: generate() caps no length at max_position_embeddings
    # Whether tie_word_embeddings ties lm_head to the embeddings (a family whose transformers class never ties, as
    # Nemotron-H's, says no: its lm_head is its own tensor in every checkpoint)
    ties_head = True

    def __init__(self, config: Mamba2Config):
        from gpuformers.models.heads import BaseModelHead

        PreTrainedModel.__init__(self, config)
        stack = self.decoder_model_class(config, self.decoder_layer_class)
        # The bare model (heads.BaseModelHead) takes the stack from "model" and keeps its modules as its own
        # (embeddings, layers, norm_f: Mamba2Model's keys); the causal LM holds it as transformers does.
        self.add_module("model" if isinstance(self, BaseModelHead) else "backbone", stack)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.ties_head and config.tie_word_embeddings:
            self.lm_head.weight = stack.embeddings.weight

    @property
    def model(self) -> Mamba2Backbone:
        return self.backbone

    @property
    def embed_tokens(self) -> nn.Embedding:
        """embeddings under the llama name, which the bare model's get_input_embeddings reads."""
        modules = self._modules
        return modules["embeddings"] if "embeddings" in modules else modules["backbone"].embeddings

    @property
    def tied_weights(self) -> dict[str, str]:
        tied = self.ties_head and self.config.tie_word_embeddings
        return {"lm_head.weight": "backbone.embeddings.weight"} if tied else {}

