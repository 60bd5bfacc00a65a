"""The checks of a GenerationConfig: each field that cannot work raises a ValueError naming the field, the value and
what to use instead; a transformers field gpuformers does not implement warns. GenerationConfig.validate() runs
them on construction, update and save.

Offers: check_generation_config, warn_unsupported_fields, sequence_bias_as_dict, CACHE_IMPLEMENTATIONS,
ASSISTANT_TOKEN_SCHEDULES (all but the first two re-exported by generation/config.py).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import TYPE_CHECKING, Any

from gpuformers.generation.compile_config import CompileConfig

if TYPE_CHECKING:
    from gpuformers.generation.config import GenerationConfig

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


def warn_unsupported_fields(extra: dict[str, Any]) -> None:
    """Warn for each entry of a config's `extra` that sets a transformers field gpuformers does not implement to
    anything but its "off" value. Called by GenerationConfig.__init__: the warning points at the caller's line."""
    for name, off_value in _UNSUPPORTED_FIELDS.items():
        value = extra.get(name, off_value)
        if value != off_value and value is not None:
            warnings.warn(
                f"generation config field {name}={value!r} is not supported by gpuformers and is ignored",
                UserWarning,
                stacklevel=3,
            )


def check_generation_config(config: GenerationConfig) -> None:
    """Raise ValueError naming the field for a setting of `config` that cannot work."""
    _check_int("max_length", config.max_length, minimum=1)
    _check_int("max_new_tokens", config.max_new_tokens, minimum=1, optional=True,
               hint="; ask for at least one new token")
    _check_int("min_length", config.min_length, minimum=0)
    _check_int("min_new_tokens", config.min_new_tokens, minimum=0, optional=True)
    _check_int("num_beams", config.num_beams, minimum=1)
    _check_int("num_return_sequences", config.num_return_sequences, minimum=1)
    _check_int("top_k", config.top_k, minimum=0, hint="; use 0 to turn top-k filtering off")
    _check_int("no_repeat_ngram_size", config.no_repeat_ngram_size, minimum=0)
    _check_int("max_cache_len", config.max_cache_len, minimum=1, optional=True)
    _check_int("num_assistant_tokens", config.num_assistant_tokens, minimum=1)
    _check_int("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens, minimum=1, optional=True)
    _check_int("max_matching_ngram_size", config.max_matching_ngram_size, minimum=1, optional=True)
    _check_int("prefill_chunk_size", config.prefill_chunk_size, minimum=1, optional=True,
               hint="; it is the number of prompt tokens per prefill forward, None prefills in one piece")
    if config.num_assistant_tokens_schedule not in ASSISTANT_TOKEN_SCHEDULES:
        raise ValueError(
            f"generation config field num_assistant_tokens_schedule {config.num_assistant_tokens_schedule!r} is not "
            f"one of: {', '.join(ASSISTANT_TOKEN_SCHEDULES)}"
        )
    if config.assistant_confidence_threshold is not None:
        _check_number("assistant_confidence_threshold", config.assistant_confidence_threshold, low=0.0, high=1.0,
                      hint="; 0 or None lets the assistant always draft num_assistant_tokens")
    if config.max_time is not None:
        _check_number("max_time", config.max_time, low=0.0, low_open=True)
    if config.early_stopping not in (True, False, "never"):
        raise ValueError(f'generation config field early_stopping must be True, False or "never", '
                         f"got {config.early_stopping!r}")
    for name in ("do_sample", "use_cache", "renormalize_logits", "remove_invalid_values", "output_attentions",
                 "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
                 "disable_compile"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"generation config field {name} must be True or False, got {getattr(config, name)!r}")
    # sampling: temperature only matters when sampling, as in transformers (greedy ignores it)
    _check_number("temperature", config.temperature, low=0.0)
    if config.do_sample and config.temperature <= 0:
        raise ValueError(
            f"generation config field temperature must be > 0 when do_sample=True, got {config.temperature}; "
            f"for deterministic output use do_sample=False (greedy) instead of temperature=0"
        )
    _check_number("top_p", config.top_p, low=0.0, high=1.0)
    if config.min_p is not None:
        _check_number("min_p", config.min_p, low=0.0, high=1.0)
    if config.top_h is not None:
        _check_number("top_h", config.top_h, low=0.0, high=1.0, low_open=True, hint="; typical values are 0.3-0.6")
    _check_number("typical_p", config.typical_p, low=0.0, high=1.0, low_open=True)
    _check_number("epsilon_cutoff", config.epsilon_cutoff, low=0.0, high=1.0)
    _check_number("eta_cutoff", config.eta_cutoff, low=0.0, high=1.0)
    _check_number("repetition_penalty", config.repetition_penalty, low=0.0, low_open=True,
                  hint="; 1.0 means no penalty")
    _check_number("length_penalty", config.length_penalty)
    if config.num_return_sequences > 1:
        if config.num_beams == 1 and not config.do_sample:
            raise ValueError(
                f"generation config field num_return_sequences ({config.num_return_sequences}) needs do_sample=True "
                f"or num_beams >= {config.num_return_sequences}: greedy search returns one sequence per prompt"
            )
        # beam sampling (do_sample=True) too returns the best of its num_beams finished sequences
        if config.num_beams > 1 and config.num_return_sequences > config.num_beams:
            raise ValueError(
                f"generation config field num_return_sequences ({config.num_return_sequences}) must be <= num_beams "
                f"({config.num_beams}) for beam search"
            )
    # special tokens; pad may be negative in old configs (transformers only warns), so it is not checked
    for name in ("bos_token_id", "forced_bos_token_id"):
        _check_int(name, getattr(config, name), minimum=0, optional=True)
    for name in ("eos_token_id", "forced_eos_token_id"):
        value = getattr(config, name)
        for token in ([] if value is None else [value] if isinstance(value, int) else value):
            _check_int(name, token, minimum=0)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        value = getattr(config, name)
        if value is not None:
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"generation config field {name} must be a list of token ids, got {value!r}")
            for token in value:
                _check_int(name, token, minimum=0)
    if config.suppress_tokens is not None:
        # transformers refuses this too: at the forcing step every score is -inf, and sampling fails on nan
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            value = getattr(config, name)
            forced = set() if value is None else {value} if isinstance(value, int) else set(value)
            if forced and forced <= set(config.suppress_tokens):
                raise ValueError(
                    f"generation config field {name} {sorted(forced)} is all in suppress_tokens: forcing a token "
                    f"while suppressing it leaves no token to choose at the forcing step; remove it from one of "
                    f"the two (to keep eos from coming early, use min_new_tokens instead)"
                )
    if config.bad_words_ids is not None:
        if not isinstance(config.bad_words_ids, (list, tuple)) or not all(
            isinstance(seq, (list, tuple)) and len(seq) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)
            for seq in config.bad_words_ids
        ):
            raise ValueError(
                f"generation config field bad_words_ids must be a list of non-empty lists of token ids, e.g. "
                f"[[12], [7, 8]], got {config.bad_words_ids!r}"
            )
    if config.sequence_bias is not None:
        sequence_bias_as_dict(config.sequence_bias, name="generation config field sequence_bias")
    decay = config.exponential_decay_length_penalty
    if decay is not None and not (
        isinstance(decay, (list, tuple)) and len(decay) == 2 and isinstance(decay[0], int)
        and not isinstance(decay[0], bool) and _is_number(decay[1])
    ):
        raise ValueError(
            f"generation config field exponential_decay_length_penalty must be a pair (start_index, decay_factor) "
            f"of an integer and a number, e.g. (15, 1.6), got {decay!r}"
        )
    if config.stop_strings is not None:
        strings = config.stop_string_list
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(
                f"generation config field stop_strings must be a non-empty string or a list of them, "
                f"got {config.stop_strings!r}"
            )
    if config.cache_implementation is not None and config.cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"generation config field cache_implementation {config.cache_implementation!r} is not one of: "
            f"{', '.join(CACHE_IMPLEMENTATIONS)}"
        )
    if config.compile_config is not None and not isinstance(config.compile_config, CompileConfig):
        raise ValueError(
            f"generation config field compile_config must be a CompileConfig or a dict of its fields, "
            f"got {type(config.compile_config).__name__}"
        )


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
