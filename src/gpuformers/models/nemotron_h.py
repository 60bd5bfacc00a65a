"""NVIDIA Nemotron-H (nvidia/Nemotron-H-8B-Base-8K, -47B, NVIDIA-Nemotron-Nano-9B-v2, ...): a hybrid stack whose
layers are each one kind of block, as `layers_block_type` says (or the older `hybrid_override_pattern`, one letter
per layer: M mamba, * attention, - MLP, E MoE). Only what differs from the llama decoder and Mamba2 lives here.

    input_ids -> embeddings -> [NemotronHBlock x N] -> norm_f -> lm_head -> logits
    NemotronHBlock: h = h + mixer(norm(h)), the mixer one of
        "linear_attention"  the Mamba2 mixer (layers/mamba2.py), dt clamped below at time_step_min, as transformers
        "full_attention"    llama's GQA attention with no rotary and no biases (no positions anywhere in the model)
        "mlp"               down_proj(relu(up_proj(h))^2), not gated
        "moe"               routed experts (NemotronHRouter: sigmoid scores, a correction bias, group-limited top-k;
                            non-gated relu^2 experts, over a latent projection when moe_latent_size is set) plus a
                            shared expert (NVIDIA-Nemotron-3-Nano-30B-A3B)

Checkpoint keys are what transformers saves (backbone.embeddings, backbone.layers.{i}.norm / .mixer.*, the experts
one by one as mixer.experts.{e}.{up,down}_proj.weight, backbone.norm_f, lm_head: the Hub's layout; the bare model's
without "backbone."), which the model keeps. The RecurrentCache (generation/state_cache.py) holds the mamba layers'
conv and SSM states and the attention layers' keys and values. Not implemented: the multi-token-prediction layers
(their mtp.* weights are ignored, as transformers ignores them), router logits in the output
(output_router_logits). transformers' in-memory layout (model.* keys, each layer's experts fused in one tensor), which
its save_pretrained(save_original_format=False) writes, loads into the causal LM too (not into the bare model).

Offers: NemotronHConfig, NemotronHAttention, NemotronHMLP, NemotronHRouter, NemotronHMoE, NemotronHBlock,
NemotronHDecoder, NemotronHForCausalLM, transformers_module_name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuformers.layers.attention import build_attention_mask
from gpuformers.layers.mamba2 import Mamba2Mixer
from gpuformers.layers.moe import SparseMoeBlock
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.config import ModelConfig
from gpuformers.models.config_checks import ConfigFieldError
from gpuformers.models.llama import LlamaAttention
from gpuformers.models.mamba2 import MAMBA_MIXER_PARAMETERS, Mamba2Backbone, Mamba2ForCausalLM, backbone_renames
from gpuformers.models.olmo2 import Olmo2RMSNorm

# transformers' older names of the mamba settings (NemotronHConfig reads them as the new ones)
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
            "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
            "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
            "mamba_chunk_size": "chunk_size"}
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_ACTIVATIONS = {"relu2": lambda x: torch.relu(x).square(), "silu": nn.functional.silu, "relu": torch.relu}


@dataclass
class NemotronHConfig(ModelConfig):
    """transformers' NemotronHConfig fields with its defaults. num_hidden_layers is len(layers_block_type); the
    attention's head_dim / num_attention_heads / num_key_value_heads are ModelConfig's, the mamba heads'
    mamba_num_heads / mamba_head_dim. The multi-token-prediction fields are read and written back only."""

    family_defaults = {"nemotron_h": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
                                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                      "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1,
                                      "eos_token_id": 2}}
    required_fields = ()  # transformers has a default for every field
    absent_fields = ("num_hidden_layers", "hidden_act", "rms_norm_eps", "rope_parameters", "use_sliding_window",
                     "max_window_layers", "layer_types")

    layers_block_type: list[str] | None = None
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 128
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_limit: list[float] | tuple[float, float] = (0.0, float("inf"))  # not read: transformers' mixer neither
    time_step_floor: float = 1e-4
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_hidden_act: str = "silu"
    mamba_ssm_cache_dtype: str = "float32"
    use_mamba_kernels: bool = True
    mlp_hidden_act: str = "relu2"
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = False  # not read: transformers' block keeps the residual in the model dtype
    hidden_dropout: float = 0.0
    rescale_prenorm_residual: bool = True
    num_logits_to_keep: int = 1
    # the "moe" blocks' (n_shared_experts and moe_shared_expert_overlap are not read, as transformers does not), and
    # multi-token prediction (not implemented: module doc)
    n_routed_experts: int = 8
    output_router_logits: bool = False
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    moe_shared_expert_overlap: bool = True
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: list[str] | None = None

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        for old, new in _ALIASES.items():
            if old in data:
                data[new] = data.pop(old)
        # "layer_types" is transformers' other name for layers_block_type; the pattern string is the older form
        blocks = data.pop("layer_types", None) or data.get("layers_block_type")
        pattern = data.pop("hybrid_override_pattern", None)
        if blocks is None and isinstance(pattern, str):
            unknown = sorted(set(pattern) - set(_PATTERN))
            if unknown:
                raise ConfigFieldError(f"hybrid_override_pattern {pattern!r} has the letters {unknown}; each letter "
                                       f"must be one of M (mamba), * (attention), - (mlp), E (moe): fix the file")
            blocks = [_PATTERN[letter] for letter in pattern]
        if blocks is None:
            blocks = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise ConfigFieldError(f"layers_block_type is {blocks!r}; it must be a list of block types: fix the file")
        data["layers_block_type"] = [_LEGACY_TYPES.get(b, b) for b in blocks]
        data["num_hidden_layers"] = len(data["layers_block_type"])
        if data.get("mtp_layers_block_type") is None:
            data["mtp_layers_block_type"] = ["full_attention", "moe"]
        return data

    def _fill_layer_types(self) -> None:
        # Every attention block attends to the whole sequence (transformers' causal mask); sliding_window is kept only
        # to be written back.
        self.layer_types = ["full_attention"] * self.num_hidden_layers

    def _check_family(self) -> None:
        bad = sorted(set(self.layers_block_type) - {"linear_attention", "full_attention", "mlp", "moe"})
        if bad:
            raise ConfigFieldError(f"layers_block_type has the block types {bad}; each must be one of "
                                   f"linear_attention, full_attention, mlp, moe: fix the file")
        if "moe" in self.layers_block_type:
            per_group, rest = divmod(self.n_routed_experts, self.n_group)
            if rest or per_group < 2 or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"nemotron_h: n_routed_experts ({self.n_routed_experts}) must split into n_group "
                                 f"({self.n_group}) groups of at least 2 experts (a group scores by its best two), "
                                 f"and topk_group ({self.topk_group}) be between 1 and n_group: fix the file")
            if not 0 < self.num_experts_per_tok <= per_group * self.topk_group:
                raise ValueError(f"nemotron_h: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                 f"the experts of the topk_group chosen groups ({per_group * self.topk_group})")
        if self.mamba_hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"nemotron_h mamba_hidden_act {self.mamba_hidden_act!r} is not supported; "
                                      f"supported: silu")
        if self.mlp_hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"nemotron_h mlp_hidden_act {self.mlp_hidden_act!r} is not supported; "
                                      f"supported: {', '.join(_ACTIVATIONS)}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"nemotron_h: mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups "
                             f"({self.n_groups}): each group's B and C serve mamba_num_heads / n_groups heads")

    # transformers' Nemotron-H attention has no biases, whatever attention_bias says
    qkv_bias = False
    o_bias = False

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("rope_theta")  # no rotary
        out.pop("rope_scaling", None)
        return out


class NemotronHAttention(LlamaAttention):
    """llama's attention without rotary: q and k go to the backend as they are projected."""

    def position_qk(self, q, k, position_embeddings):
        # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim)
        return q.transpose(1, 2), k.transpose(1, 2)

    def forward(self, hidden_states, attention_mask, cache):
        return super().forward(hidden_states, None, attention_mask, cache)


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(h))), act = mlp_hidden_act (relu^2 by default); no gate, so no SwiGLU kernel. The "mlp"
    block's (hidden -> intermediate_size -> hidden), and the MoE block's experts and shared expert."""

    def __init__(self, config: NemotronHConfig, width: int | None = None, intermediate_size: int | None = None,
                 bias: bool | None = None):
        super().__init__()
        width, intermediate_size = width or config.hidden_size, intermediate_size or config.intermediate_size
        bias = config.mlp_bias if bias is None else bias
        self.up_proj = nn.Linear(width, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, width, bias=bias)
        self.act_fn = _ACTIVATIONS[config.mlp_hidden_act]

    def forward(self, hidden_states, attention_mask=None, cache=None):
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


class NemotronHRouter(nn.Module):
    """Sigmoid scores of n_routed_experts; the experts are chosen among the topk_group best of n_group groups (a
    group scored by its two best experts), by score + e_score_correction_bias, and weighted by their plain scores,
    renormalised with norm_topk_prob and times routed_scaling_factor (transformers' DeepSeek-V3-style router, in
    float32). Not an nn.Linear, so LoRA's "all-linear" and quantization leave it alone."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))  # a checkpoint tensor, not trained
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, float(config.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor):
        """(tokens, hidden) -> router logits (tokens, experts), weights (tokens, top_k) float32, expert ids."""
        logits = nn.functional.linear(hidden_states.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()  # (tokens, experts)
        grouped = choice.unflatten(-1, (self.n_group, -1))  # (tokens, groups, experts per group)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)  # (tokens, groups)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, experts


class NemotronHMoE(SparseMoeBlock):
    """The "moe" block: the routed experts (NemotronHMLP of moe_intermediate_size, not gated, over the latent
    projection fc1_latent_proj when moe_latent_size is set, back through fc2_latent_proj) plus a shared expert every
    token goes through. Keys mixer.gate.{weight, e_score_correction_bias}, mixer.experts.{e}.{up,down}_proj.weight,
    mixer.shared_experts.*, as transformers saves them. Not the fused MoE kernel's layer (no kernel_layer_name): its
    experts are not gated."""

    kernel_layer_name = None

    def __init__(self, config: NemotronHConfig):
        nn.Module.__init__(self)
        width = config.moe_latent_size or config.hidden_size  # the experts' input and output
        self.gate = NemotronHRouter(config)
        self.experts = nn.ModuleList(
            NemotronHMLP(config, width, config.moe_intermediate_size, bias=False)
            for _ in range(config.n_routed_experts))
        self.shared_experts = NemotronHMLP(config, config.hidden_size, config.moe_shared_expert_intermediate_size)
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, width, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def forward(self, hidden_states, attention_mask=None, cache=None):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, hidden)
        _, weights, experts = self.gate(x)
        routed = self.fc2_latent_proj(self.run_experts(self.fc1_latent_proj(x), weights, experts))
        return routed.view(shape) + self.shared_experts(hidden_states)


def _mamba_mixer(config: NemotronHConfig, layer_idx: int) -> Mamba2Mixer:
    # transformers' Nemotron-H mixer clamps dt to (time_step_min, inf), not to config.time_step_limit
    return Mamba2Mixer(layer_idx, config.hidden_size, config.mamba_num_heads, config.mamba_head_dim,
                       config.ssm_state_size, config.n_groups, config.conv_kernel, config.chunk_size,
                       (config.time_step_min, float("inf")), config.use_bias, config.use_conv_bias,
                       config.layer_norm_epsilon)


_MIXERS = {"linear_attention": _mamba_mixer, "full_attention": NemotronHAttention,
           "mlp": lambda config, layer_idx: NemotronHMLP(config),
           "moe": lambda config, layer_idx: NemotronHMoE(config)}


class NemotronHBlock(nn.Module):
    """norm -> the block type's mixer -> residual add. Every mixer takes (hidden, mask, cache): the mamba mixer a
    (batch, seq) padding mask, the attention the 4-D causal one, the MLP neither."""

    def __init__(self, config: NemotronHConfig, layer_idx: int):
        super().__init__()
        self.block_type = config.layers_block_type[layer_idx]
        self.norm = Olmo2RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)  # weight times, then cast
        self.mixer = _MIXERS[self.block_type](config, layer_idx)

    def forward(self, hidden_states, masks, cache):
        mixed = self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)), masks[self.block_type], cache)
        return hidden_states + mixed


class NemotronHDecoder(Mamba2Backbone):
    """Mamba2's stack with NemotronHBlocks, their norm, and a mask per block type."""

    norm_class = Olmo2RMSNorm

    def __init__(self, config: NemotronHConfig, layer_class=NemotronHBlock):
        super().__init__(config, layer_class)

    def layer_masks(self, attention_mask, seq, cache, device):
        past = cache.get_seq_length() if cache is not None else 0
        return {
            # attention: causal over past and new tokens, padding hidden (None: plain causal)
            "full_attention": build_attention_mask(attention_mask, seq, past + seq, past, None, device),
            "linear_attention": super().layer_masks(attention_mask, seq, cache, device),
            "mlp": None,
            "moe": None,
        }


def _checkpoint_renames() -> tuple[FanOut, ...]:
    """The Hub's layout (backbone.*, the experts one by one) to and from the bare model's (Mamba2's rules), and
    transformers' in-memory layout, which its save_pretrained(save_original_format=False) writes: model.* for
    backbone.*, each layer's experts fused in (experts, out, in) tensors mixer.experts.up_proj / down_proj."""
    attention = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlps = tuple(f"{module}{name}.{p}" for module in ("", "shared_experts.", "experts.*.")
                 for name in ("up_proj", "down_proj") for p in ("weight", "bias"))
    moe = tuple(f"{name}.{p}" for name in ("fc1_latent_proj", "fc2_latent_proj") for p in ("weight", "bias")) + (
        "gate.weight", "gate.e_score_correction_bias")
    params = MAMBA_MIXER_PARAMETERS + attention + mlps + moe
    renames = backbone_renames(params)
    in_memory = tuple(FanOut(f"model.{rule.targets[0].removeprefix('backbone.')}", rule.targets)
                      for rule in renames if rule.targets[0].startswith("backbone.") and "*.mixer.experts.*" not in
                      rule.source)
    # a fused tensor's row e is expert e's weight ("#"); for the causal LM only (a bare NemotronHModel does not load
    # this layout's fused experts)
    fused = tuple(FanOut(f"model.layers.*.mixer.experts.{name}", (f"backbone.layers.*.mixer.experts.#.{name}.weight",))
                  for name in ("up_proj", "down_proj"))
    return renames + in_memory + fused


def transformers_module_name(name: str) -> str:
    """Our parameter name -> transformers' in-memory one, which peft's adapter keys and configs use: transformers
    loads the checkpoint's backbone.* as model.* (backbone.layers.0.mixer.in_proj -> model.layers.0.mixer.in_proj)."""
    return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name


class NemotronHForCausalLM(Mamba2ForCausalLM):
    """Mamba2's causal LM (the stack as `backbone`, as transformers saves Nemotron-H; its RecurrentCache and
    refusals) over the hybrid stack."""

    config_class = NemotronHConfig
    decoder_model_class = NemotronHDecoder
    decoder_layer_class = NemotronHBlock
    ties_head = False  # transformers' Nemotron-H never ties lm_head, whatever tie_word_embeddings says
    checkpoint_key = staticmethod(transformers_module_name)  # LoRA adapters under transformers' (and peft's) names
    checkpoint_fan_out = _checkpoint_renames()
