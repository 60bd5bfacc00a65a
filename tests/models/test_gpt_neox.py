"""GPT-NeoX (Pythia) against transformers on tiny random checkpoints: the Hub's key names read and written back, the
fused per-head q/k/v layout, partial and full rotary, the parallel and sequential residual, LayerNorm and biases, the
untied (embed_out) and tied heads, the old config spelling (rotary_pct, rotary_emb_base), logits (eager and sdpa, left
padding), greedy tokens (dynamic and static cache), loss and backward, saving for transformers, the engine, AutoModel
and AutoModelForSequenceClassification, use_kernels, tp_plan="auto" over two processes, and the activation refused
by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import (assert_engine_matches_generate, assert_engine_serves_adapter, assert_greedy_matches,
                                 assert_loss_matches_and_trains, checkpoint_cases, left_padded, load, max_logit_diff)

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # Pythia's shape: parallel residual, biases, untied embed_out, rotary over a quarter of each head, exact GELU
    "pythia": dict(),
    # GPT-NeoX's other switches: sequential residual, no attention biases, tied head, full rotary with linear
    # scaling, the tanh GELU of GPT-NeoX-20B
    "sequential-tied": dict(use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True,
                            hidden_act="gelu_fast",
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0,
                                             "partial_rotary_factor": 1.0}),
}


def _theirs(auto: str, folder):
    import transformers

    return getattr(transformers, auto).from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "gpt_neox", CASES, **TOKENS)


def _safetensors_keys(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_modules_and_the_hub_key_names(checkpoints):
    from gpuformers.models.gpt_neox import checkpoint_name

    folder, hf = checkpoints["pythia"]
    ours = load(folder)
    assert type(ours).__name__ == "GPTNeoXForCausalLM"
    # every parameter comes from the checkpoint key the Hub names it by, with the same shape
    stored = _safetensors_keys(folder)
    assert "gpt_neox.layers.0.attention.query_key_value.bias" in stored and "embed_out.weight" in stored
    ours_by_key = {checkpoint_name(k): tuple(v.shape) for k, v in ours.state_dict().items()}
    assert set(ours_by_key) == stored
    theirs = {k.replace("lm_head.", "embed_out."): tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours_by_key == theirs
    layer = ours.model.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) and isinstance(ours.model.norm, torch.nn.LayerNorm)
    assert layer.self_attn.query_key_value.weight.shape == (3 * 64, 64)
    assert layer.self_attn.rotary_dim == 4  # a quarter of head_dim 16
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    assert ours.config.num_key_value_heads == 4 and ours.config.head_dim == 16  # config.json's kv heads ignored


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


def test_old_config_spelling_and_old_checkpoint_keys(checkpoints, tmp_path):
    # Pythia's config.json: rotary_pct / rotary_emb_base instead of rope_parameters; its weights carry the old
    # attention.bias / masked_bias buffers, which both libraries skip.
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = checkpoints["pythia"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, rope_parameters=None, rotary_pct=0.5, rotary_emb_base=1000)
    weights = load_file(tmp_path / "model.safetensors")
    weights["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    weights["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = load(tmp_path), _theirs("AutoModelForCausalLM", tmp_path)
    assert ours.config.rope_parameters["partial_rotary_factor"] == 0.5 and ours.config.rope_theta == 1000
    assert ours.model.layers[0].self_attn.rotary_dim == 8
    assert max_logit_diff(ours, theirs, *left_padded()) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_matches_transformers_and_trains(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[0]
    for param in (layer.input_layernorm.bias, layer.post_attention_layernorm.weight, layer.mlp.dense_h_to_4h.bias,
                  ours.model.norm.bias, ours.model.embed_tokens.weight):
        assert param.grad.abs().sum() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    folder, _ = checkpoints[case]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    assert _safetensors_keys(tmp_path) == _safetensors_keys(folder)  # the Hub's names: gpt_neox.*, embed_out
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GPTNeoXForCausalLM"]
    assert "rms_norm_eps" not in saved and "num_key_value_heads" not in saved
    assert saved["rotary_pct"] == ours.config.rope_parameters["partial_rotary_factor"]
    back = _theirs("AutoModelForCausalLM", tmp_path)
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5
    assert max_logit_diff(load(tmp_path), back, *left_padded()) < 1e-5


def test_gelu_is_the_one_config_names(checkpoints):
    # exact (erf) GELU for "gelu", the tanh form for "gelu_fast": too close to show in tiny logits, so the MLP is
    # compared on inputs wide enough to reach where the two differ
    for case in CASES:
        folder, hf = checkpoints[case]
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 20
        with torch.no_grad():
            torch.testing.assert_close(load(folder).model.layers[0].mlp(x), hf.gpt_neox.layers[0].mlp(x),
                                       atol=1e-6, rtol=1e-5)


def test_engine_matches_generate(checkpoints):
    for case in CASES:
        assert_engine_matches_generate(load(checkpoints[case][0]))


def test_bare_model_and_classifier_match_transformers(checkpoints, tmp_path):
    import transformers

    import gpuformers

    folder, _ = checkpoints["pythia"]
    ids, mask = left_padded()
    theirs = _theirs("AutoModel", folder)
    ours = gpuformers.AutoModel.from_pretrained(folder, progress=False)
    assert type(ours).__name__ == "GPTNeoXModel"
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4
    # a bare model's own keys (embed_in, layers.*.attention, final_layer_norm: no prefix) read and written back
    theirs.save_pretrained(tmp_path / "base")
    ours = gpuformers.AutoModel.from_pretrained(tmp_path / "base", progress=False)
    ours.save_pretrained(tmp_path / "ours-base")
    assert _safetensors_keys(tmp_path / "ours-base") == _safetensors_keys(tmp_path / "base")
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4

    torch.manual_seed(1)
    head = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3).eval()
    head.save_pretrained(tmp_path / "cls")
    ours = gpuformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls", progress=False)
    assert type(ours).__name__ == "GPTNeoXForSequenceClassification"
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, head(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)
    # and saved back under the Hub's keys (gpt_neox.*, score.weight), which transformers reads
    ours.save_pretrained(tmp_path / "ours-cls")
    assert _safetensors_keys(tmp_path / "ours-cls") == _safetensors_keys(tmp_path / "cls")
    back = _theirs("AutoModelForSequenceClassification", tmp_path / "ours-cls")
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, head(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


def test_unsupported_activation_is_refused_by_name():
    from gpuformers.models.config import ModelConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(NotImplementedError, match="gpt_neox hidden_act 'relu' is not supported; supported: gelu"):
        ModelConfig.from_dict(dict(model_type="gpt_neox", hidden_act="relu", **sizes))


def test_tensor_parallel_plan_names_gpt_neox_modules(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    plan = _resolve_plan(load(checkpoints["pythia"][0]), "auto")
    assert plan == {f"model.layers.{i}.{name}": style for i in range(2) for name, style in
                    [("self_attn.query_key_value", "colwise"), ("self_attn.dense", "rowwise"),
                     ("mlp.dense_h_to_4h", "colwise"), ("mlp.dense_4h_to_h", "rowwise")]}


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    # whole heads per process (the per-head q/k/v rows), and the row-wise layers' biases added once
    from tests.models.parity import assert_tensor_parallel_matches

    shapes = assert_tensor_parallel_matches(checkpoints["pythia"][0], tmp_path)["local_shapes"]
    assert shapes["query_key_value"] == [3 * 64 // 2, 64] and shapes["dense"] == [64, 32]


def test_hidden_dropout_applies_in_training_only(checkpoints, tmp_path):
    import shutil

    folder, _ = checkpoints["pythia"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, hidden_dropout=0.5)
    ours = load(tmp_path)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ours(ids).logits)
        ours.train()
        assert not torch.equal(ours(ids).logits, ours(ids).logits)


def test_use_kernels_keeps_logits(checkpoints, monkeypatch):
    # No kernel layer is a LayerNorm or a GELU MLP: the layers keep their torch forwards, and the rotary kernel
    # turns the rotated quarter of each head in place.
    import gpuformers.kernels.mapping as mapping
    import gpuformers.kernels.rotary as rotary

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    calls = []
    original = rotary.apply_rotary_inplace
    monkeypatch.setattr(rotary, "apply_rotary_inplace", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    folder, hf = checkpoints["pythia"]
    ours = load(folder, use_kernels=True, device_map=device)
    assert not [name for name, module in ours.named_modules() if "forward" in vars(module)]
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert calls == [(2, 4, 16, 4)] * len(ours.model.layers)  # q's 4 rotated dims of 16, in every layer


def test_lora_adapters_are_peft_compatible(checkpoints, tmp_path):
    """A peft adapter for GPT-NeoX names the Hub's modules (gpt_neox.layers.0.attention.query_key_value): ours loads
    it with peft's logits and saves under the same names, and the multi-LoRA engine serves it."""
    import copy

    import peft

    from gpuformers.lora import LoraConfig, PeftModel, get_peft_model

    folder, hf = checkpoints["pythia"]
    ids, mask = left_padded()

    def round_trip(config, name):
        """peft's adapter loads in ours with peft's logits, and ours saved loads back in peft with them too."""
        theirs = peft.get_peft_model(copy.deepcopy(hf), config)
        theirs.save_pretrained(tmp_path / f"peft-{name}")
        with torch.no_grad():
            expected = theirs(input_ids=ids, attention_mask=mask).logits
            ours = PeftModel.from_pretrained(load(folder), tmp_path / f"peft-{name}")
            assert (ours(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-5
            ours.save_pretrained(tmp_path / f"ours-{name}")
            back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / f"ours-{name}")
            assert (back(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-5
        return tmp_path / f"peft-{name}"

    adapter = round_trip(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False), "default")
    assert get_peft_model(load(folder), LoraConfig()).peft_config["default"].target_modules == ["query_key_value"]
    assert_engine_serves_adapter(folder, adapter)
    # the LM head: transformers 5 names the module lm_head (its checkpoint key stays embed_out), and so do peft's keys
    round_trip(peft.LoraConfig(r=4, target_modules=["lm_head", "dense"], init_lora_weights=False), "head")
