"""ModelConfig: a decoder's `config.json`, read into one checked dataclass.

Every supported family (llama, mistral, qwen2, qwen3) is described by the same fields; the differences between
them are flags (`attention_bias`, `qk_norm`, sliding-window layers), so there is no table of models here.
Old and new spellings are both accepted and normalised:

    old: "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}, "torch_dtype": "bfloat16"
    new: "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2}, "dtype": "bfloat16"

Offers: ModelConfig (from_dict, from_pretrained, to_dict, save_pretrained), SUPPORTED_MODEL_TYPES, ROPE_TYPES.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "granite", "olmo2", "mixtral",
                         "phi3",
                         "gemma", "gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# Keys each rope type needs in rope_parameters, besides rope_theta.
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
}

# Per-family defaults where config.json may omit a field (the values transformers' config classes use).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
                "num_key_value_heads": 8},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28, "head_dim": 128},
    # Qwen3-MoE: head_dim defaults to hidden_size / heads; the MoE fields live in `extra` (read by qwen3_moe.py).
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                  "router_aux_loss_coef": 0.001},
    # Mixtral: Mistral's attention (no window unless sliding_window is set); the MoE fields live in `extra`.
    "mixtral": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    # SmolLM3: no_rope_layers (1 = rotary, 0 = NoPE) defaults to a NoPE layer every no_rope_layer_interval layers.
    "smollm3": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rope_theta": 2000000.0,
                "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004,
                "no_rope_layer_interval": 4},
    # Granite: the four scalars live in `extra` (read by granite.py).
    "granite": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048, "embedding_multiplier": 1.0,
                "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "pad_token_id": 1, "eos_token_id": 50279},
    # Phi-3: original_max_position_embeddings (longrope's pretraining length) and the dropouts live in `extra`.
    "phi3": {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    # Gemma, Gemma 2 and Gemma 3 (text): query_pre_attn_scalar, the soft-caps, hidden_activation and Gemma 3's
    # rope_local_base_freq live in `extra` (read by gemma.py); ModelConfig._check_gemma says what they mean.
    "gemma": {"vocab_size": 256000, "max_position_embeddings": 8192, "num_key_value_heads": 16, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
              "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256000, "max_position_embeddings": 8192, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0,
               "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072, "num_key_value_heads": 4,
                    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "sliding_window_pattern": 6},
}

_DEFAULT_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@dataclass
class ModelConfig:
    """A decoder-only causal LM's hyper-parameters, as in its `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    architectures: list[str] | None = None
    use_cache: bool = True
    initializer_range: float = 0.02
    # Keys we do not interpret, kept so that save_pretrained writes them back.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly in config.json"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type in ("gemma", "gemma2", "gemma3_text"):
            self._check_gemma()
        elif self.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")
        self._normalise_sliding_window()
        self._check_rope()

    # --- derived values -------------------------------------------------------------------------------------

    @property
    def qk_norm(self) -> bool:
        """Qwen3 (and Qwen3-MoE) normalise q and k per head before rotary."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases (and none on o_proj); the others follow attention_bias."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def rope_type(self) -> str:
        return self.rope_parameters["rope_type"]

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters["rope_theta"]

    @property
    def architecture(self) -> str:
        return (self.architectures or [_DEFAULT_ARCHITECTURE[self.model_type]])[0]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        if self.layer_types is None or self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    # --- normalisation --------------------------------------------------------------------------------------

    def _normalise_sliding_window(self):
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            # The window only applies when use_sliding_window is set, and then only from max_window_layers on.
            if not self.use_sliding_window:
                self.sliding_window = None
            if self.layer_types is None:
                first = self.max_window_layers if self.max_window_layers is not None else 0
                self.layer_types = [
                    "sliding_attention" if self.sliding_window is not None and i >= first else "full_attention"
                    for i in range(self.num_hidden_layers)
                ]
        elif self.model_type == "smollm3":
            self._normalise_smollm3_layers()
        elif self.model_type in ("mistral", "mixtral", "phi3"):
            self.layer_types = [
                "sliding_attention" if self.sliding_window is not None else "full_attention"
            ] * self.num_hidden_layers
        elif self.model_type in ("gemma2", "gemma3_text"):
            if self.layer_types is None:  # Gemma 2: every other layer slides; Gemma 3: five in every six
                every = 2 if self.model_type == "gemma2" else self.extra["sliding_window_pattern"]
                self.layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                                    for i in range(self.num_hidden_layers)]
        else:
            self.sliding_window = None
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} not supported; use full_attention or sliding_attention")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")

    def _normalise_smollm3_layers(self):
        """SmolLM3: no_rope_layers (in extra; 1 = the layer uses rotary, 0 = a NoPE layer) and layer_types, filled
        in as transformers does: with use_sliding_window, the NoPE layers are the sliding ones."""
        rope_layers = self.extra.get("no_rope_layers")
        if rope_layers is None:
            interval = self.extra["no_rope_layer_interval"]
            rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
            self.extra["no_rope_layers"] = rope_layers
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

    def _check_gemma(self):
        """The Gemma families' fields that change the numbers, as transformers reads them: Gemma's MLP activation is
        hidden_act (its original releases say "gelu", meaning the tanh approximation), Gemma 2's and 3's is
        hidden_activation; the bidirectional variant (EmbeddingGemma) is not a causal LM."""
        if self.model_type == "gemma" and self.hidden_act == "gelu":
            self.hidden_act = "gelu_pytorch_tanh"
        key = "hidden_act" if self.model_type == "gemma" else "hidden_activation"
        activation = self.hidden_act if self.model_type == "gemma" else self.extra[key]
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"{key} {activation!r} is not supported for {self.model_type}; supported: "
                                      f"gelu_pytorch_tanh, gelu")
        if self.extra.get("use_bidirectional_attention"):
            raise NotImplementedError(f"use_bidirectional_attention=True ({self.model_type}, as in EmbeddingGemma) is "
                                      f"not supported: gpuformers runs causal LMs; set it to false or null")

    def _check_rope(self):
        rope = dict(self.rope_parameters)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
        if self.model_type == "phi3":
            self._phi3_rope(rope)
        rope_type = rope["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}")
        if rope_type in ("llama3", "yarn", "longrope"):
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        missing = [k for k in _ROPE_REQUIRED[rope_type] if rope.get(k) is None]
        if rope_type == "yarn" and rope.get("factor") is None and "original_max_position_embeddings" in rope:
            missing = []
        if missing:
            raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters (or rope_scaling)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0 and self.model_type != "phi3":
            raise NotImplementedError(
                f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported by the llama-family decoder"
            )
        if rope_type == "longrope":
            half = int(self.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2  # over the rotated dims
            for key in ("long_factor", "short_factor"):
                if len(rope[key]) != half:
                    raise ValueError(f"rope_parameters.{key} must have rotary_dim/2 = {half} entries, got "
                                     f"{len(rope[key])}")
        self.rope_parameters = rope

    def _phi3_rope(self, rope: dict) -> None:
        """Phi-3's rope, normalised in place as transformers' Phi3Config does: "su" and "yarn" are its old names for
        longrope, only default and longrope exist, and the top-level original_max_position_embeddings (4096 when
        config.json omits it) wins over rope_parameters'."""
        if rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"
        if rope["rope_type"] not in ("default", "longrope"):
            raise ValueError(f"phi3 rope_type {rope['rope_type']!r} is not supported; Phi-3 has default and longrope")
        if rope["rope_type"] == "longrope":
            rope["original_max_position_embeddings"] = self.extra.get("original_max_position_embeddings", 4096)

    # --- reading and writing --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        model_type = data.get("model_type")
        if model_type is None:
            raise ValueError(
                f"config.json has no model_type; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if "num_local_experts" in data:  # transformers 5 writes Qwen3-MoE's num_experts under this name
            data.setdefault("num_experts", data["num_local_experts"])
        for key, value in _FAMILY_DEFAULTS[model_type].items():
            data.setdefault(key, value)
        if model_type == "mixtral":  # the MoE forward Mixtral shares with Qwen3-MoE reads num_experts
            data["num_experts"] = data["num_local_experts"]
        if model_type == "gemma3_text":
            data = _gemma3_rope(data)
        # Old spellings -> new.
        if "torch_dtype" in data:
            data.setdefault("dtype", data.pop("torch_dtype"))
        rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None) or {}
        data.pop("rope_scaling", None)
        rope = dict(rope)
        if "rope_theta" in data:
            rope.setdefault("rope_theta", data.pop("rope_theta"))
        if "partial_rotary_factor" in data:
            rope.setdefault("partial_rotary_factor", data.pop("partial_rotary_factor"))
        data["rope_parameters"] = rope
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        for required in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if required not in known:
                raise ValueError(f"config.json is missing the required field {required!r}")
        return cls(**known, extra=extra)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs) -> "ModelConfig":
        from gpuformers.hub import CONFIG_PATTERNS, HubKwargs, resolve_model_dir

        folder = resolve_model_dir(name_or_path, CONFIG_PATTERNS, HubKwargs(**hub_kwargs))
        return cls.from_file(folder / "config.json")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            present = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
            raise FileNotFoundError(
                f"no config.json in {path.parent} (found: {', '.join(present) or 'nothing'}); "
                f"a Hugging Face checkpoint folder needs config.json beside its weights"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); re-download or fix the file") from err
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict in the current (transformers 5) spelling, readable by transformers 4.5x too."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        out["architectures"] = [self.architecture]
        if self.model_type in ("llama", "mistral", "mixtral"):
            out.pop("use_sliding_window")
            out.pop("max_window_layers")
            out.pop("layer_types")
        if self.model_type == "llama":
            out.pop("sliding_window")
        if self.model_type == "mixtral":  # read as num_local_experts, its transformers name
            out.pop("num_experts")
        if self.model_type in ("granite", "olmo2"):  # fields their transformers configs do not have
            for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
                out.pop(key)
        if self.model_type == "smollm3":
            out.pop("max_window_layers")
        # transformers 4.x reads rope_theta at the top level and rope_scaling; 5.x reads rope_parameters.
        out["rope_theta"] = self.rope_theta
        if self.rope_type != "default":
            out["rope_scaling"] = dict(self.rope_parameters)
        if self.model_type in ("gemma", "gemma2", "gemma3_text"):  # fields their transformers configs do not have
            gemma_only = ("sliding_window", "layer_types") if self.model_type == "gemma" else ()
            for key in ("use_sliding_window", "max_window_layers") + gemma_only:
                out.pop(key)
        if self.model_type == "gemma3_text":  # transformers 5 reads one rope per layer type
            out["rope_parameters"] = {
                "full_attention": dict(self.rope_parameters),
                "sliding_attention": {"rope_type": "default", "rope_theta": self.extra["rope_local_base_freq"]},
            }
        if self.model_type == "phi3":
            for key in ("use_sliding_window", "max_window_layers", "layer_types"):
                out.pop(key)
            # Phi3Config reads partial_rotary_factor at the top level, and transformers 4.x takes a rope_scaling of
            # exactly type, short_factor and long_factor.
            out["partial_rotary_factor"] = self.rope_parameters.get("partial_rotary_factor", 1.0)
            if self.rope_type == "longrope":
                out["rope_scaling"] = {"type": "longrope", "short_factor": self.rope_parameters["short_factor"],
                                       "long_factor": self.rope_parameters["long_factor"]}
        return out

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _gemma3_rope(data: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 has one rope per layer type. transformers 5 writes rope_parameters = {"full_attention": {...},
    "sliding_attention": {...}}; older config.json files rope_theta and rope_scaling for the full-attention layers
    and rope_local_base_freq for the sliding ones. Either way -> rope_parameters: the full-attention layers' rope
    (checked as every family's), rope_local_base_freq: the sliding layers' base (their rope is the default one)."""
    rope = data.get("rope_parameters")
    if isinstance(rope, dict) and {"full_attention", "sliding_attention"} & set(rope):
        sliding = rope.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise NotImplementedError(f"Gemma 3 sliding-attention layers with rope_type {sliding['rope_type']!r} are "
                                      f"not supported; only the default rope (rope_theta) is")
        data["rope_parameters"] = dict(rope.get("full_attention") or {})
        if "rope_theta" in sliding:
            data["rope_local_base_freq"] = sliding["rope_theta"]
    return data
