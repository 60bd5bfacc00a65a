"""DoRA (LoraConfig(use_dora=True)) against peft's DoRA on transformers: the same magnitude at creation (float32 and
bfloat16 bases), the same logits with random adapters (float32, 1e-5), the same loss and gradients of lora_A, lora_B
and the magnitude (dropout off and on), adapter files that load on either side, merge_and_unload and unmerge, a few
training steps that lower the loss, and the targets DoRA refuses.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import LoraConfig, LoraLinear, PeftModel, get_peft_model, set_peft_model_state_dict
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DORA = dict(r=4, lora_alpha=8, target_modules=ATTN_MLP, use_dora=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 with attention biases (so that DoRA's bias handling counts) and the transformers model."""
    folder = tmp_path_factory.mktemp("dora-qwen3")
    return folder, make_checkpoint(folder, "qwen3", head_dim=16, attention_bias=True)


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


def _dora_pair(checkpoint, **config):
    """(ours, peft's) with the same random A, B and magnitude (m = peft's initial m times 1 + 0.1 * noise), copied
    into ours through peft's saved-key state dict."""
    import peft

    folder, hf_model = checkpoint
    config = {**DORA, **config}
    theirs = _randomize(peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**config)).eval())
    ours = get_peft_model(_load(folder), LoraConfig(**config)).eval()
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    return ours, theirs


def _randomize(peft_model):
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, param in peft_model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.1 * noise)
            elif "lora_" in name:
                param.copy_(noise * 0.1)
    return peft_model


def _magnitudes(model) -> dict[str, torch.Tensor]:
    """{module name: magnitude} for our model or peft's (whose name has ".lora_magnitude_vector.default.weight")."""
    return {n.split(".lora_magnitude_vector")[0]: p.detach() for n, p in model.named_parameters()
            if "lora_magnitude_vector" in n}


def _lora_grads(model) -> dict[str, torch.Tensor]:
    """Gradients of lora_A, lora_B and the magnitude under our names (peft's adapter name taken out)."""
    return {n.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector"): p.grad
            for n, p in model.named_parameters() if p.requires_grad}


def test_magnitude_starts_as_peft_row_norm(checkpoint):
    """Fresh (B = 0): m = ||W|| per output row and the model unchanged; with peft's random A, B put in, m is
    ||W + s B A|| exactly as peft sets it (k_proj, gate_proj are not square: the wrong axis cannot pass)."""
    import peft

    folder, hf_model = checkpoint
    ours = get_peft_model(_load(folder), LoraConfig(**DORA)).eval()
    theirs = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**DORA))
    mine, reference = _magnitudes(ours), _magnitudes(theirs)
    assert len(mine) == 14 and mine.keys() == reference.keys()
    for name in mine:
        torch.testing.assert_close(mine[name], reference[name], atol=0, rtol=0)
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(ours, ids, mask), _logits(_load(folder), ids, mask), atol=ATOL, rtol=0)

    random_ab = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**DORA, init_lora_weights=False))
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(random_ab))
    for _, layer in ours.base_model.lora_layers():
        layer.reset_magnitude()
    mine, reference = _magnitudes(ours), _magnitudes(random_ab)
    for name in mine:
        assert not torch.allclose(reference[name], _magnitudes(theirs)[name])  # B A really moved the norm
        torch.testing.assert_close(mine[name], reference[name], atol=1e-6, rtol=1e-6)


def test_bfloat16_base_magnitude_and_logits_are_peft_ones(checkpoint):
    """peft computes m in the base's bfloat16 before upcasting the adapters to float32: ours is bit-identical;
    with random adapters the bfloat16 logits agree as plain LoRA's do."""
    import peft
    import transformers

    folder = checkpoint[0]
    theirs = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16),
                                 peft.LoraConfig(**DORA)).eval()
    ours = get_peft_model(_load(folder, dtype=torch.bfloat16), LoraConfig(**DORA)).eval()
    mine, reference = _magnitudes(ours), _magnitudes(theirs)
    assert {m.dtype for m in mine.values()} == {torch.float32}
    for name in mine:
        torch.testing.assert_close(mine[name], reference[name], atol=0, rtol=0)
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(_randomize(theirs)))
    ids, mask = _inputs()
    got, want = _logits(ours, ids, mask), _logits(theirs, ids, mask)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("config", [
    dict(),
    dict(target_modules="all-linear", use_rslora=True, lora_dropout=0.1),  # dropout: eval, so off
], ids=["attn-mlp", "all-linear-rslora"])
def test_logits_and_trainable_counts_match_peft(checkpoint, config):
    ours, theirs = _dora_pair(checkpoint, **config)
    ids, mask = _inputs()
    got, want = _logits(ours, ids, mask), _logits(theirs, ids, mask)
    assert (got - _logits(_load(checkpoint[0]), ids, mask)).abs().max() > 1e-2  # the adapters change the logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert sum(n.endswith(".lora_magnitude_vector") for n in trainable) == len(trainable) // 3


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_gradients_match_peft(checkpoint, dropout):
    """One training batch: the same loss and the same gradients of every lora_A, lora_B and magnitude. With
    dropout both libraries draw the same masks from the same seed (one draw per layer, in the same order), so
    the recomputed x W^T on the dropped-out input is checked too. The norm passes no gradient in either."""
    ours, theirs = _dora_pair(checkpoint, lora_dropout=dropout)
    ids, mask = _inputs()
    losses = []
    for model in (ours, theirs):
        model.train()
        torch.manual_seed(11)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    mine, reference = _lora_grads(ours), _lora_grads(theirs)
    assert mine.keys() == reference.keys() and any(".lora_magnitude_vector" in k for k in mine)
    for name, grad in mine.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, reference[name], atol=1e-5, rtol=1e-4, msg=name)


def test_training_lowers_the_loss_and_moves_only_the_adapters(checkpoint):
    model = get_peft_model(_load(checkpoint[0]), LoraConfig(**DORA, lora_dropout=0.1)).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = _inputs()
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, param in model.named_parameters():
        trained = any(part in name for part in (".lora_A.", ".lora_B.", ".lora_magnitude_vector"))
        assert torch.equal(param, before[name]) != trained, name


def test_adapter_saved_by_us_loads_in_peft(checkpoint, tmp_path):
    import peft
    from safetensors.torch import load_file

    ours, theirs = _dora_pair(checkpoint)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "peft")
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    assert saved["base_model.model.model.layers.0.self_attn.k_proj.lora_magnitude_vector"].shape == (32,)
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["use_dora"] is True

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(checkpoint[1]), tmp_path / "ours").eval()
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(ours, ids, mask), atol=ATOL, rtol=0)


def test_adapter_saved_by_peft_loads_in_ours(checkpoint, tmp_path):
    ours, theirs = _dora_pair(checkpoint)
    theirs.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path)
    assert not any(p.requires_grad for p in loaded.parameters())
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)


def test_merge_and_unload_and_unmerge(checkpoint):
    ours, theirs = _dora_pair(checkpoint, target_modules="all-linear")
    ids, mask = _inputs()
    unmerged = _logits(ours, ids, mask)
    base = {n: p.detach().clone() for n, p in ours.get_base_model().named_parameters() if "lora_" not in n}

    ours.merge_adapter()
    torch.testing.assert_close(_logits(ours, ids, mask), unmerged, atol=1e-4, rtol=0)
    ours.unmerge_adapter()
    for name, param in ours.get_base_model().named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(param, base[name], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(_logits(ours, ids, mask), unmerged, atol=ATOL, rtol=0)

    merged = ours.merge_and_unload()
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert sorted(merged.state_dict()) == sorted(_load(checkpoint[0]).state_dict())
    torch.testing.assert_close(_logits(merged, ids, mask), unmerged, atol=1e-4, rtol=0)
    torch.testing.assert_close(_logits(merged, ids, mask), _logits(theirs.merge_and_unload(), ids, mask),
                               atol=1e-4, rtol=0)


def test_refused_targets_leave_the_model_as_it_was(checkpoint):
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    model = _load(checkpoint[0])
    attention = model.model.layers[0].self_attn
    attention.q_proj = WeightOnlyLinear.from_linear(attention.q_proj, bits=8, group_size=None)
    with pytest.raises(NotImplementedError, match=r"DoRA \(use_dora=True\) on model\.layers\.0\.self_attn\.q_proj "
                                                  r"\(WeightOnlyLinear\)"):
        get_peft_model(model, LoraConfig(**DORA))
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    with pytest.raises(NotImplementedError, match=r"LoRA on model\.embed_tokens \(Embedding\) is not supported"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens"], use_dora=True))


def test_add_adapter_trains_and_saves_the_magnitude(checkpoint, tmp_path):
    """transformers' integration (the adapter on the model itself): the magnitude trains and is saved."""
    from safetensors.torch import load_file

    model = _load(checkpoint[0])
    model.add_adapter(LoraConfig(**DORA))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "model.layers.0.self_attn.q_proj.lora_magnitude_vector" in trainable
    model.save_pretrained(tmp_path)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector" in load_file(
        tmp_path / "adapter_model.safetensors")


def test_disable_and_enable_adapters_freeze_and_unfreeze_the_magnitude(checkpoint):
    """As peft's: disabling the adapter freezes all its weights, the magnitude included; enabling trains them again."""
    model = _load(checkpoint[0])
    model.add_adapter(LoraConfig(**DORA))
    magnitude = model.model.layers[0].self_attn.q_proj.lora_magnitude_vector
    model.disable_adapters()
    assert not magnitude.requires_grad
    model.enable_adapters()
    assert magnitude.requires_grad
