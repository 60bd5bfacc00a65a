"""Seed-OSS against transformers on tiny random checkpoints: the checkpoint's modules (q/k/v biases with
attention_bias, o_proj's with attention_out_bias), config defaults, logits (eager and sdpa, left padding), training
logits with the same dropout masks (attention_dropout and residual_dropout), greedy tokens (dynamic and static cache),
loss and backward, saving for transformers, the engine, tp_plan="auto" over two processes, and use_kernels (where
Triton runs) keeping the branch dropouts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load, max_logit_diff,
                                 train_logits)

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Seed-OSS's defaults put bos at 0, pad at 1 and head_dim at 128: a tiny head_dim (16) and llama's tokens are given.
COMMON = dict(head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # Seed-OSS-36B: GQA, q/k/v biases, none on o_proj, dropouts 0.1 (the defaults)
    "gqa": {},
    # multi-head, tied, o_proj and MLP biases without q/k/v ones, linear rope scaling
    "mha-tied-outbias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=False,
                             attention_out_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "seed_oss", CASES, **COMMON)


@pytest.mark.parametrize("case", list(CASES))
def test_modules_are_the_checkpoint_s(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = load(folder)
    assert type(ours).__name__ == "SeedOssForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    assert {p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj)} == {hf.config.attention_bias}
    assert (attn.o_proj.bias is not None) == hf.config.attention_out_bias
    assert (mlp.down_proj.bias is not None) == hf.config.mlp_bias


def test_config_defaults_match_transformers():
    # a config.json naming only the sizes: transformers' defaults (head_dim 128, 8 kv heads, q/k/v biases, dropouts)
    import transformers

    from gpuformers import AutoConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)
    ours, theirs = AutoConfig.for_model("seed_oss", **sizes), transformers.AutoConfig.for_model("seed_oss", **sizes)
    for field in ("head_dim", "num_key_value_heads", "attention_bias", "mlp_bias", "attention_dropout", "rms_norm_eps",
                  "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                  "rope_parameters"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("attention_out_bias", "residual_dropout"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.qkv_bias and not ours.o_bias
    assert ours.layer_types == ["full_attention"] * 2 and ours.sliding_window is None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_training_dropouts_match_transformers(checkpoints, attn):
    # The same seed draws the same masks in both libraries when the dropouts come in transformers' order: the
    # attention weights, then o_proj's output, then the MLP's, layer by layer.
    folder, hf = checkpoints["gqa"]
    ours = load(folder, attn_implementation=attn)
    hf.set_attn_implementation(attn)
    try:
        expected = train_logits(hf, seed=3)
        assert (train_logits(ours, seed=3) - expected).abs().max() < 1e-4
        assert (train_logits(ours, seed=4) - expected).abs().max() > 1e-2  # the masks do change the logits
    finally:
        hf.set_attn_implementation("sdpa")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["mha-tied-outbias"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    attn = ours.model.layers[0].self_attn
    for param in (attn.q_proj.weight, attn.o_proj.bias, ours.model.layers[0].mlp.down_proj.bias):
        assert param.grad.abs().sum() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    import transformers

    folder, hf = checkpoints[case]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["SeedOssForCausalLM"] and not {"sliding_window", "layer_types"} & set(saved)
    assert (saved["attention_bias"], saved["attention_out_bias"], saved["residual_dropout"]) == \
        (hf.config.attention_bias, hf.config.attention_out_bias, hf.config.residual_dropout)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    assert_engine_matches_generate(load(checkpoints["gqa"][0]))


@pytest.mark.distributed
def test_two_processes_match_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (the llama plan) under torchrun, 2 processes on gloo, on the case with o_proj and MLP biases:
    # rowwise biases must be added once, after the sum. tests/tp_worker.py compares the split model's logits,
    # greedy tokens, saved checkpoint and engine with the whole model's.
    result = assert_tensor_parallel_matches(checkpoints["mha-tied-outbias"][0], tmp_path)
    assert result["local_shapes"]["q_proj"] == [32, 64]


def test_use_kernels_keeps_logits_and_the_branch_dropouts(checkpoints, monkeypatch):
    import gpuformers.kernels.swiglu as swiglu
    from gpuformers.kernels import mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    folder, hf = checkpoints["gqa"]
    ours = load(folder, use_kernels=True, device_map=device)
    mlp = ours.model.layers[0].mlp
    assert mlp.forward.__func__ is mapping._swiglu_mlp_forward
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    if device == "cpu":  # the same seed, the same masks: the kernelized MLP's output is still dropped out
        calls = []
        original = swiglu.silu_and_mul
        monkeypatch.setattr(swiglu, "silu_and_mul", lambda *a: calls.append(1) or original(*a))
        assert (train_logits(ours, seed=3) - train_logits(hf, seed=3)).abs().max() < 1e-4
        assert len(calls) == len(ours.model.layers)  # train() kept the SwiGLU kernel
