"""OpenAI GPT-2 (gpt2, distilgpt2 and the many GPT-2-shaped checkpoints): a pre-norm decoder with learned absolute
positions, LayerNorm with bias, one fused q/k/v projection and a non-gated GELU MLP. Only what differs from the llama
decoder lives here.

    input_ids -> wte(ids) + wpe(position_ids) -> dropout -> [GPT2Block x n_layer] -> ln_f -> lm_head -> logits
    GPT2Block: h = h + attn(ln_1(h)); h = h + mlp(ln_2(h))
    attn:      c_attn (hidden -> 3 hidden: q, k, v), no rotary, scores * 1/sqrt(head_dim) (scale_attn_weights)
    mlp:       c_proj(act(c_fc(h))), act = activation_function (gelu_new: GELU, tanh approximation)

Positions come from position_ids, which every caller passes per token (generate()'s padding-aware ones, the engine's
per-sequence ones), so wpe is added where the stack starts its layers, after `embed` (the token embedding alone).
The projections are transformers' Conv1D: their weights are stored (in_features, out_features), the transpose of an
nn.Linear's, and kept so (GPT2Conv1D), so a Hub checkpoint loads as it is and save_pretrained writes what
transformers reads. Module names are transformers' (transformer.h.{i}.attn.c_attn, ...); a checkpoint saved by the
bare GPT2Model (openai-community/gpt2's own file: h.{i}..., wte, no "transformer.") loads through rename rules, in
both directions (checkpoint_fan_out). `model` is the stack under its llama name, for the engine and the heads.

tp_plan="auto" (GPT2_TP_PLAN): c_attn "packed_colwise" (its q | k | v outputs are split one by one, so each process
gets its own heads of each), attn.c_proj and mlp.c_proj row-wise (their bias added once, after the sum), mlp.c_fc
column-wise. tensor_parallel.py splits a Conv1D along its (in, out) weight's other dims (fan_in_fan_out).
transformers' own GPT-2 plan (base_model_tp_plan) is empty: it does not split GPT-2.

Not supported, refused by name: scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, add_cross_attention,
activations other than those in ACTIVATIONS.

Offers: GPT2Config, GPT2Conv1D, GPT2Attention, GPT2MLP, GPT2Block, GPT2Decoder, GPT2LMHeadModel, GPT2_TP_PLAN,
ACTIVATIONS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.attention import AttentionInterface
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaForCausalLM, LlamaModel
from gpuformers.models.modeling import PreTrainedModel

# activation_function -> the function; gelu_new and gelu_fast are transformers' names for the tanh approximation
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# GPT-2's config.json spelling -> ModelConfig's
_RENAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_positions": "max_position_embeddings", "activation_function": "hidden_act"}
# GPT2Config options that change the math in ways this file does not implement
_REFUSED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
# tp_plan="auto" (module doc); the bare GPT2Model's modules (h.*, no "transformer.") are not split, as for llama
GPT2_TP_PLAN = {
    "transformer.h.*.attn.c_attn": "packed_colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}


@dataclass
class GPT2Config(ModelConfig):
    """GPT-2's field names, read into ModelConfig's (n_embd -> hidden_size, ...; intermediate_size is n_inner, or
    4 * n_embd when null) and written back in GPT-2's; and GPT-2's own fields, with GPT2Config's defaults."""

    family_defaults = {"gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                                "activation_function": "gelu_new", "bos_token_id": 50256, "eos_token_id": 50256,
                                "tie_word_embeddings": True}}
    absent_fields = ("intermediate_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias",
                     "mlp_bias", "attention_dropout", "rope_parameters", "sliding_window", "use_sliding_window",
                     "max_window_layers", "layer_types")
    field_spelling = {name: gpt2_name for gpt2_name, name in _RENAMES.items()} | {"intermediate_size": "n_inner"}

    n_inner: int | None = None  # the MLP's width as config.json says it (intermediate_size: as used)
    layer_norm_epsilon: float = 1e-5
    resid_pdrop: float = 0.1  # dropouts, in training only
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    scale_attn_weights: bool = True  # scores * 1/sqrt(head_dim)
    # _REFUSED: not implemented, so only false loads
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    add_cross_attention: bool = False

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        # GPT2Config also takes the common names (its attribute_map): those win over the defaults
        for gpt2_name, name in _RENAMES.items():
            if name in data and gpt2_name not in data:
                data[gpt2_name] = data.pop(name)
        data = super()._prepare_dict(data)
        for gpt2_name, name in _RENAMES.items():
            data[name] = data.pop(gpt2_name)
        inner = data.get("n_inner")
        data["intermediate_size"] = inner if inner is not None else 4 * data["hidden_size"]
        data.pop("num_key_value_heads", None)  # GPT-2 has one k/v head per query head
        return data

    def _check_family(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"gpt2 activation_function {self.hidden_act!r} is not supported; supported: "
                                      f"{', '.join(ACTIVATIONS)}")
        for name in _REFUSED:
            if getattr(self, name):
                raise NotImplementedError(f"gpt2 {name}=True is not supported by gpuformers; only checkpoints with "
                                          f"{name}=false load")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"gpt2 has no grouped-query attention: num_key_value_heads "
                             f"({self.num_key_value_heads}) must equal n_head ({self.num_attention_heads})")

    def _fill_layer_types(self) -> None:
        self.sliding_window = None
        self.layer_types = ["full_attention"] * self.num_hidden_layers

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("rope_theta")  # GPT-2 has no rotary
        out.pop("rope_scaling", None)
        for gpt2_name, name in _RENAMES.items():
            out[gpt2_name] = out.pop(name)
        return out


class GPT2Conv1D(nn.Module):
    """transformers' Conv1D: x @ weight + bias, with the weight stored (in_features, out_features), the checkpoint's
    layout (an nn.Linear holds its transpose). LoRA wraps it as a linear layer (peft's fan_in_fan_out); tensor
    parallelism splits the weight's other dims; quantization transposes it into a Linear's quantized layer.
    packed_parts: how many equal outputs the layer concatenates (3 for c_attn: q | k | v), which "packed_colwise"
    splits one by one."""

    fan_in_fan_out = True  # lora/layers.py, tensor_parallel.py, quantization/config.py: the weight is (in, out)

    def __init__(self, in_features: int, out_features: int, std: float = 0.02, packed_parts: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.packed_parts = in_features, out_features, packed_parts
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=std)  # what from_config draws; from_pretrained overwrites it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (tokens, in) @ (in, out) + bias -> (..., out): one addmm, as transformers computes it
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _projection_std(config: ModelConfig) -> float:
    """transformers' GPT-2 initialisation of the c_proj layers, which add into the residual stream: scaled down by
    sqrt(2 * n_layer)."""
    return config.initializer_range / math.sqrt(2 * config.num_hidden_layers)


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        self.attention_dropout = float(config.attn_pdrop)
        self.resid_pdrop = float(config.resid_pdrop)
        self.sliding_window = None
        hidden = config.hidden_size
        self.c_attn = GPT2Conv1D(hidden, 3 * hidden, std=config.initializer_range, packed_parts=3)
        self.c_proj = GPT2Conv1D(hidden, hidden, std=_projection_std(config))
        self.attention_fn = AttentionInterface.get("sdpa")

    def forward(self, hidden_states, attention_mask, past_key_values, cache_position=None):
        batch, seq, _ = hidden_states.shape
        c_attn, c_proj = self.c_attn, self.c_proj
        # (batch, seq, 3 hidden) -> q, k, v each (batch, heads, seq, head_dim); heads from the width: under tensor
        # parallelism c_attn gives this process's share of the heads
        q, k, v = c_attn(hidden_states).view(batch, seq, 3, -1, self.head_dim).transpose(1, 3).unbind(2)
        if past_key_values is not None:
            k, v = past_key_values.update(self.layer_idx, k, v, cache_position)
        out, _ = self.attention_fn(self, q, k, v, attention_mask, scaling=self.scaling,
                                   dropout=self.attention_dropout, sliding_window=None)
        return F.dropout(c_proj(out.reshape(batch, seq, -1)), self.resid_pdrop, self.training)


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(h))): not gated, so no kernel_layer_name (the SwiGLU kernel would compute another thing)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = GPT2Conv1D(config.hidden_size, config.intermediate_size, std=config.initializer_range)
        self.c_proj = GPT2Conv1D(config.intermediate_size, config.hidden_size, std=_projection_std(config))
        self.act = ACTIVATIONS[config.hidden_act]
        self.resid_pdrop = float(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_fc, c_proj = self.c_fc, self.c_proj
        return F.dropout(c_proj(self.act(c_fc(x))), self.resid_pdrop, self.training)


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        eps = float(config.layer_norm_epsilon)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states, attention_mask, past_key_values, cache_position=None):
        ln_1, attn, ln_2, mlp = self.ln_1, self.attn, self.ln_2, self.mlp
        hidden_states = hidden_states + attn(ln_1(hidden_states), attention_mask, past_key_values, cache_position)
        return hidden_states + mlp(ln_2(hidden_states))


class GPT2Decoder(LlamaModel):
    """transformers' GPT2Model under its module names (wte, wpe, h, ln_f); the llama stack's forward builds the
    masks and positions, `_run_layers` adds the position embeddings and runs the blocks."""

    def __init__(self, config: ModelConfig, layer_class=GPT2Block):
        nn.Module.__init__(self)  # none of the llama stack's modules: GPT-2 names its own
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        # a module, not a flag read off the stack: the bare model shares the stack's modules but not the stack
        # itself, and train() / eval() reach only the modules
        self.drop = nn.Dropout(float(config.embd_pdrop))
        self.h = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=float(config.layer_norm_epsilon))
        self._windows = [None]  # every layer attends to the whole sequence

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings; the position embeddings join in _run_layers, where position_ids are known."""
        return self.wte(input_ids)

    def _run_layers(self, inputs_embeds, position_ids, masks, past_key_values, cache_position, output_hidden_states):
        # position_ids (batch or 1, seq): absolute positions, the row's own (left padding shifts them, as in
        # transformers' generate; the engine gives each sequence its own)
        hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))
        all_hidden = [hidden_states] if output_hidden_states else None
        mask = masks[None]
        for layer in self.h:
            hidden_states = layer(hidden_states, mask, past_key_values, cache_position)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        hidden_states = self.ln_f(hidden_states)
        if output_hidden_states:
            all_hidden[-1] = hidden_states
        return hidden_states, all_hidden


def _checkpoint_renames() -> tuple[FanOut, ...]:
    """Rename rules between the two key layouts GPT-2 checkpoints come in: transformers' GPT2LMHeadModel (and
    GPT2ForSequenceClassification) save "transformer.h.0.attn.c_attn.weight", the bare GPT2Model (and the Hub's
    openai-community/gpt2 file) "h.0.attn.c_attn.weight". The loader uses a rule only for a key the model lacks, so
    each model takes the other layout's keys through one direction."""
    layer = [f"{module}.{p}" for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
             for p in ("weight", "bias")]
    names = [f"h.*.{name}" for name in layer] + ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    return (*(FanOut(name, (f"transformer.{name}",)) for name in names),
            *(FanOut(f"transformer.{name}", (name,)) for name in names))


class GPT2LMHeadModel(LlamaForCausalLM):
    """The stack as `transformer` (transformers' name and keys) and the LM head, tied to wte by default. The llama
    forward, logits and loss run unchanged: they call the stack as `self.model`, which is `transformer` here."""

    config_class = GPT2Config
    decoder_model_class = GPT2Decoder
    decoder_layer_class = GPT2Block
    tp_plan_auto = GPT2_TP_PLAN
    checkpoint_fan_out = _checkpoint_renames()

    def __init__(self, config: ModelConfig):
        from gpuformers.models.heads import BaseModelHead

        PreTrainedModel.__init__(self, config)
        stack = self.decoder_model_class(config, self.decoder_layer_class)
        # The bare model (heads.BaseModelHead) takes the stack from "model" and keeps its modules as its own (wte,
        # h, ...: GPT2Model's keys); the causal LM and the classifier hold it as transformers does.
        self.add_module("model" if isinstance(self, BaseModelHead) else "transformer", stack)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = stack.wte.weight

    @property
    def model(self) -> GPT2Decoder:
        return self.transformer

    @property
    def learned_positions(self) -> int:
        return self.transformer.wpe.num_embeddings

    @property
    def embed_tokens(self) -> nn.Embedding:
        """wte under the llama name, which the bare model's get_input_embeddings reads."""
        modules = self._modules
        return modules["wte"] if "wte" in modules else modules["transformer"].wte

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "transformer.wte.weight"} if self.config.tie_word_embeddings else {}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte
