"""IBM Granite 3 against transformers on tiny random checkpoints: logits (eager and sdpa, left padding, embeddings
passed in), greedy tokens (dynamic and static cache), loss and backward, saving for transformers, the engine,
use_kernels (where Triton runs) without the fused LM-head loss, and tp_plan="auto" (the llama plan) over two
processes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load)

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Multipliers far from 1 (and attention_multiplier far from 1/sqrt(head_dim) = 0.25), so that each one shows.
CASES = {
    "gqa": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.04, logits_scaling=8.0),
    "mha-tied-bias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                          embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.5,
                          logits_scaling=0.25, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "granite", CASES, **TOKENS)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = load(folder, attn_implementation=attn)
    assert type(ours).__name__ == "GraniteForCausalLM"
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits
        # embeddings passed in are scaled by embedding_multiplier too, as in transformers
        embeds = hf.get_input_embeddings()(ids)
        embeds_diff = (ours(inputs_embeds=embeds, attention_mask=mask).logits
                       - hf(inputs_embeds=embeds, attention_mask=mask).logits)
    assert diff[mask.bool()].abs().max() < 1e-4
    assert embeds_diff[mask.bool()].abs().max() < 1e-4


def test_training_loss_keeps_logits_scaling(checkpoints):
    # The Trainer's step reads no logits (logits_not_needed): a model whose logits are the head's output then fuses
    # head and loss; Granite's must not, or its loss would skip the division by logits_scaling.
    from gpuformers.layers.loss import logits_not_needed

    folder, hf = checkpoints["gqa"]
    ours = load(folder).train()
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    with logits_not_needed():
        loss = ours(ids, attention_mask=mask, labels=labels).loss
    with torch.no_grad():
        expected = hf.eval()(ids, attention_mask=mask, labels=labels).loss
    assert abs(loss.item() - expected.item()) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["gqa"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    assert ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert ours.model.embed_tokens.weight.grad.abs().sum() > 0


def test_transformers_loads_what_we_save(checkpoints, tmp_path):
    import transformers

    folder, _ = checkpoints["mha-tied-bias"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GraniteForCausalLM"] and "layer_types" not in saved
    assert (saved["embedding_multiplier"], saved["logits_scaling"]) == (3.0, 0.25)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, mask = left_padded()
    with torch.no_grad():
        diff = back(ids, attention_mask=mask).logits - ours(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-5


def test_engine_matches_generate(checkpoints):
    folder, _ = checkpoints["gqa"]
    model = load(folder)
    assert_engine_matches_generate(model)


def test_use_kernels_keeps_logits_and_leaves_out_the_fused_head_loss(checkpoints):
    from gpuformers.kernels.mapping import kernels_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({kernels_available(device)[1]})")
    folder, hf = checkpoints["gqa"]
    ours = load(folder, use_kernels=True, device_map=device)
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert "AddRMSNorm" in ours._kernel_state.functions  # the fused add + norm is right for the scaled branch
    ours.train()
    labels = ids.masked_fill(mask == 0, -100)
    loss = ours(ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss.detach().cpu(), expected, atol=1e-4, rtol=0)


@pytest.mark.distributed
def test_two_processes_match_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (the llama plan) under torchrun, 2 processes on gloo: tests/tp_worker.py compares the split
    # model's logits, greedy tokens, saved checkpoint and engine with the whole model's.
    assert_tensor_parallel_matches(checkpoints["gqa"][0], tmp_path)