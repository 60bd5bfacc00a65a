"""Several adapters on one PeftModel, as peft's: load_adapter / add_adapter add one without activating it,
set_adapter switches (logits and trainable parameters equal peft's at every switch), delete_adapter of the active
one activates the first remaining, save_pretrained writes each adapter in peft's layout (peft loads every one of
them back), merge_and_unload merges the active one; several active at once is refused."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import LoraConfig, PeftModel
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
            "b": dict(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"], use_rslora=True)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base folder, transformers model, {name: adapter folder saved by peft with random A and B})."""
    import peft

    folder = tmp_path_factory.mktemp("multi-base")
    hf = make_checkpoint(folder, "qwen3", head_dim=16)
    adapters = {}
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        adapters[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(init_lora_weights=False, **settings)).save_pretrained(
            adapters[name])
    return folder, hf, adapters


def _logits(model):
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trainable(model) -> set[str]:
    return {n.replace(".a.", ".").replace(".b.", ".").replace(".c.", ".") for n, p in model.named_parameters()
            if p.requires_grad}


def _pair(setup):
    import peft

    folder, hf, adapters = setup
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, progress=False), adapters["a"],
                                     adapter_name="a", is_trainable=True)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapters["a"], adapter_name="a", is_trainable=True)
    for model in (ours, theirs):
        model.load_adapter(adapters["b"], adapter_name="b")
    return ours, theirs


def test_switching_adapters_matches_peft(setup):
    import peft

    ours, theirs = _pair(setup)
    assert ours.active_adapter == theirs.active_adapter == "a" and list(ours.peft_config) == ["a", "b"]
    first = _logits(ours)
    lora_a = ours.get_base_model().model.layers[0].self_attn.q_proj.lora_A.weight
    for name in ("a", "b", "a", "b"):
        ours.set_adapter(name)
        theirs.set_adapter(name)
        torch.testing.assert_close(_logits(ours), _logits(theirs), atol=ATOL, rtol=0)
        assert _trainable(ours) == _trainable(theirs) != set()
    assert not torch.allclose(_logits(ours), first)
    ours.set_adapter("a")
    theirs.set_adapter("a")
    assert ours.get_base_model().model.layers[0].self_attn.q_proj.lora_A.weight is lora_a  # the same layers back
    torch.testing.assert_close(_logits(ours), first, atol=0, rtol=0)

    ours.add_adapter("c", LoraConfig(r=2, target_modules=["k_proj"]))
    theirs.add_adapter("c", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    assert ours.active_adapter == theirs.active_adapter == "a" and list(ours.peft_config) == ["a", "b", "c"]
    torch.testing.assert_close(_logits(ours), first, atol=0, rtol=0)  # added, not active
    for model in (ours, theirs):
        model.set_adapter("c")
        model.delete_adapter("c")  # the active one: the first remaining takes its place
    assert ours.active_adapter == theirs.active_adapter == "a" and list(ours.peft_config) == ["a", "b"]
    # peft falls back per layer (a layer without "a" keeps "b" on): set_adapter makes it whole "a" again
    theirs.set_adapter("a")
    torch.testing.assert_close(_logits(ours), _logits(theirs), atol=ATOL, rtol=0)

    with pytest.raises(NotImplementedError, match="several active adapters"):
        ours.set_adapter(["a", "b"])
    with pytest.raises(ValueError, match="'b' already exists"):
        ours.load_adapter(setup[2]["b"], adapter_name="b")
    with pytest.raises(ValueError, match=r"'z' not found: this model's adapters are \['a', 'b'\]"):
        ours.set_adapter("z")
    with pytest.raises(NotImplementedError, match=r"merging adapters \['b'\]: only the active adapter \('a'\)"):
        ours.merge_and_unload(adapter_names=["b"])
    merged = ours.merge_and_unload(adapter_names=["a"])
    torch.testing.assert_close(_logits(merged), _logits(theirs.merge_and_unload(adapter_names=["a"])), atol=ATOL,
                               rtol=0)


def test_every_adapter_is_saved_in_peft_layout_and_loads_in_peft(setup, tmp_path):
    import peft

    ours, theirs = _pair(setup)
    ours.set_adapter("b")  # saving switches to each adapter and back
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "peft")
    assert sorted(os.listdir(tmp_path / "ours")) == ["a", "b"] and ours.active_adapter == "b"
    for name in ("a", "b"):
        theirs.set_adapter(name)
        back = peft.PeftModel.from_pretrained(copy.deepcopy(setup[1]), tmp_path / "ours" / name)
        torch.testing.assert_close(_logits(back), _logits(theirs), atol=ATOL, rtol=0)
    ours.save_pretrained(tmp_path / "only", selected_adapters=["a"])
    assert os.listdir(tmp_path / "only") == ["a"]


def test_a_failed_load_leaves_the_adapters_as_they_were(setup, tmp_path):
    import json
    import shutil

    ours, _ = _pair(setup)
    before = _logits(ours)
    broken = tmp_path / "broken"
    shutil.copytree(setup[2]["b"], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))  # weights of rank 2
    with pytest.raises(ValueError, match="lora_A.weight has shape"):
        ours.load_adapter(broken, adapter_name="broken")
    assert list(ours.peft_config) == ["a", "b"] and ours.active_adapter == "a"
    torch.testing.assert_close(_logits(ours), before, atol=0, rtol=0)
