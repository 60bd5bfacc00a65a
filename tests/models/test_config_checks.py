"""Every numeric config.json field a model reads is type- and range-checked when the config is read
(models/config_checks.py): a bad value fails at load with the file, the field, the value and the fix, and the values
real checkpoints hold (ints for floats, nulls where transformers allows them) still load."""

import json

import pytest

from gpuformers.models.config import ConfigFieldError, ModelConfig

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _read(model_type: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": model_type, **SIZES, **fields})


def test_a_bad_number_in_config_json_fails_at_load_naming_the_file_field_value_and_default(tmp_path):
    from gpuformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(_read("llama")).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "rms_norm_eps": None}))
    # before: the model loaded, and the first forward died in layers/norm.py
    with pytest.raises(ValueError) as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert str(info.value) == (f"{path}: rms_norm_eps is null; it must be a positive number (transformers' default "
                               f"is 1e-06): fix the file")


@pytest.mark.parametrize("fields, message", [
    # the cases: a bare TypeError from rotary.py, and values accepted as they were
    (dict(rope_theta="x"), 'rope_theta is "x"; it must be a positive number (transformers\' default is 10000.0)'),
    (dict(rope_theta=-1), "rope_theta is -1; it must be a positive number"),
    (dict(max_position_embeddings=-5), "max_position_embeddings is -5; it must be a positive integer "
                                       "(transformers' default is 2048)"),
    # int fields take ints only: not a bool, not a float
    (dict(hidden_size=True), "hidden_size is true; it must be a positive integer"),
    (dict(head_dim=16.0), "head_dim is 16.0; it must be a positive integer or null"),
    (dict(num_key_value_heads=0), "num_key_value_heads is 0; it must be a positive integer or null"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps is NaN; it must be a positive number"),
    (dict(attention_dropout=1.5), "attention_dropout is 1.5; it must be a number in [0, 1]"),
    (dict(initializer_range="0.02"), 'initializer_range is "0.02"; it must be a number in [0, 1]'),
    (dict(pad_token_id="0"), 'pad_token_id is "0"; it must be an integer or null'),
    (dict(eos_token_id=[2, "3"]), 'eos_token_id is [2, "3"]; it must be an integer or a list of integers or null'),
    # rope_parameters / rope_scaling keys
    (dict(rope_scaling={"rope_type": "linear", "factor": -2}), "rope_parameters.factor is -2; it must be a positive"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1", "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}), 'rope_parameters.low_freq_factor is "1"'),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}),
     "rope_parameters.beta_fast is -32; it must be a non-negative number"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6.5}),
     "rope_parameters.original_max_position_embeddings is 6.5; it must be a positive integer"),
    (dict(rope_scaling="linear"), 'rope_scaling is "linear"; it must be an object'),
])
def test_each_bad_value_is_refused_by_name(fields, message):
    with pytest.raises(ConfigFieldError) as info:
        _read("llama", **fields)
    assert str(info.value).startswith(f"config.json: {message}")
    assert str(info.value).endswith(": fix the file")


@pytest.mark.parametrize("model_type, fields, message", [
    # the families' own fields, read from `extra`, and their config.json spellings
    ("gpt2", dict(n_positions=-5), "n_positions is -5; it must be a positive integer (transformers' default is 1024)"),
    ("gpt2", dict(layer_norm_epsilon=None), "layer_norm_epsilon is null; it must be a positive number"),
    ("gpt2", dict(attn_pdrop=2), "attn_pdrop is 2; it must be a number in [0, 1] (transformers' default is 0.1)"),
    ("starcoder2", dict(norm_epsilon=0), "norm_epsilon is 0; it must be a positive number (transformers' default is "
                                         "1e-05)"),
    ("gpt_neox", dict(layer_norm_eps="1e-5"), 'layer_norm_eps is "1e-5"; it must be a positive number'),
    ("gpt_neox", dict(rotary_pct=1.5), "partial_rotary_factor is 1.5; it must be a number in (0, 1]"),
    ("glm4", dict(partial_rotary_factor=0), "partial_rotary_factor is 0; it must be a number in (0, 1] "
                                            "(transformers' default is 0.5)"),
    ("granite", dict(logits_scaling=0), "logits_scaling is 0; it must be a positive number"),
    ("gemma2", dict(attn_logit_softcapping="50"), 'attn_logit_softcapping is "50"; it must be a positive number or '
                                                  'null'),
    ("gemma3_text", dict(rope_local_base_freq=None), "rope_local_base_freq is null; it must be a positive number"),
    ("gemma3_text", dict(sliding_window_pattern=-1), "sliding_window_pattern is -1; it must be a non-negative "
                                                     "integer"),
    ("phi3", dict(resid_pdrop=-0.1), "resid_pdrop is -0.1; it must be a number in [0, 1]"),
    ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok is 0; it must be a positive integer"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step is 0; it must be a positive integer"),
    ("mixtral", dict(num_local_experts=True), "num_local_experts is true; it must be a non-negative integer"),
    ("olmoe", dict(clip_qkv=-1), "clip_qkv is -1; it must be a positive number or null"),
    ("mistral", dict(sliding_window=0), "sliding_window is 0; it must be a positive integer, or null for no window"),
    ("mistral", dict(sliding_window=-4), "sliding_window is -4; it must be a non-negative integer or null"),
])
def test_each_family_field_is_refused_by_its_config_json_name(model_type, fields, message):
    with pytest.raises(ConfigFieldError) as info:
        _read(model_type, **fields)
    assert str(info.value).startswith(f"config.json: {message}")


def test_values_real_checkpoints_hold_still_load():
    # floats written as ints, and the nulls transformers reads as "unset"
    config = _read("llama", rope_theta=10000, rms_norm_eps=1, head_dim=None, rope_scaling=None, pad_token_id=-1,
                   eos_token_id=[2, 3], attention_dropout=0)
    assert (config.rope_theta, config.rms_norm_eps, config.head_dim, config.pad_token_id) == (10000, 1, 16, -1)
    # Qwen2 configs carry sliding_window 0 (or null) and max_window_layers null with use_sliding_window false
    for window in (0, None):
        qwen = _read("qwen2", sliding_window=window, max_window_layers=None, use_sliding_window=False)
        assert qwen.sliding_window is None and qwen.layer_types == ["full_attention"] * 2
    assert _read("mistral", sliding_window=None).sliding_window is None
    assert _read("olmoe", clip_qkv=None).clip_qkv is None
    assert _read("gemma2", final_logit_softcapping=None).final_logit_softcapping is None
    yarn = _read("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768,
                                         "beta_fast": None, "attention_factor": None})
    assert yarn.rope_parameters["factor"] == 4
    assert _read("qwen3_moe", num_experts=0).num_experts == 0  # a dense model in MoE clothing
    assert _read("exaone4", sliding_window_pattern="LLLG").layer_types == ["sliding_attention", "full_attention"]


def test_from_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3", **SIZES, "max_position_embeddings": "32k"}))
    with pytest.raises(ConfigFieldError, match=rf"^{path}: max_position_embeddings is \"32k\"; .*default is 32768"):
        ModelConfig.from_file(path)
