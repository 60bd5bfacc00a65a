"""GenerationConfig: the settings of `generate()`, read from `generation_config.json`, checked, and merged.

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
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG_NAME = "generation_config.json"

# Names transformers accepts for `cache_implementation`. generate() says which of them it implements; the config
# only rejects names that mean nothing at all, so that any published generation_config.json still loads.
CACHE_IMPLEMENTATIONS = (
    "dynamic", "static", "offloaded", "offloaded_static", "quantized", "sliding_window", "hybrid", "mamba",
    "hybrid_chunked", "offloaded_hybrid", "offloaded_hybrid_chunked", "paged",
)

# transformers fields gpuformers does not implement, with the value that means "off". Setting one to anything else
# warns instead of being silently ignored (and does not fail, so a checkpoint that sets one still loads).
_UNSUPPORTED_FIELDS: dict[str, Any] = {
    "guidance_scale": None, "watermarking_config": None, "token_healing": False, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "decoder_start_token_id": None, "penalty_alpha": None, "dola_layers": None,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "constraints": None, "force_words_ids": None, "low_memory": None,
    "use_mtp": None, "assistant_early_exit": None,
}

# Values of num_assistant_tokens_schedule (transformers'): how the draft length changes from round to round.
ASSISTANT_TOKEN_SCHEDULES = ("heuristic", "heuristic_transient", "constant")


@dataclass
class CompileConfig:
    """How generate() compiles the decode step (`torch.compile` arguments), as transformers' CompileConfig."""

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    mode: str = "reduce-overhead"
    options: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        self._warn_unsupported()
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

    def _warn_unsupported(self) -> None:
        for name, off_value in _UNSUPPORTED_FIELDS.items():
            value = self.extra.get(name, off_value)
            if value != off_value and value is not None:
                warnings.warn(
                    f"generation config field {name}={value!r} is not supported by gpuformers and is ignored",
                    UserWarning,
                    stacklevel=3,
                )

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

    def merged_with(self, base: "GenerationConfig | None") -> "GenerationConfig":
        """A copy of this config whose unset fields take `base`'s values (transformers' rule for a config passed to
        generate() on top of model.generation_config). Fields set in either stay marked as set."""
        merged = self.copy()
        if base is None:
            return merged
        for name in base._explicit:
            if name not in self._explicit:
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
        """Raise ValueError naming the field for a setting that cannot work."""
        _check_int("max_length", self.max_length, minimum=1)
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1, optional=True,
                   hint="; ask for at least one new token")
        _check_int("min_length", self.min_length, minimum=0)
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0, optional=True)
        _check_int("num_beams", self.num_beams, minimum=1)
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1)
        _check_int("top_k", self.top_k, minimum=0, hint="; use 0 to turn top-k filtering off")
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0)
        _check_int("max_cache_len", self.max_cache_len, minimum=1, optional=True)
        _check_int("num_assistant_tokens", self.num_assistant_tokens, minimum=1)
        _check_int("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, minimum=1, optional=True)
        _check_int("max_matching_ngram_size", self.max_matching_ngram_size, minimum=1, optional=True)
        _check_int("prefill_chunk_size", self.prefill_chunk_size, minimum=1, optional=True,
                   hint="; it is the number of prompt tokens per prefill forward, None prefills in one piece")
        if self.num_assistant_tokens_schedule not in ASSISTANT_TOKEN_SCHEDULES:
            raise ValueError(
                f"generation config field num_assistant_tokens_schedule {self.num_assistant_tokens_schedule!r} is not "
                f"one of: {', '.join(ASSISTANT_TOKEN_SCHEDULES)}"
            )
        if self.assistant_confidence_threshold is not None:
            _check_number("assistant_confidence_threshold", self.assistant_confidence_threshold, low=0.0, high=1.0,
                          hint="; 0 or None lets the assistant always draft num_assistant_tokens")
        if self.max_time is not None:
            _check_number("max_time", self.max_time, low=0.0, low_open=True)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f'generation config field early_stopping must be True, False or "never", '
                             f"got {self.early_stopping!r}")
        for name in ("do_sample", "use_cache", "renormalize_logits", "remove_invalid_values", "output_attentions",
                     "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
                     "disable_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"generation config field {name} must be True or False, got {getattr(self, name)!r}")
        # sampling: temperature only matters when sampling, as in transformers (greedy ignores it)
        _check_number("temperature", self.temperature, low=0.0)
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"generation config field temperature must be > 0 when do_sample=True, got {self.temperature}; "
                f"for deterministic output use do_sample=False (greedy) instead of temperature=0"
            )
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.min_p is not None:
            _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.top_h is not None:
            _check_number("top_h", self.top_h, low=0.0, high=1.0, low_open=True, hint="; typical values are 0.3-0.6")
        _check_number("typical_p", self.typical_p, low=0.0, high=1.0, low_open=True)
        _check_number("epsilon_cutoff", self.epsilon_cutoff, low=0.0, high=1.0)
        _check_number("eta_cutoff", self.eta_cutoff, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True,
                      hint="; 1.0 means no penalty")
        _check_number("length_penalty", self.length_penalty)
        if self.num_return_sequences > 1 and not self.do_sample:
            if self.num_beams == 1:
                raise ValueError(
                    f"generation config field num_return_sequences ({self.num_return_sequences}) needs do_sample=True "
                    f"or num_beams >= {self.num_return_sequences}: greedy search returns one sequence per prompt"
                )
            if self.num_return_sequences > self.num_beams:
                raise ValueError(
                    f"generation config field num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                    f"({self.num_beams}) for beam search"
                )
        # special tokens; pad may be negative in old configs (transformers only warns), so it is not checked
        for name in ("bos_token_id", "forced_bos_token_id"):
            _check_int(name, getattr(self, name), minimum=0, optional=True)
        for name in ("eos_token_id", "forced_eos_token_id"):
            value = getattr(self, name)
            for token in ([] if value is None else [value] if isinstance(value, int) else value):
                _check_int(name, token, minimum=0)
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"generation config field {name} must be a list of token ids, got {value!r}")
                for token in value:
                    _check_int(name, token, minimum=0)
        if self.bad_words_ids is not None:
            if not isinstance(self.bad_words_ids, (list, tuple)) or not all(
                isinstance(seq, (list, tuple)) and len(seq) > 0
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)
                for seq in self.bad_words_ids
            ):
                raise ValueError(
                    f"generation config field bad_words_ids must be a list of non-empty lists of token ids, e.g. "
                    f"[[12], [7, 8]], got {self.bad_words_ids!r}"
                )
        if self.sequence_bias is not None:
            sequence_bias_as_dict(self.sequence_bias, name="generation config field sequence_bias")
        decay = self.exponential_decay_length_penalty
        if decay is not None and not (
            isinstance(decay, (list, tuple)) and len(decay) == 2 and isinstance(decay[0], int)
            and not isinstance(decay[0], bool) and _is_number(decay[1])
        ):
            raise ValueError(
                f"generation config field exponential_decay_length_penalty must be a pair (start_index, decay_factor) "
                f"of an integer and a number, e.g. (15, 1.6), got {decay!r}"
            )
        if self.stop_strings is not None:
            strings = self.stop_string_list
            if not strings or not all(isinstance(s, str) and s for s in strings):
                raise ValueError(
                    f"generation config field stop_strings must be a non-empty string or a list of them, "
                    f"got {self.stop_strings!r}"
                )
        if self.cache_implementation is not None and self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"generation config field cache_implementation {self.cache_implementation!r} is not one of: "
                f"{', '.join(CACHE_IMPLEMENTATIONS)}"
            )
        if self.compile_config is not None and not isinstance(self.compile_config, CompileConfig):
            raise ValueError(
                f"generation config field compile_config must be a CompileConfig or a dict of its fields, "
                f"got {type(self.compile_config).__name__}"
            )

    def __repr__(self) -> str:
        return f"GenerationConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return self.to_dict(include_defaults=True) == other.to_dict(include_defaults=True)


_FIELDS = tuple(f for f in dataclasses.fields(GenerationConfig) if f.name != "extra")
_FIELD_NAMES = frozenset(f.name for f in _FIELDS)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False, hint: str = "") -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"generation config field {name} must be an integer >= {minimum}, got {value!r}{hint}")


def sequence_bias_as_dict(sequence_bias: Any, name: str = "sequence_bias") -> dict[tuple[int, ...], float]:
    """transformers' two forms of `sequence_bias`, a list of [token ids, bias] pairs (`[[[10, 45], -2.0]]`, what
    generation_config.json holds) or a dict (`{(10, 45): -2.0}`), as the dict; a later pair for the same ids wins,
    as in transformers. Raises ValueError naming `name` for anything else.

    Two deviations: an int bias is accepted (-2 means -2.0; transformers wants a float), and an entry without token
    ids is refused (transformers takes it and never applies it).
    """
    form = "a list of [token ids, bias] pairs, e.g. [[[10, 45], -2.0], [[64], 7.5]], or a dict {(10, 45): -2.0}"
    if isinstance(sequence_bias, dict):
        if not all(isinstance(ids, tuple) for ids in sequence_bias):
            raise ValueError(f"{name} must be {form}: dict keys are tuples of token ids, e.g. (64,); "
                             f"got {sequence_bias!r}")
        pairs = list(sequence_bias.items())
    elif isinstance(sequence_bias, (list, tuple)) and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], (list, tuple))
        for pair in sequence_bias
    ):
        pairs = [(tuple(ids), bias) for ids, bias in sequence_bias]
    else:
        raise ValueError(f"{name} must be {form}, got {sequence_bias!r}")
    if not pairs:
        raise ValueError(f"{name} is empty; give at least one pair, as {form}, or leave it None")
    for ids, bias in pairs:
        if not ids or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"{name}: each entry's token ids must be a non-empty list of integers >= 0, "
                             f"got {list(ids)!r}")
        if not _is_number(bias):
            raise ValueError(f"{name}: the bias of {list(ids)!r} must be a number, got {bias!r}")
    return {tuple(int(t) for t in ids): float(bias) for ids, bias in pairs}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                  low_open: bool = False, hint: str = "") -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"generation config field {name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise ValueError(f"generation config field {name} must be {bounds}, got {value!r}{hint}")
