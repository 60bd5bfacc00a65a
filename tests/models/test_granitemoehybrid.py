"""Granite 4.0 (granitemoehybrid) against transformers' GraniteMoeHybridForCausalLM on tiny random hybrid checkpoints
(mamba and attention layers; n_groups > 1; chunk sizes that do not divide the prompts; Granite's four multipliers off
their defaults): the checkpoint layout (fused experts as saved), logits, loss and gradients, one cache from prefill to
decode, greedy, sampling and beam-search tokens, the bare model, saving for transformers, transformers' in-memory
layout, and the config checks. Two cases: a MoE with rotary positions, and a dense model (num_local_experts 0) with no
positions, a tied head and biases."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import checkpoint_cases, left_padded, load, max_logit_diff
from tests.models.recurrent import (assert_bare_model_matches, assert_classifier_pools_the_last_state,
                                    assert_generation_continues_from_its_cache, assert_greedy_matches,
                                    assert_lora_matches_peft, assert_loss_and_gradients_match,
                                    assert_sampling_and_beams_match, assert_saved_model_loads_in_transformers,
                                    cached_pieces_minus_full)

BLOCKS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, shared_intermediate_size=48,
              embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)
CASES = {
    # 4 experts, top 2; rotary positions; 2 groups, chunks of 5 over prompts of 16, 10, 7 tokens
    "moe-rope": dict(layer_types=BLOCKS, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
                     mamba_n_groups=2, mamba_chunk_size=5),
    # dense (the shared MLP alone), no positions, 4 groups, chunks of 3, a conv of 3 taps without bias, in_proj and
    # out_proj biases, a tied head
    "dense-nope": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                       num_local_experts=0, mamba_n_groups=4, mamba_chunk_size=3, mamba_d_conv=3,
                       mamba_conv_bias=False, mamba_proj_bias=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model). The MoE case's experts are scaled up (transformers draws std 0.02), so
    that which experts a token reaches shows in the logits; saved again. The dense case's config.json is rewritten in
    the released checkpoints' spellings: blocks "mamba" / "attention", position_embedding_type "nope"."""
    cases = checkpoint_cases(tmp_path_factory, "granitemoehybrid", CASES, **SHAPES)
    folder, hf = cases["moe-rope"]
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if ".experts." in name or name.endswith("router.weight"):
                tensor.mul_(10.0)
    hf.save_pretrained(folder)
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    rewrite_config(cases["dense-nope"][0], position_embedding_type="nope",
                   layer_types=[legacy[b] for b in CASES["dense-nope"]["layer_types"]])
    return cases


def _checkpoint_name(name: str) -> str:
    """transformers' in-memory parameter name -> ours (the Hub's key)."""
    return (name.replace("experts.gate_up_proj", "input_linear.weight")
            .replace("experts.down_proj", "output_linear.weight").replace("router.weight", "router.layer.weight"))


@pytest.mark.parametrize("case", list(CASES))
def test_layout_is_the_saved_checkpoints(checkpoints, case):
    folder, _ = checkpoints[case]
    ours = load(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        assert ("model.layers.0.block_sparse_moe.input_linear.weight" in saved) == (case == "moe-rope")
    tied = {"lm_head.weight"} if case == "dense-nope" else set()
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items() if k not in tied} == saved
    assert [layer.block_type for layer in ours.model.layers] == CASES[case]["layer_types"]
    assert ours.no_split_modules == ("GraniteMoeHybridDecoderLayer",)


@pytest.mark.parametrize("case,attn", [("moe-rope", "sdpa"), ("moe-rope", "eager"), ("dense-nope", "sdpa")])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_the_experts_take_part(checkpoints):
    """The parity above would hold with a broken router if the experts changed nothing: zeroing one expert moves the
    logits."""
    folder, _ = checkpoints["moe-rope"]
    ours = load(folder)
    ids, mask = left_padded()
    with torch.no_grad():
        before = ours(ids, attention_mask=mask).logits
        ours.model.layers[1].block_sparse_moe.output_linear.weight[0].zero_()
        assert (ours(ids, attention_mask=mask).logits - before).abs().max() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_loss_and_gradients_match(load(folder), hf, _checkpoint_name)


@pytest.mark.parametrize("case", list(CASES))
def test_one_cache_carries_states_and_keys_from_prefill_to_decode(checkpoints, case):
    cache, diff = cached_pieces_minus_full(load(checkpoints[case][0]), prompt=7, chunk=3, total=14)
    assert [cache.get_seq_length(i) for i in range(4)] == [14] * 4
    assert diff.abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf)


def test_generate_continues_from_a_returned_cache(checkpoints):
    """A second turn from the cache the first returned (states, and keys and values at their positions)."""
    assert_generation_continues_from_its_cache(load(checkpoints["moe-rope"][0]))


def test_sampling_and_beam_search_match_transformers(checkpoints):
    folder, hf = checkpoints["moe-rope"]
    assert_sampling_and_beams_match(load(folder), hf)


def test_bare_model_classifier_and_saving_for_transformers(checkpoints, tmp_path):
    for case in CASES:
        folder, hf = checkpoints[case]
        assert_bare_model_matches(folder, "GraniteMoeHybridModel")
        assert_classifier_pools_the_last_state(folder)
        saved = assert_saved_model_loads_in_transformers(load(folder), hf, tmp_path / case)
        assert saved["layer_types"] == CASES[case]["layer_types"] and saved["mamba_d_head"] == 16  # remapped
        assert not {"head_dim", "sliding_window", "layers_block_type"} & set(saved)


def test_transformers_in_memory_layout_loads(checkpoints, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers' in-memory names (experts.gate_up_proj,
    experts.down_proj, router.weight): they load through rename rules."""
    folder, hf = checkpoints["moe-rope"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in set(f.keys())
    assert max_logit_diff(load(tmp_path), hf, *left_padded()) < 1e-4


def test_config_checks_name_the_field():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.config_checks import ConfigFieldError

    config = {"model_type": "granitemoehybrid", **SHAPES, "layer_types": BLOCKS}
    assert ModelConfig.from_dict({**config, "mamba_d_head": "auto"}).mamba_d_head == 16  # 2 * 64 / 8
    with pytest.raises(ValueError, match=r"mamba_n_heads \* mamba_d_head \(8 \* 8\) must equal mamba_expand"):
        ModelConfig.from_dict({**config, "mamba_d_head": 8})
    with pytest.raises(ValueError, match=r"mamba_n_heads \(8\) must be a multiple of mamba_n_groups \(3\)"):
        ModelConfig.from_dict({**config, "mamba_n_groups": 3})
    assert ModelConfig.from_dict({**config, "layer_types": ["mamba", "attention"] * 2}).layer_types == BLOCKS
    with pytest.raises(ConfigFieldError, match=r"layer_types has the block types \['moe'\]"):
        ModelConfig.from_dict({**config, "layer_types": ["moe", "full_attention"] * 2})
    with pytest.raises(ConfigFieldError, match="mamba_d_state is 0; it must be a positive integer"):
        ModelConfig.from_dict({**config, "mamba_d_state": 0})
    with pytest.raises(NotImplementedError, match="output_router_logits=true"):
        ModelConfig.from_dict({**config, "output_router_logits": True})
    with pytest.raises(NotImplementedError, match="position_embedding_type 'alibi'"):
        ModelConfig.from_dict({**config, "position_embedding_type": "alibi"})


def test_lora_matches_peft_and_our_adapter_loads_in_peft(checkpoints, tmp_path):
    """LoRA on the mamba in_proj, the attention and the shared MLP (module names are transformers')."""
    assert_lora_matches_peft(checkpoints["moe-rope"], ["in_proj", "q_proj", "v_proj", "shared_mlp.input_linear"],
                             tmp_path)
