"""LoRA on embedding layers and bias="all" / "lora_only" against peft 0.21 on transformers: the same logits (float32,
1e-5), loss and gradients of every trained tensor, adapter files that load on either side with the same keys,
merge_and_unload equal to the unmerged model, the Trainer lowering the loss; and on a tied model with
ensure_weight_tying=True, peft's config, keys and logits with one LoRA shared by embedding and head.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from gpuformers.lora.embedding import LoraEmbedding, TiedLoraLinear
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
CONFIGS = {  # ids: LoRA on the embeddings (lora_dropout must not touch them), and the two bias modes
    "embedding": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], lora_dropout=0.2),
    "embedding-rslora": dict(r=8, lora_alpha=4, target_modules=["embed_tokens"], use_rslora=True),
    "bias-all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="all"),
    "bias-lora-only": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], bias="lora_only"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 with attention biases (so that the bias modes have something to train), untied head."""
    folder = tmp_path_factory.mktemp("lora-embedding-qwen3")
    return folder, make_checkpoint(folder, "qwen3", head_dim=16, attention_bias=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama with tie_word_embeddings=True."""
    folder = tmp_path_factory.mktemp("lora-embedding-tied")
    return folder, make_checkpoint(folder, "llama", tie_word_embeddings=True)


def _load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs).eval()


def _inputs():
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0  # left padding in the last row
    return ids, mask


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _quiet(fn, *args, **kwargs):
    """Call fn with the tied-embeddings and save_embedding_layers warnings (checked elsewhere) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _pair(checkpoint, **config):
    """(ours, peft's) with the same random adapters, and random biases where a bias mode trains them, copied into ours
    through peft's saved-key state dict (so the keys are checked too)."""
    import peft

    folder, hf_model = checkpoint
    theirs = _quiet(peft.get_peft_model, copy.deepcopy(hf_model), peft.LoraConfig(**config)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, param in theirs.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=g) * 0.1)
    ours = _quiet(get_peft_model, _load(folder), LoraConfig(**config)).eval()
    set_peft_model_state_dict(ours, _quiet(peft.get_peft_model_state_dict, theirs, save_embedding_layers=False))
    return ours, theirs


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients of the trained tensors under our names (peft's adapter name taken out)."""
    return {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_gradients_and_counts_match_peft(checkpoint, name):
    """The same logits, trainable counts, loss and gradient of every trained tensor (lora_embedding_A / _B, the
    biases). Training mode with lora_dropout: peft applies no dropout to embeddings, nor do we."""
    ours, theirs = _pair(checkpoint, **CONFIGS[name])
    ids, mask = _inputs()
    got = _logits(ours, ids, mask)
    assert (got - _logits(_load(checkpoint[0]), ids, mask)).abs().max() > 1e-2  # the adapter is in the forward
    torch.testing.assert_close(got, _logits(theirs, ids, mask), atol=ATOL, rtol=0)
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    losses = []
    for model in (ours, theirs):
        model.train()
        torch.manual_seed(11)  # the same dropout masks on the linear targets
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    mine, reference = _grads(ours), _grads(theirs)
    assert mine.keys() == reference.keys()
    expected = {"embedding": ".lora_embedding_B", "embedding-rslora": ".lora_embedding_A",
                "bias-all": "k_proj.bias", "bias-lora-only": "q_proj.base_layer.bias"}[name]
    assert any(k.endswith(expected) for k in mine), sorted(mine)
    for key, grad in mine.items():
        assert grad is not None and grad.abs().max() > 0, key
        torch.testing.assert_close(grad, reference[key], atol=1e-5, rtol=1e-4, msg=key)


def test_fresh_embedding_adapter_is_peft_shaped_and_changes_nothing(checkpoint):
    """A zeros (r, vocab), B standard normal (hidden, r), in float32 over a bfloat16 base; the model unchanged."""
    folder = checkpoint[0]
    model = get_peft_model(_load(folder), LoraConfig(r=4, target_modules=["embed_tokens"]))
    layer = model.get_base_model().model.embed_tokens
    assert isinstance(layer, LoraEmbedding)
    assert layer.lora_embedding_A.shape == (4, 128) and not layer.lora_embedding_A.any()
    assert layer.lora_embedding_B.shape == (64, 4) and 0.5 < layer.lora_embedding_B.std() < 1.5
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(model, ids, mask), _logits(_load(folder), ids, mask), atol=0, rtol=0)
    bf16 = get_peft_model(_load(folder, dtype=torch.bfloat16), LoraConfig(r=4, target_modules=["embed_tokens"]))
    assert bf16.get_base_model().model.embed_tokens.lora_embedding_B.dtype == torch.float32


@pytest.mark.parametrize("name", ["embedding", "bias-all", "bias-lora-only"])
def test_adapter_files_load_either_way(checkpoint, name, tmp_path):
    """peft's keys: `...embed_tokens.lora_embedding_A` (no .weight), a bias under `<module>.bias` or, on a LoRA
    target, `<module>.base_layer.bias`; with the embedding targeted, its base weight too (save_embedding_layers)."""
    import peft
    from safetensors.torch import load_file

    ours, theirs = _pair(checkpoint, **CONFIGS[name])
    _quiet(ours.save_pretrained, tmp_path / "ours")
    _quiet(theirs.save_pretrained, tmp_path / "peft")
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["bias"] == CONFIGS[name].get("bias",
                                                                                                          "none")
    ids, mask = _inputs()
    want = _logits(ours, ids, mask)
    in_peft = _quiet(peft.PeftModel.from_pretrained, copy.deepcopy(checkpoint[1]), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(in_peft, ids, mask), want, atol=ATOL, rtol=0)
    in_ours = _quiet(PeftModel.from_pretrained, _load(checkpoint[0]), tmp_path / "peft")
    assert not any(p.requires_grad for p in in_ours.parameters())
    torch.testing.assert_close(_logits(in_ours, ids, mask), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["embedding", "bias-lora-only"])
def test_merge_and_unload_equals_the_unmerged_model(checkpoint, name):
    ours, _ = _pair(checkpoint, **CONFIGS[name])
    ids, mask = _inputs()
    unmerged = _logits(ours, ids, mask)
    ours.merge_adapter()
    torch.testing.assert_close(_logits(ours, ids, mask), unmerged, atol=1e-4, rtol=0)
    ours.unmerge_adapter()
    torch.testing.assert_close(_logits(ours, ids, mask), unmerged, atol=ATOL, rtol=0)
    merged = ours.merge_and_unload()
    assert type(merged.model.embed_tokens) is torch.nn.Embedding
    assert sorted(merged.state_dict()) == sorted(_load(checkpoint[0]).state_dict())
    torch.testing.assert_close(_logits(merged, ids, mask), unmerged, atol=1e-4, rtol=0)


def test_trainer_lowers_the_loss_and_moves_only_the_adapter_and_biases(checkpoint, tmp_path):
    from gpuformers import Trainer
    from tests.training.helpers import make_rows, tiny_args

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], bias="lora_only")
    model = get_peft_model(_load(checkpoint[0]), config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=tiny_args(tmp_path, max_steps=4, learning_rate=1e-2),
                      train_dataset=make_rows(8))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" in changed
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in changed


def test_adapter_on_the_model_switches_the_embedding_tensors(checkpoint, tmp_path):
    """transformers' integration: disable_adapters freezes lora_embedding_A / _B, enable_adapters trains them again;
    save_pretrained writes peft's keys."""
    from safetensors.torch import load_file

    model = _load(checkpoint[0])
    model.add_adapter(LoraConfig(r=4, target_modules=["embed_tokens"], bias="lora_only"))
    layer = model.model.embed_tokens
    model.disable_adapters()
    assert not layer.lora_embedding_A.requires_grad and not layer.lora_embedding_B.requires_grad
    model.enable_adapters()
    assert layer.lora_embedding_A.requires_grad and layer.lora_embedding_B.requires_grad
    _quiet(model.save_pretrained, tmp_path)
    assert "base_model.model.model.embed_tokens.lora_embedding_B" in load_file(tmp_path / "adapter_model.safetensors")


# --- a tied embedding and head with ensure_weight_tying ------------------------------------------------------------

@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["lm_head"], "(.*q_proj|.*embed_tokens)"],
                         ids=["embedding", "head", "regex"])
def test_tied_lora_as_peft(tied, targets, tmp_path):
    """peft moves the LoRA to the embedding (its full name added to target_modules, the head's entry removed) and
    gives the head the transposed pair: the same config, saved keys and logits here, with one pair shared by both.
    The gradient of each shared tensor is the sum of peft's two (its embedding's and its head's copy)."""
    import peft

    folder, hf_model = tied
    config = dict(r=4, lora_alpha=8, target_modules=targets, ensure_weight_tying=True, init_lora_weights=False)
    theirs = _quiet(peft.get_peft_model, copy.deepcopy(hf_model), peft.LoraConfig(**config)).eval()
    ours = get_peft_model(_load(folder), LoraConfig(**config)).eval()
    head, embedding = ours.get_base_model().lm_head, ours.get_base_model().model.embed_tokens
    assert isinstance(head, TiedLoraLinear) and isinstance(embedding, LoraEmbedding)
    want_targets = theirs.peft_config["default"].target_modules
    got_targets = ours.peft_config["default"].target_modules
    assert got_targets == (want_targets if isinstance(want_targets, str) else sorted(want_targets))
    state = _quiet(peft.get_peft_model_state_dict, theirs)
    assert sorted(_quiet(get_peft_model_state_dict, ours)) == sorted(state)
    set_peft_model_state_dict(ours, state)
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(ours, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)

    for model in (ours, theirs):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    reference = _grads(theirs)
    prefix = "base_model.model."
    torch.testing.assert_close(embedding.lora_embedding_A.grad, reference[prefix + "model.embed_tokens.lora_embedding_A"]
                               + reference[prefix + "lm_head.lora_B.weight"].T, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(embedding.lora_embedding_B.grad, reference[prefix + "model.embed_tokens.lora_embedding_B"]
                               + reference[prefix + "lm_head.lora_A.weight"].T, atol=1e-5, rtol=1e-4)

    _quiet(ours.save_pretrained, tmp_path / "ours")
    in_peft = _quiet(peft.PeftModel.from_pretrained, copy.deepcopy(hf_model), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(in_peft, ids, mask), _logits(ours, ids, mask), atol=ATOL, rtol=0)
    _quiet(theirs.save_pretrained, tmp_path / "peft")
    in_ours = _quiet(PeftModel.from_pretrained, _load(folder), tmp_path / "peft")
    assert isinstance(in_ours.get_base_model().lm_head, TiedLoraLinear)
    torch.testing.assert_close(_logits(in_ours, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)


def test_tied_lora_merges_once_and_stays_tied(tied):
    """The head's base weight is the embedding's: the update is added once and serves both (peft 0.21 adds it twice,
    so its merged logits are not its unmerged ones); the merged model is still tied."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True,
                        init_lora_weights=False)
    model = get_peft_model(_load(tied[0]), config).eval()
    ids, mask = _inputs()
    unmerged = _logits(model, ids, mask)
    assert (unmerged - _logits(_load(tied[0]), ids, mask)).abs().max() > 1e-2
    model.merge_adapter()  # logits in the hundreds (init_lora_weights=False: B A is large): relative tolerance
    torch.testing.assert_close(_logits(model, ids, mask), unmerged, atol=1e-4, rtol=1e-5)
    model.unmerge_adapter()
    torch.testing.assert_close(_logits(model, ids, mask), unmerged, atol=1e-4, rtol=1e-5)
    merged = model.merge_and_unload()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight and merged.config.tie_word_embeddings
    torch.testing.assert_close(_logits(merged, ids, mask), unmerged, atol=1e-4, rtol=1e-5)


def test_tied_file_whose_head_was_trained_apart_is_refused(tied, tmp_path):
    """peft over a half-precision base trains the head's pair apart from the embedding's; such a file cannot be one
    shared pair, so loading it says how to load it untied."""
    config = LoraConfig(r=4, target_modules=["embed_tokens"], ensure_weight_tying=True, init_lora_weights=False)
    model = get_peft_model(_load(tied[0]), config)
    state = _quiet(get_peft_model_state_dict, model)
    state["base_model.model.lm_head.lora_A.weight"] = state["base_model.model.lm_head.lora_A.weight"] + 0.1
    with pytest.raises(ValueError, match=r"lm_head\.lora_A\.weight is not .*lora_embedding_B transposed.*"
                                         r"ensure_weight_tying=False"):
        set_peft_model_state_dict(model, state)


def test_refusals_name_the_value_and_the_fix(checkpoint):
    with pytest.raises(ValueError, match=r"bias='some'.*\"none\", \"all\".*\"lora_only\""):
        LoraConfig(target_modules=["q_proj"], bias="some")
    model = _load(checkpoint[0])
    with pytest.raises(NotImplementedError, match=r"LoRA on model\.embed_tokens \(Embedding\).*use_dora=True"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens"], use_dora=True))
    assert type(model.model.embed_tokens) is torch.nn.Embedding
