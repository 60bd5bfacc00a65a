"""OLMoE against transformers on tiny random checkpoints: logits (eager and sdpa, left padding), greedy tokens
(dynamic and static cache), loss and backward, router logits and the aux loss with their gradients, clip_qkv, the
q/k norm over the whole projection with llama's rounding, config defaults, saving (the Hub's key layout), the
engine, use_kernels (the fused MoE kernel under the Triton interpreter on the CPU), and tp_plan="auto" refused."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.fixtures.checkpoints import make_checkpoint
from tests.models.parity import (assert_engine_matches_generate, assert_moe_loss_and_grads_match, count_fused_moe_calls,
                                 left_padded, load)

if not torch.cuda.is_available():  # before the kernels are imported: the fused MoE kernel runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

MOE = dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    "gqa": {},
    # clip 0.5 bites: q and k leave their norms with unit RMS, and v_proj's outputs reach past it too
    "mha-tied-bias-clip-top3-normtopk-linear-rope": dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, clip_qkv=0.5, num_experts_per_tok=3,
        norm_topk_prob=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}


def _checkpoint(folder, **overrides):
    """transformers' OLMoE saved to `folder`, its routers perturbed so that routing differs between tokens."""
    hf = make_checkpoint(folder, "olmoe", **{**MOE, **overrides})
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("v_proj.weight"):
                p.mul_(8)  # v reaches past clip_qkv
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: (folder := tmp_path_factory.mktemp(f"olmoe-{name}"), _checkpoint(folder, **overrides))
            for name, overrides in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_tokens_match_transformers(checkpoints, case):
    from gpuformers.models.olmoe import OlmoeForCausalLM

    folder, hf = checkpoints[case]
    ids, mask = left_padded(seq=14, pad=3)
    labels = ids.masked_fill(mask == 0, -100)
    for attn in ("eager", "sdpa"):  # sdpa last: the fixture's model stays as it came
        ours = load(folder, attn_implementation=attn)
        hf.set_attn_implementation(attn)
        assert type(ours) is OlmoeForCausalLM
        with torch.no_grad():
            theirs, mine = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    for cache in (None, "static"):
        greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                      cache_implementation=cache)
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy)), cache
    ours.train()
    ours(ids, attention_mask=mask, labels=labels).loss.backward()
    attn = ours.model.layers[0].self_attn
    assert attn.q_norm.weight.grad.abs().sum() > 0 and attn.k_norm.weight.grad.abs().sum() > 0


def test_clip_qkv_changes_the_logits(checkpoints):
    # the clipped case's logits (equal to transformers' above) differ from the same weights unclipped
    folder, hf = checkpoints["mha-tied-bias-clip-top3-normtopk-linear-rope"]
    unclipped = copy.deepcopy(hf)
    unclipped.config.clip_qkv = None
    ids, mask = left_padded()
    with torch.no_grad():
        diff = load(folder)(ids, attention_mask=mask).logits - unclipped(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() > 1e-2


def test_modules_config_defaults_and_refusals(checkpoints):
    from safetensors import safe_open

    from gpuformers.models.config import ModelConfig

    folder, hf = checkpoints["gqa"]
    ours = load(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:  # transformers' own save: the Hub's layout
        hub = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == hub
    assert hub["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    attn = ours.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)  # over all (kv) heads

    bare = ModelConfig.from_dict(dict(model_type="olmoe", vocab_size=128, hidden_size=64, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4))
    # transformers' OlmoeConfig defaults where config.json is silent
    assert (bare.max_position_embeddings, bare.rms_norm_eps, bare.pad_token_id, bare.eos_token_id,
            bare.num_key_value_heads, bare.sliding_window) == (4096, 1e-5, 1, 50279, 4, None)
    assert {k: getattr(bare, k) for k in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "clip_qkv",
                                       "router_aux_loss_coef", "output_router_logits")} == dict(
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None, router_aux_loss_coef=0.01,
        output_router_logits=False)
    renamed = {k: v for k, v in bare.to_dict().items() if k != "num_experts"}  # transformers' other name for it
    assert ModelConfig.from_dict(dict(renamed, num_local_experts=6)).num_experts == 6
    with pytest.raises(ValueError, match="head_dim must be hidden_size / num_attention_heads = 16, got 32"):
        ModelConfig.from_dict(dict(bare.to_dict(), head_dim=32))
    with pytest.raises(ValueError, match="clip_qkv is -1; it must be a positive number or null"):
        ModelConfig.from_dict(dict(bare.to_dict(), clip_qkv=-1))

    from gpuformers.tensor_parallel import _resolve_plan

    with pytest.raises(NotImplementedError, match='tp_plan="auto" for OlmoeForCausalLM is not supported'):
        _resolve_plan(ours, "auto")


def test_bfloat16_qk_norm_rounds_like_transformers(checkpoints):
    # OLMoE's norms are llama's (cast back, then the weight), not OLMo 2's (the weight in float32, then the cast)
    folder, hf = checkpoints["gqa"]
    ours = load(folder, dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    theirs = copy.deepcopy(hf.model.layers[0].self_attn.q_norm).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.model.layers[0].self_attn.q_norm(x), theirs(x))


def test_aux_loss_router_logits_and_gradients_match_transformers(tmp_path):
    hf = _checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5, clip_qkv=0.5)
    # every layer is sparse: two routers
    assert_moe_loss_and_grads_match(load(tmp_path), hf, 2, (
        "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.v_proj.weight"), expert_layer=1)


def test_saved_checkpoint_has_the_hub_layout_and_loads_in_transformers(checkpoints, tmp_path):
    import json

    import transformers
    from safetensors import safe_open

    folder, hf = checkpoints["mha-tied-bias-clip-top3-normtopk-linear-rope"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f, safe_open(folder / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["OlmoeForCausalLM"] and saved["clip_qkv"] == 0.5 and saved["num_experts"] == 4
    assert not {"sliding_window", "layer_types", "head_dim", "mlp_bias"} & set(saved)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_generate(checkpoints, case):
    assert_engine_matches_generate(load(checkpoints[case][0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test; on a GPU tests/kernels runs the kernel")
def test_use_kernels_runs_the_fused_moe_kernel_with_the_same_logits(checkpoints, monkeypatch):
    calls = count_fused_moe_calls(monkeypatch)
    folder, hf = checkpoints["mha-tied-bias-clip-top3-normtopk-linear-rope"]
    fast = load(folder, use_kernels=True)
    ids = left_padded(seq=12)[0]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == 2  # both layers' experts went through the kernel
