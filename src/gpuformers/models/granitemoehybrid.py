"""IBM Granite 4.0 (ibm-granite/granite-4.0-h-tiny, -h-small, -h-micro, -micro: model type `granitemoehybrid`): Granite
3's decoder (models/granite.py: its four multipliers) whose layers are each a mamba or an attention layer, as
`layer_types` says, followed by a shared-expert MoE. Only what differs from Granite 3, llama and Mamba2 lives here.

    input_ids -> embed_tokens * embedding_multiplier -> [GraniteMoeHybridDecoderLayer x N] -> norm
              -> lm_head / logits_scaling -> logits
    layer:  h = h + mixer(input_layernorm(h)) * residual_multiplier
            mixer: "linear_attention" the Mamba2 mixer (layers/mamba2.py) as `mamba`, its sizes from the mamba_*
                   fields; "full_attention" llama's attention as `self_attn`, scores scaled by attention_multiplier,
                   rotary when position_embedding_type is "rope", no positions at all when it is "nope" (the released
                   checkpoints) or null (the default). The Hub's files name the blocks "mamba" and "attention", read
                   as transformers remaps them
            h = h + (moe(x) + shared_mlp(x)) * residual_multiplier,   x = post_attention_layernorm(h)
            moe: a router (top num_experts_per_tok logits, softmax over those alone) over num_local_experts gated
                 SiLU experts; none when num_local_experts is 0 (a dense model: the shared MLP alone)

Checkpoint keys are the Hub's, which transformers' save_pretrained writes too, and the model keeps them: model.layers.
{i}.mamba.* or .self_attn.*, .block_sparse_moe.input_linear.weight (experts, 2 * intermediate, hidden: gate rows then
up rows), .block_sparse_moe.output_linear.weight (experts, hidden, intermediate), .block_sparse_moe.router.layer.weight
(experts, hidden), .shared_mlp.input_linear.weight (2 * shared_intermediate, hidden), .shared_mlp.output_linear.weight.
The experts stay fused (one tensor per layer, as saved); transformers' in-memory names (experts.gate_up_proj, ...,
router.weight) load through rename rules. The cache is Mamba2's RecurrentCache (conv and SSM states, and the attention
layers' keys and values). Not implemented: router logits and the auxiliary loss (output_router_logits: refused by the
config), the fused MoE kernel (the experts run one after the other, as transformers' eager experts).

Offers: GraniteMoeHybridConfig, check_mamba_heads, GraniteMoeHybridAttention, GraniteMoeHybridMoE, GraniteMoeHybridMLP,
GraniteMoeHybridDecoderLayer, GraniteMoeHybridModel, GraniteMoeHybridForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.attention import build_attention_mask
from gpuformers.layers.mamba2 import Mamba2Mixer
from gpuformers.layers.norm import RMSNorm, add_rms_norm
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.config import ModelConfig
from gpuformers.models.config_checks import ConfigFieldError
from gpuformers.models.granite import GraniteAttention, GraniteForCausalLM, GraniteModel
from gpuformers.models.llama import LlamaForCausalLM
from gpuformers.models.mamba2 import RecurrentStateLM
from gpuformers.models.modeling import PreTrainedModel

_BLOCKS = ("linear_attention", "full_attention")
_LEGACY_BLOCKS = {"mamba": "linear_attention", "attention": "full_attention"}  # the released checkpoints' names


@dataclass
class GraniteMoeHybridConfig(ModelConfig):
    """transformers' GraniteMoeHybridConfig fields with its defaults. layer_types holds each layer's block
    ("linear_attention": mamba, "full_attention"; transformers also calls it layers_block_type), all mamba by
    default; mamba_d_head "auto" is read as mamba_expand * hidden_size / mamba_n_heads, as transformers resolves it."""

    family_defaults = {"granitemoehybrid": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                                            "num_hidden_layers": 32, "num_attention_heads": 32, "bos_token_id": 1,
                                            "eos_token_id": 2}}
    required_fields = ()  # transformers has a default for every field
    absent_fields = ("head_dim", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers")

    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list[float] = field(default_factory=lambda: [0.0, float("inf")])

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        data.pop("head_dim", None)  # transformers' attention uses hidden_size / num_attention_heads, whatever it says
        blocks = data.pop("layers_block_type", None)  # transformers' other name
        if data.get("layer_types") is None:
            data["layer_types"] = blocks or ["linear_attention"] * data["num_hidden_layers"]
        if isinstance(data["layer_types"], list):  # the Hub's files say "mamba" / "attention", as transformers remaps
            data["layer_types"] = [_LEGACY_BLOCKS.get(b, b) if isinstance(b, str) else b for b in data["layer_types"]]
        if data.get("mamba_d_head", "auto") == "auto":
            expand, hidden, heads = data.get("mamba_expand", 2), data["hidden_size"], data.get("mamba_n_heads", 128)
            valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (expand, hidden, heads))
            data["mamba_d_head"] = expand * hidden // heads if valid else 1  # bad sizes: the field checks say so
        return data

    def _normalise_sliding_window(self) -> None:
        # layer_types are the blocks here (no sliding windows: layer_sliding_window is None for every layer)
        self.sliding_window = None
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers:
            raise ConfigFieldError(f"layer_types is {self.layer_types!r}; it must list one block type per layer "
                                   f"({self.num_hidden_layers}): fix the file")
        bad = sorted(set(self.layer_types) - set(_BLOCKS))
        if bad:
            raise ConfigFieldError(f"layer_types has the block types {bad}; each must be one of "
                                   f"{', '.join(_BLOCKS)}: fix the file")

    def _check_family(self) -> None:
        super()._check_family()  # hidden_act silu: the experts', the shared MLP's and the mamba conv's
        if self.position_embedding_type not in (None, "nope", "rope"):
            raise NotImplementedError(f"granitemoehybrid position_embedding_type {self.position_embedding_type!r} is "
                                      f"not supported; supported: \"rope\", \"nope\" or null (no positions)")
        if self.output_router_logits:
            raise NotImplementedError("granitemoehybrid output_router_logits=true (router logits and the auxiliary "
                                      "load-balancing loss) is not implemented; set it to false")
        check_mamba_heads(self, self.mamba_expand * self.hidden_size,
                          f"mamba_expand * hidden_size ({self.mamba_expand} * {self.hidden_size})")
        if self.num_local_experts and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"granitemoehybrid: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                             f"and num_local_experts ({self.num_local_experts})")


def check_mamba_heads(config: ModelConfig, width: int, width_text: str) -> None:
    """The mamba_* head sizes (Granite 4's and Falcon-H1's spelling) against the mixer's width: mamba_n_heads *
    mamba_d_head must be it, and mamba_n_groups must divide the heads."""
    heads, head_dim, groups = config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups
    if heads * head_dim != width:
        raise ValueError(f"{config.model_type}: mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must equal "
                         f"{width_text}, as transformers requires: fix the file")
    if heads % groups:
        raise ValueError(f"{config.model_type}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups "
                         f"({groups}): each group's B and C serve mamba_n_heads / mamba_n_groups heads")


class GraniteMoeHybridAttention(GraniteAttention):
    """Granite 3's attention (attention_multiplier as the scale), with rotary only when the model has positions
    (position_embeddings None: q and k go to the backend as projected)."""

    def position_qk(self, q, k, position_embeddings):
        if position_embeddings is None:  # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
            return q.transpose(1, 2), k.transpose(1, 2)
        return super().position_qk(q, k, position_embeddings)


class GraniteMoeHybridMLP(nn.Module):
    """The shared expert: output_linear(silu(gate) * up), [gate | up] = input_linear(x) (one Linear of 2 * width)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(hidden_states).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class _ExpertWeights(nn.Module):
    """One (experts, out, in) weight under `<name>.weight`, the checkpoint's key; not an nn.Linear, so LoRA's
    "all-linear" and quantization leave the router and the fused experts alone, as they do transformers'."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class GraniteMoeHybridMoE(nn.Module):
    """The routed experts (module doc): router.layer (experts, hidden); the experts fused as saved, input_linear
    (experts, 2 * intermediate, hidden) and output_linear (experts, hidden, intermediate)."""

    syncs_host = True  # forward reads the routed experts on the host (layers/moe.py: no CUDA graph)

    def __init__(self, config: GraniteMoeHybridConfig):
        super().__init__()
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = _ExpertWeights(experts, hidden)
        self.input_linear = _ExpertWeights(experts, 2 * inter, hidden)
        self.output_linear = _ExpertWeights(experts, hidden, inter)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, hidden)
        logits = F.linear(x, self.router.layer.weight).float()  # (tokens, experts)
        top_logits, experts = logits.topk(self.top_k, dim=-1)  # (tokens, top_k)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)  # over the chosen experts alone
        out = torch.zeros_like(x)
        # the experts that got tokens (a host sync, as in transformers), in expert order
        for expert in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)


class GraniteMoeHybridDecoderLayer(nn.Module):
    """Module doc: the mixer (`mamba` or `self_attn`, by layer_types), then the MoE and the shared MLP, each branch
    times residual_multiplier before its residual add."""

    def __init__(self, config: GraniteMoeHybridConfig, layer_idx: int):
        super().__init__()
        self.block_type = config.layer_types[layer_idx]
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.block_type == "linear_attention":
            self.mamba = Mamba2Mixer(
                layer_idx, config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state,
                config.mamba_n_groups, config.mamba_d_conv, config.mamba_chunk_size, config.time_step_limit,
                config.mamba_proj_bias, config.mamba_conv_bias, config.rms_norm_eps)
        else:
            self.self_attn = GraniteMoeHybridAttention(config, layer_idx)
        self.block_sparse_moe = GraniteMoeHybridMoE(config) if config.num_local_experts else None
        self.shared_mlp = GraniteMoeHybridMLP(config.hidden_size, config.shared_intermediate_size)

    def forward(self, hidden_states, position_embeddings, masks, cache, cache_position=None):
        normed = self.input_layernorm(hidden_states)
        if self.block_type == "linear_attention":
            mixed = self.mamba(normed, masks["linear_attention"], cache)
        else:
            mixed = self.self_attn(normed, position_embeddings, masks["full_attention"], cache, cache_position)
        normed, hidden_states = add_rms_norm(mixed * self.residual_multiplier, hidden_states,
                                             self.post_attention_layernorm)
        out = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(normed) + out
        return hidden_states + out * self.residual_multiplier


class GraniteMoeHybridModel(GraniteModel):
    """Granite 3's stack (embed_tokens, layers, norm; embeddings scaled) with the hybrid layers: each layer gets
    masks {"full_attention": the 4-D causal mask, "linear_attention": the (batch, seq) padding mask of the new
    tokens}; rotary only with position_embedding_type "rope". Falcon-H1's stack is this one with its hooks
    (use_rope, scales_inputs_embeds, final_norm)."""

    scales_inputs_embeds = True  # embeddings passed in are scaled too, as transformers' Granite does

    def __init__(self, config: GraniteMoeHybridConfig, layer_class=GraniteMoeHybridDecoderLayer):
        super().__init__(config, layer_class)
        self.use_rope = config.position_embedding_type == "rope"

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, output_hidden_states=False, cache_position=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            hidden_states = self.embed(input_ids)
        else:
            hidden_states = inputs_embeds * self.embedding_multiplier if self.scales_inputs_embeds else inputs_embeds
        batch, seq, _ = hidden_states.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        masks = {"full_attention": build_attention_mask(attention_mask, seq, past + seq, past, None,
                                                        hidden_states.device),
                 "linear_attention": attention_mask[:, -seq:] if attention_mask is not None else None}
        position_embeddings = None
        if self.use_rope:
            if position_ids is None:  # cache positions; generate() passes padding-aware ones
                position_ids = torch.arange(past, past + seq, device=hidden_states.device)[None].expand(batch, -1)
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, masks, past_key_values, cache_position)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden[-1] = hidden_states
        return hidden_states, all_hidden


def _in_memory_renames() -> tuple[FanOut, ...]:
    """transformers' in-memory names (what its save_pretrained(save_original_format=False) writes) -> the Hub's."""
    moe = "model.layers.*.block_sparse_moe"
    return (FanOut(f"{moe}.experts.gate_up_proj", (f"{moe}.input_linear.weight",)),
            FanOut(f"{moe}.experts.down_proj", (f"{moe}.output_linear.weight",)),
            FanOut(f"{moe}.router.weight", (f"{moe}.router.layer.weight",)))


class GraniteMoeHybridForCausalLM(RecurrentStateLM, GraniteForCausalLM):
    """Granite 3's causal LM (lm_head / logits_scaling, never the fused head-and-loss) over the hybrid stack, with
    the RecurrentCache and refusals of the mamba families (models/mamba2.py)."""

    config_class = GraniteMoeHybridConfig
    decoder_model_class = GraniteMoeHybridModel
    decoder_layer_class = GraniteMoeHybridDecoderLayer
    checkpoint_fan_out = _in_memory_renames()
    get_input_embeddings = LlamaForCausalLM.get_input_embeddings  # the stack's embed_tokens

    @property
    def position_limit(self) -> int | None:
        # rotary positions as llama's; none at all without them
        return self.config.max_position_embeddings if self.config.position_embedding_type == "rope" else None

    def prompt_length_error(self, prompt_length: int) -> str | None:
        if self.config.position_embedding_type == "rope":
            return PreTrainedModel.prompt_length_error(self, prompt_length)
        return None
