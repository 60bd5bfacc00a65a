"""GenerationConfig: the settings of `generate()`, read from `generation_config.json`, checked, and merged.
The checks themselves are in generation/config_checks.py, CompileConfig in generation/compile_config.py.

The fields, names and defaults are transformers' (its effective defaults, the values `generate` falls back to),
so a user's `generation_config.json` and `generate(**kwargs)` mean the same thing here. One difference in how the
defaults are stored: transformers keeps `None` for "unset" and fills defaults inside `generate`; here every field
holds its real default and the config remembers which fields someone set (`is_set`). That keeps the values
readable (`GenerationConfig().top_k == 50`) and still allows transformers' priority rule:

    generate(**kwargs)  >  the generation_config passed to generate  >  model.generation_config  >  defaults

    merged = user_config.merged_with(model.generation_config)   # unset fields of user_config come from the model
    unused = merged.update(**kwargs)                            # kwargs win; unknown keys are handed back

Offers: GenerationConfig (from_dict, from_model_config, from_pretrained, to_dict, to_diff_dict, save_pretrained,
update, merged_with, validate, copy, is_set, eos_token_ids, max_length_for, min_length_for), CompileConfig,
sequence_bias_as_dict, CACHE_IMPLEMENTATIONS, ASSISTANT_TOKEN_SCHEDULES, GENERATION_CONFIG_NAME.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuformers.generation.compile_config import CompileConfig
from gpuformers.generation.config_checks import check_generation_config, warn_unsupported_fields
# Re-exported: public names of this module from before the checks moved out (penalties.py imports one from here).
from gpuformers.generation.config_checks import (  # noqa: F401
    ASSISTANT_TOKEN_SCHEDULES,
    CACHE_IMPLEMENTATIONS,
    sequence_bias_as_dict,
)

GENERATION_CONFIG_NAME = "generation_config.json"


@dataclass(init=False)
class GenerationConfig:
    """Settings of `generate()`. Build it with keyword arguments (`GenerationConfig(max_new_tokens=32)`), from a
    dict or from a folder holding `generation_config.json`. Unknown keys are kept in `extra` and written back."""

    # --- length -----------------------------------------------------------------------------------------------
    max_length: int = 20  # prompt + new tokens; when nobody sets it, generate() reads it as 20 *new* tokens
    max_new_tokens: int | None = None  # wins over max_length
    min_length: int = 0
    min_new_tokens: int | None = None  # wins over min_length
    early_stopping: bool | str = False  # beam search: True, False or "never"
    max_time: float | None = None  # seconds
    stop_strings: str | list[str] | None = None  # needs generate(tokenizer=...)
    # --- strategy ---------------------------------------------------------------------------------------------
    do_sample: bool = False
    num_beams: int = 1
    # --- assisted generation (speculative decoding; generation/assisted.py) -----------------------------------
    num_assistant_tokens: int = 20  # tokens the assistant drafts per round
    num_assistant_tokens_schedule: str = "constant"  # "heuristic": +2 after a fully accepted draft, else -1 (min 1)
    assistant_confidence_threshold: float | None = 0.4  # the assistant stops drafting below this probability
    prompt_lookup_num_tokens: int | None = None  # draft by n-gram lookup in the prompt instead of an assistant
    max_matching_ngram_size: int | None = None  # longest n-gram prompt lookup matches; None means 2 (transformers)
    # --- cache ------------------------------------------------------------------------------------------------
    use_cache: bool = True
    cache_implementation: str | None = None
    cache_config: dict | None = None
    max_cache_len: int | None = None
    # --- logits processing (the sampling warpers apply only with do_sample=True) ------------------------------
    temperature: float = 1.0
    top_k: int = 50  # 0 turns it off
    top_p: float = 1.0
    min_p: float | None = None
    top_h: float | None = None  # in (0, 1]: keep the top tokens whose entropy stays within top_h * H (Top-H)
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    # added to the last token's score where the sequence would complete: [[[10, 45], -2.0]] or {(10, 45): -2.0}
    sequence_bias: list | dict | None = None
    # (start_index, decay_factor): past start_index new tokens, eos scores grow by decay_factor ** (tokens past it)
    exponential_decay_length_penalty: tuple[int, float] | None = None
    renormalize_logits: bool = False
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    remove_invalid_values: bool = False
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    # --- outputs ----------------------------------------------------------------------------------------------
    num_return_sequences: int = 1
    output_attentions: bool = False
    output_hidden_states: bool = False
    output_scores: bool = False
    output_logits: bool = False
    return_dict_in_generate: bool = False
    # --- special tokens ---------------------------------------------------------------------------------------
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # --- performance ------------------------------------------------------------------------------------------
    compile_config: CompileConfig | None = None
    disable_compile: bool = False
    prefill_chunk_size: int | None = None  # prompt tokens per prefill forward: same tokens, less activation memory
    # Keys that are not fields (metadata such as transformers_version, custom entries), written back as they came
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __init__(self, **kwargs: Any):
        explicit = set()
        for f in _FIELDS:
            if f.name in kwargs:
                explicit.add(f.name)
            object.__setattr__(self, f.name, kwargs.pop(f.name, f.default))
        object.__setattr__(self, "extra", {**(kwargs.pop("extra", None) or {}), **kwargs})
        # Fields someone set (here, from a file, by update or by assignment); see merged_with and max_length_for.
        object.__setattr__(self, "_explicit", explicit)
        self._normalise()
        warn_unsupported_fields(self.extra)
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _FIELD_NAMES:
            self._explicit.add(name)

    def _normalise(self) -> None:
        # JSON has no CompileConfig; a dict read from a file becomes one.
        if isinstance(self.compile_config, dict):
            object.__setattr__(self, "compile_config", CompileConfig(**self.compile_config))
        if isinstance(self.eos_token_id, tuple):
            object.__setattr__(self, "eos_token_id", list(self.eos_token_id))
        # JSON has no tuple: a pair read from a file is a list
        if isinstance(self.exponential_decay_length_penalty, list):
            object.__setattr__(self, "exponential_decay_length_penalty", tuple(self.exponential_decay_length_penalty))

    # --- reading and writing --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "GenerationConfig":
        """Build from a dict (a parsed generation_config.json); kwargs override its entries."""
        return cls(**{**config_dict, **kwargs})

    @classmethod
    def from_model_config(cls, model_config: Any) -> "GenerationConfig":
        """Defaults for a checkpoint with no generation_config.json: the special tokens of its model config
        (a ModelConfig or a config.json dict)."""
        source = model_config if isinstance(model_config, dict) else model_config.to_dict()
        tokens = {name: source[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if source.get(name) is not None}
        return cls(**tokens, _from_model_config=True)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, config_file_name: str = GENERATION_CONFIG_NAME,
                        **kwargs: Any) -> "GenerationConfig":
        """Read `<folder>/generation_config.json` (a local folder; resolve Hub ids with gpuformers.hub first);
        kwargs override its entries."""
        path = Path(folder)
        path = path if path.is_file() else path / config_file_name
        if not path.is_file():
            raise FileNotFoundError(
                f"no {config_file_name} in {folder}; pass the folder of a checkpoint that has one, or build the config "
                f"with GenerationConfig(...) or GenerationConfig.from_model_config(model.config)"
            )
        try:
            config_dict = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); fix or delete the file") from err
        return cls.from_dict(config_dict, **kwargs)

    def to_dict(self, include_defaults: bool = False) -> dict[str, Any]:
        """JSON-ready values: the fields that were set or differ from their defaults, plus the extra keys (what
        generation_config.json holds; `from_dict(to_dict())` gives back an equal config that remembers the same
        set fields). `include_defaults=True` lists every field."""
        out = {}
        for f in _FIELDS:
            value = getattr(self, f.name)
            if include_defaults or f.name in self._explicit or value != f.default:
                if f.name == "sequence_bias" and isinstance(value, dict):
                    # JSON keys are strings: the dict form is written as transformers' list of [ids, bias] pairs
                    value = [[list(ids), bias] for ids, bias in value.items()]
                out[f.name] = value.to_dict() if isinstance(value, CompileConfig) else copy.deepcopy(value)
        out.update(copy.deepcopy(self.extra))
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        """transformers' name for `to_dict()`: what differs from the defaults or was set explicitly. Explicit
        defaults are kept because "set to the default" and "not set" differ when configs are merged."""
        return self.to_dict()

    def save_pretrained(self, save_directory: str | os.PathLike,
                        config_file_name: str = GENERATION_CONFIG_NAME) -> None:
        """Write `<save_directory>/generation_config.json`, readable by transformers' GenerationConfig too."""
        self.validate()
        directory = Path(save_directory)
        if directory.is_file():
            raise ValueError(f"save_directory {directory} is a file; pass a folder")
        directory.mkdir(parents=True, exist_ok=True)
        # compile_config describes this machine's run, not the checkpoint (transformers leaves it out too)
        data = {k: v for k, v in self.to_dict().items() if k != "compile_config"}
        (directory / config_file_name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    # --- changing ---------------------------------------------------------------------------------------------

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the fields named in kwargs, validate, and return the kwargs that are not fields (generate() passes
        those on to the model or rejects them)."""
        unused = {}
        for key, value in kwargs.items():
            if key in _FIELD_NAMES:
                setattr(self, key, value)
            else:
                unused[key] = value
        self._normalise()
        self.validate()
        return unused

    def merged_with(self, base: "GenerationConfig | None", none_is_unset: bool = False) -> "GenerationConfig":
        """A copy of this config whose unset fields take `base`'s values (transformers' rule for a config passed to
        generate() on top of model.generation_config). Fields set in either stay marked as set.

        none_is_unset: a field this config sets to None counts as unset too, as in transformers' generate(), where
        None is what "unset" looks like: a passed GenerationConfig(eos_token_id=None) keeps the model's eos there
        (while generate(eos_token_id=None) drops it)."""
        merged = self.copy()
        if base is None:
            return merged
        for name in base._explicit:
            if name not in self._explicit or (none_is_unset and getattr(self, name) is None):
                setattr(merged, name, copy.deepcopy(getattr(base, name)))
        for key, value in base.extra.items():
            merged.extra.setdefault(key, copy.deepcopy(value))
        merged._normalise()
        return merged

    def copy(self) -> "GenerationConfig":
        return copy.deepcopy(self)

    def is_set(self, name: str) -> bool:
        """True when `name` was given (constructor, file, update or assignment) rather than left at its default."""
        return name in self._explicit

    # --- derived values ---------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence tokens as a list (empty when there are none)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return [int(t) for t in self.eos_token_id]

    @property
    def stop_string_list(self) -> list[str]:
        if self.stop_strings is None:
            return []
        return [self.stop_strings] if isinstance(self.stop_strings, str) else list(self.stop_strings)

    def max_length_for(self, prompt_length: int, max_position_embeddings: int | None = None) -> int:
        """Total length (prompt + new tokens) at which generation stops, by transformers' rule: prompt +
        max_new_tokens when that is set; else max_length when someone set it; else prompt + 20 new tokens,
        capped at the model's max_position_embeddings."""
        if self.max_new_tokens is not None:
            return prompt_length + self.max_new_tokens
        if self.is_set("max_length"):
            return self.max_length
        total = prompt_length + self.max_length
        return min(total, max_position_embeddings) if max_position_embeddings else total

    def min_length_for(self, prompt_length: int) -> int:
        """Total length before which eos is suppressed: prompt + min_new_tokens when set, else min_length."""
        if self.min_new_tokens is not None:
            return prompt_length + self.min_new_tokens
        return self.min_length

    # --- checks -----------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the field for a setting that cannot work (see generation/config_checks.py)."""
        check_generation_config(self)

    def __repr__(self) -> str:
        return f"GenerationConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return self.to_dict(include_defaults=True) == other.to_dict(include_defaults=True)


_FIELDS = tuple(f for f in dataclasses.fields(GenerationConfig) if f.name != "extra")
_FIELD_NAMES = frozenset(f.name for f in _FIELDS)

