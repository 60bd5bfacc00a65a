"""OpenAI GPT-2 against transformers on tiny random checkpoints: the Conv1D layout and key names (transformers' and the
Hub file's unprefixed ones), GPT-2's config names both ways, logits (eager and sdpa, left padding), greedy tokens
(dynamic and static cache), loss and backward, saving for transformers, the engine, AutoModel and
AutoModelForSequenceClassification, use_kernels, and what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_engine_serves_adapter, assert_greedy_matches,
                                 assert_loss_matches_and_trains, left_padded, load, max_logit_diff)

TINY = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
CASES = {
    "tied": dict(),  # gpt2's own settings: gelu_new, n_inner null (4 * n_embd), tied lm_head
    "untied-inner-gelu": dict(tie_word_embeddings=False, n_inner=96, activation_function="gelu",
                              layer_norm_epsilon=1e-3, scale_attn_weights=False),
}


def _make_checkpoint(folder, **overrides):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(**TINY, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves LayerNorms at (1, 0): perturb them so a missing one shows
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
        model.transformer.wpe.weight.mul_(20)  # positions as large as tokens, so a wrong position changes tokens
    model.save_pretrained(folder)
    return model


def _hub_layout(source, folder):
    """The checkpoint as openai-community/gpt2's file holds it: no "transformer." prefix, no lm_head, and each
    layer's causal-mask buffer (h.{i}.attn.bias)."""
    from safetensors.torch import load_file, save_file

    tensors = {k.removeprefix("transformer."): v for k, v in load_file(source / "model.safetensors").items()}
    for i in range(TINY["n_layer"]):
        positions = TINY["n_positions"]
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(positions, positions, dtype=torch.uint8))[None, None]
    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((source / "config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model); "hub" is the tied one in the Hub file's key layout."""
    out = {}
    for name, overrides in CASES.items():
        folder = tmp_path_factory.mktemp(f"gpt2-{name}")
        out[name] = (folder, _make_checkpoint(folder, **overrides))
    out["hub"] = (_hub_layout(out["tied"][0], tmp_path_factory.mktemp("gpt2-hub")), out["tied"][1])
    return out


def test_modules_keep_the_checkpoint_layout(checkpoints):
    folder, hf = checkpoints["untied-inner-gelu"]
    ours = load(folder)
    assert type(ours).__name__ == "GPT2LMHeadModel"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours.transformer.h[0].attn.c_attn.weight.shape == (64, 192)  # Conv1D: (in_features, out_features)
    assert ours.transformer.h[0].mlp.c_fc.weight.shape == (64, 96)  # n_inner
    assert ours.model is ours.transformer  # the stack under the llama name, for the engine


def test_config_reads_and_writes_gpt2_names(checkpoints):
    from gpuformers.models.config import ModelConfig

    folder, _ = checkpoints["tied"]
    written = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_dict(written)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
            config.max_position_embeddings, config.hidden_act) == (64, 2, 4, 256, 64, "gelu_new")
    out = config.to_dict()
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "activation_function", "layer_norm_epsilon"):
        assert out[key] == written[key], key
    assert not {"hidden_size", "intermediate_size", "rope_theta", "num_key_value_heads", "rms_norm_eps"} & set(out)
    # transformers' defaults where config.json is silent (gpt2's own values)
    bare = ModelConfig.from_dict({"model_type": "gpt2"})
    assert (bare.vocab_size, bare.hidden_size, bare.max_position_embeddings, bare.tie_word_embeddings) == \
        (50257, 768, 1024, True)


@pytest.mark.parametrize("case", ["tied", "untied-inner-gelu", "hub"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_positions_come_from_position_ids(checkpoints):
    folder, hf = checkpoints["tied"]
    ours = load(folder)
    ids, mask = left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # the padded row's first real token at position 0
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, position_ids=positions).logits
        diff = logits - hf(ids, attention_mask=mask, position_ids=positions).logits
        shifted = ours(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert (shifted - logits)[1, 4:].abs().max() > 1e-2  # the padded row reads other positions without them


@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, cache):
    folder, hf = checkpoints["tied"]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["untied-inner-gelu"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    stack = ours.transformer
    for p in (stack.wpe.weight, stack.h[0].attn.c_attn.weight, stack.h[1].mlp.c_fc.bias, stack.h[0].ln_1.bias):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["untied-inner-gelu", "hub"])
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    import transformers
    from safetensors import safe_open

    folder, _ = checkpoints[case]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GPT2LMHeadModel"] and "rope_theta" not in saved and "n_embd" in saved
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [64, 192]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    # the engine's tokens at different positions per sequence: wpe must come from each token's position_ids
    assert_engine_matches_generate(load(checkpoints["tied"][0]))


@pytest.mark.parametrize("case", ["tied", "hub"])
def test_auto_model_matches_transformers(checkpoints, case):
    import transformers

    from gpuformers import AutoModel

    folder, _ = checkpoints[case]
    ours = AutoModel.from_pretrained(folder, progress=False)
    theirs = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4
    assert "wte" in dict(ours.named_children()) and ours.get_input_embeddings() is ours.wte


def test_sequence_classification_matches_transformers(checkpoints, tmp_path):
    import transformers

    from gpuformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        checkpoints["hub"][0], num_labels=3, dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path)
    ours = AutoModelForSequenceClassification.from_pretrained(tmp_path, progress=False)
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


def test_use_kernels_keeps_logits(checkpoints):
    import gpuformers.kernels.mapping as mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    folder, hf = checkpoints["tied"]
    ours = load(folder, use_kernels=True, device_map=device)
    # no layer of GPT-2 is one a kernel replaces (LayerNorm, Conv1D and a plain GELU MLP)
    assert not any("forward" in vars(m) for m in ours.modules())
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4


def test_activations_equal_transformers():
    from transformers.activations import ACT2FN

    from gpuformers.models.gpt2 import ACTIVATIONS

    x = torch.linspace(-6, 6, 1001)
    for name, fn in ACTIVATIONS.items():
        torch.testing.assert_close(fn(x), ACT2FN[name](x), atol=1e-6, rtol=0, msg=name)


def test_from_config_builds_a_working_model():
    from gpuformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", **TINY)
    model = AutoModelForCausalLM.from_config(config).eval()
    c_proj = model.transformer.h[0].attn.c_proj.weight
    assert 0.005 < c_proj.std() < 0.015  # 0.02 / sqrt(2 * n_layer), as transformers draws it
    assert model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, do_sample=False).shape == (1, 5)


def test_lora_on_conv1d_matches_peft(checkpoints, tmp_path):
    """peft's LoRA on GPT-2's Conv1D (fan_in_fan_out=True, its default target c_attn): the same logits, the same
    merged weights (the update added transposed), adapter files both ways, and the engine serves it."""
    import copy

    import peft

    from gpuformers.lora import LoraConfig, get_peft_model, set_peft_model_state_dict

    folder, hf = checkpoints["untied-inner-gelu"]
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, fan_in_fan_out=True))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ours = get_peft_model(load(folder), LoraConfig(r=4, lora_alpha=8, fan_in_fan_out=True))
    assert ours.peft_config["default"].target_modules == ["c_attn"]  # peft's default for gpt2
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    ids, mask = left_padded()
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask).logits
        assert (ours(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-5
        ours.save_pretrained(tmp_path / "adapter")
        back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter")
        assert (back(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-5
        merged = ours.merge_and_unload()
        assert (merged(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-4
    all_linear = get_peft_model(load(folder), LoraConfig(target_modules="all-linear"))
    assert {n.rpartition(".")[2] for n in all_linear.peft_config["default"].target_modules} == \
        {"c_attn", "c_proj", "c_fc"}  # the Conv1D layers, not the LM head, as peft's all-linear
    assert_engine_serves_adapter(folder, tmp_path / "adapter")


@pytest.mark.parametrize("setting, value", [("scale_attn_by_inverse_layer_idx", True),
                                            ("reorder_and_upcast_attn", True), ("add_cross_attention", True),
                                            ("activation_function", "quick_gelu")])
def test_unsupported_settings_are_refused_by_name(setting, value):
    from gpuformers.models.config import ModelConfig

    with pytest.raises(NotImplementedError, match=setting if setting != "activation_function" else "quick_gelu"):
        ModelConfig.from_dict({"model_type": "gpt2", **TINY, setting: value})


def test_tensor_parallel_plan_names_gpt2_modules(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    plan = _resolve_plan(load(checkpoints["tied"][0]), "auto")
    assert plan == {f"transformer.h.{i}.{name}": style for i in range(2) for name, style in
                    [("attn.c_attn", "packed_colwise"), ("attn.c_proj", "rowwise"), ("mlp.c_fc", "colwise"),
                     ("mlp.c_proj", "rowwise")]}


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    # c_attn's q | k | v split one by one (each process: its 2 heads of q, of k and of v), the Conv1D weights (in, out)
    # split along their other dims, the row-wise biases added once; saving gathers the checkpoint's layout back
    from tests.models.parity import assert_tensor_parallel_matches

    shapes = assert_tensor_parallel_matches(checkpoints["untied-inner-gelu"][0], tmp_path)["local_shapes"]
    assert shapes["c_attn"] == [64, 3 * 64 // 2] and shapes["c_fc"] == [64, 96 // 2] and shapes["c_proj"] == [48, 64]
