"""LoRA with modules_to_save (gpuformers.lora) against peft 0.21 on transformers: the same copies and LoRA weights
give the same logits (float32, 1e-4) on an untied Qwen3 and on a tied Llama, with and without ensure_weight_tying;
the saved keys are peft's; adapters trained here load in peft and the other way round; the originals stay frozen
and unchanged through training; merge_and_unload / unload / disable_adapter give peft's logits; and the flow after
adding tokens (embeddings resized) saves and loads peft's files.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import (LoraConfig, ModulesToSaveWrapper, PeftModel, get_peft_model, get_peft_model_state_dict,
                             set_peft_model_state_dict)
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-4
TO_SAVE = ["lm_head", "embed_tokens"]
CASES = {  # name: (model_type, tie_word_embeddings, ensure_weight_tying)
    "untied": ("qwen3", False, False),
    "tied": ("llama", True, False),
    "tied-ensure": ("llama", True, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(folder, transformers model, LoraConfig kwargs) for a tiny untied Qwen3 or tied Llama."""
    model_type, tie, ensure = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"mts-{request.param}")
    extra = dict(head_dim=16) if model_type == "qwen3" else {}
    hf_model = make_checkpoint(folder, model_type, tie_word_embeddings=tie, **extra)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=list(TO_SAVE),
                  ensure_weight_tying=ensure)
    return folder, hf_model, config


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False).eval()


def _ids():
    return torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _quiet(fn, *args, **kwargs):
    """Call fn with the tied-embeddings warnings (checked in test_tied_embeddings_as_peft) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _peft_config(config):
    import peft

    return peft.LoraConfig(**copy.deepcopy(config))  # peft rewrites modules_to_save in place (ensure_weight_tying)


def _theirs(case, seed=7):
    """peft's model with random LoRA weights and perturbed modules_to_save copies (so every part shows)."""
    import peft

    _, hf_model, config = case
    theirs = _quiet(peft.get_peft_model, copy.deepcopy(hf_model), _peft_config(config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=g) * 0.1)
    return theirs


def _ours(case):
    return _quiet(get_peft_model, _load(case[0]), LoraConfig(**case[2])).eval()


def test_logits_keys_and_counts_match_peft(case):
    import peft

    theirs, ours = _theirs(case), _ours(case)
    want_state = peft.get_peft_model_state_dict(theirs)
    assert sorted(get_peft_model_state_dict(ours)) == sorted(want_state)  # the saved key names are peft's
    assert sorted(k for k in want_state if "lora_" not in k) == [
        "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"]
    set_peft_model_state_dict(ours, want_state)
    ids = _ids()
    got, want, base = _logits(ours, ids), _logits(theirs, ids), _logits(_load(case[0]), ids)
    assert (got - base).abs().max() > 1e-2
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    assert ours.peft_config["default"].modules_to_save == theirs.peft_config["default"].modules_to_save
    with ours.disable_adapter(), theirs.disable_adapter():
        torch.testing.assert_close(_logits(ours, ids), base, atol=ATOL, rtol=0)
        torch.testing.assert_close(_logits(theirs, ids), base, atol=ATOL, rtol=0)


def test_tied_embeddings_as_peft(case):
    """On a tied model peft warns unless ensure_weight_tying; with it, the head's copy is the embedding's copy."""
    folder, _, config = case
    model = _load(folder)
    tied, ensure = model.config.tie_word_embeddings, config["ensure_weight_tying"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = get_peft_model(model, LoraConfig(**config))
    warned = any("tie_word_embeddings=True" in str(w.message) for w in caught)
    assert warned == (tied and not ensure)
    head, embedding = ours.get_base_model().lm_head, ours.get_base_model().model.embed_tokens
    assert isinstance(head, ModulesToSaveWrapper) and isinstance(embedding, ModulesToSaveWrapper)
    assert (head.modules_to_save.weight is embedding.modules_to_save.weight) == (tied and ensure)
    assert (head.original_module.weight is embedding.original_module.weight) == tied  # the base stays as it was
    assert config["modules_to_save"] == TO_SAVE  # the caller's list is not rewritten


def test_trained_here_loads_in_peft_and_back(case, tmp_path):
    import peft
    from safetensors.torch import load_file

    folder, hf_model, config = case
    ours = _quiet(get_peft_model, _load(folder), LoraConfig(**config))
    originals = {n: p.detach().clone() for n, p in ours.named_parameters() if ".original_module." in n}
    assert originals and not any(p.requires_grad for n, p in ours.named_parameters() if ".original_module." in n)
    copies = {n: p.detach().clone() for n, p in ours.named_parameters() if ".modules_to_save." in n}
    assert copies and all(p.requires_grad for n, p in ours.named_parameters() if ".modules_to_save." in n)
    optimizer = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.5)
    ours.train()
    ids = _ids()
    ours(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    ours.eval()
    params = dict(ours.named_parameters())
    for name, before in originals.items():  # frozen and bit-identical
        assert params[name].grad is None and torch.equal(params[name], before), name
    for name, before in copies.items():
        assert not torch.equal(params[name], before), name
    ours.save_pretrained(tmp_path / "ours")

    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    reference = _quiet(peft.get_peft_model, copy.deepcopy(hf_model), _peft_config(config))
    assert sorted(saved) == sorted(peft.get_peft_model_state_dict(reference))
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["modules_to_save"] == reference.peft_config["default"].modules_to_save
    assert written["ensure_weight_tying"] == config["ensure_weight_tying"]

    theirs = _quiet(peft.PeftModel.from_pretrained, copy.deepcopy(hf_model), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(theirs, ids), _logits(ours, ids), atol=ATOL, rtol=0)

    theirs = _theirs(case, seed=11)
    theirs.save_pretrained(tmp_path / "theirs")
    back = _quiet(PeftModel.from_pretrained, _load(folder), tmp_path / "theirs")
    torch.testing.assert_close(_logits(back, ids), _logits(theirs, ids), atol=ATOL, rtol=0)
    assert not any(p.requires_grad for p in back.parameters())  # loaded for inference


@pytest.mark.parametrize("how", ["merge_and_unload", "unload"])
def test_merge_and_unload_match_peft(case, how, tmp_path):
    import peft

    theirs, ours = _theirs(case), _ours(case)
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    ids = _ids()
    adapted = _logits(ours, ids)
    got, want = _quiet(getattr(ours, how)), _quiet(getattr(theirs, how))
    assert not any(isinstance(m, ModulesToSaveWrapper) for m in got.modules())
    assert type(got.lm_head) is nn.Linear and type(got.model.embed_tokens) is nn.Embedding
    torch.testing.assert_close(_logits(got, ids), _logits(want, ids), atol=ATOL, rtol=0)
    if how == "merge_and_unload":  # the trained copies are the model now
        torch.testing.assert_close(_logits(got, ids), adapted, atol=ATOL, rtol=0)
        assert got.config.tie_word_embeddings == want.config.tie_word_embeddings
    assert got.config.tie_word_embeddings == (got.lm_head.weight is got.model.embed_tokens.weight)
    got.save_pretrained(tmp_path)  # a tie the copies broke is not written as a tie
    torch.testing.assert_close(_logits(_load(tmp_path), ids), _logits(got, ids), atol=ATOL, rtol=0)


def _resize(model, vocab_size, rows):
    """Add tokens to an untied model by hand (embedding and head rows `rows` appended), as resizing does."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    new_embedding = nn.Embedding(vocab_size, embedding.embedding_dim, embedding.padding_idx)
    new_head = nn.Linear(head.in_features, vocab_size, bias=False)
    with torch.no_grad():
        new_embedding.weight.copy_(torch.cat([embedding.weight, rows[0]]))
        new_head.weight.copy_(torch.cat([head.weight, rows[1]]))
    model.model.embed_tokens, model.lm_head = new_embedding, new_head
    model.config.vocab_size = vocab_size
    return model


def test_added_tokens_flow_saves_and_loads_peft_files(tmp_path):
    """Add tokens, resize, LoRA with modules_to_save: peft then also saves the embeddings whole (their original and
    copy), and so do we; each library loads the other's files onto the resized base."""
    import peft
    import transformers

    make_checkpoint(tmp_path / "base", "qwen3", head_dim=16)
    g = torch.Generator().manual_seed(5)
    rows = (torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g) * 0.1)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    hf_model.resize_token_embeddings(130, mean_resizing=False)
    with torch.no_grad():
        hf_model.get_input_embeddings().weight[128:] = rows[0]
        hf_model.get_output_embeddings().weight[128:] = rows[1]
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"])
    theirs = _theirs((tmp_path / "base", hf_model, config))
    _quiet(theirs.save_pretrained, tmp_path / "theirs")

    ours = _quiet(get_peft_model, _resize(_load(tmp_path / "base"), 130, rows), LoraConfig(**config))
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs, save_embedding_layers=False))
    ids = torch.cat([_ids(), torch.tensor([[128, 129]] * 2)], dim=1)  # the new tokens too
    torch.testing.assert_close(_logits(ours, ids), _logits(theirs, ids), atol=ATOL, rtol=0)
    with pytest.warns(UserWarning, match="resized"):
        ours.save_pretrained(tmp_path / "ours")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    want = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(want)
    assert "base_model.model.lm_head.original_module.weight" in saved

    # The new rows of a fresh resize differ from run to run: the saved originals' rows come back with the adapter.
    other_rows = (torch.zeros(2, 64), torch.zeros(2, 64))
    back = PeftModel.from_pretrained(_resize(_load(tmp_path / "base"), 130, other_rows), tmp_path / "theirs")
    torch.testing.assert_close(_logits(back, ids), _logits(theirs, ids), atol=ATOL, rtol=0)
    with back.disable_adapter(), theirs.disable_adapter():
        torch.testing.assert_close(_logits(back, ids), _logits(theirs, ids), atol=ATOL, rtol=0)
    again = _quiet(peft.PeftModel.from_pretrained, copy.deepcopy(hf_model), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(again, ids), _logits(ours, ids), atol=ATOL, rtol=0)
    plain = _load(tmp_path / "base")
    head = plain.lm_head
    with pytest.raises(ValueError, match=r"\(130, 64\).*\(128, 64\).*resize the model's to 130 tokens"):
        PeftModel.from_pretrained(plain, tmp_path / "theirs")
    assert plain.lm_head is head and not any(isinstance(m, ModulesToSaveWrapper) for m in plain.modules())


def test_errors_name_the_value_and_the_fix(tmp_path):
    make_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model = _load(tmp_path / "tied")
    with pytest.raises(ValueError, match=r"'lm_haed' matches no module"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_haed"]))
    with pytest.raises(ValueError, match=r"only layers inside modules_to_save"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["self_attn"]))
    with pytest.raises(NotImplementedError, match=r"nested"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["layers.0", "mlp"]))
    assert not any(isinstance(m, ModulesToSaveWrapper) for m in model.modules())  # each error left it untouched


def test_lora_on_the_head_saves_its_base_weight_as_peft(tmp_path):
    """peft saves an embedding layer's base weight beside its LoRA when target_modules names it; so do we."""
    import peft

    hf_model = make_checkpoint(tmp_path, "qwen3", head_dim=16)
    config = dict(r=4, target_modules=["q_proj", "lm_head"])
    theirs = peft.get_peft_model(copy.deepcopy(hf_model), _peft_config(config))
    ours = get_peft_model(_load(tmp_path), LoraConfig(**config))
    with pytest.warns(UserWarning, match="save_embedding_layers"):
        keys = sorted(get_peft_model_state_dict(ours))
    assert "base_model.model.lm_head.base_layer.weight" in keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert keys == sorted(peft.get_peft_model_state_dict(theirs))


def test_trainer_trains_the_copies_and_resumes_exactly(tmp_path):
    """With the Trainer: only the copies and LoRA weights move, and a run resumed from a checkpoint (which holds
    the adapter only) ends with the same copies as an uninterrupted one; tied head and embedding stay one copy."""
    from gpuformers import Trainer
    from tests.training.distributed_worker import StopAt
    from tests.training.helpers import make_rows, tiny_args

    make_checkpoint(tmp_path / "base", "llama", tie_word_embeddings=True)
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], ensure_weight_tying=True)

    def run(output_dir, resume=None, stop_at=None):
        torch.manual_seed(0)
        model = get_peft_model(_load(tmp_path / "base"), config)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = tiny_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
        Trainer(model=model, args=args, train_dataset=make_rows(8),
                callbacks=[StopAt(stop_at)] if stop_at else None).train(resume_from_checkpoint=resume)
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed == {n for n, p in model.named_parameters() if p.requires_grad}
        assert any(".modules_to_save." in n for n in changed)
        head = model.get_base_model().lm_head
        assert head.modules_to_save.weight is model.get_base_model().model.embed_tokens.modules_to_save.weight
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    straight = run(tmp_path / "straight")
    run(tmp_path / "split", stop_at=2)
    resumed = run(tmp_path / "split", resume=str(tmp_path / "split" / "checkpoint-2"))
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=1e-6)


def test_greedy_generate_and_the_batching_engine_use_the_copies(case):
    import peft

    theirs, ours = _theirs(case), _ours(case)
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    ids = _ids()[:1]
    got = ours.generate(ids, max_new_tokens=6, do_sample=False)
    want = theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
    assert got.tolist() == want.tolist()
    batch = ours.generate_batch([ids[0].tolist()], max_new_tokens=6, do_sample=False, progress_bar=False)
    assert next(iter(batch.values())).generated_tokens == got[0, ids.shape[1]:].tolist()
