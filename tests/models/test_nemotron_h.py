"""Nemotron-H against transformers' NemotronHForCausalLM on tiny random hybrid checkpoints (mamba, attention, MLP and
MoE blocks; n_groups > 1; chunk sizes that do not divide the prompts): the checkpoint layout, logits, loss and gradients,
one cache holding the mamba states and the attention keys and values (prefill then decode), greedy, sampling and
beam search tokens, the bare model, saving for transformers, the older config spellings (hybrid_override_pattern,
mamba_* names), LoRA against peft, and the refusals (bad expert groups)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import checkpoint_cases, left_padded, load, max_logit_diff
from tests.models.recurrent import (assert_generation_continues_from_its_cache, assert_greedy_matches,
                                    assert_loss_and_gradients_match, assert_sampling_and_beams_match,
                                    cached_pieces_minus_full)

BLOCKS = ["linear_attention", "full_attention", "mlp", "linear_attention", "full_attention", "mlp"]
SHAPES = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16)
CASES = {
    "hybrid": dict(layers_block_type=BLOCKS, n_groups=2, chunk_size=5),
    # read back below from the older spellings: hybrid_override_pattern and mamba_* names
    "pattern-tied-bias": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
                              n_groups=4, chunk_size=3, tie_word_embeddings=True, use_bias=True, mlp_bias=True),
    # sparse blocks: 8 experts in 2 groups (the best group kept), top 2, a latent projection, biases on the shared
    # expert and the projections; the router's correction bias perturbed (fixture)
    "moe": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_groups=2, chunk_size=5,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48, moe_latent_size=32, mlp_bias=True, routed_scaling_factor=2.5),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model); the second case's config.json in the older spellings. In the MoE case
    the routed experts' weights are scaled up and the router's correction biases made nonzero (transformers draws
    std 0.02 and zeros), so that which experts a token reaches shows in the logits; saved again."""
    cases = checkpoint_cases(tmp_path_factory, "nemotron_h", CASES, **SHAPES)
    folder, hf = cases["moe"]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, tensor in [*hf.named_buffers(), *hf.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
            elif name.endswith(("experts.up_proj", "experts.down_proj")):
                tensor.mul_(10.0)
    hf.save_pretrained(folder)
    folder = cases["pattern-tied-bias"][0]
    data = json.loads((folder / "config.json").read_text())
    rewrite_config(folder, layers_block_type=None, hybrid_override_pattern="M-*M", n_groups=None, chunk_size=None,
                   mamba_n_groups=data["n_groups"], mamba_chunk_size=data["chunk_size"])
    return cases


@pytest.mark.parametrize("case", ["hybrid", "moe"])
def test_layout_is_the_saved_checkpoints(checkpoints, case):
    folder, _ = checkpoints[case]
    ours = load(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == saved
    assert [layer.block_type for layer in ours.model.layers] == CASES[case]["layers_block_type"]
    assert ours.no_split_modules == ("NemotronHBlock",)


@pytest.mark.parametrize("case,attn", [("hybrid", "sdpa"), ("hybrid", "eager"), ("pattern-tied-bias", "sdpa"),
                                       ("moe", "sdpa")])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = load(folder, attn_implementation=attn)
    if case == "pattern-tied-bias":
        assert ours.config.layers_block_type == CASES[case]["layers_block_type"] and ours.config.n_groups == 4
    assert max_logit_diff(ours, hf, *left_padded()) < 1e-4


def test_loss_and_gradients_match_transformers(checkpoints):
    folder, hf = checkpoints["hybrid"]
    # transformers keeps the stack as `model` in memory (and saves it as `backbone`, as we keep it)
    assert_loss_and_gradients_match(load(folder), hf, lambda name: name.replace("model.", "backbone.", 1))


def test_moe_loss_and_gradients_match_transformers(checkpoints):
    """transformers stacks each layer's experts ((experts, out, in) tensors): ours one Linear each; an expert no token
    reached has no gradient (zeros there). The correction bias is a buffer: no gradient in either."""
    folder, hf = checkpoints["moe"]
    ours, hf = load(folder).train(), copy.deepcopy(hf).train()
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    expected, got = hf(ids, attention_mask=mask, labels=labels).loss, ours(ids, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - expected.item()) < 1e-5
    expected.backward(), got.backward()
    theirs = dict(hf.named_parameters())
    for i, block in enumerate(CASES["moe"]["layers_block_type"]):
        if block != "moe":
            continue
        mine = ours.model.layers[i].mixer
        for name in ("up_proj", "down_proj"):
            stacked = torch.stack([getattr(e, name).weight.grad if getattr(e, name).weight.grad is not None
                                   else torch.zeros_like(getattr(e, name).weight) for e in mine.experts])
            torch.testing.assert_close(stacked, theirs[f"model.layers.{i}.mixer.experts.{name}"].grad,
                                       atol=1e-6, rtol=1e-5)
        for name in ("gate.weight", "shared_experts.up_proj.weight", "fc1_latent_proj.weight", "fc2_latent_proj.bias"):
            torch.testing.assert_close(mine.get_parameter(name).grad,
                                       theirs[f"model.layers.{i}.mixer.{name}"].grad, atol=1e-6, rtol=1e-5)


def test_one_cache_carries_states_and_keys_from_prefill_to_decode(checkpoints):
    cache, diff = cached_pieces_minus_full(load(checkpoints["hybrid"][0]), prompt=7, chunk=3, total=14)
    assert [cache.get_seq_length(i) for i in range(len(BLOCKS))] == [14, 14, 0, 14, 14, 0]
    assert diff.abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf)


def test_sampling_and_beam_search_match_transformers(checkpoints):
    folder, hf = checkpoints["hybrid"]
    assert_sampling_and_beams_match(load(folder), hf)


def test_generate_continues_from_a_returned_cache(checkpoints):
    assert_generation_continues_from_its_cache(load(checkpoints["hybrid"][0]))


def test_bare_model_and_saving_for_transformers(checkpoints, tmp_path):
    import transformers

    from gpuformers import AutoModel

    folder, hf = checkpoints["pattern-tied-bias"]
    ids, mask = left_padded()
    ours = AutoModel.from_pretrained(folder, progress=False)
    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    assert type(ours).__name__ == "NemotronHModel"
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4

    load(folder).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layers_block_type"] == CASES["pattern-tied-bias"]["layers_block_type"] and saved["n_groups"] == 4
    assert not {"hybrid_override_pattern", "mamba_n_groups", "layer_types", "rope_theta", "num_hidden_layers"} & set(
        saved)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_logit_diff(reloaded, hf, *left_padded()) == 0.0


def test_refusals_name_what_is_missing(checkpoints):
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.config_checks import ConfigFieldError

    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) must split into n_group \(3\) groups"):
        ModelConfig.from_dict({"model_type": "nemotron_h", **SHAPES, "hybrid_override_pattern": "M*E", "n_group": 3})
    with pytest.raises(ConfigFieldError, match=r"hybrid_override_pattern 'M\*X' has the letters \['X'\]"):
        ModelConfig.from_dict({"model_type": "nemotron_h", **SHAPES, "hybrid_override_pattern": "M*X"})


def test_mamba_sizes_are_range_checked():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.config_checks import ConfigFieldError

    config = {"model_type": "nemotron_h", **SHAPES, "hybrid_override_pattern": "M*"}
    with pytest.raises(ConfigFieldError, match="ssm_state_size is 0; it must be a positive integer"):
        ModelConfig.from_dict({**config, "ssm_state_size": 0})
    with pytest.raises(ValueError, match=r"mamba_num_heads \(8\) must be a multiple of n_groups \(3\)"):
        ModelConfig.from_dict({**config, "mamba_n_groups": 3})  # the older spelling, read as n_groups


def test_lora_matches_peft_and_our_adapter_loads_in_peft(checkpoints, tmp_path):
    """Adapter keys use transformers' module names (model.layers..., ours backbone.layers...), both ways."""
    import peft

    from tests.test_lora import _peft_pair

    folder, hf = checkpoints["hybrid"]
    ours, theirs = _peft_pair(checkpoints["hybrid"], r=4, lora_alpha=8,
                              target_modules=["in_proj", "q_proj", "v_proj", "up_proj"])
    assert max_logit_diff(ours, theirs, *left_padded()) < 1e-4
    assert max_logit_diff(ours, hf, *left_padded()) > 1e-2  # the adapters took part
    ours.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert max_logit_diff(ours, reloaded, *left_padded()) < 1e-4


def test_transformers_in_memory_layout_loads(checkpoints, tmp_path):
    """save_pretrained(save_original_format=False) writes model.* keys and each layer's experts as one fused
    (experts, out, in) tensor: the causal LM loads it (renames, and a fused tensor cut into the experts)."""
    folder, hf = checkpoints["moe"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.1.mixer.experts.up_proj" in set(f.keys())
    assert max_logit_diff(load(tmp_path), hf, *left_padded()) < 1e-4


def test_fit_counts_states_and_the_attention_layers_keys(checkpoints):
    from gpuformers.fit import fit_report

    ours = load(checkpoints["hybrid"][0])
    report = fit_report(ours.config, {"cpu": 2**30}, dtype=torch.bfloat16, context=1024, batch=4)
    mixer = ours.model.layers[0].mixer  # two mamba layers: conv state (bfloat16) and SSM state (float32) each
    assert report.state_bytes_per_sequence == 2 * (mixer.conv_dim * 3 * 2 + 8 * 16 * 16 * 4)
    assert report.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # two attention layers x (k, v) x 2 kv heads x 16 x bf16
    # the largest batch at 1024 tokens counts the state once per sequence
    budget = report.devices["cpu"] - report.options[0].weights_bytes - 4 * 128 * 4
    per_token = report.kv_bytes_per_token + report.activation_bytes_per_token
    assert report.options[0].max_batch == budget // (per_token * 1024 + report.state_bytes_per_sequence)
