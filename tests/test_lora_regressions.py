"""Regressions found by a differential campaign of gpuformers' LoRA against peft 0.21 on transformers: each test is
one configuration peft accepts where ours built other layers, refused peft's files, or wrote a different file.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gpuformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from gpuformers.lora import LoraConfig, PeftModel, get_peft_model
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 (biases on q/k/v) and the transformers model that wrote it."""
    folder = tmp_path_factory.mktemp("lora-reg-qwen2")
    return folder, make_checkpoint(folder, "qwen2")


def _logits(model):
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _randomized_peft(hf_model, **config):
    """peft's model over a copy of `hf_model`, its adapter tensors (and modules_to_save copies, biases) random."""
    import peft

    theirs = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**config)).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return theirs


def _trainable(model) -> set[str]:
    return {n.replace(".default", "") for n, p in model.named_parameters() if p.requires_grad}


def test_a_whole_module_name_in_target_modules_ignores_layers_to_transform(qwen2, tmp_path):
    # peft matches an entry equal to a module's whole name ("lm_head") before it looks at layers_to_transform, so
    # the head gets a LoRA; ours dropped it and refused peft's file (unexpected lm_head keys)
    folder, hf_model = qwen2
    config = dict(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"], layers_to_transform=[0])
    theirs = _randomized_peft(hf_model, **config)
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, progress=False), LoraConfig(**config))
    assert _trainable(ours) == _trainable(theirs)
    assert "base_model.model.lm_head.lora_A.weight" in _trainable(ours)
    theirs.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, progress=False), tmp_path).eval()
    torch.testing.assert_close(_logits(loaded), _logits(theirs), atol=ATOL, rtol=0)


def test_bias_all_with_a_biased_modules_to_save_module_reads_and_writes_peft_files(qwen2, tmp_path):
    # peft's bias="all" saves every parameter named bias: a modules_to_save wrapper's original_module.bias and
    # modules_to_save.bias too. Ours refused those keys when loading and did not write them.
    import peft
    from safetensors.torch import load_file

    folder, hf_model = qwen2
    config = dict(r=2, target_modules=["q_proj"], modules_to_save=["k_proj"], bias="all")
    theirs = _randomized_peft(hf_model, **config)
    theirs.save_pretrained(tmp_path / "peft")
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, progress=False), tmp_path / "peft")
    torch.testing.assert_close(_logits(ours.eval()), _logits(theirs), atol=ATOL, rtol=0)
    ours.save_pretrained(tmp_path / "ours")
    reference = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.k_proj.original_module.bias" in saved
    assert sorted(saved) == sorted(reference)
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(back), _logits(theirs), atol=ATOL, rtol=0)


def test_a_seq_cls_adapter_config_lists_the_classifier_once_after_a_round_trip(qwen2, tmp_path):
    # SEQ_CLS adds "classifier" and "score" to modules_to_save; loading a saved config added them a second time
    folder, _ = qwen2
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, progress=False)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS")).save_pretrained(tmp_path / "a")
    base = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, progress=False)
    PeftModel.from_pretrained(base, tmp_path / "a").save_pretrained(tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert sorted(saved["modules_to_save"]) == ["classifier", "score"]


def test_an_adapter_config_with_empty_target_parameters_loads():
    # peft writes target_parameters=[] over a model with fused MoE experts (Qwen3-MoE) that it did not target: "off"
    config = LoraConfig.from_dict({**LoraConfig(target_modules=["q_proj"]).to_dict(), "target_parameters": []})
    assert config.target_modules == ["q_proj"]
    with pytest.raises(NotImplementedError, match="target_parameters"):
        LoraConfig.from_dict({**LoraConfig(target_modules=["q_proj"]).to_dict(), "target_parameters": ["w"]})


def test_gpt_neox_configs_use_transformers_module_names_both_ways(tmp_path):
    # our GPT-NeoX names its modules model.layers.0.self_attn.dense where transformers (and peft's configs) say
    # gpt_neox.layers.0.attention.dense: peft's "all-linear" config (expanded to full names) matched nothing here,
    # ours wrote names peft cannot match, and "final_layer_norm" in modules_to_save was refused
    import peft

    folder = tmp_path / "neox"
    hf_model = make_checkpoint(folder, "gpt_neox")
    config = dict(r=2, target_modules="all-linear", modules_to_save=["final_layer_norm"])
    theirs = _randomized_peft(hf_model, **config)
    theirs.save_pretrained(tmp_path / "peft")
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, progress=False), tmp_path / "peft")
    torch.testing.assert_close(_logits(ours.eval()), _logits(theirs), atol=ATOL, rtol=0)

    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, progress=False), LoraConfig(**config))
    fresh.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == sorted(theirs.peft_config["default"].target_modules)
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), tmp_path / "ours").eval()
    assert _trainable(back) == set()  # loaded frozen; the adapter layers are there:
    assert sum("lora_A" in n for n, _ in back.named_parameters()) == sum("lora_A" in n for n, _ in
                                                                        theirs.named_parameters())
    torch.testing.assert_close(_logits(back), _logits(fresh.eval()), atol=ATOL, rtol=0)


def test_peft_only_fields_passed_to_lora_config_are_refused_by_name():
    # LoraConfig(lora_bias=True) (a peft field for a feature we lack) was a TypeError; an "off" value is taken, as
    # in an adapter_config.json, and a typo stays a TypeError
    assert LoraConfig(target_modules=["q_proj"], lora_bias=False, use_qalora=False).target_modules == ["q_proj"]
    for field, value in (("lora_bias", True), ("layer_replication", [[0, 1]]), ("trainable_token_indices", [5])):
        with pytest.raises(NotImplementedError, match=field):
            LoraConfig(target_modules=["q_proj"], **{field: value})
    with pytest.raises(TypeError, match="lora_aplha"):
        LoraConfig(lora_aplha=16)


def test_layers_to_transform_that_keeps_no_layer_says_so(qwen2):
    # the error named no entry ("target_modules entry  matches no layer") when every layer was filtered out
    model = AutoModelForCausalLM.from_pretrained(qwen2[0], progress=False)
    with pytest.raises(ValueError, match=r"layers_to_transform=\[5\]"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"], layers_to_transform=[5]))
