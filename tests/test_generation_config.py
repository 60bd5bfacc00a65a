"""GenerationConfig: transformers' defaults, generation_config.json in both directions, validation, merging."""

from __future__ import annotations

import json
import warnings

import pytest

from gpuformers.generation.config import CompileConfig, GenerationConfig
from gpuformers.models.config import ModelConfig

BOOL_FIELDS = {"do_sample", "use_cache", "renormalize_logits", "remove_invalid_values", "output_attentions",
               "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "disable_compile"}


def _field_names() -> list[str]:
    return [name for name in GenerationConfig().to_dict(include_defaults=True)]


def test_defaults_equal_transformers_effective_defaults():
    from transformers import GenerationConfig as HFGenerationConfig

    hf = HFGenerationConfig()
    # transformers 5 stores None for "unset" and applies these inside generate()
    effective = HFGenerationConfig._get_default_generation_params()
    ours = GenerationConfig()
    names = _field_names()
    assert len(names) >= 40
    for name in names:
        assert hasattr(hf, name), f"{name} is not a transformers GenerationConfig field"
        expected = effective.get(name, getattr(hf, name))
        if expected is None and name in BOOL_FIELDS:
            expected = False  # an unset flag is off
        assert getattr(ours, name) == expected, f"default of {name}: ours {getattr(ours, name)!r}, hf {expected!r}"
    # the values named in the interface, spelled out
    assert (ours.max_length, ours.top_k, ours.top_p, ours.temperature, ours.num_beams) == (20, 50, 1.0, 1.0, 1)
    assert ours.eos_token_ids == [] and ours.max_new_tokens is None and ours.do_sample is False


def test_loads_generation_config_json_written_by_transformers(tmp_path):
    from transformers import GenerationConfig as HFGenerationConfig

    HFGenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
        temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=64, repetition_penalty=1.1,
        stop_strings=["\n\n"], cache_implementation="static",
    ).save_pretrained(tmp_path)
    ours = GenerationConfig.from_pretrained(tmp_path)
    assert ours.eos_token_ids == [151645, 151643] and ours.bos_token_id == 151643
    assert (ours.do_sample, ours.temperature, ours.top_k, ours.top_p) == (True, 0.6, 20, 0.95)
    assert (ours.max_new_tokens, ours.repetition_penalty, ours.cache_implementation) == (64, 1.1, "static")
    assert ours.stop_strings == ["\n\n"]
    assert "transformers_version" in ours.extra  # metadata kept, written back
    assert ours.is_set("temperature") and not ours.is_set("min_p")
    assert ours.min_p is None and ours.num_beams == 1  # absent keys keep their defaults


def test_save_pretrained_is_read_back_by_transformers_and_by_us(tmp_path):
    from transformers import GenerationConfig as HFGenerationConfig

    ours = GenerationConfig(eos_token_id=[2, 7], do_sample=True, temperature=0.7, top_p=0.9, max_length=20,
                            compile_config=CompileConfig(fullgraph=True))
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    # an explicit default (max_length=20) is written: "set to 20" and "unset" differ when configs merge
    assert written["max_length"] == 20 and "top_k" not in written and "compile_config" not in written
    hf = HFGenerationConfig.from_pretrained(tmp_path)
    assert (hf.eos_token_id, hf.do_sample, hf.temperature, hf.top_p) == ([2, 7], True, 0.7, 0.9)
    back = GenerationConfig.from_pretrained(tmp_path)
    assert back.to_dict() == {k: v for k, v in ours.to_dict().items() if k != "compile_config"}
    assert back.is_set("max_length") and not back.is_set("top_k")


def test_from_model_config_takes_special_tokens():
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=[2, 3])
    gc = GenerationConfig.from_model_config(cfg)
    assert gc.bos_token_id == 1 and gc.eos_token_ids == [2, 3] and gc.pad_token_id is None
    assert GenerationConfig.from_model_config({"eos_token_id": 5, "pad_token_id": 0}).eos_token_ids == [5]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_length=0), "max_length"),
        (dict(num_return_sequences=3), "num_return_sequences"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size"),
        (dict(bad_words_ids=[3, 4]), "bad_words_ids"),
        (dict(bad_words_ids=[[]]), "bad_words_ids"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(eos_token_id=[1, "x"]), "eos_token_id"),
        (dict(stop_strings=""), "stop_strings"),
        (dict(max_time=0), "max_time"),
        (dict(cache_implementation="statik"), "cache_implementation"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(do_sample="yes"), "do_sample"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"field {field} "):
        GenerationConfig(**kwargs)


def test_valid_settings_that_look_odd_are_accepted():
    # greedy ignores temperature (transformers only warns); sampling may return several sequences
    GenerationConfig(temperature=0.0)
    GenerationConfig(do_sample=True, num_return_sequences=4)
    GenerationConfig(num_beams=4, num_return_sequences=2, early_stopping="never")
    GenerationConfig(top_k=0, top_p=0.0, pad_token_id=-1)


def test_update_sets_fields_and_returns_unknown_kwargs():
    gc = GenerationConfig()
    unused = gc.update(max_new_tokens=8, do_sample=True, temperature=0.5, attention_mask="mask", foo=1)
    assert unused == {"attention_mask": "mask", "foo": 1}
    assert (gc.max_new_tokens, gc.do_sample, gc.temperature) == (8, True, 0.5)
    assert gc.is_set("temperature") and not gc.is_set("top_k")
    with pytest.raises(ValueError, match="top_p"):
        gc.update(top_p=7)


def test_merged_with_follows_transformers_priority():
    model = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, eos_token_id=[1, 2])
    user = GenerationConfig(max_new_tokens=5, temperature=1.0)  # an explicit default still wins
    merged = user.merged_with(model)
    assert (merged.temperature, merged.top_p, merged.do_sample, merged.max_new_tokens) == (1.0, 0.95, True, 5)
    assert merged.eos_token_ids == [1, 2]
    assert model.temperature == 0.6 and user.top_p == 1.0  # inputs untouched


def test_length_rules():
    gc = GenerationConfig()
    assert gc.max_length_for(7) == 27  # nobody set a length: 20 new tokens
    assert gc.max_length_for(7, max_position_embeddings=16) == 16
    assert GenerationConfig(max_length=12).max_length_for(7) == 12  # a set max_length counts the prompt
    assert GenerationConfig(max_length=12, max_new_tokens=3).max_length_for(7) == 10
    assert GenerationConfig(min_new_tokens=4).min_length_for(7) == 11
    assert GenerationConfig(min_length=9).min_length_for(7) == 9


def test_copy_is_independent_and_assignment_counts_as_set():
    gc = GenerationConfig(bad_words_ids=[[1, 2]])
    other = gc.copy()
    other.bad_words_ids[0].append(3)
    other.top_k = 5
    assert gc.bad_words_ids == [[1, 2]] and gc.top_k == 50 and not gc.is_set("top_k")
    assert other.is_set("top_k")


def test_unsupported_transformers_field_warns_not_silently_ignored():
    with pytest.warns(UserWarning, match="guidance_scale"):
        gc = GenerationConfig(guidance_scale=1.5)
    assert gc.extra["guidance_scale"] == 1.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig(num_beam_groups=1, transformers_version="5.0.0")  # "off" values and metadata: no warning


def test_missing_file_error_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        GenerationConfig.from_pretrained(tmp_path)
