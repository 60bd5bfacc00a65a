"""LoRA (gpuformers.lora) against peft on transformers: the same LoRA weights give the same logits (float32, 1e-5)
for attention, MLP and "all-linear" targets; adapters saved by either library load in the other; the same
trainable-parameter counts; merge_and_unload, unload, training that moves only the adapters, generate through
the wrapper, and the errors users meet.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import LoraConfig, LoraLinear, PeftModel, get_peft_model, set_peft_model_state_dict
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 (q/k norms, untied head) and the transformers model that wrote it."""
    folder = tmp_path_factory.mktemp("lora-qwen3")
    hf_model = make_checkpoint(folder, "qwen3", head_dim=16)
    return folder, hf_model


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False).eval()


def _inputs(batch=2, seq=12):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch == 1:
        return ids, mask
    mask[-1, :3] = 0  # left padding in the last row
    return ids, mask


def _peft_pair(checkpoint, **config):
    """(ours, peft's): each base model wrapped with the same config, peft's LoRA weights random and copied into
    ours through peft's saved-key state dict (so the test also checks that the keys agree)."""
    import peft

    folder, hf_model = checkpoint
    theirs = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**config)).eval()
    with torch.no_grad():  # B starts at zero: randomise both so that every adapter changes the logits
        g = torch.Generator().manual_seed(7)
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    ours = get_peft_model(_load(folder), LoraConfig(**config)).eval()
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    return ours, theirs


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("config", [
    dict(r=4, lora_alpha=8, target_modules=ATTN_MLP),
    dict(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    dict(r=4, lora_alpha=8, target_modules=ATTN_MLP, rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
         alpha_pattern={"v_proj": 32, r"layers\.0\.self_attn\.q_proj": 3}),
    dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["o_proj", "layers.0.mlp.up_proj"]),
    dict(r=4, lora_alpha=8, target_modules=ATTN_MLP, exclude_modules=r"model\.layers\.0\.mlp\..*"),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1],
         layers_pattern="layers"),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=0),
], ids=["attn-mlp", "all-linear", "rslora", "rank-alpha-patterns", "exclude-list", "exclude-regex",
        "layers-to-transform", "one-layer"])
def test_logits_and_trainable_counts_match_peft(checkpoint, config, capsys):
    ours, theirs = _peft_pair(checkpoint, **config)
    ids, mask = _inputs()
    base = _logits(_load(checkpoint[0]), ids, mask)
    got, want = _logits(ours, ids, mask), _logits(theirs, ids, mask)
    assert (got - base).abs().max() > 1e-2  # the adapters really are in the forward
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    ours.print_trainable_parameters()
    theirs.print_trainable_parameters()
    mine, peft_line = capsys.readouterr().out.strip().splitlines()
    assert mine == peft_line
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    wrapped = {n for n, m in ours.get_base_model().named_modules() if isinstance(m, LoraLinear)}
    assert "lm_head" not in wrapped and len(wrapped) == len(trainable) // 2
    peft_ranks = {n: m.r["default"] for n, m in theirs.get_base_model().named_modules() if hasattr(m, "lora_A")}
    assert {n: m.r for n, m in ours.get_base_model().named_modules() if isinstance(m, LoraLinear)} == peft_ranks


def test_adapter_saved_by_us_loads_in_peft(checkpoint, tmp_path):
    import peft

    ours, theirs = _peft_pair(checkpoint, r=4, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "peft")

    mine = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    reference = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(mine["target_modules"]) == set(reference["target_modules"])  # peft's order is a set's
    for key, value in mine.items():
        if key not in ("target_modules", "base_model_name_or_path"):
            assert reference.get(key) == value, key
    assert mine["peft_type"] == "LORA" and mine["base_model_name_or_path"] == str(checkpoint[0])

    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(load_file(tmp_path / "peft" / "adapter_model.safetensors"))

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(checkpoint[1]), tmp_path / "ours").eval()
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(ours, ids, mask), atol=ATOL, rtol=0)


def test_adapter_saved_by_peft_loads_in_ours(checkpoint, tmp_path):
    ours, theirs = _peft_pair(checkpoint, r=2, lora_alpha=5, target_modules=["q_proj", "down_proj"])
    theirs.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)

    trainable = PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path, is_trainable=True)
    assert trainable.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()


def test_merge_and_unload_gives_a_plain_model_with_the_same_logits(checkpoint, tmp_path):
    ours, theirs = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules="all-linear")
    ids, mask = _inputs()
    unmerged = _logits(ours, ids, mask)
    merged = ours.merge_and_unload()
    assert type(merged) is type(_load(checkpoint[0]))
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert sorted(merged.state_dict()) == sorted(_load(checkpoint[0]).state_dict())
    torch.testing.assert_close(_logits(merged, ids, mask), unmerged, atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(merged, ids, mask), _logits(theirs.merge_and_unload(), ids, mask),
                               atol=ATOL, rtol=0)
    merged.save_pretrained(tmp_path)  # a plain checkpoint: loads with no LoRA code at all
    torch.testing.assert_close(_logits(_load(tmp_path), ids, mask), unmerged, atol=ATOL, rtol=0)


def test_merge_refuses_a_head_tied_to_the_embeddings(tmp_path):
    make_checkpoint(tmp_path, "qwen3", head_dim=16, tie_word_embeddings=True)
    model = get_peft_model(_load(tmp_path), LoraConfig(target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied"):
        model.merge_and_unload()


def test_half_precision_base_gets_float32_adapters_like_peft(checkpoint, tmp_path):
    import peft
    import transformers

    folder = checkpoint[0]
    theirs = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16),
                                 peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, progress=False, dtype=torch.bfloat16),
                          LoraConfig(r=4, target_modules="all-linear")).eval()
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    assert {p.dtype for n, p in ours.named_parameters() if "lora_" in n} == {torch.float32}
    ids, mask = _inputs()
    got, want = _logits(ours, ids, mask), _logits(theirs, ids, mask)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    ours.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "adapter_model.safetensors").values()} == {torch.float32}


def test_unload_gives_back_the_base_model(checkpoint):
    ours, _ = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules=ATTN_MLP)
    ids, mask = _inputs()
    with ours.disable_adapter():
        disabled = _logits(ours, ids, mask)
    base = _logits(_load(checkpoint[0]), ids, mask)
    assert torch.equal(disabled, base)
    assert torch.equal(_logits(ours.unload(), ids, mask), base)


def test_training_moves_only_the_adapters(checkpoint):
    model = get_peft_model(_load(checkpoint[0]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           lora_dropout=0.1))
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = _inputs()
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name


def test_greedy_generate_through_the_wrapper_matches_peft(checkpoint):
    ours, theirs = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    ids = _inputs(batch=1)[0]  # one row: no padding
    got = ours.generate(ids, max_new_tokens=8, do_sample=False)
    want = theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)
    assert got.tolist() == want.tolist()
    with ours.disable_adapter():
        assert ours.generate(ids, max_new_tokens=8, do_sample=False).tolist() != got.tolist()
    prompts = [ids[0, :5].tolist(), ids[0].tolist()]  # the continuous batching engine, through the wrapper too
    batch = ours.generate_batch(prompts, max_new_tokens=4, do_sample=False, progress_bar=False)
    for prompt, output in zip(prompts, batch.values()):
        single = ours.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
        assert output.generated_tokens == single.tolist()


def test_trainer_trains_and_saves_the_adapter(checkpoint, tmp_path):
    from gpuformers import Trainer
    from tests.training.helpers import make_rows, tiny_args

    model = get_peft_model(_load(checkpoint[0]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=tiny_args(tmp_path, max_steps=3), train_dataset=make_rows(8))
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad}
    trainer.save_model(tmp_path / "final")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "final").iterdir()}
    loaded = PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path / "final")
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(model.eval(), ids, mask), atol=ATOL, rtol=0)


def test_trainer_resumes_a_lora_run(checkpoint, tmp_path):
    """A LoRA checkpoint holds the adapter only: resuming from it continues exactly (same adapter at the end)."""
    from gpuformers import Trainer
    from tests.training.distributed_worker import StopAt
    from tests.training.helpers import make_rows, tiny_args

    def run(output_dir, resume=None, stop_at=None):
        torch.manual_seed(0)
        model = get_peft_model(_load(checkpoint[0]), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        args = tiny_args(output_dir, max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=2)
        trainer = Trainer(model=model, args=args, train_dataset=make_rows(12),
                          callbacks=[StopAt(stop_at)] if stop_at else None)
        trainer.train(resume_from_checkpoint=resume)
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    straight = run(tmp_path / "straight")
    run(tmp_path / "split", stop_at=3)
    resumed = run(tmp_path / "split", resume=str(tmp_path / "split" / "checkpoint-3"))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(r=0), ValueError, ["r=0", "positive integer"]),
    (dict(bias="some"), ValueError, ["bias='some'", '"lora_only"', 'use "none"']),
    (dict(lora_dropout=1.5), ValueError, ["lora_dropout=1.5"]),
    (dict(modules_to_save="lm_head"), ValueError, ["modules_to_save='lm_head'", '["lm_head", "embed_tokens"]']),
])
def test_bad_config_names_the_value_and_the_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        LoraConfig(target_modules=["q_proj"], **kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_targets_name_the_value_and_the_fix(checkpoint):
    folder = checkpoint[0]
    with pytest.raises(ValueError, match=r"'qproj'.*q_proj"):
        get_peft_model(_load(folder), LoraConfig(target_modules=["q_proj", "qproj"]))
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp \(GatedMLP\)"):
        get_peft_model(_load(folder), LoraConfig(target_modules=["layers.0.mlp"]))

    class Linear4bit(nn.Linear):  # stands in for a quantized layer (bitsandbytes' subclass nn.Linear)
        pass

    model = _load(folder)
    old = model.model.layers[-1].self_attn.q_proj  # the last layer: the first layer's q_proj comes before it
    model.model.layers[-1].self_attn.q_proj = Linear4bit(old.in_features, old.out_features, bias=False)
    with pytest.raises(NotImplementedError, match=r"Linear4bit.*QLoRA"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    assert not any(isinstance(m, LoraLinear) for m in model.modules())  # the error left the model untouched

    model = _load(folder)
    model.hf_device_map = {"model": 0, "lm_head": "cpu"}  # what device_map with CPU offload leaves
    with pytest.raises(NotImplementedError, match="offloaded layers.*cpu"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))


def test_adapter_for_another_model_is_refused(checkpoint, tmp_path):
    _, theirs = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules=["q_proj"])
    theirs.save_pretrained(tmp_path / "adapter")
    make_checkpoint(tmp_path / "wider", "qwen3", head_dim=16, hidden_size=32)
    model = _load(tmp_path / "wider")
    with pytest.raises(ValueError, match=r"lora_A\.weight has shape \(4, 64\).*\(4, 32\)"):
        PeftModel.from_pretrained(model, tmp_path / "adapter")
    assert not any(isinstance(m, LoraLinear) for m in model.modules())


def test_adapter_with_a_feature_we_lack_is_refused(checkpoint, tmp_path):
    _, theirs = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules=["q_proj"])
    theirs.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "layer_replication": [[0, 2], [1, 2]]}))
    with pytest.raises(NotImplementedError, match=r"layer_replication=\[\[0, 2\], \[1, 2\]\]"):
        PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path)


def test_layer_selection_and_patterns_load_and_save_both_ways(checkpoint, tmp_path):
    import peft

    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], layers_to_transform=[0],
                  rank_pattern={"v_proj": 6}, alpha_pattern={"gate_proj": 2}, exclude_modules=["layers.0.mlp.gate_proj"])
    ours, theirs = _peft_pair(checkpoint, **config)
    theirs.save_pretrained(tmp_path / "peft")
    ids, mask = _inputs()
    loaded = PeftModel.from_pretrained(_load(checkpoint[0]), tmp_path / "peft").eval()
    torch.testing.assert_close(_logits(loaded, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)
    loaded.save_pretrained(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(copy.deepcopy(checkpoint[1]), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(back, ids, mask), _logits(theirs, ids, mask), atol=ATOL, rtol=0)
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (saved["rank_pattern"], saved["layers_to_transform"]) == ({"v_proj": 6}, [0])
    with pytest.raises(ValueError, match="exclude_modules=.* takes back every layer"):
        get_peft_model(_load(checkpoint[0]), LoraConfig(target_modules=["q_proj"], exclude_modules=["q_proj"]))
    for targets in (".*q_proj", "all-linear"):  # as peft refuses them
        with pytest.raises(ValueError, match="layers_to_transform / layers_pattern cannot be used when target_"):
            LoraConfig(target_modules=targets, layers_to_transform=[0])


def test_default_targets_and_double_wrapping(checkpoint):
    import peft

    model = get_peft_model(_load(checkpoint[0]), LoraConfig())  # None: peft's default for qwen3, q and v
    assert model.peft_config["default"].target_modules == ["q_proj", "v_proj"]
    theirs = peft.get_peft_model(copy.deepcopy(checkpoint[1]), peft.LoraConfig())
    assert model.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    ported = get_peft_model(_load(checkpoint[0]), peft.LoraConfig(r=2, use_rslora=True, target_modules=["o_proj"]))
    assert ported.peft_config["default"] == LoraConfig(r=2, use_rslora=True, target_modules=["o_proj"],
                                                       base_model_name_or_path=str(checkpoint[0]))
    with pytest.raises(ValueError, match="already"):
        get_peft_model(model, LoraConfig())
