"""EXAONE 4.0 against transformers on tiny random checkpoints: the post-norm layer, per-head q/k norm and the NoPE
global layers of a hybrid model (module names, which layers slide and rotate), logits (eager and sdpa, left padding,
prompts longer than the window), layer types derived from sliding_window_pattern, greedy tokens (dynamic and static
cache), loss and backward, bfloat16 rounding, saving for transformers, the engine, use_kernels (where Triton runs)
with no fused residual-add + norm, and tp_plan="auto" over two processes."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load, max_logit_diff)

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # as EXAONE-4.0-32B: three sliding layers (rotary, llama3-scaled) then a global NoPE one (the default pattern 4),
    # a window of 5 that the 16-token prompts overrun
    "hybrid": dict(num_hidden_layers=4, sliding_window=5,
                   rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 1_000_000.0}),
    # as EXAONE-4.0-1.2B: no window, every layer global and rotating; tied embeddings, no GQA
    "global-tied": dict(sliding_window=None, layer_types=["full_attention"] * 2, tie_word_embeddings=True,
                        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}
LONG_PROMPTS = [[5, 9, 23, 42, 17, 3, 99, 12], [7, 64, 100, 3, 8, 2, 77], [11]]  # the first two overrun the window


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "exaone4", CASES, **TOKENS)


def test_layers_slide_and_rotate_as_transformers(checkpoints):
    folder, hf = checkpoints["hybrid"]
    ours = load(folder)
    assert type(ours).__name__ == "Exaone4ForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    layers = ours.model.layers
    assert not hasattr(layers[0], "input_layernorm") and layers[0].self_attn.q_norm.weight.shape == (16,)
    assert [layer.self_attn.sliding_window for layer in layers] == [5, 5, 5, None]
    assert [layer.self_attn.use_rope for layer in layers] == [True, True, True, False]
    assert [layer.self_attn.is_sliding for layer in hf.model.layers] == [True, True, True, False]
    everywhere = load(checkpoints["global-tied"][0]).model.layers
    assert [(layer.self_attn.sliding_window, layer.self_attn.use_rope) for layer in everywhere] == [(None, True)] * 2


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


@pytest.mark.parametrize("pattern", [4, "LLLG"])
def test_layer_types_come_from_sliding_window_pattern(checkpoints, tmp_path, pattern):
    # A config.json without layer_types: every 4th layer is global (transformers' rule for an integer), and the
    # string form means the same layers
    folder, hf = checkpoints["hybrid"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, layer_types=None, sliding_window_pattern=pattern)
    ours = load(tmp_path)
    assert ours.config.layer_types == hf.config.layer_types
    assert max_logit_diff(ours, hf, *left_padded()) < 1e-4


def test_defaults_are_transformers_and_biases_are_never_built():
    import transformers

    from gpuformers.models.config import ModelConfig

    sizes = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=8, num_attention_heads=32)
    theirs = transformers.Exaone4Config(**sizes)
    ours = ModelConfig.from_dict({"model_type": "exaone4", **sizes})
    for name in ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "sliding_window", "layer_types",
                 "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.sliding_window_pattern == theirs.sliding_window_pattern
    assert ours.rope_parameters == theirs.rope_parameters
    # transformers' EXAONE 4 has no bias anywhere, whatever config.json says
    biased = ModelConfig.from_dict({"model_type": "exaone4", **sizes, "attention_bias": True, "mlp_bias": True})
    assert not (biased.qkv_bias or biased.o_bias or biased.mlp_bias)


def test_layer_types_without_a_window_or_a_pattern():
    from gpuformers.models.config import ModelConfig

    sizes = dict(model_type="exaone4", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                 num_attention_heads=4, num_key_value_heads=2)
    # a string pattern repeats, and the last layer is global whatever it says
    assert ModelConfig.from_dict({**sizes, "sliding_window_pattern": "LG"}).layer_types == \
        ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert ModelConfig.from_dict({**sizes, "sliding_window": None}).layer_types == ["full_attention"] * 5
    with pytest.raises(ValueError, match="sliding_window_pattern 'LXG' does not say which layers slide"):
        ModelConfig.from_dict({**sizes, "sliding_window_pattern": "LXG"})
    with pytest.raises(ValueError, match="sliding_attention layers but sliding_window is null"):
        ModelConfig.from_dict({**sizes, "sliding_window": None, "layer_types": ["sliding_attention"] * 5})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    # 10-token prompts and 10 new tokens: the hybrid model's window of 5 slides during prefill and decode
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["hybrid"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[-1]  # the NoPE layer
    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_attention_layernorm,
                 layer.post_feedforward_layernorm):
        assert norm.weight.grad.abs().sum() > 0


def test_bfloat16_rounds_like_transformers(checkpoints):
    # EXAONE 4's RMSNorm is llama's (cast back, then the weight), not OLMo 2's, whose layer it otherwise shares
    folder, hf = checkpoints["hybrid"]
    ours = load(folder, dtype=torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
        theirs = copy.deepcopy(getattr(hf.model.layers[0], name)).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(getattr(ours.model.layers[0], name)(x), theirs(x))


def test_transformers_loads_what_we_save(checkpoints, tmp_path):
    import transformers

    folder, _ = checkpoints["hybrid"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Exaone4ForCausalLM"] and saved["sliding_window_pattern"] == 4
    assert saved["layer_types"][-1] == "full_attention" and "attention_bias" not in saved
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_generate(checkpoints, case):
    assert_engine_matches_generate(load(checkpoints[case][0]), LONG_PROMPTS)


def test_use_kernels_keeps_logits(checkpoints, monkeypatch):
    import gpuformers.kernels.mapping as mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    fused = []
    original = mapping._add_rms_norm
    monkeypatch.setattr(mapping, "_add_rms_norm", lambda *a, **k: fused.append(1) or original(*a, **k))
    folder, hf = checkpoints["hybrid"]
    ours = load(folder, use_kernels=True, device_map=device)
    layer = ours.model.layers[0]
    assert layer.self_attn.q_norm.forward.__func__ is mapping._rms_norm_forward
    assert layer.post_feedforward_layernorm.forward.__func__ is mapping._rms_norm_forward
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert not fused  # a post-norm layer has no add followed by a norm


@pytest.mark.distributed
def test_two_processes_match_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (the llama plan: q_norm / k_norm work within a head) under torchrun, 2 processes on gloo:
    # tests/tp_worker.py compares the split model's logits, greedy tokens, saved checkpoint and engine with the
    # whole model's, on the hybrid checkpoint (8- and 20-token prompts overrun its window of 5).
    result = assert_tensor_parallel_matches(checkpoints["hybrid"][0], tmp_path)
    assert result["local_shapes"]["q_proj"] == [32, 64] and result["local_shapes"]["k_proj"] == [16, 64]