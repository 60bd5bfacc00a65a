"""The checks of a ModelConfig's numbers: every numeric config.json field a model reads, its type and its range, in
one table, so that a bad value fails when the config is read, with a message naming the file, the field, the value
and the fix, instead of deep inside the first forward (`rms_norm_eps: null` in layers/norm.py, `rope_theta: "x"`
in layers/rotary.py) or never (`max_position_embeddings: -5`).

What is accepted is what transformers' config classes accept where a model can use it: an integer field takes an
int (a bool is not one, nor is 4096.0); a float field takes an int or a float (`rope_theta: 10000`), finite; null
only where transformers' field is optional and gpuformers reads null as "unset" (`sliding_window`, `head_dim`,
`clip_qkv`, ...). A field absent from config.json takes the family's default, which passes; a key of the table that
the family's config class has no field for is checked only where config.json has it (it is kept in `extra`).

Offers: ConfigFieldError, check_fields, NUMERIC_FIELDS, TOP_LEVEL_FIELDS, ROPE_KEYS.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ConfigFieldError(ValueError):
    """A config field whose value no model can use; `source` is the file it came from (ModelConfig.from_file sets
    the path), printed first."""

    def __init__(self, detail: str, source: str = "config.json"):
        super().__init__(detail)
        self.detail, self.source = detail, source

    def __str__(self) -> str:
        return f"{self.source}: {self.detail}"


@dataclass(frozen=True)
class _Rule:
    """What a field may hold, as the message says it, and the test of one (non-null) value."""

    what: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not a layer count


def _is_number(value: Any) -> bool:
    # NaN and Infinity parse from JSON (Python's json reads them) and would poison every logit
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


_POSITIVE_INT = _Rule("a positive integer", lambda v: _is_int(v) and v > 0)
_NON_NEGATIVE_INT = _Rule("a non-negative integer", lambda v: _is_int(v) and v >= 0)
_POSITIVE = _Rule("a positive number", lambda v: _is_number(v) and v > 0)
_NON_NEGATIVE = _Rule("a non-negative number", lambda v: _is_number(v) and v >= 0)
_UNIT = _Rule("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1)  # dropouts, init std
_FRACTION = _Rule("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1)
_TOKEN_ID = _Rule("an integer", _is_int)  # no range: published configs hold pad_token_id -1, as transformers allows
_TOKEN_IDS = _Rule("an integer or a list of integers",
                   lambda v: _is_int(v) or (isinstance(v, list) and bool(v) and all(map(_is_int, v))))
_POSITIVE_LIST = _Rule("a list of positive numbers",
                       lambda v: isinstance(v, list) and all(_is_number(x) and x > 0 for x in v))
# Mamba2's clamp of its step sizes: [low, high], 0 <= low <= high, high may be Infinity (no upper clamp)
_DT_LIMIT = _Rule("a list [low, high] of numbers with 0 <= low <= high (high may be Infinity)",
                  lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                  and all((_is_int(x) or isinstance(x, float)) and not math.isnan(x) for x in v)
                  and 0 <= v[0] <= v[1] and math.isfinite(v[0]))
# EXAONE 4 also spells the pattern as a string of L and G, which its config class checks itself, and transformers
# writes 0 there for a model without sliding layers
_PATTERN = _Rule("a non-negative integer", lambda v: isinstance(v, str) or (_is_int(v) and v >= 0))

# field -> (rule, whether null is accepted). Looked up among the dataclass fields (a family's own included) and
# `extra` (the config.json keys no field names), and, for the rope keys, in rope_parameters once it is normalised.
NUMERIC_FIELDS: dict[str, tuple[_Rule, bool]] = {
    # shapes
    "vocab_size": (_POSITIVE_INT, False),
    "hidden_size": (_POSITIVE_INT, False),
    "intermediate_size": (_POSITIVE_INT, False),
    "num_hidden_layers": (_POSITIVE_INT, False),
    "num_attention_heads": (_POSITIVE_INT, True),  # null: an attention-free family (ModelConfig.required_fields)
    "num_key_value_heads": (_POSITIVE_INT, True),  # null: one k/v head per query head
    "head_dim": (_POSITIVE_INT, True),  # null: hidden_size / num_attention_heads
    "max_position_embeddings": (_POSITIVE_INT, False),
    # 0 is what transformers writes for "no window" when use_sliding_window is off; a window in use must be > 0,
    # which ModelConfig checks once the layer types are known
    "sliding_window": (_NON_NEGATIVE_INT, True),
    "max_window_layers": (_NON_NEGATIVE_INT, True),
    "sliding_window_pattern": (_PATTERN, False),
    "original_max_position_embeddings": (_POSITIVE_INT, True),
    # norms and scalars
    "rms_norm_eps": (_POSITIVE, False),
    "layer_norm_eps": (_POSITIVE, False),
    "layer_norm_epsilon": (_POSITIVE, False),
    "initializer_range": (_UNIT, False),
    "query_pre_attn_scalar": (_POSITIVE, False),
    "attn_logit_softcapping": (_POSITIVE, True),  # null: no soft-cap
    "final_logit_softcapping": (_POSITIVE, True),
    "clip_qkv": (_POSITIVE, True),  # null: no clipping
    "attention_multiplier": (_POSITIVE, False),
    "embedding_multiplier": (_POSITIVE, False),
    "residual_multiplier": (_POSITIVE, False),
    "logits_scaling": (_POSITIVE, False),
    "swiglu_alpha": (_POSITIVE, False),
    "swiglu_limit": (_POSITIVE, False),
    # dropouts (training only, but nn.Dropout and SDPA refuse anything outside [0, 1])
    "attention_dropout": (_UNIT, False),
    "attn_pdrop": (_UNIT, False),
    "resid_pdrop": (_UNIT, False),
    "embd_pdrop": (_UNIT, False),
    "hidden_dropout": (_UNIT, False),
    "residual_dropout": (_UNIT, False),
    "embedding_dropout": (_UNIT, False),
    # mixture of experts
    "num_local_experts": (_NON_NEGATIVE_INT, False),  # Mixtral's and gpt-oss's num_experts; 0: dense Granite 4
    "num_experts": (_NON_NEGATIVE_INT, False),  # 0: Qwen-MoE's config for a dense model
    "num_experts_per_tok": (_POSITIVE_INT, False),
    "moe_intermediate_size": (_POSITIVE_INT, False),
    "shared_expert_intermediate_size": (_POSITIVE_INT, False),
    "decoder_sparse_step": (_POSITIVE_INT, False),
    "router_aux_loss_coef": (_NON_NEGATIVE, False),
    "n_routed_experts": (_POSITIVE_INT, False),  # Nemotron-H's MoE blocks
    "n_group": (_POSITIVE_INT, False),
    "topk_group": (_POSITIVE_INT, False),
    "moe_shared_expert_intermediate_size": (_POSITIVE_INT, False),
    "moe_latent_size": (_POSITIVE_INT, True),  # null: the experts work at hidden_size
    "routed_scaling_factor": (_POSITIVE, False),
    "router_jitter_noise": (_NON_NEGATIVE, False),
    "no_rope_layer_interval": (_POSITIVE_INT, False),
    # state-space (Mamba2) mixers, also in the hybrid families
    "num_heads": (_POSITIVE_INT, False),
    "state_size": (_POSITIVE_INT, False),
    "expand": (_POSITIVE_INT, False),
    "conv_kernel": (_POSITIVE_INT, False),
    "n_groups": (_POSITIVE_INT, False),
    "chunk_size": (_POSITIVE_INT, False),
    "time_step_min": (_POSITIVE, False),
    "time_step_max": (_POSITIVE, False),
    "time_step_floor": (_NON_NEGATIVE, False),
    "time_step_limit": (_DT_LIMIT, False),
    "mamba_num_heads": (_POSITIVE_INT, False),  # a hybrid's (Nemotron-H's) mamba sizes
    "mamba_head_dim": (_POSITIVE_INT, False),
    "ssm_state_size": (_POSITIVE_INT, False),
    "mamba_n_heads": (_POSITIVE_INT, False),  # Granite 4's (granitemoehybrid) mamba sizes
    "mamba_n_groups": (_POSITIVE_INT, False),
    "mamba_d_state": (_POSITIVE_INT, False),
    "mamba_d_head": (_POSITIVE_INT, False),  # "auto" is resolved before the check
    "mamba_d_conv": (_POSITIVE_INT, False),
    "mamba_expand": (_POSITIVE_INT, False),
    "mamba_chunk_size": (_POSITIVE_INT, False),
    "shared_intermediate_size": (_POSITIVE_INT, False),
    "mamba_d_ssm": (_POSITIVE_INT, True),  # Falcon-H1's mixer width; null: mamba_expand * hidden_size
    "lm_head_multiplier": (_POSITIVE, False),  # Falcon-H1's muP multipliers
    "key_multiplier": (_POSITIVE, False),
    "attention_in_multiplier": (_POSITIVE, False),
    "attention_out_multiplier": (_POSITIVE, False),
    "ssm_in_multiplier": (_POSITIVE, False),
    "ssm_out_multiplier": (_POSITIVE, False),
    "mlp_multipliers": (_POSITIVE_LIST, True),  # null: all 1 (transformers' default)
    "ssm_multipliers": (_POSITIVE_LIST, True),
    # special tokens
    "bos_token_id": (_TOKEN_ID, True),
    "pad_token_id": (_TOKEN_ID, True),
    "eos_token_id": (_TOKEN_IDS, True),
    # rope: rope_parameters' keys (rope_theta and partial_rotary_factor are also top-level keys in config.json).
    # Null reads as absent, as layers/rotary.py reads it; a key the rope type needs is checked as missing first.
    "rope_theta": (_POSITIVE, False),
    "rope_local_base_freq": (_POSITIVE, False),  # Gemma 3's sliding layers' theta
    "partial_rotary_factor": (_FRACTION, False),
    "factor": (_POSITIVE, True),
    "low_freq_factor": (_POSITIVE, True),
    "high_freq_factor": (_POSITIVE, True),
    "attention_factor": (_POSITIVE, True),
    "beta_fast": (_NON_NEGATIVE, True),  # 0 and null: the default (32 / 1), as rotary.py reads them
    "beta_slow": (_NON_NEGATIVE, True),
    "mscale": (_NON_NEGATIVE, True),
    "mscale_all_dim": (_NON_NEGATIVE, True),
    "long_factor": (_POSITIVE_LIST, True),
    "short_factor": (_POSITIVE_LIST, True),
    "llama_4_scaling_beta": (_NON_NEGATIVE, True),
}

# The keys read from rope_parameters; the others are top-level fields (the dataclass's or `extra`'s), as is
# original_max_position_embeddings (Phi-3's). rope_theta and partial_rotary_factor are top-level in most files, so
# the message names them without "rope_parameters.".
ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "long_factor", "short_factor", "llama_4_scaling_beta")
TOP_LEVEL_FIELDS = tuple(name for name in NUMERIC_FIELDS
                         if name not in ROPE_KEYS or name == "original_max_position_embeddings")
_TOP_LEVEL_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_fields(values: Mapping[str, Any], names, *, defaults: Mapping[str, Any], spelling: Mapping[str, str],
                 prefix: str = "") -> None:
    """Raise ConfigFieldError for the first of `names` present in `values` whose value its rule refuses.

    defaults: the value transformers uses for a field config.json leaves out (quoted as the fix);
    spelling: our field name -> config.json's, where the family spells it differently (GPT-2's n_positions);
    prefix: how the message names the dict the key is in ("rope_parameters." for the rope keys)."""
    for name in names:
        if name not in values:
            continue
        value = values[name]
        rule, nullable = NUMERIC_FIELDS[name]
        if (value is None and nullable) or (value is not None and rule.accepts(value)):
            continue
        shown = "null" if value is None else _as_json(value)
        what = rule.what + (" or null" if nullable else "")
        default = defaults.get(name)
        hint = f" (transformers' default is {_as_json(default)})" if default is not None else ""
        field = spelling.get(name, name if name in _TOP_LEVEL_ROPE_KEYS else prefix + name)
        raise ConfigFieldError(f"{field} is {shown}; it must be {what}{hint}: fix the file")
