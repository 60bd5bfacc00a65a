"""StarCoder2 against transformers on tiny random checkpoints: the checkpoint's modules (LayerNorms with biases, the
c_fc / c_proj MLP, use_bias), config defaults and spelling, logits (eager and sdpa, left padding, a sliding window
shorter than the batch), training logits with the same dropout masks (embedding, attention and residual dropout),
greedy tokens (dynamic and static cache), loss and backward, saving for transformers, the engine, AutoModel and
AutoModelForSequenceClassification, tp_plan="auto" over two processes, and use_kernels (where Triton runs) keeping
the LayerNorm / GELU layers in torch."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load, max_logit_diff,
                                 train_logits)

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # the released shape: GQA, biases everywhere, tied embeddings, a sliding window (here shorter than the batch)
    "gqa-window": dict(sliding_window=5),
    # multi-head, no biases, untied, another norm epsilon, linear rope scaling
    "mha-nobias-untied": dict(num_key_value_heads=4, use_bias=False, tie_word_embeddings=False, norm_epsilon=1e-3,
                              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "starcoder2", CASES, **TOKENS)


@pytest.mark.parametrize("case", list(CASES))
def test_modules_are_the_checkpoint_s(checkpoints, case):
    from torch import nn

    folder, hf = checkpoints[case]
    ours = load(folder)
    assert type(ours).__name__ == "Starcoder2ForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    layer = ours.model.layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, ours.model.norm]
    assert all(type(norm) is nn.LayerNorm and norm.eps == hf.config.norm_epsilon for norm in norms)
    projections = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.c_fc, layer.mlp.c_proj]
    assert {p.bias is not None for p in projections} == {hf.config.use_bias}
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    # The MLP and a norm alone, on inputs wide enough that exact GELU and its tanh approximation differ (by up to
    # 1e-3, which the tiny model's logits would hide)
    x = 3 * torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer.mlp(x), hf.model.layers[0].mlp(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.input_layernorm(x), hf.model.layers[0].input_layernorm(x), atol=1e-6, rtol=0)


def test_config_defaults_and_spelling_match_transformers():
    # a config.json naming only the sizes: transformers' defaults (2 kv heads, biases, tied, gelu tanh, 1e-5, ...)
    import transformers

    from gpuformers import AutoConfig
    from gpuformers.models.config import ModelConfig

    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    ours, theirs = AutoConfig.for_model("starcoder2", **sizes), transformers.AutoConfig.for_model("starcoder2", **sizes)
    for field in ("vocab_size", "num_key_value_heads", "hidden_act", "max_position_embeddings", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings", "sliding_window", "attention_dropout", "rope_parameters",
                  "initializer_range"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.rms_norm_eps, ours.attention_bias, ours.mlp_bias) == (theirs.norm_epsilon, True, True)
    assert ours.residual_dropout == theirs.residual_dropout == ours.embedding_dropout == 0.0
    written = ours.to_dict()
    assert (written["use_bias"], written["norm_epsilon"]) == (True, 1e-5)
    assert not {"rms_norm_eps", "attention_bias", "mlp_bias", "layer_types", "use_sliding_window"} & set(written)
    windowed = AutoConfig.for_model("starcoder2", sliding_window=7, use_bias=False, **sizes)
    assert windowed.layer_types == ["sliding_attention"] * 2 and not windowed.qkv_bias and not windowed.o_bias
    # bigcode/starcoder2-3b's config.json spelling: top-level rope_theta, torch_dtype, keys transformers ignores
    hub = dict(model_type="starcoder2", rope_theta=999999.4420358813, torch_dtype="bfloat16", norm_type="layer_norm",
               mlp_type="default", sliding_window=4096, attention_dropout=0.1, residual_dropout=0.1,
               embedding_dropout=0.1, use_bias=True, norm_epsilon=1e-5, **sizes)
    read = ModelConfig.from_dict(hub)
    assert read.rope_theta == transformers.Starcoder2Config(**hub).rope_parameters["rope_theta"]
    assert read.dtype == "bfloat16" and read.extra["norm_type"] == "layer_norm"
    assert ModelConfig.from_dict(read.to_dict()).to_dict() == read.to_dict()
    with pytest.raises(NotImplementedError, match="hidden_act 'relu' is not supported for starcoder2"):
        AutoConfig.for_model("starcoder2", hidden_act="relu", **sizes)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_training_dropouts_match_transformers(checkpoints, tmp_path):
    # Dropout is on in training only, as in transformers: drawn in its order (the embeddings, then per layer the
    # attention weights, o_proj's output and the MLP's), the same seed gives the same masks in both libraries.
    import transformers

    shutil.copytree(checkpoints["gqa-window"][0], tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, embedding_dropout=0.1, attention_dropout=0.1, residual_dropout=0.2)
    ours = load(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = train_logits(hf, seed=3)
    assert (train_logits(ours, seed=3) - expected).abs().max() < 1e-4
    assert (train_logits(ours, seed=4) - expected).abs().max() > 1e-2  # the masks do change the logits
    assert max_logit_diff(ours, hf, *left_padded()) < 1e-4  # and inference drops nothing


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["gqa-window"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[0]
    for param in (layer.input_layernorm.bias, layer.mlp.c_fc.bias, layer.mlp.c_proj.weight, ours.model.norm.bias):
        assert param.grad.abs().sum() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    import transformers

    folder, hf = checkpoints[case]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Starcoder2ForCausalLM"]
    assert (saved["use_bias"], saved["norm_epsilon"], saved["sliding_window"]) == \
        (hf.config.use_bias, hf.config.norm_epsilon, hf.config.sliding_window)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    # prompts of up to 7 tokens and 6 new ones: past the window of 5
    assert_engine_matches_generate(load(checkpoints["gqa-window"][0]))


def test_auto_model_and_sequence_classification_match_transformers(checkpoints, tmp_path):
    import transformers

    import gpuformers

    folder, _ = checkpoints["gqa-window"]
    ids, mask = left_padded()
    theirs = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = gpuformers.AutoModel.from_pretrained(folder, progress=False)
    assert type(ours).__name__ == "Starcoder2Model"
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4
    torch.manual_seed(1)
    transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3).save_pretrained(tmp_path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = gpuformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, progress=False)
    assert type(ours).__name__ == "Starcoder2ForSequenceClassification"
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (STARCODER2_TP_PLAN) on gloo, with biases everywhere and a sliding window: c_proj's and o_proj's
    # biases must be added once, after the sum over the processes
    from gpuformers.tensor_parallel import _resolve_plan

    folder, _ = checkpoints["gqa-window"]
    plan = _resolve_plan(load(folder), "auto")
    assert (plan["model.layers.1.mlp.c_fc"], plan["model.layers.1.mlp.c_proj"]) == ("colwise", "rowwise")
    shapes = assert_tensor_parallel_matches(folder, tmp_path)["local_shapes"]
    assert shapes["c_fc"] == [48, 64] and shapes["c_proj"] == [64, 48]


def test_use_kernels_keeps_the_layer_norms_and_the_gelu_mlp(checkpoints, monkeypatch):
    from torch import nn

    import gpuformers.kernels.rotary as rotary
    from gpuformers.kernels import mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    fused, rotated = [], []
    monkeypatch.setattr(mapping, "_add_rms_norm", lambda *a, **k: fused.append(1))
    original = rotary.apply_rotary_inplace
    monkeypatch.setattr(rotary, "apply_rotary_inplace", lambda *a, **k: rotated.append(1) or original(*a, **k))
    folder, hf = checkpoints["gqa-window"]
    ours = load(folder, use_kernels=True, device_map=device)
    layer = ours.model.layers[0]
    for module in (layer.input_layernorm, layer.mlp, ours.model.norm):
        assert "forward" not in vars(module)  # the class's own forward: no RMSNorm or SwiGLU kernel
    assert type(ours.model.norm) is nn.LayerNorm
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert not fused and rotated  # no add + RMSNorm; rotary's kernel did run


def test_lora_targets(checkpoints):
    from gpuformers import LoraConfig, get_peft_model

    folder = checkpoints["gqa-window"][0]
    with pytest.raises(ValueError, match="no default targets for model_type 'starcoder2'"):  # as in peft's table
        get_peft_model(load(folder), LoraConfig(r=2))
    lora = get_peft_model(load(folder), LoraConfig(r=2, target_modules="all-linear"))
    kinds = {name.rsplit(".", 1)[-1] for name in lora.peft_config["default"].target_modules}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"}
