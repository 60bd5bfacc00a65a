"""LoRA on a sequence classifier (task_type="SEQ_CLS", peft's PeftModelForSequenceClassification): the score head is
added to modules_to_save and trains fully beside the adapters; logits, trainable parameters and the adapter files
equal peft's on transformers' classifier, and each side loads the other's adapter."""

from __future__ import annotations

import copy

import pytest
import torch

from gpuformers import AutoModelForSequenceClassification
from gpuformers.lora import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
SETTINGS = dict(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny Qwen3 classifier (3 labels, pad id 0) saved by transformers, and that transformers model."""
    import transformers

    lm = tmp_path_factory.mktemp("seq-cls-lm")
    make_checkpoint(lm, "qwen3", head_dim=16)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(lm, num_labels=3, pad_token_id=0,
                                                                             dtype=torch.float32)
    folder = tmp_path_factory.mktemp("seq-cls")
    theirs.save_pretrained(folder)
    return folder, theirs


def _inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (3, 10), generator=g)
    ids[1, :4] = 0  # left padding
    ids[2, 7:] = 0  # right padding
    return ids, (ids != 0).long()


def _logits(model):
    ids, mask = _inputs()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _pair(classifier):
    import peft

    folder, hf = classifier
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**SETTINGS)).eval()
    with torch.no_grad():  # B starts at zero and the score copy equals the head: randomise both
        g = torch.Generator().manual_seed(9)
        for name, param in theirs.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    ours = get_peft_model(AutoModelForSequenceClassification.from_pretrained(folder, progress=False),
                          LoraConfig(**SETTINGS)).eval()
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    return ours, theirs


def test_score_trains_fully_beside_the_adapters_as_in_peft(classifier, capsys):
    ours, theirs = _pair(classifier)
    base = _logits(AutoModelForSequenceClassification.from_pretrained(classifier[0], progress=False))
    got = _logits(ours)
    assert (got - base).abs().max() > 1e-2
    torch.testing.assert_close(got, _logits(theirs), atol=ATOL, rtol=0)
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {n.replace(".default.", ".") for n, p in theirs.named_parameters() if p.requires_grad}
    assert {n for n in trainable if "score" in n} == {"base_model.model.score.modules_to_save.weight"}
    ours.print_trainable_parameters()
    theirs.print_trainable_parameters()
    mine, peft_line = capsys.readouterr().out.strip().splitlines()
    assert mine == peft_line
    assert ours.peft_config["default"].modules_to_save == theirs.peft_config["default"].modules_to_save


def test_adapter_files_load_both_ways(classifier, tmp_path):
    import peft
    from safetensors.torch import load_file

    folder, hf = classifier
    ours, theirs = _pair(classifier)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "peft")
    mine, reference = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "peft"))
    assert set(mine) == set(reference) and "base_model.model.score.weight" in mine
    expected = _logits(theirs)
    loaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(folder, progress=False),
                                       tmp_path / "peft")
    torch.testing.assert_close(_logits(loaded), expected, atol=ATOL, rtol=0)
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(back), expected, atol=ATOL, rtol=0)


def test_other_task_types_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="task_type='TOKEN_CLS' is not supported.*\"SEQ_CLS\""):
        LoraConfig(task_type="TOKEN_CLS")
