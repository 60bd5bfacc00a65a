"""Falcon-H1 against transformers' FalconH1ForCausalLM on tiny random checkpoints (attention and mamba in parallel in
every layer; n_groups > 1; chunk sizes that do not divide the prompts; every multiplier off its default, the mup
vector's five parts different): the checkpoint layout, logits, loss and gradients, one cache from prefill to decode,
greedy, sampling and beam-search tokens, the bare model, saving for transformers, LoRA against peft, the config checks.
Cases: the mixer gated without a norm (transformers' default), with its RMSNorm before the gate, and after it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.models.parity import checkpoint_cases, left_padded, load, max_logit_diff
from tests.models.recurrent import (assert_bare_model_matches, assert_classifier_pools_the_last_state,
                                    assert_generation_continues_from_its_cache, assert_greedy_matches,
                                    assert_lora_matches_peft, assert_loss_and_gradients_match,
                                    assert_sampling_and_beams_match, assert_saved_model_loads_in_transformers,
                                    cached_pieces_minus_full)

SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
              lm_head_multiplier=0.5, embedding_multiplier=3.0, mlp_multipliers=[0.7, 1.3], key_multiplier=0.6,
              attention_in_multiplier=1.2, attention_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
              ssm_in_multiplier=0.3, ssm_out_multiplier=4.0)
CASES = {
    # y * silu(z) after the scan; 2 groups of 4 heads, chunks of 5 over prompts of 16, 10, 7 tokens
    "gate": dict(mamba_d_ssm=128, mamba_n_groups=2, mamba_chunk_size=5),
    # the grouped RMSNorm before the gate; 4 groups, chunks of 3; the width from mamba_expand (mamba_d_ssm null);
    # a conv of 3 taps without bias, every bias on, a tied head
    "norm-biases-tied": dict(mamba_d_ssm=None, mamba_expand=2, mamba_n_groups=4, mamba_chunk_size=3,
                             mamba_rms_norm=True, mamba_d_conv=3, mamba_conv_bias=False, mamba_proj_bias=True,
                             projectors_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # the RMSNorm after the gate
    "norm-after-gate": dict(mamba_d_ssm=128, mamba_n_groups=2, mamba_chunk_size=5, mamba_rms_norm=True,
                            mamba_norm_before_gate=False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model). The mamba in_proj and conv weights are scaled up (transformers draws
    std 0.02, which leaves x, B and C to the conv's perturbed bias and the scan's part of the output near zero), so
    that each part of the mup vector shows in the logits; saved again."""
    cases = checkpoint_cases(tmp_path_factory, "falcon_h1", CASES, **SHAPES)
    for folder, hf in cases.values():
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.mamba.in_proj.weight.mul_(10.0)
                layer.mamba.conv1d.weight.mul_(50.0)
        hf.save_pretrained(folder)
    return cases


@pytest.mark.parametrize("case", ["gate", "norm-biases-tied"])
def test_layout_is_the_saved_checkpoints(checkpoints, case):
    folder, _ = checkpoints[case]
    ours = load(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    tied = {"lm_head.weight"} if CASES[case].get("tie_word_embeddings") else set()
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items() if k not in tied} == saved
    assert ("model.layers.0.mamba.norm.weight" in saved) == CASES[case].get("mamba_rms_norm", False)
    assert ours.no_split_modules == ("FalconH1DecoderLayer",)


@pytest.mark.parametrize("case,attn", [("gate", "sdpa"), ("gate", "eager"), ("norm-biases-tied", "sdpa"),
                                       ("norm-after-gate", "sdpa")])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_every_multiplier_takes_part(checkpoints):
    """A multiplier our model ignored would show against transformers above only if it moves the logits: each one
    set back to 1 on our model does, and so does each part of the mup vector."""
    folder, _ = checkpoints["gate"]
    ours = load(folder)
    ids, mask = left_padded()
    with torch.no_grad():
        before = ours(ids, attention_mask=mask).logits
        layer = ours.model.layers[0]
        targets = [(ours, "lm_head_multiplier"), (ours.model, "embedding_multiplier"),
                   (layer, "attention_in_multiplier"), (layer, "attention_out_multiplier"),
                   (layer, "ssm_out_multiplier"), (layer.mamba, "ssm_in_multiplier"),
                   (layer.self_attn, "key_multiplier"),
                   (layer.feed_forward, "gate_multiplier"), (layer.feed_forward, "down_multiplier")]
        for module, name in targets:
            saved = getattr(module, name)
            setattr(module, name, 1.0)
            assert (ours(ids, attention_mask=mask).logits - before).abs().max() > 1e-3, name
            setattr(module, name, saved)
        for part in range(5):  # the mup vector: each part of in_proj's output
            multipliers = SHAPES["ssm_multipliers"]
            layer.mamba.ssm_multipliers = tuple(1.0 if i == part else m for i, m in enumerate(multipliers))
            layer.mamba.reset_buffers()
            assert (ours(ids, attention_mask=mask).logits - before).abs().max() > 1e-3, part


@pytest.mark.parametrize("case", ["gate", "norm-biases-tied"])
def test_loss_and_gradients_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_loss_and_gradients_match(load(folder), hf)


@pytest.mark.parametrize("case", ["gate", "norm-biases-tied"])
def test_one_cache_carries_states_and_keys_from_prefill_to_decode(checkpoints, case):
    cache, diff = cached_pieces_minus_full(load(checkpoints[case][0]), prompt=7, chunk=3, total=14)
    assert [cache.get_seq_length(i) for i in range(2)] == [14, 14]
    assert diff.abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf)


def test_generate_continues_from_a_returned_cache(checkpoints):
    """A second turn from the cache the first returned (states, and keys and values at their positions)."""
    assert_generation_continues_from_its_cache(load(checkpoints["gate"][0]))


def test_sampling_and_beam_search_match_transformers(checkpoints):
    folder, hf = checkpoints["gate"]
    assert_sampling_and_beams_match(load(folder), hf)


def test_bare_model_classifier_and_saving_for_transformers(checkpoints, tmp_path):
    folder, hf = checkpoints["norm-biases-tied"]
    assert_bare_model_matches(folder, "FalconH1Model")
    assert_classifier_pools_the_last_state(folder)
    saved = assert_saved_model_loads_in_transformers(load(folder), hf, tmp_path)
    assert saved["mamba_d_ssm"] is None and saved["mamba_d_head"] == 16 and saved["ssm_multipliers"][1] == 1.5
    assert not {"layer_types", "layers_block_type", "sliding_window"} & set(saved)


def test_lora_matches_peft_and_our_adapter_loads_in_peft(checkpoints, tmp_path):
    assert_lora_matches_peft(checkpoints["gate"], ["in_proj", "q_proj", "k_proj", "gate_proj"], tmp_path)


def test_config_checks_name_the_field():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.config_checks import ConfigFieldError

    config = {"model_type": "falcon_h1", **SHAPES, "mamba_d_ssm": 128}
    assert ModelConfig.from_dict({**config, "mamba_d_head": "auto"}).mamba_d_head == 16
    assert ModelConfig.from_dict({**config, "mamba_d_ssm": None, "mamba_expand": 1,
                                  "mamba_d_head": "auto"}).mamba_d_head == 8  # 1 * 64 / 8
    assert ModelConfig.from_dict({**config, "ssm_multipliers": None}).ssm_multipliers == [1.0] * 5
    with pytest.raises(ValueError, match=r"mamba_n_heads \* mamba_d_head \(8 \* 8\) must equal the mixer's width "
                                         r"\(128"):
        ModelConfig.from_dict({**config, "mamba_d_head": 8})
    with pytest.raises(ValueError, match=r"mamba_n_heads \(8\) must be a multiple of mamba_n_groups \(3\)"):
        ModelConfig.from_dict({**config, "mamba_n_groups": 3})
    with pytest.raises(ValueError, match="ssm_multipliers has 4 entries; it must have 5"):
        ModelConfig.from_dict({**config, "ssm_multipliers": [1.0] * 4})
    with pytest.raises(ConfigFieldError, match="key_multiplier is 0; it must be a positive number"):
        ModelConfig.from_dict({**config, "key_multiplier": 0})
