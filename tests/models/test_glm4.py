"""GLM-4 (model types glm4 and glm) against transformers on tiny random checkpoints: the checkpoint's modules (fused
gate_up MLP, q/k/v biases, glm4's two extra norms), the interleaved partial rotary (bitwise, float32 and bfloat16),
config defaults, logits (eager and sdpa, left padding), greedy tokens (dynamic and static cache), loss and backward,
saving for transformers, the engine, tp_plan="auto" refused, and use_kernels (where Triton runs) leaving the
interleaved rotary out of the halves-rotating kernel."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 checkpoint_cases, left_padded, load, max_logit_diff)

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# GLM's defaults put pad and eos past a tiny vocabulary; head_dim 16 (the default is 128) rotates 8 dims, 4 pairs.
COMMON = dict(head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    "glm4": {
        # GLM-4-0414: GQA, q/k/v biases, half of each head rotated (the defaults)
        "gqa": {},
        # multi-head, tied, no biases, 3/4 of each head rotated (12 dims: 6 pairs) with linear scaling
        "mha-tied-nobias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=False,
                                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0,
                                                 "partial_rotary_factor": 0.75}),
    },
    "glm": {
        # GLM-4-9B-chat-hf's layer (no sandwich norms), the whole head rotated with yarn
        "gqa-yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 128, "partial_rotary_factor": 1.0}),
    },
}
NAMES = [f"{model_type}/{case}" for model_type, cases in CASES.items() for case in cases]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """"model_type/case" -> (folder, transformers model)."""
    out = {}
    for model_type, cases in CASES.items():
        made = checkpoint_cases(tmp_path_factory, model_type, cases, **COMMON)
        out.update({f"{model_type}/{case}": value for case, value in made.items()})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_modules_are_the_checkpoint_s(checkpoints, name):
    folder, hf = checkpoints[name]
    ours = load(folder)
    assert type(ours).__name__ == type(hf).__name__
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    attn = ours.model.layers[0].self_attn
    assert attn.o_proj.bias is None and (attn.q_proj.bias is not None) == hf.config.attention_bias
    assert hasattr(ours.model.layers[0], "post_mlp_layernorm") == name.startswith("glm4/")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rotary_equals_transformers(dtype):
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as theirs

    from gpuformers.layers.rotary import apply_rotary_pos_emb as halves
    from gpuformers.models.glm4 import apply_interleaved_rotary, pair_tables

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen).to(dtype), torch.randn(2, 2, 5, 16, generator=gen).to(dtype)
    freqs = torch.rand(2, 5, 4, generator=gen) * 5  # (batch, seq, rotary_dim / 2): 8 of 16 dims turned
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    q_ref, k_ref = theirs(q, k, cos, sin)
    for grad in (False, True):  # in place without autograd, out of place with it
        with torch.set_grad_enabled(grad):
            assert torch.equal(apply_interleaved_rotary(q, *pair_tables(cos, sin)), q_ref)
            assert torch.equal(apply_interleaved_rotary(k, *pair_tables(cos, sin)), k_ref)
    assert not torch.allclose(halves(q[..., :8], k[..., :8], cos, sin)[0], q_ref[..., :8], atol=1e-2)
    assert torch.equal(q_ref[..., 8:], q[..., 8:])  # the rest of each head passes through


@pytest.mark.parametrize("model_type", ["glm4", "glm"])
def test_config_defaults_match_transformers(model_type):
    # a config.json naming only the sizes: transformers' defaults (head_dim 128, 2 kv heads, biases, half rotary)
    import transformers

    from gpuformers import AutoConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    ours, theirs = AutoConfig.for_model(model_type, **sizes), transformers.AutoConfig.for_model(model_type, **sizes)
    for field in ("head_dim", "num_key_value_heads", "attention_bias", "rms_norm_eps", "max_position_embeddings",
                  "pad_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.layer_types == ["full_attention"] * 2 and ours.sliding_window is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, name, attn):
    folder, hf = checkpoints[name]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, name, cache):
    folder, hf = checkpoints[name]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["glm4/gqa"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[0]
    for param in (layer.post_self_attn_layernorm.weight, layer.post_mlp_layernorm.weight,
                  layer.self_attn.k_proj.bias, layer.mlp.gate_up_proj.weight):
        assert param.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["glm4/mha-tied-nobias", "glm/gqa-yarn"])
def test_transformers_loads_what_we_save(checkpoints, name, tmp_path):
    import transformers

    folder, hf = checkpoints[name]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [type(hf).__name__] and "sliding_window" not in saved
    # transformers 4.x reads the factor at the top level, 5.x in rope_parameters
    assert saved["partial_rotary_factor"] == saved["rope_parameters"]["partial_rotary_factor"] == \
        hf.config.rope_parameters["partial_rotary_factor"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


@pytest.mark.parametrize("name", ["glm4/gqa", "glm/gqa-yarn"])
def test_engine_matches_generate(checkpoints, name):
    assert_engine_matches_generate(load(checkpoints[name][0]))


@pytest.mark.parametrize("name", ["glm4/gqa", "glm/gqa-yarn"])
def test_tensor_parallel_auto_is_refused(checkpoints, name):
    # the llama plan splits gate_proj / up_proj and makes down_proj row-parallel; GLM fuses gate and up
    from gpuformers.tensor_parallel import _resolve_plan

    model = load(checkpoints[name][0])
    with pytest.raises(NotImplementedError, match=f'tp_plan="auto" for {type(model).__name__} is not supported'):
        _resolve_plan(model, "auto")


def test_use_kernels_leaves_the_interleaved_rotary_in_torch(checkpoints, monkeypatch):
    import gpuformers.kernels.rotary as rotary_kernels
    from gpuformers.kernels import mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    rotated = []  # the rotary kernel turns halves: GLM's pairs must never reach it
    for name in ("apply_rotary_inplace", "apply_rotary"):
        original = getattr(rotary_kernels, name)
        monkeypatch.setattr(rotary_kernels, name, lambda *a, _f=original, **k: rotated.append(1) or _f(*a, **k))
    folder, hf = checkpoints["glm4/gqa"]
    ours = load(folder, use_kernels=True, device_map=device)
    layer = ours.model.layers[0]
    assert layer.post_mlp_layernorm.forward.__func__ is mapping._rms_norm_forward
    assert "forward" not in vars(layer.mlp)  # the SwiGLU kernel reads gate_proj / up_proj, which GLM fuses
    assert "AddRMSNorm" in ours._kernel_state.functions
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert not rotated
