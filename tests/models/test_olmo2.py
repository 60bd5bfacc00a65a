"""AllenAI OLMo 2 against transformers on tiny random checkpoints: the post-norm layer and the q/k norm over the whole
projection (module names and shapes), logits (eager and sdpa, left padding), greedy tokens (dynamic and static
cache), loss and backward, saving for transformers, the engine, bfloat16 rounding, tp_plan="auto" refused, and
use_kernels (where Triton runs) with no fused residual-add + norm."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 checkpoint_cases, left_padded, load, max_logit_diff)

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    "gqa": dict(),
    "mha-tied-bias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "olmo2", CASES, **TOKENS)


def test_layer_has_the_checkpoint_norms(checkpoints):
    folder, hf = checkpoints["gqa"]
    ours = load(folder)
    assert type(ours).__name__ == "Olmo2ForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    layer = ours.model.layers[0]
    assert not hasattr(layer, "input_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_bfloat16_rounds_like_transformers(checkpoints):
    # OLMo 2's RMSNorm multiplies by its weight before casting back (llama's casts first)
    folder, hf = checkpoints["gqa"]
    ours = load(folder, dtype=torch.bfloat16)
    norm = ours.model.layers[0].post_attention_layernorm
    theirs = copy.deepcopy(hf.model.layers[0].post_attention_layernorm).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(norm(x), theirs(x))
    norms = [name for name, module in ours.named_modules() if type(module).__name__ == "Olmo2RMSNorm"]
    assert len(norms) == 1 + 4 * len(ours.model.layers) and "model.norm" in norms


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["gqa"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[0]
    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_feedforward_layernorm):
        assert norm.weight.grad.abs().sum() > 0


def test_transformers_loads_what_we_save(checkpoints, tmp_path):
    import json

    import transformers

    folder, _ = checkpoints["mha-tied-bias"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Olmo2ForCausalLM"] and "sliding_window" not in saved
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    folder, _ = checkpoints["gqa"]
    model = load(folder)
    assert_engine_matches_generate(model)


def test_tensor_parallel_auto_is_refused(checkpoints):
    # q_norm / k_norm reduce over every head: the llama plan's head split would normalise each slice on its own
    from gpuformers.tensor_parallel import _resolve_plan

    with pytest.raises(NotImplementedError, match='tp_plan="auto" for Olmo2ForCausalLM is not supported'):
        _resolve_plan(load(checkpoints["gqa"][0]), "auto")


def test_use_kernels_keeps_logits(checkpoints, monkeypatch):
    import gpuformers.kernels.mapping as mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    fused = []
    original = mapping._add_rms_norm
    monkeypatch.setattr(mapping, "_add_rms_norm", lambda *a, **k: fused.append(1) or original(*a, **k))
    folder, hf = checkpoints["gqa"]
    ours = load(folder, use_kernels=True, device_map=device)
    assert ours.model.layers[0].self_attn.q_norm.forward.__func__ is mapping._rms_norm_forward
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert not fused  # a post-norm layer has no add followed by a norm
