"""SmolLM3 against transformers on tiny random checkpoints: which layers skip rotary (no_rope_layers, 1 = rotary),
logits (eager and sdpa, left padding), sliding-window NoPE layers, a config.json without the per-layer lists,
greedy tokens (dynamic and static cache), loss and backward, saving for transformers, the engine, use_kernels
(where Triton runs) and tp_plan="auto" over two processes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load, max_logit_diff)

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # transformers' default: every fourth layer is NoPE; tied embeddings (SmolLM3's default)
    "interval-4-tied": dict(num_hidden_layers=4),
    "explicit-untied": dict(no_rope_layers=[0, 1], tie_word_embeddings=False, num_key_value_heads=4),
    # with use_sliding_window the NoPE layers are the sliding ones (layer 1 here); yarn rotary on the others
    "sliding-yarn": dict(num_hidden_layers=3, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5,
                         rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 2_000_000.0,
                                          "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "smollm3", CASES, **TOKENS)


def test_rotary_follows_no_rope_layers(checkpoints):
    # transformers' convention: no_rope_layers[i] == 1 means layer i uses rotary
    for name, expected in [("interval-4-tied", [True, True, True, False]), ("explicit-untied", [False, True])]:
        folder, hf = checkpoints[name]
        ours = load(folder)
        assert [layer.self_attn.use_rope for layer in ours.model.layers] == expected
        assert [bool(layer.self_attn.use_rope) for layer in hf.model.layers] == expected
    windows = [layer.self_attn.sliding_window for layer in load(checkpoints["sliding-yarn"][0]).model.layers]
    assert windows == [None, 5, None]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = load(folder, attn_implementation=attn)
    assert type(ours).__name__ == "SmolLM3ForCausalLM"
    assert max_logit_diff(ours, hf, *left_padded()) < 1e-4


def test_config_without_per_layer_lists(checkpoints, tmp_path):
    # A config.json that leaves no_rope_layers and layer_types out gets transformers' defaults.
    import shutil

    folder, hf = checkpoints["sliding-yarn"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, no_rope_layers=None, layer_types=None)
    ours = load(tmp_path)
    assert ours.config.no_rope_layers == [1, 0, 1]
    assert ours.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert max_logit_diff(ours, hf, *left_padded()) < 1e-4


def test_bad_no_rope_layers_is_an_error(checkpoints, tmp_path):
    import shutil

    shutil.copytree(checkpoints["explicit-untied"][0], tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, no_rope_layers=[1])
    with pytest.raises(ValueError, match="no_rope_layers has 1 entries but num_hidden_layers is 2"):
        load(tmp_path)


@pytest.mark.parametrize("case", ["interval-4-tied", "sliding-yarn"])
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["explicit-untied"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    assert all(layer.self_attn.k_proj.weight.grad.abs().sum() > 0 for layer in ours.model.layers)


def test_transformers_loads_what_we_save(checkpoints, tmp_path):
    import transformers

    folder, _ = checkpoints["sliding-yarn"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["SmolLM3ForCausalLM"] and saved["no_rope_layers"] == [1, 0, 1]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    folder, _ = checkpoints["sliding-yarn"]
    model = load(folder)
    # prompts longer than the window of 5
    assert_engine_matches_generate(model, [[5, 9, 23, 42, 17, 3, 99, 12], [7, 64, 100, 3, 8, 2, 77], [11]])


def test_use_kernels_keeps_logits(checkpoints):
    from gpuformers.kernels.mapping import kernels_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({kernels_available(device)[1]})")
    folder, hf = checkpoints["interval-4-tied"]
    ours = load(folder, use_kernels=True, device_map=device)
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4


@pytest.mark.distributed
def test_two_processes_match_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (the llama plan) under torchrun, 2 processes on gloo: tests/tp_worker.py compares the split
    # model's logits, greedy tokens, saved checkpoint and engine with the whole model's.
    assert_tensor_parallel_matches(checkpoints["explicit-untied"][0], tmp_path)