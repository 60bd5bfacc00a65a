"""EleutherAI GPT-NeoX (Pythia, GPT-NeoX-20B) = the llama decoder with LayerNorms, one fused attention projection,
partial rotary, a GELU MLP and (by default) a parallel residual. Only those differences live here.

    sequential (use_parallel_residual=False):  h = h + attn(ln1(h));  h = h + mlp(ln2(h))
    parallel   (use_parallel_residual=True):   h = h + attn(ln1(h)) + mlp(ln2(h))      both norms read the same h
    attention.query_key_value  (hidden -> 3 * hidden, bias): per head (q, k, v) side by side,
                               i.e. the output is (heads, 3, head_dim), not llama's (3, heads, head_dim)
    rotary_pct (0.25)          rotary turns the first int(head_dim * rotary_pct) dims of each head; rotary_emb_base
                               is its theta (rope_parameters' partial_rotary_factor / rope_theta in new configs)
    mlp                        dense_4h_to_h(gelu(dense_h_to_4h(x))), both with bias; hidden_act gelu (exact) or a
                               tanh approximation (gelu_fast: GPT-NeoX-20B, gelu_new, gelu_pytorch_tanh)
    norms                      nn.LayerNorm with bias (layer_norm_eps); no multi-query heads (num_key_value_heads
                               and head_dim in config.json are ignored, as transformers ignores them)
    embed_out                  the untied LM head (tie_word_embeddings defaults to False)
    hidden_dropout             on the embeddings and on each branch output, in training only

Checkpoint names: the modules keep the llama names the rest of the library reads (model.embed_tokens, model.norm,
layers.*.self_attn, lm_head) and the checkpoint's leaf names (query_key_value, dense, dense_h_to_4h, dense_4h_to_h,
input_layernorm, post_attention_layernorm). The Hub's keys are renamed on load (checkpoint_fan_out rules, which the
heads in models/heads.py apply too) and back on save, so a saved folder has the Hub's layout:

    gpt_neox.embed_in            <-> model.embed_tokens
    gpt_neox.final_layer_norm    <-> model.norm
    gpt_neox.layers.*.attention  <-> model.layers.*.self_attn
    gpt_neox.layers.*            <-> model.layers.*
    embed_out                    <-> lm_head
    (a bare GPTNeoXModel's keys: the same without "gpt_neox.")

tp_plan="auto" (GPT_NEOX_TP_PLAN) splits query_key_value by rows: its per-head layout puts each head's q, k and v
in one run of rows, so an even split hands every process whole heads (transformers' plan for this model does the
same); dense and dense_4h_to_h are row-wise (their bias added once, after the sum), dense_h_to_4h column-wise.
use_kernels=True is exact: no kernel layer matches a LayerNorm or a GELU MLP, so only the rotary and loss kernels run.

Not supported: LoRA adapters saved by peft for GPT-NeoX name gpt_neox.* modules, which these modules are not called
(adapters trained here save and load here, under our names).

Offers: GPTNeoXConfig, GPTNeoXAttention, GPTNeoXMLP, GPTNeoXLayer, GPTNeoXModel, GPTNeoXForCausalLM,
GPT_NEOX_TP_PLAN, checkpoint_name, module_name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.rotary import apply_rotary_pos_emb, rotary_dim
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# hidden_act -> F.gelu's `approximate`: transformers' gelu is the exact (erf) one, the others its tanh form.
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_fast": "tanh", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

# Our parameter names -> the Hub's (the inverse of _rules() below); applied in order, each at most once per name.
_TO_CHECKPOINT = (
    (re.compile(r"^model\."), "gpt_neox."),
    (re.compile(r"^lm_head\."), "embed_out."),
    (re.compile(r"(^|\.)embed_tokens\."), r"\1embed_in."),
    (re.compile(r"(^|\.)norm\."), r"\1final_layer_norm."),
    (re.compile(r"\.self_attn\."), ".attention."),
)


def module_name(name: str) -> str:
    """Our parameter name -> transformers 5's module path for it, which peft's adapter keys and configs use: the
    checkpoint's names (checkpoint_name) but for the LM head, which is the module lm_head there (embed_out only in
    the checkpoint file)."""
    if name.startswith("lm_head."):
        return name
    return checkpoint_name(name)


def checkpoint_name(name: str) -> str:
    """Our parameter name -> the key the Hub's GPT-NeoX checkpoints use (model.layers.0.self_attn.dense.weight ->
    gpt_neox.layers.0.attention.dense.weight; a bare model's embed_tokens.weight -> embed_in.weight)."""
    for pattern, replacement in _TO_CHECKPOINT:
        name = pattern.sub(replacement, name, count=1)
    return name


GPT_NEOX_TP_PLAN = {
    "model.layers.*.self_attn.query_key_value": "colwise",
    "model.layers.*.self_attn.dense": "rowwise",
    "model.layers.*.mlp.dense_h_to_4h": "colwise",
    "model.layers.*.mlp.dense_4h_to_h": "rowwise",
}

# The Hub's module paths -> ours ("*": a layer number); each module's tensors (weight, bias) follow it.
_MODULES = (("embed_in", "embed_tokens"), ("final_layer_norm", "norm"),
            ("layers.*.attention.query_key_value", "layers.*.self_attn.query_key_value"),
            ("layers.*.attention.dense", "layers.*.self_attn.dense"),
            ("layers.*.mlp.dense_h_to_4h", "layers.*.mlp.dense_h_to_4h"),
            ("layers.*.mlp.dense_4h_to_h", "layers.*.mlp.dense_4h_to_h"),
            ("layers.*.input_layernorm", "layers.*.input_layernorm"),
            ("layers.*.post_attention_layernorm", "layers.*.post_attention_layernorm"))


def _rules() -> tuple[FanOut, ...]:
    """The Hub's keys -> ours, as one-target FanOut rules (renames): a causal LM's or classifier's keys
    (gpt_neox.*) and a bare model's (no prefix) alike. The embedding comes first: with tied embeddings it is the
    copy that is read. Old checkpoints' attention.bias / masked_bias / rotary_emb.inv_freq buffers match no rule
    and are reported as unexpected, as transformers skips them."""
    rules = [FanOut(f"{prefix}{hub}.*", (f"model.{ours}.*",))
             for prefix in ("gpt_neox.", "") for hub, ours in _MODULES if prefix or hub != ours]
    rules.append(FanOut("embed_out.*", ("lm_head.*",)))
    return tuple(rules)


@dataclass
class GPTNeoXConfig(ModelConfig):
    """GPT-NeoX's defaults and spelling (rotary_pct, rotary_emb_base), layer_norm_eps, use_parallel_residual and the
    dropouts; no sliding window, no grouped-query attention."""

    family_defaults = {"gpt_neox": {"hidden_act": "gelu", "max_position_embeddings": 2048, "bos_token_id": 0,
                                    "eos_token_id": 2, "attention_bias": True, "tie_word_embeddings": False}}
    partial_rotary = True
    absent_fields = ("num_key_value_heads", "head_dim", "rms_norm_eps", "mlp_bias", "sliding_window",
                     "use_sliding_window", "max_window_layers", "layer_types")

    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True  # module doc
    hidden_dropout: float = 0.0  # on the embeddings and each branch output, in training
    classifier_dropout: float = 0.1  # transformers' token-classification head's; no model here reads it

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        # transformers' GPTNeoXConfig: rope_parameters' own values win over rotary_pct / rotary_emb_base, and
        # rotary turns a quarter of each head when neither says otherwise.
        if "rotary_emb_base" in data:
            data.setdefault("rope_theta", data.pop("rotary_emb_base"))
        data.setdefault("partial_rotary_factor", data.pop("rotary_pct", 0.25))
        # Every head has its own k and v, of hidden_size / num_attention_heads dims, whatever config.json says.
        data.pop("num_key_value_heads", None)
        data.pop("head_dim", None)
        return data

    def _check_family(self) -> None:
        if self.hidden_act not in _GELU_APPROXIMATIONS:
            raise NotImplementedError(f"gpt_neox hidden_act {self.hidden_act!r} is not supported; supported: "
                                      f"{', '.join(_GELU_APPROXIMATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads}) in GPT-NeoX")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # transformers 4.x's GPTNeoXConfig reads rotary_pct and rotary_emb_base; 5.x reads rope_parameters.
        out["rotary_pct"] = self.rope_parameters.get("partial_rotary_factor", 1.0)
        out["rotary_emb_base"] = self.rope_theta
        return out


class GPTNeoXAttention(LlamaAttention):
    """Multi-head attention with one fused, per-head interleaved projection and partial rotary."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # The checkpoint holds one fused weight; the llama layer's projections go (on the meta device, where
        # from_pretrained builds, they never held memory).
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj
        hidden = config.hidden_size
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.dense = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.rotary_dim = rotary_dim(config)

    def position_qk(self, q, k, position_embeddings):
        # (batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim); cos/sin are (batch, seq, rotary_dim).
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rot = self.rotary_dim
        if rot == self.head_dim:
            return apply_rotary_pos_emb(q, k, *position_embeddings)
        # The slices are views: the rotary kernel (use_kernels, inference) may turn them in place, which the
        # concatenation below reads the same way.
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], *position_embeddings)
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        batch, seq, _ = hidden_states.shape
        query_key_value, dense = self.query_key_value, self.dense
        # (batch, seq, heads, 3 * head_dim): each head's q, k and v side by side. The heads are read from the
        # width, as the llama layer reads them.
        qkv = query_key_value(hidden_states).view(batch, seq, -1, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        return dense(self.attend(q, k, v, position_embeddings, attention_mask, past_key_values, cache_position))


class GPTNeoXMLP(nn.Module):
    """dense_4h_to_h(gelu(dense_h_to_4h(x))), with biases. No kernel_layer_name: no kernel computes this MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = _GELU_APPROXIMATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense_h_to_4h, dense_4h_to_h = self.dense_h_to_4h, self.dense_4h_to_h
        return dense_4h_to_h(F.gelu(dense_h_to_4h(x), approximate=self.approximate))


class GPTNeoXLayer(LlamaDecoderLayer):
    attention_class = GPTNeoXAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        eps = float(config.layer_norm_eps)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPTNeoXMLP(config)
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.hidden_dropout = float(config.hidden_dropout)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, post_norm, attn, mlp = self.input_layernorm, self.post_attention_layernorm, self.self_attn, self.mlp
        attn_out = self._dropout(attn(input_norm(hidden_states), position_embeddings, attention_mask,
                                      past_key_values, cache_position))
        if self.use_parallel_residual:
            # Both branches read the layer's input; summed in transformers' order (mlp, attention, residual).
            return self._dropout(mlp(post_norm(hidden_states))) + attn_out + hidden_states
        hidden_states = attn_out + hidden_states
        return self._dropout(mlp(post_norm(hidden_states))) + hidden_states

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout:
            return F.dropout(branch, self.hidden_dropout, training=True)
        return branch


class GPTNeoXModel(LlamaModel):
    """The llama stack with GPT-NeoX's embedding (no padding_idx, as transformers has none), final LayerNorm and
    embedding dropout."""

    def __init__(self, config: ModelConfig, layer_class=GPTNeoXLayer):
        super().__init__(config, layer_class)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=float(config.layer_norm_eps))
        self.hidden_dropout = float(config.hidden_dropout)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, output_hidden_states=False, cache_position=None):
        if self.training and self.hidden_dropout:
            # transformers drops out whatever embeddings enter the stack, passed-in ones included.
            if inputs_embeds is None and input_ids is not None:
                inputs_embeds, input_ids = self.embed(input_ids), None
            if inputs_embeds is not None:
                inputs_embeds = F.dropout(inputs_embeds, self.hidden_dropout, training=True)
        return super().forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                               output_hidden_states, cache_position)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    config_class = GPTNeoXConfig
    decoder_model_class = GPTNeoXModel
    decoder_layer_class = GPTNeoXLayer
    tp_plan_auto = GPT_NEOX_TP_PLAN
    checkpoint_fan_out = _rules()
    checkpoint_key = staticmethod(module_name)  # LoRA adapters are saved and read under transformers' module names

    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """As PreTrainedModel's, under the Hub's keys (module doc): what transformers and the Hub's GPT-NeoX
        checkpoints name gpt_neox.*, embed_out; the heads built on this class (GPTNeoXModel,
        GPTNeoXForSequenceClassification) save through here too. An adapter saves as PreTrainedModel's does."""
        from gpuformers.distributed import full_model_state_dict, is_main_process
        from gpuformers.tensor_parallel import is_tensor_parallel

        if self._hf_peft_config_loaded:
            return super().save_pretrained(save_directory, max_shard_size, state_dict)
        if state_dict is None and is_tensor_parallel(self):
            state_dict = full_model_state_dict(self)  # the slices gathered (a collective); process 0 writes
            if not is_main_process():
                return None
        state = self.state_dict() if state_dict is None else state_dict
        tied = self.tied_weights  # stored once, as the source
        renamed = {checkpoint_name(name): tensor for name, tensor in state.items() if name not in tied}
        return super().save_pretrained(save_directory, max_shard_size, renamed)
