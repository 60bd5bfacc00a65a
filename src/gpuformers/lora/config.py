"""LoraConfig: the settings of a LoRA adapter, read and written as peft's adapter_config.json.

Which layers get an adapter, and with which rank, follows peft's rules: target_modules selects layers (a list entry
matches a name or its last parts, a string is a regular expression for the whole name), exclude_modules takes some
back (the same rules), layers_to_transform keeps only the decoder layers with those indices (with a list of
target_modules only, as in peft; layers_pattern names the module list, "layers" and the like by default), and
rank_pattern / alpha_pattern give a layer its own r / lora_alpha when a key matches the end of its name
(`rank_and_alpha`).

Offers: LoraConfig, CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME, ALL_LINEAR, EMBEDDING_LAYER_NAMES, TASK_TYPES,
CLASSIFIER_MODULES, LORA_PARTS (what marks an adapter tensor's name), DEFAULT_TARGET_MODULES (peft's targets per
model_type).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"  # what peft wrote with safe_serialization=False
ALL_LINEAR = "all-linear"
TASK_TYPES = (None, "CAUSAL_LM", "SEQ_CLS")
# peft's SEQ_CLS adds these to modules_to_save (PeftModelForSequenceClassification): the classifier head trains fully
CLASSIFIER_MODULES = ("classifier", "score")
# in the names of trained adapter tensors (an embedding's LoRA: `...embed_tokens.lora_embedding_A`, peft's key)
LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector", ".lora_embedding_A", ".lora_embedding_B")
# peft's names for the layers tied in language models (peft.utils.constants.EMBEDDING_LAYER_NAMES): a
# modules_to_save or target_modules entry ending in one of them asks about weight tying.
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")

# peft's default targets when target_modules is None, for the model types gpuformers runs.
# peft's default targets per model_type (its table; qwen3_moe is ours, like qwen3); peft has none for phi3, granite,
# olmo2, olmoe, smollm3, glm, glm4, exaone4, ernie4_5, seed_oss, ministral, ministral3 or starcoder2, nor do we:
# target_modules must be given for them.
DEFAULT_TARGET_MODULES = {**{t: ["q_proj", "v_proj"] for t in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                                               "mixtral", "gemma", "gemma2", "gemma3_text")},
                          "gpt2": ["c_attn"], "gpt_neox": ["query_key_value"]}

# Fields of peft's adapter_config.json that we write with peft's defaults and read back: any other value asks
# for a feature we do not have, and loading such an adapter would silently give other outputs.
_UNSUPPORTED_DEFAULTS = {
    "lora_bias": False,
    "layer_replication": None,
    "loftq_config": {},
    "megatron_config": None,
    "target_parameters": None,
    "trainable_token_indices": None,
}
# Fields peft writes that change nothing in the forward.
_IGNORED_FIELDS = {"peft_version", "auto_mapping", "megatron_core", "qalora_group_size"}
# peft 0.21's other LoraConfig fields: features gpuformers lacks. LoraConfig(...) takes them at their "off" value
# and refuses any other by name, as loading an adapter_config.json does (rather than a TypeError for a peft field).
_PEFT_ONLY_FIELDS = frozenset({
    *_UNSUPPORTED_DEFAULTS, *_IGNORED_FIELDS, "alora_invocation_tokens", "arrow_config", "corda_config",
    "eva_config", "kasa_config", "lora_ga_config", "monteclora_config", "runtime_config", "use_bdlora", "use_qalora",
    "velora_config"})


def _check_peft_only_field(key: str, value) -> None:
    """Refuse a peft field gpuformers does not have unless it leaves the feature off."""
    if key in _IGNORED_FIELDS or key == "runtime_config":  # runtime_config: peft's GPU offload at load, no output
        return
    if key in _UNSUPPORTED_DEFAULTS and value == _UNSUPPORTED_DEFAULTS[key]:
        return
    if value in (None, False, {}, []):  # peft writes target_parameters=[] over fused MoE experts it did not target
        return
    raise NotImplementedError(f"{key}={value!r} asks for a peft LoRA feature gpuformers does not support yet; "
                              f"leave {key} out (for a saved adapter: use one trained without it)")


@dataclass
class LoraConfig:
    """peft's LoraConfig for what gpuformers supports; the defaults are peft's."""

    r: int = 8
    lora_alpha: float = 8
    target_modules: list[str] | str | None = None
    lora_dropout: float = 0.0
    bias: str = "none"
    task_type: str | None = None
    modules_to_save: list[str] | None = None
    use_rslora: bool = False
    init_lora_weights: bool | str = True
    # peft's flag for Conv1D targets (GPT-2); kept as given: the layers read their own weight layout
    fan_in_fan_out: bool = False
    use_dora: bool = False
    inference_mode: bool = False
    base_model_name_or_path: str | None = None
    revision: str | None = None
    peft_type: str = "LORA"
    ensure_weight_tying: bool = False
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)  # layer name pattern -> r
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)  # layer name pattern -> lora_alpha
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None

    def __post_init__(self):
        self.task_type = getattr(self.task_type, "value", self.task_type)  # peft.TaskType is a str enum
        self.peft_type = getattr(self.peft_type, "value", self.peft_type)
        if self.peft_type != "LORA":
            raise NotImplementedError(f"peft_type {self.peft_type!r} is not supported: gpuformers has LoRA only")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"r={self.r!r}: the LoRA rank must be a positive integer, e.g. LoraConfig(r=8)")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)):
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be a number, e.g. lora_alpha=16 (2 * r)")
        if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout!r} must be a probability in [0, 1), e.g. 0.05")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f'bias={self.bias!r} is not one of peft\'s "none", "all" (train every bias of the '
                             f'model), "lora_only" (the biases of the LoRA targets); use "none"')
        if self.task_type not in TASK_TYPES:
            raise NotImplementedError(f"task_type={self.task_type!r} is not supported: gpuformers has causal "
                                      f"language models and sequence classifiers; use task_type=\"CAUSAL_LM\", "
                                      f"\"SEQ_CLS\" or None")
        if isinstance(self.modules_to_save, tuple):
            self.modules_to_save = list(self.modules_to_save)
        if self.modules_to_save is not None and not (
                isinstance(self.modules_to_save, list) and all(isinstance(m, str) and m for m in self.modules_to_save)):
            raise ValueError(f"modules_to_save={self.modules_to_save!r} must be a list of module names, e.g. "
                             f"[\"lm_head\", \"embed_tokens\"]")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise NotImplementedError(f"init_lora_weights={self.init_lora_weights!r} is not supported; use True "
                                      f"(peft's default), False or \"gaussian\"")
        targets = self.target_modules
        if isinstance(targets, (set, frozenset, tuple)):
            targets = sorted(targets)  # peft stores a set; a sorted list writes the same file every time
            self.target_modules = targets
        if isinstance(targets, list):
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"target_modules={targets!r} must name at least one layer, e.g. "
                                 f"[\"q_proj\", \"v_proj\"] or \"all-linear\"")
        elif targets is not None and not isinstance(targets, str):
            raise ValueError(f"target_modules={targets!r} must be a list of layer names (e.g. [\"q_proj\", "
                             f"\"v_proj\"]), a regular expression, or \"all-linear\"")

        self._check_layer_selection()

    def _check_layer_selection(self) -> None:
        """exclude_modules, layers_to_transform / layers_pattern and the rank and alpha patterns, as peft checks
        them."""
        if isinstance(self.exclude_modules, (set, frozenset, tuple)):
            self.exclude_modules = sorted(self.exclude_modules)
        if isinstance(self.target_modules, str) and (self.layers_to_transform is not None
                                                     or self.layers_pattern is not None):
            raise ValueError(f"layers_to_transform / layers_pattern cannot be used when target_modules is a string "
                             f"({self.target_modules!r}: a regular expression or \"all-linear\"), as in peft; put the "
                             f"layer indices in the expression, or pass target_modules as a list of names")
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError(f"layers_pattern={self.layers_pattern!r} needs layers_to_transform (the layer indices "
                             f"to adapt), e.g. layers_to_transform=[0, 1]")
        for name, pattern, kind in (("rank_pattern", self.rank_pattern, int), ("alpha_pattern", self.alpha_pattern,
                                                                                (int, float))):
            if not isinstance(pattern, dict) or not all(
                    isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool) for k, v in pattern.items()):
                raise ValueError(f"{name}={pattern!r} must map layer names (or patterns) to numbers, e.g. "
                                 f"{{\"q_proj\": 16}}")
        if any(r <= 0 for r in self.rank_pattern.values()):
            raise ValueError(f"rank_pattern={self.rank_pattern!r}: every rank must be a positive integer")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def rank_and_alpha(self, module_name: str) -> tuple[int, float]:
        """The r and lora_alpha of the layer `module_name`: the first rank_pattern / alpha_pattern key that matches
        the end of the name (whole dot-separated parts, a regular expression; peft's get_pattern_key), else r /
        lora_alpha."""
        def lookup(pattern: dict, default):
            for key, value in pattern.items():
                if re.match(rf"(.*\.)?({key})$", module_name):
                    return value
            return default

        return lookup(self.rank_pattern, self.r), lookup(self.alpha_pattern, self.lora_alpha)

    def for_module(self, module_name: str) -> "LoraConfig":
        """This config with the r and lora_alpha of layer `module_name` (rank_and_alpha): what its adapter is built
        with."""
        r, alpha = self.rank_and_alpha(module_name)
        if (r, alpha) == (self.r, self.lora_alpha):
            return self
        return dataclasses.replace(self, r=r, lora_alpha=alpha)

    def excludes(self, module_name: str) -> bool:
        """Whether exclude_modules takes layer `module_name` out of the targets (peft's rule: a string is a
        regular expression for the whole name, a list entry matches the name or its last parts)."""
        excluded = self.exclude_modules
        if not excluded:
            return False
        if isinstance(excluded, str):
            return re.fullmatch(excluded, module_name) is not None
        return any(module_name == e or module_name.endswith(f".{e}") for e in excluded)

    def in_transformed_layer(self, module_name: str) -> bool:
        """Whether layer `module_name` lies in a decoder layer layers_to_transform keeps (True without it): its
        index is the first number after layers_pattern (any module list name by default), as peft reads it."""
        indices = self.layers_to_transform
        if indices is None or indices == []:
            return True
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
        else:
            patterns = [self.layers_pattern] if isinstance(self.layers_pattern, str) else self.layers_pattern
            match = next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module_name))),
                         None)
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == indices if isinstance(indices, int) else index in indices

    # --- adapter_config.json ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**_UNSUPPORTED_DEFAULTS, **data}

    @classmethod
    def from_dict(cls, data: dict) -> "LoraConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in known:  # a peft field, or one of a later peft: taken when it leaves its feature off
                _check_peft_only_field(key, value)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "LoraConfig":
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {folder}: pass the folder save_pretrained() wrote")
        return cls.from_dict(json.loads(path.read_text()))


def _taking_peft_only_fields(init):
    """LoraConfig's __init__, which also takes peft's fields for features we lack (_check_peft_only_field)."""
    def __init__(self, *args, **kwargs):
        for key in sorted(kwargs.keys() & _PEFT_ONLY_FIELDS):
            _check_peft_only_field(key, kwargs.pop(key))
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__signature__ = init.__doc__, inspect.signature(init)
    return __init__


LoraConfig.__init__ = _taking_peft_only_fields(LoraConfig.__init__)
