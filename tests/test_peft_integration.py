"""LoRA adapters on the model itself (gpuformers.lora.integration) against transformers' PEFT integration: the same
adapter folder loaded by model.load_adapter gives the same logits and greedy tokens; an adapter added, trained and
saved by us loads in transformers; from_pretrained(adapter_folder) loads the base then the adapter; disable /
enable; several adapters switched with set_adapter; and the errors users meet.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.lora import LoraConfig, LoraLinear
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-4
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 and a LoRA adapter for it saved by peft (random B, so the adapter changes the logits)."""
    import peft

    folder = tmp_path_factory.mktemp("peft-integration-qwen3")
    hf_model = make_checkpoint(folder, "qwen3", head_dim=16)
    with_adapter = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(r=4, lora_alpha=8,
                                                                                 target_modules=TARGETS))
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, param in with_adapter.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    adapter = tmp_path_factory.mktemp("peft-adapter")
    with_adapter.save_pretrained(adapter)
    return folder, adapter


@pytest.fixture
def transformers_peft(monkeypatch):
    """transformers' load_adapter / add_adapter, the parity oracle. transformers 5.24 asks for peft >= 0.22.0,
    which is not published yet; its integration runs on peft 0.21.2 once that version check is skipped."""
    import peft
    import transformers
    import transformers.integrations.peft as integration
    from packaging.version import Version

    if Version(peft.__version__) < Version("0.22.0"):
        monkeypatch.setattr(integration, "check_peft_version", lambda **kwargs: None)
    return transformers


def _load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs).eval()


def _hf_load(transformers, folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0  # left padding in the last row
    return ids, mask


def _logits(model):
    ids, mask = _inputs()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _greedy(model, **kwargs):
    ids = _inputs()[0][:1]
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          **kwargs)[0].tolist()


def _trainable(model) -> set[str]:
    return {n.replace(".default.", ".") for n, p in model.named_parameters() if p.requires_grad}


def _randomize_adapter(model, seed=11):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def test_load_adapter_matches_transformers(checkpoint, transformers_peft):
    folder, adapter = checkpoint
    theirs = _hf_load(transformers_peft, folder)
    theirs.load_adapter(str(adapter))
    ours = _load(folder)
    cls = type(ours)
    ours.load_adapter(adapter)

    assert type(ours) is cls and ours._hf_peft_config_loaded and list(ours.peft_config) == ["default"]
    assert ours.active_adapters() == theirs.active_adapters() == ["default"]
    assert not ours.training and _trainable(ours) == _trainable(theirs) == set()
    got = _logits(ours)
    assert (got - _logits(_load(folder))).abs().max() > 1e-2  # the adapter really is in the forward
    torch.testing.assert_close(got, _logits(theirs), atol=ATOL, rtol=0)
    assert _greedy(ours) == _greedy(theirs, pad_token_id=0)

    mine, reference = ours.get_adapter_state_dict(), theirs.get_adapter_state_dict()
    assert sorted(mine) == sorted(reference) and all(torch.equal(mine[k], reference[k]) for k in mine)

    # the same adapter given as a config and a state dict (transformers' keys, without peft's prefix)
    from_state = _load(folder)
    from_state.load_adapter(peft_config=LoraConfig.from_pretrained(adapter), adapter_state_dict=reference)
    torch.testing.assert_close(_logits(from_state), got, atol=0, rtol=0)


def test_added_trained_and_saved_adapter_loads_in_transformers(checkpoint, transformers_peft, tmp_path):
    import peft
    from safetensors.torch import load_file

    folder, _ = checkpoint
    model = _load(folder)
    base = _logits(model)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    reference = _hf_load(transformers_peft, folder)
    reference.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    assert _trainable(model) == _trainable(reference)  # base frozen, only the adapter trains, as transformers
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)  # B starts at zero

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = _inputs()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    trained = _logits(model)
    assert (trained - base).abs().max() > 1e-3

    model.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "theirs")
    files = {p.name for p in (tmp_path / "ours").iterdir()}
    assert files == {p.name for p in (tmp_path / "theirs").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "generation_config.json"}
    assert not (tmp_path / "ours" / "config.json").exists()
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(load_file(tmp_path / "theirs" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder) and config["inference_mode"] is False

    loaded = _hf_load(transformers_peft, folder)
    loaded.load_adapter(str(tmp_path / "ours"))
    torch.testing.assert_close(_logits(loaded), trained, atol=ATOL, rtol=0)


def test_from_pretrained_on_an_adapter_folder_loads_its_base_then_the_adapter(checkpoint, tmp_path):
    folder, _ = checkpoint
    model = _load(folder)
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"]))
    _randomize_adapter(model)
    model.save_pretrained(tmp_path / "adapter")

    loaded = _load(tmp_path / "adapter", adapter_name="mine")
    assert type(loaded) is type(model) and loaded.name_or_path == str(folder)
    assert list(loaded.peft_config) == ["mine"] and not loaded.training
    torch.testing.assert_close(_logits(loaded), _logits(model), atol=0, rtol=0)

    both = tmp_path / "base-and-adapter"  # transformers' rule: a folder with config.json is its own base
    shutil.copytree(folder, both)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(tmp_path / "adapter" / name, both / name)
    embedded = _load(both)
    assert embedded.name_or_path == str(both) and embedded.active_adapters() == ["default"]
    torch.testing.assert_close(_logits(embedded), _logits(model), atol=0, rtol=0)

    config_path = tmp_path / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="names no base model.*load_adapter"):
        _load(tmp_path / "adapter")


def test_disable_and_enable_switch_the_adapter_off_and_on(checkpoint, transformers_peft):
    import peft

    folder, adapter = checkpoint
    base = _logits(_load(folder))
    model = _load(folder)
    model.load_adapter(adapter, is_trainable=True)
    reference = _hf_load(transformers_peft, folder)
    reference.load_adapter(str(adapter), is_trainable=True)
    with_adapter = _logits(model)
    assert _trainable(model) == _trainable(reference) != set()

    model.disable_adapters()
    reference.disable_adapters()
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)
    assert _trainable(model) == _trainable(reference) == set()  # peft freezes a disabled adapter
    model.enable_adapters()
    reference.enable_adapters()
    torch.testing.assert_close(_logits(model), with_adapter, atol=0, rtol=0)
    assert _trainable(model) == _trainable(reference) != set()

    fresh = _load(folder)
    fresh.add_adapter(peft.LoraConfig(r=4, target_modules=TARGETS))  # peft's own config is taken too
    assert fresh.peft_config["default"].target_modules == sorted(TARGETS)


def test_several_adapters_switch_like_transformers(checkpoint, transformers_peft, tmp_path):
    import peft

    folder, adapter = checkpoint
    second = tmp_path / "second"  # another rank and other layers, so the two adapters give other logits
    other = peft.get_peft_model(_hf_load(transformers_peft, folder),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"],
                                                init_lora_weights=False))
    other.save_pretrained(second)
    base = _logits(_load(folder))
    model, reference = _load(folder), _hf_load(transformers_peft, folder)
    for m in (model, reference):
        m.load_adapter(str(adapter))
        m.load_adapter(str(second), adapter_name="second")  # loading makes it the active one, as in transformers
    assert model.active_adapters() == reference.active_adapters() == ["second"]
    assert list(model.peft_config) == list(reference.peft_config) == ["default", "second"]
    first_a = model.get_submodule("model.layers.0.self_attn.q_proj")  # parked while "second" is active
    assert not isinstance(first_a, LoraLinear)
    for name in ("second", "default", "second", "default"):
        model.set_adapter(name)
        reference.set_adapter(name)
        torch.testing.assert_close(_logits(model), _logits(reference), atol=ATOL, rtol=0)
        assert _greedy(model) == _greedy(reference)
        assert _trainable(model) == {n.replace(f".{name}.", ".") for n, p in reference.named_parameters()
                                     if p.requires_grad}
    # the same layer objects come back: an optimizer holding their parameters keeps working
    lora_a = model.get_submodule("model.layers.0.self_attn.q_proj").lora_A.weight
    model.set_adapter("second")
    model.set_adapter("default")
    assert model.get_submodule("model.layers.0.self_attn.q_proj").lora_A.weight is lora_a
    # a parked adapter's tensors, and the active one saved
    parked = model.get_adapter_state_dict("second")
    for key, value in reference.get_adapter_state_dict("second").items():
        torch.testing.assert_close(parked[key], value, atol=0, rtol=0)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "adapter_config.json").read_text())["r"] == 4  # "default", the active

    with pytest.raises(NotImplementedError, match="several active adapters at once"):
        model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match="'second' already exists"):
        model.load_adapter(second, adapter_name="second")
    with pytest.raises(ValueError, match=r"'third' not found: this model's adapters are \['default', 'second'\]"):
        model.set_adapter("third")
    model.disable_adapters()
    model.set_adapter("second")  # disabled holds across a switch
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)
    model.enable_adapters()
    model.delete_adapter("second")  # the active one: the first remaining becomes active, as in peft
    reference.delete_adapter("second")
    reference.set_adapter("default")
    assert model.active_adapters() == ["default"] and list(model.peft_config) == ["default"]
    torch.testing.assert_close(_logits(model), _logits(reference), atol=ATOL, rtol=0)
    model.delete_adapter("default")
    assert not model._hf_peft_config_loaded and not hasattr(model, "peft_config")
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)


def test_a_second_adapter_with_a_trained_bias_saves_it_like_transformers(transformers_peft, tmp_path):
    """With several adapters on the model, the active one's bias="lora_only" biases are saved, as transformers'
    get_adapter_state_dict (peft's, with the adapter's own config) saves them."""
    import peft

    folder = tmp_path / "with-bias"
    make_checkpoint(folder, "qwen3", head_dim=16, attention_bias=True)  # q/k/v/o biases that bias= can train
    adapter, biased = tmp_path / "plain", tmp_path / "biased"
    peft.get_peft_model(_hf_load(transformers_peft, folder),
                        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
                        ).save_pretrained(adapter)
    other = peft.get_peft_model(_hf_load(transformers_peft, folder),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"],
                                                bias="lora_only", init_lora_weights=False))
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith("k_proj.base_layer.bias"):
                param.add_(0.5)  # trained: no longer the base model's bias
    other.save_pretrained(biased)
    model, reference = _load(folder), _hf_load(transformers_peft, folder)
    for m in (model, reference):
        m.load_adapter(str(adapter))
        m.load_adapter(str(biased), adapter_name="biased")
    ours, theirs = model.get_adapter_state_dict(), reference.get_adapter_state_dict()
    assert any(key.endswith("k_proj.base_layer.bias") for key in theirs)  # the oracle saves the trained biases
    # peft also adds the biases of the other adapter's layers (q_proj, v_proj: any layer with a lora_ key in the
    # state dict); they are the base model's own, untrained, and are left out here.
    others = {k for k in theirs if k.endswith("base_layer.bias") and ("q_proj" in k or "v_proj" in k)}
    assert others and sorted(ours) == sorted(set(theirs) - others)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], atol=0, rtol=0)
    model.save_pretrained(tmp_path / "saved")
    reloaded = _load(folder)
    reloaded.load_adapter(str(tmp_path / "saved"))
    torch.testing.assert_close(_logits(reloaded), _logits(model), atol=ATOL, rtol=0)


def test_a_failed_load_leaves_the_active_adapter_in_place(checkpoint, tmp_path):
    folder, adapter = checkpoint
    model = _load(folder)
    model.load_adapter(adapter)
    with_adapter = _logits(model)
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["no_such_proj"]}))
    with pytest.raises(ValueError, match="no_such_proj"):
        model.load_adapter(broken, adapter_name="broken")
    assert model.active_adapters() == ["default"] and list(model.peft_config) == ["default"]
    torch.testing.assert_close(_logits(model), with_adapter, atol=0, rtol=0)


def test_missing_folder_or_file_gives_a_clear_error(checkpoint, tmp_path):
    folder, adapter = checkpoint
    model = _load(folder)
    with pytest.raises(ValueError, match="no adapter.*add_adapter"):
        model.active_adapters()
    with pytest.raises(FileNotFoundError, match="no folder at"):
        model.load_adapter(tmp_path / "missing")

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors in"):
        model.load_adapter(config_only)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json in"):
        model.load_adapter(tmp_path)
    assert not model._hf_peft_config_loaded and not any(isinstance(m, LoraLinear) for m in model.modules())
    model.load_adapter(adapter)  # a failed load leaves the model ready for the next one
    assert model.active_adapters() == ["default"]


def test_trainer_trains_the_adapter_and_saves_it_alone(checkpoint, tmp_path):
    from gpuformers import Trainer
    from tests.training.helpers import make_rows, tiny_args

    folder, _ = checkpoint
    model = _load(folder)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model=model, args=tiny_args(tmp_path, max_steps=2), train_dataset=make_rows(8)).train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed == {n for n, p in model.named_parameters() if p.requires_grad}

    model.save_pretrained(tmp_path / "final")
    loaded = _load(tmp_path / "final")
    torch.testing.assert_close(_logits(loaded), _logits(model.eval()), atol=0, rtol=0)


def test_trainer_resumes_an_adapter_added_to_the_model(checkpoint, tmp_path):
    # The checkpoint holds the adapter under peft's keys ("base_model.model. ..."): resuming puts them back into
    # the adapter on the model itself and ends where an uninterrupted run ends.
    from gpuformers import Trainer
    from tests.training.helpers import make_rows, tiny_args

    folder, _ = checkpoint

    def run(output_dir, resume=None):
        torch.manual_seed(0)
        model = _load(folder)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=["lm_head"]))
        args = tiny_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2)
        Trainer(model=model, args=args, train_dataset=make_rows(16)).train(resume_from_checkpoint=resume)
        return model.get_adapter_state_dict()

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert whole.keys() == resumed.keys()
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0, msg=key)


def test_modules_to_save_train_save_and_switch_like_transformers(checkpoint, transformers_peft, tmp_path):
    import peft

    folder, _ = checkpoint
    model = _load(folder)
    base = _logits(model)
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    reference = _hf_load(transformers_peft, folder)
    reference.add_adapter(peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert _trainable(model) == _trainable(reference)

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = _inputs()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    trained = _logits(model)
    model.save_pretrained(tmp_path)
    loaded = _hf_load(transformers_peft, folder)
    loaded.load_adapter(str(tmp_path))
    torch.testing.assert_close(_logits(loaded), trained, atol=ATOL, rtol=0)

    # transformers' enable_adapters leaves a modules_to_save wrapper on its original module; ours switches it back
    model.disable_adapters()
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)
    model.enable_adapters()
    torch.testing.assert_close(_logits(model), trained, atol=0, rtol=0)
    model.delete_adapter("default")
    torch.testing.assert_close(_logits(model), base, atol=0, rtol=0)  # the original head back, not the copy
