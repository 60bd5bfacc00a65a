"""ModelConfig: a decoder's `config.json`, read into one checked dataclass.

The llama-family core (llama, mistral, qwen2, qwen3) is described by these fields alone; the differences between
them are flags (`attention_bias`, `qk_norm`, sliding-window layers), so there is no table of models here. A family
with more to say subclasses ModelConfig beside its model (GemmaConfig in models/gemma.py) and holds only that: its
settings, as typed dataclass fields with the defaults of its transformers config class (Gemma 2's
query_pre_attn_scalar = 256), the defaults it changes for ModelConfig's own fields (family_defaults), how it
prepares the raw dict, its checks and layer types, its rope, its to_dict. `ModelConfig.from_dict` returns the class
that models/registry.py names for the model_type, imported then and not before; the keys no field of that class
names stay in `extra`, and to_dict writes them back as they came.
Old and new spellings are both accepted and normalised:

    old: "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}, "torch_dtype": "bfloat16"
    new: "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2}, "dtype": "bfloat16"

Every numeric field a model reads is type- and range-checked when the config is read (the table is in
config_checks.py); a bad one raises ConfigFieldError naming the file, the field, the value and the fix.

Offers: ModelConfig (from_dict, from_pretrained, to_dict, save_pretrained; the hooks family_defaults, _prepare_dict,
_check_family, _derive_attention_shapes, _fill_layer_types, _normalise_rope, partial_rotary, field_spelling,
required_fields), SUPPORTED_MODEL_TYPES,
ROPE_TYPES, ConfigFieldError.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gpuformers.models.config_checks import ROPE_KEYS, TOP_LEVEL_FIELDS, ConfigFieldError, check_fields
from gpuformers.models.registry import MODEL_TYPES, config_class_for, default_architecture

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
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


@dataclass
class ModelConfig:
    """A decoder-only causal LM's hyper-parameters, as in its `config.json`."""

    # model_type -> the values its transformers config class uses for ModelConfig's own fields where config.json
    # omits them (a family's own fields carry their defaults on the subclass).
    family_defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "llama": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
        "mistral": {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096 * 32,
                    "sliding_window": 4096, "num_key_value_heads": 8},
        "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                  "max_window_layers": 28},
        "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                  "max_window_layers": 28, "head_dim": 128},
    }
    # Whether the family's attention rotates only part of each head (rope_parameters.partial_rotary_factor < 1).
    partial_rotary: ClassVar[bool] = False
    # Fields of this dataclass that the family's transformers config class does not have: to_dict leaves them out.
    absent_fields: ClassVar[tuple[str, ...]] = ()
    # Our field name -> the family's config.json name, where they differ (GPT-2's n_positions): errors name the key
    # the user has to fix.
    field_spelling: ClassVar[dict[str, str]] = {}
    # The fields a config.json of the family must have (the others have defaults). An attention-free family
    # (Mamba2) has no num_attention_heads and drops it here; its _derive_attention_shapes then derives nothing.
    required_fields: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads")

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int | None = None  # None only in an attention-free family (required_fields)
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
    # Keys no field of the family's class names (metadata, other libraries' settings, options we do not implement),
    # kept so that save_pretrained writes them back.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = config_class_for(self.model_type)
        if not isinstance(self, family):  # the family's defaults and checks would be skipped
            raise TypeError(f"a {self.model_type!r} config is a {family.__name__}, not a {type(self).__name__}; "
                            f"build it with ModelConfig.from_dict(config_dict), which also fills in its defaults")
        # Before anything computes with them: a bad number fails here, not in the first forward.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        self._check_numbers({**self.extra, **fields}, TOP_LEVEL_FIELDS)
        self._derive_attention_shapes()
        self._check_family()
        self._normalise_sliding_window()
        self._check_rope()

    def _derive_attention_shapes(self) -> None:
        """num_key_value_heads and head_dim where config.json leaves them out, and their checks; an attention-free
        family overrides this with nothing to derive."""
        if self.num_attention_heads is None:
            raise ConfigFieldError("num_attention_heads is missing or null; it must be a positive integer: fix the "
                                   "file")
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
        return (self.architectures or [default_architecture(self.model_type)])[0]

    # A classifier's labels (models/classification.py), read from config.json as transformers' config has them.
    # Every model has these in transformers' PretrainedConfig, but they stay keys of `extra` (classification.py sets
    # them there): a config.json that has none gets none written back, as transformers' save_pretrained leaves out
    # the PretrainedConfig defaults, where fields would write their defaults into every config.json we save.
    @property
    def id2label(self) -> dict[int, str]:
        """{class id: label name}; LABEL_0, LABEL_1 when config.json has none (transformers' default)."""
        return {int(k): v for k, v in (self.extra.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"}).items()}

    @property
    def label2id(self) -> dict[str, int]:
        return dict(self.extra.get("label2id") or {v: k for k, v in self.id2label.items()})

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def problem_type(self) -> str | None:
        return self.extra.get("problem_type")

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        if self.layer_types is None or self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    # --- family hooks: a subclass overrides what its family does differently ----------------------------------

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The raw config.json dict (a copy) before it is read: the family's defaults filled in, and whatever
        spelling only this family has turned into the common one."""
        for key, value in cls.family_defaults[data["model_type"]].items():
            data.setdefault(key, value)
        return data

    def _check_family(self) -> None:
        """Check the fields the family's modules read: the llama family's MLP is SwiGLU."""
        if self.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")

    def _fill_layer_types(self) -> None:
        """Set layer_types (and sliding_window) as the family's transformers config does."""
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
        elif self.model_type == "mistral":
            self._slide_every_layer()
        else:
            self.sliding_window = None
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    def _normalise_rope(self, rope: dict[str, Any]) -> None:
        """Change rope_parameters (a copy, rope_type and rope_theta set) in place before it is checked."""

    # --- normalisation --------------------------------------------------------------------------------------

    def _slide_every_layer(self) -> None:
        """Mistral's rule: every layer slides when sliding_window is set, none when it is null."""
        self.layer_types = [
            "sliding_attention" if self.sliding_window is not None else "full_attention"
        ] * self.num_hidden_layers

    def _normalise_sliding_window(self):
        self._fill_layer_types()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} not supported; use full_attention or sliding_attention")
        if self.sliding_window == 0:  # read, but a window of 0 tokens cannot be applied
            raise ConfigFieldError("sliding_window is 0; it must be a positive integer, or null for no window: fix "
                                   "the file")

    def _check_rope(self):
        rope = dict(self.rope_parameters)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
        self._normalise_rope(rope)
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
        self._check_numbers(rope, ROPE_KEYS, prefix="rope_parameters.")
        if rope.get("partial_rotary_factor", 1.0) != 1.0 and not self.partial_rotary:
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

    def _check_numbers(self, values: dict[str, Any], names, prefix: str = "") -> None:
        """config_checks.check_fields with this family's defaults (quoted as the fix) and spelling."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        defaults["rope_theta"] = 10000.0  # _check_rope's default
        family = self.family_defaults.get(self.model_type, {})
        defaults.update(family)
        defaults.update({name: family[spelled] for name, spelled in self.field_spelling.items() if spelled in family})
        check_fields(values, names, defaults=defaults, spelling=self.field_spelling, prefix=prefix)

    # --- reading and writing --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The config of data's model_type, as the class models/registry.py names for it (a subclass of cls)."""
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type is None:
            raise ValueError(
                f"config.json has no model_type; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "mistral" and "layer_types" in data:
            # transformers' AutoConfig rule: a Mistral config with layer_types (Ministral-8B's alternating sliding
            # and full layers) is a Ministral one; read as Mistral, every layer would slide.
            model_type = "ministral"
            architectures = [name.replace("MistralForCausalLM", "MinistralForCausalLM")
                             for name in data.get("architectures") or []]
            data = {**data, "model_type": model_type, **({"architectures": architectures} if architectures else {})}
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = config_class_for(model_type)
        if not issubclass(family, cls):
            raise ValueError(f"{cls.__name__}.from_dict was given a {model_type!r} config, which {family.__name__} "
                             f"reads; use ModelConfig.from_dict (or AutoConfig) for any model_type")
        data = family._prepare_dict(_decode_special_floats(dict(data)))
        # Old spellings -> new.
        if "torch_dtype" in data:
            data.setdefault("dtype", data.pop("torch_dtype"))
        spelling = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
        rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None) or {}
        data.pop("rope_scaling", None)
        if not isinstance(rope, dict):
            raise ConfigFieldError(f"{spelling} is {json.dumps(rope)}; it must be an object such as "
                                   f'{{"rope_type": "linear", "factor": 2.0}}, or null for the default rope: fix '
                                   f"the file")
        rope = dict(rope)
        if "rope_theta" in data:
            rope.setdefault("rope_theta", data.pop("rope_theta"))
        if "partial_rotary_factor" in data:
            rope.setdefault("partial_rotary_factor", data.pop("partial_rotary_factor"))
        data["rope_parameters"] = rope
        names = {f.name for f in dataclasses.fields(family)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        for required in family.required_fields:
            if required not in known:
                raise ValueError(f"config.json is missing the required field {required!r}")
        return family(**known, extra=extra)

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
        try:
            return cls.from_dict(data)
        except ConfigFieldError as err:
            err.source = str(path)  # say which config.json, not just "config.json"
            raise

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict in the current (transformers 5) spelling, readable by transformers 4.5x too.
        A family's override takes this and removes or respells what its transformers config reads differently."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        out["architectures"] = [self.architecture]
        if self.model_type in ("llama", "mistral"):
            out.pop("use_sliding_window")
            out.pop("max_window_layers")
            out.pop("layer_types")
        if self.model_type == "llama":
            out.pop("sliding_window")
        for key in self.absent_fields:
            out.pop(key)
        # transformers 4.x reads rope_theta at the top level and rope_scaling; 5.x reads rope_parameters.
        out["rope_theta"] = self.rope_theta
        if self.rope_type != "default":
            out["rope_scaling"] = dict(self.rope_parameters)
        return out

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _decode_special_floats(value: Any) -> Any:
    """transformers 5 writes an infinite or NaN float in config.json as {"__float__": "Infinity"} (Mamba2's
    time_step_limit); older files and ours write JSON's extension Infinity, which json reads as a float. Both ->
    float."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].lower().replace("infinity", "inf"))
        return {k: _decode_special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_special_floats(v) for v in value]
    return value
