"""TII Falcon-H1 (tiiuae/Falcon-H1-0.5B to -34B, base and instruct; model type `falcon_h1`): every layer runs an
attention and a Mamba2 mixer side by side on the same normed input, then a SwiGLU MLP, with muP multipliers
throughout. Only what differs from llama, Mamba2 and the Granite 4 stack (models/granitemoehybrid.py) lives here.

    input_ids -> embed_tokens * embedding_multiplier -> [FalconH1DecoderLayer x N] -> final_layernorm
              -> lm_head * lm_head_multiplier -> logits
    layer:  x = input_layernorm(h)
            h = h + mamba(x) * ssm_out_multiplier + self_attn(x * attention_in_multiplier) * attention_out_multiplier
            h = h + feed_forward(pre_ff_layernorm(h))
    mamba:  in_proj(x * ssm_in_multiplier) * mup_vector, the mup vector one multiplier per part of the projection
            (ssm_multipliers: gate z, x, B, C, dt); the width is mamba_d_ssm (or mamba_expand * hidden_size); after
            the scan y * silu(z), or with mamba_rms_norm a grouped RMSNorm, applied before the gate
            (mamba_norm_before_gate, the default: norm(y) * silu(z)) or after it (norm(y * silu(z))); in_proj's bias
            is mamba_proj_bias, out_proj's projectors_bias
    self_attn: llama's, keys times key_multiplier before rotary (rotary on every layer)
    feed_forward: down_proj(silu(gate_proj(x) * gate_mult) * up_proj(x)) * down_mult, mlp_multipliers = [gate_mult,
            down_mult]

Embeddings passed in (inputs_embeds) are not scaled, as transformers does. Checkpoint keys are transformers' (which
are the Hub's), kept as they are: model.embed_tokens, model.layers.{i}.{mamba, self_attn, feed_forward,
input_layernorm, pre_ff_layernorm}.*, model.final_layernorm, lm_head. The mup vector is computed from the config, not
stored. One RecurrentCache holds each layer's conv and SSM states and its keys and values.

Offers: FalconH1Config, FalconH1GatedNorm, FalconH1Mixer, FalconH1Attention, FalconH1MLP, FalconH1DecoderLayer,
FalconH1Model, FalconH1ForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.mamba2 import Mamba2Mixer
from gpuformers.layers.mlp import GatedMLP
from gpuformers.layers.norm import RMSNorm, add_rms_norm
from gpuformers.models.config import ModelConfig
from gpuformers.models.granitemoehybrid import GraniteMoeHybridModel, check_mamba_heads
from gpuformers.models.llama import LlamaAttention, LlamaForCausalLM
from gpuformers.models.mamba2 import RecurrentStateLM
from gpuformers.models.modeling import PreTrainedModel


@dataclass
class FalconH1Config(ModelConfig):
    """transformers' FalconH1Config fields with its defaults. mamba_d_head "auto" is read as the mixer's width
    (mamba_d_ssm, or mamba_expand * hidden_size when that is null) / mamba_n_heads, as transformers resolves it."""

    family_defaults = {"falcon_h1": {"vocab_size": 128000, "hidden_size": 4096, "intermediate_size": 14336,
                                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "rms_norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                     "max_position_embeddings": 8192}}
    required_fields = ()  # transformers has a default for every field
    # transformers' layer_types is a read-only alias of its layers_block_type (every layer "hybrid"): not written
    absent_fields = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

    num_logits_to_keep: int | None = 1
    mamba_d_ssm: int | None = 1024
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: list[float] = field(default_factory=lambda: [0.0, float("inf")])
    projectors_bias: bool = False
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: list[float] = field(default_factory=lambda: [1.0, 1.0])
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: list[float] = field(default_factory=lambda: [1.0] * 5)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0

    # every attention layer is rotary (the hybrid stack of models/granitemoehybrid.py reads this)
    position_embedding_type = "rope"

    @property
    def mamba_width(self) -> int:
        """The mixer's intermediate size: mamba_d_ssm, or mamba_expand * hidden_size when that is null."""
        return self.mamba_expand * self.hidden_size if self.mamba_d_ssm is None else self.mamba_d_ssm

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        data.pop("layers_block_type", None)  # ["hybrid"] * layers, whatever it says
        for name, default in (("mlp_multipliers", [1.0, 1.0]), ("ssm_multipliers", [1.0] * 5)):
            if data.get(name) is None:  # transformers' default for null
                data[name] = default
        if data.get("mamba_d_head", "auto") == "auto":
            width, heads = data.get("mamba_d_ssm", 1024), data.get("mamba_n_heads", 128)
            expand, hidden = data.get("mamba_expand", 2), data["hidden_size"]
            sizes = (heads, expand, hidden) if width is None else (heads, width)
            if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
                data["mamba_d_head"] = (expand * hidden if width is None else width) // heads
            else:
                data["mamba_d_head"] = 1  # bad sizes: the field checks say which
        return data

    def _check_family(self) -> None:
        super()._check_family()  # hidden_act silu: the MLP's and the mamba conv's
        check_mamba_heads(self, self.mamba_width, f"the mixer's width ({self.mamba_width}: mamba_d_ssm, or "
                                                  f"mamba_expand * hidden_size when it is null)")
        for name, count in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
            if len(getattr(self, name)) != count:
                raise ValueError(f"falcon_h1: {name} has {len(getattr(self, name))} entries; it must have {count}: "
                                 f"fix the file")


class FalconH1GatedNorm(nn.Module):
    """What follows the scan, y (batch, seq, width) and the gate z -> (batch, seq, width) in y's dtype: y * silu(z)
    without mamba_rms_norm (no weight, as transformers' nn.Identity), else an RMSNorm over groups of `group_size`
    channels in float32, times the weight, with the gate after it (norm_before_gate) or before it."""

    def __init__(self, width: int, group_size: int, eps: float, rms_norm: bool, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width)) if rms_norm else None
        self.group_size, self.variance_epsilon, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        y, silu_gate = hidden_states.float(), F.silu(gate.float())
        if self.weight is None:
            return (y * silu_gate).to(dtype)
        if not self.norm_before_gate:
            y = y * silu_gate
        groups = y.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        y = self.weight * normed.flatten(-2)
        return (y * silu_gate if self.norm_before_gate else y).to(dtype)


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with Falcon-H1's input multiplier and mup vector on in_proj (project_in), its own gate /
    norm after the scan and out_proj's bias from projectors_bias (module doc)."""

    def __init__(self, config: FalconH1Config, layer_idx: int):
        super().__init__(layer_idx, config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
                         config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv, config.mamba_chunk_size,
                         config.time_step_limit, config.mamba_proj_bias, config.mamba_conv_bias, config.rms_norm_eps)
        width = self.intermediate_size
        self.norm = FalconH1GatedNorm(width, width // self.n_groups, config.rms_norm_eps, config.mamba_rms_norm,
                                      config.mamba_norm_before_gate)
        self.out_proj = nn.Linear(width, config.hidden_size, bias=config.projectors_bias)
        self.ssm_in_multiplier = float(config.ssm_in_multiplier)
        self.ssm_multipliers = tuple(float(m) for m in config.ssm_multipliers)
        self.reset_buffers()

    def reset_buffers(self, device=None) -> None:
        """The mup vector (in_proj's width,): one multiplier per part [z | x | B | C | dt]; not in the checkpoint,
        so computed again after a model built on the meta device is loaded."""
        if device is None or torch.device(device).type == "meta":
            device = "cpu"
        group_state = self.n_groups * self.state_size
        sizes = (self.intermediate_size, self.intermediate_size, group_state, group_state, self.num_heads)
        vector = torch.cat([torch.full((n,), m, device=device) for n, m in zip(sizes, self.ssm_multipliers)])
        self.register_buffer("mup_vector", vector, persistent=False)

    def project_in(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected = self.in_proj(hidden_states * self.ssm_in_multiplier)
        return projected * self.mup_vector.to(projected.dtype)


class FalconH1Attention(LlamaAttention):
    """llama's attention with the keys times key_multiplier before rotary."""

    def __init__(self, config: FalconH1Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.key_multiplier = float(config.key_multiplier)

    def project_qk(self, q, k):
        return q, k * self.key_multiplier


class FalconH1MLP(GatedMLP):
    """The SwiGLU MLP with mlp_multipliers on the gate's input and the output; not the SwiGLU kernel's layer (no
    kernel_layer_name): the kernel would skip the multipliers."""

    kernel_layer_name = None

    def __init__(self, config: FalconH1Config):
        super().__init__(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        return down_proj(up_proj(x) * F.silu(gate_proj(x) * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """Attention and mamba side by side, then the MLP (module doc)."""

    def __init__(self, config: FalconH1Config, layer_idx: int):
        super().__init__()
        self.feed_forward = FalconH1MLP(config)
        self.mamba = FalconH1Mixer(config, layer_idx)
        self.self_attn = FalconH1Attention(config, layer_idx)
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.attention_out_multiplier = float(config.attention_out_multiplier)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, masks, cache, cache_position=None):
        # masks as the hybrid stack gives them: the 4-D causal one and the (batch, seq) padding mask
        normed = self.input_layernorm(hidden_states)
        mixed = self.mamba(normed, masks["linear_attention"], cache) * self.ssm_out_multiplier
        attended = self.self_attn(normed * self.attention_in_multiplier, position_embeddings, masks["full_attention"],
                                  cache, cache_position)
        normed, hidden_states = add_rms_norm(mixed + attended * self.attention_out_multiplier, hidden_states,
                                             self.pre_ff_layernorm)
        return hidden_states + self.feed_forward(normed)


class FalconH1Model(GraniteMoeHybridModel):
    """The hybrid stack of Granite 4 (its masks and loop) with Falcon-H1's layers, rotary on every layer, its final
    norm under transformers' name (final_layernorm), and embeddings passed in left unscaled."""

    scales_inputs_embeds = False

    def __init__(self, config: FalconH1Config, layer_class=FalconH1DecoderLayer):
        super().__init__(config, layer_class)
        self.final_layernorm = self._modules.pop("norm")

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(hidden_states)


class FalconH1ForCausalLM(RecurrentStateLM, LlamaForCausalLM):
    """llama's causal LM (logits times lm_head_multiplier, so never the fused head-and-loss) over the Falcon-H1
    stack, with the RecurrentCache and refusals of the mamba families (models/mamba2.py)."""

    config_class = FalconH1Config
    decoder_model_class = FalconH1Model
    decoder_layer_class = FalconH1DecoderLayer
    get_input_embeddings = LlamaForCausalLM.get_input_embeddings  # the stack's embed_tokens

    def __init__(self, config: FalconH1Config):
        super().__init__(config)
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) * self.lm_head_multiplier

    def prompt_length_error(self, prompt_length: int) -> str | None:
        return PreTrainedModel.prompt_length_error(self, prompt_length)  # rotary positions, as llama's
