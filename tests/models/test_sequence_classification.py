"""AutoModelForSequenceClassification and AutoModel against transformers on tiny random checkpoints, for Llama, Qwen3,
Gemma 2 (soft-caps, scaled embeddings) and Qwen3-MoE: the classifier's logits and loss (left and right padding, the
three problem types), the bare model's last_hidden_state and cache, loading every key layout (a classifier's, a
causal LM's with score drawn fresh, a bare model's), saving both ways, a Trainer run against transformers' Trainer,
and the errors (a batch without pad_token_id, num_labels < 1)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.models.parity import checkpoint_cases, left_padded

ATOL = 1e-4
LABELS = 3
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    # soft-caps far below Google's, so that they change these tiny models' numbers
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=0.01,
                              final_logit_softcapping=0.2)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
}
TRAINING = dict(per_device_train_batch_size=8, max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant",
                weight_decay=0.0, optim="adamw_torch", seed=0, train_sampling_strategy="sequential",
                report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> folders of one family: its causal LM ("lm"), transformers' classifiers on it with 3 labels ("cls")
    and with one ("reg"), and transformers' bare model ("base"), each written by transformers."""
    import transformers

    out = {}
    for case, (model_type, overrides) in CASES.items():
        (lm, hf), = checkpoint_cases(tmp_path_factory, model_type, {case: overrides}, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2).values()
        if model_type == "qwen3_moe":  # routers perturbed, so that routing differs between tokens
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.normal_(0, 0.5)
            hf.save_pretrained(lm)
        folders = {"lm": lm}
        for kind, labels in (("cls", dict(num_labels=LABELS)), ("reg", dict(num_labels=1))):
            torch.manual_seed(1)
            head = transformers.AutoModelForSequenceClassification.from_pretrained(lm, **labels)
            folders[kind] = tmp_path_factory.mktemp(f"{case}-{kind}")
            head.save_pretrained(folders[kind])
        folders["base"] = tmp_path_factory.mktemp(f"{case}-base")
        transformers.AutoModel.from_pretrained(lm).save_pretrained(folders["base"])
        out[case] = folders
    return out


def _theirs(auto: str, folder, **kwargs):
    import transformers

    return getattr(transformers, auto).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                       **kwargs).eval()


def _ours(auto: str, folder, **kwargs):
    import gpuformers

    return getattr(gpuformers, auto).from_pretrained(folder, progress=False, **kwargs)


def right_padded(seq: int = 16, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """left_padded's rows with the second one's padding moved to its end."""
    ids, mask = left_padded(seq=seq, pad=pad)
    return torch.stack([ids[0], ids[1].roll(-pad)]), torch.stack([mask[0], mask[1].roll(-pad)])


def _labels(kind: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if kind == "single_label_classification":
        return torch.randint(0, LABELS, (2,), generator=generator)
    if kind == "multi_label_classification":
        return torch.randint(0, 2, (2, LABELS), generator=generator).float()
    return torch.randn(2, generator=generator)  # regression, one label


@pytest.mark.parametrize("case", list(CASES))
def test_classifier_logits_and_losses_match_transformers(checkpoints, case):
    folders = checkpoints[case]
    for kind in ("single_label_classification", "multi_label_classification", "regression"):
        folder = folders["reg" if kind == "regression" else "cls"]
        ours, theirs = _ours("AutoModelForSequenceClassification", folder, problem_type=kind), \
            _theirs("AutoModelForSequenceClassification", folder, problem_type=kind)
        assert type(ours).__name__ == type(theirs).__name__
        for ids, mask in (left_padded(), right_padded()):
            with torch.no_grad():
                mine = ours(ids, attention_mask=mask, labels=_labels(kind))
                hf = theirs(ids, attention_mask=mask, labels=_labels(kind))
            assert mine.logits.shape == (2, 1 if kind == "regression" else LABELS)
            assert (mine.logits - hf.logits).abs().max().item() < ATOL, (kind, case)
            assert abs(mine.loss.item() - hf.loss.item()) < ATOL, (kind, case)


def test_problem_type_is_inferred_as_transformers_infers_it(checkpoints):
    folders = checkpoints["qwen3"]
    ids, mask = left_padded()
    for folder, labels, expected in ((folders["cls"], _labels("single_label_classification"),
                                      "single_label_classification"),
                                     (folders["cls"], _labels("multi_label_classification"),
                                      "multi_label_classification"),
                                     (folders["reg"], _labels("regression"), "regression")):
        ours, theirs = _ours("AutoModelForSequenceClassification", folder), \
            _theirs("AutoModelForSequenceClassification", folder)
        with torch.no_grad():
            loss = ours(ids, attention_mask=mask, labels=labels).loss
            torch.testing.assert_close(loss, theirs(ids, attention_mask=mask, labels=labels).loss, atol=ATOL, rtol=0)
        assert ours.config.extra["problem_type"] == theirs.config.problem_type == expected


@pytest.mark.parametrize("case", list(CASES))
def test_bare_model_matches_transformers_from_either_key_layout(checkpoints, case):
    folders = checkpoints[case]
    ids, mask = left_padded()
    theirs = _theirs("AutoModel", folders["lm"])
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask).last_hidden_state
    for kind in ("lm", "base"):  # keys with "model." (lm_head unused) and without
        ours = _ours("AutoModel", folders[kind])
        assert type(ours).__name__ == type(theirs).__name__
        # transformers' names (its MoE experts are fused in memory: their names differ by design)
        assert {k for k in ours.state_dict() if ".experts." not in k} == \
            {k for k in theirs.state_dict() if ".experts." not in k}
        with torch.no_grad():
            out = ours(ids, attention_mask=mask)
        assert (out.last_hidden_state - expected)[mask.bool()].abs().max().item() < ATOL, (kind, case)
    # the cache: the last token fed alone after the others gives the same state
    with torch.no_grad():
        prefix = ours(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        step = ours(ids[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values)
    torch.testing.assert_close(step.last_hidden_state[:, 0], expected[:, -1], atol=ATOL, rtol=0)


def test_classifier_from_causal_lm_and_bare_checkpoints(checkpoints, caplog):
    """The decoder loads, score is drawn from N(0, initializer_range) and reported, lm_head is left unused; the
    logits are that score over the bare model's state at each row's last token."""
    folders = checkpoints["qwen3"]
    ids, mask = right_padded()
    bare = _ours("AutoModel", folders["lm"])
    with torch.no_grad():
        states = bare(ids, attention_mask=mask).last_hidden_state[torch.arange(2), mask.sum(1) - 1]
    for kind in ("lm", "base"):
        with caplog.at_level(logging.WARNING, logger="gpuformers.models.auto"):
            caplog.clear()
            ours, info = _ours("AutoModelForSequenceClassification", folders[kind], num_labels=5,
                               output_loading_info=True)
        assert info.missing == ["score.weight"] and info.unexpected == (["lm_head.weight"] if kind == "lm" else [])
        assert "score.weight not in the checkpoint" in caplog.text
        assert ours.score.weight.shape == (5, 64) and 0.015 < ours.score.weight.std().item() < 0.025
        with torch.no_grad():
            torch.testing.assert_close(ours(ids, attention_mask=mask).logits, states @ ours.score.weight.T)
    # a missing decoder tensor is still an error
    from gpuformers import ModelConfig

    deeper = ModelConfig.from_dict({**json.loads((folders["cls"] / "config.json").read_text()), "num_hidden_layers": 3,
                                  "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="lacks .* model.layers.2"):
        _ours("AutoModelForSequenceClassification", folders["cls"], config=deeper)


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_saved_heads_load_in_transformers_and_back(checkpoints, case, tmp_path):
    folders = checkpoints[case]
    ids, mask = left_padded()
    ours = _ours("AutoModelForSequenceClassification", folders["lm"], id2label={0: "neg", 1: "pos"})
    ours.save_pretrained(tmp_path / "cls")
    saved = json.loads((tmp_path / "cls" / "config.json").read_text())
    assert saved["architectures"] == [type(ours).__name__] and saved["id2label"] == {"0": "neg", "1": "pos"}
    assert not (tmp_path / "cls" / "generation_config.json").exists()
    theirs = _theirs("AutoModelForSequenceClassification", tmp_path / "cls")
    again = _ours("AutoModelForSequenceClassification", tmp_path / "cls")
    assert theirs.config.label2id == {"neg": 0, "pos": 1} and again.config.extra["id2label"] == {0: "neg", 1: "pos"}
    for name in ("id2label", "label2id", "num_labels", "problem_type"):  # read as code written for transformers does
        assert getattr(again.config, name) == getattr(theirs.config, name), name
    with torch.no_grad():
        expected = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(theirs(ids, attention_mask=mask).logits, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, expected, atol=0, rtol=0)

    bare = _ours("AutoModel", folders["lm"])
    bare.save_pretrained(tmp_path / "base")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "base" / "model.safetensors"), "pt") as f:
        assert not any(key.startswith("model.") for key in f.keys())
    theirs = _theirs("AutoModel", tmp_path / "base")
    with torch.no_grad():
        expected = bare(ids, attention_mask=mask).last_hidden_state[mask.bool()]
        torch.testing.assert_close(theirs(ids, attention_mask=mask).last_hidden_state[mask.bool()], expected,
                                   atol=ATOL, rtol=0)
        again = _ours("AutoModel", tmp_path / "base")(ids, attention_mask=mask).last_hidden_state[mask.bool()]
    torch.testing.assert_close(again, expected, atol=0, rtol=0)


def _rows(count: int = 8) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(4, 12, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(3, 128, (n,), generator=generator).tolist(),
             "label": int(torch.randint(0, LABELS, (1,), generator=generator))} for n in lengths]


def _collate(rows: list[dict]) -> dict:
    """Right-padded ids and mask, integer labels (batch,): the same batches for both trainers."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([row["label"] for row in rows])}


def test_trainer_lowers_the_loss_as_transformers_trainer_does(checkpoints, tmp_path):
    import transformers

    from gpuformers.training import Trainer
    from tests.training.helpers import tiny_args

    folder, rows = checkpoints["qwen3"]["cls"], _rows()
    theirs = transformers.Trainer(_theirs("AutoModelForSequenceClassification", folder),
                                  transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                                                 **TRAINING),
                                  train_dataset=rows, data_collator=_collate)
    theirs.train()
    ours = Trainer(_ours("AutoModelForSequenceClassification", folder),
                   tiny_args(tmp_path / "ours", use_cpu=True, **TRAINING), train_dataset=rows, data_collator=_collate)
    ours.train()
    hf_losses = [e["loss"] for e in theirs.state.log_history if "loss" in e]
    losses = [e["loss"] for e in ours.state.log_history if "loss" in e]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert losses == pytest.approx(hf_losses, rel=1e-4)


def test_errors_name_the_value_and_the_fix(checkpoints):
    folder = checkpoints["llama"]["cls"]
    ids, mask = left_padded()
    ours = _ours("AutoModelForSequenceClassification", folder)
    ours.config.pad_token_id = None  # as a checkpoint without one
    with pytest.raises(ValueError, match="batch of 2 rows needs config.pad_token_id"):
        ours(ids, attention_mask=mask)
    assert ours(ids[:1]).logits.shape == (1, LABELS)  # one row: its last position
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"num_labels={bad} must be an int >= 1"):
            _ours("AutoModelForSequenceClassification", folder, num_labels=bad)
    with pytest.raises(ValueError, match="needs num_labels >= 2"):
        _ours("AutoModelForSequenceClassification", folder, num_labels=1, problem_type="single_label_classification")
    with pytest.raises(ValueError, match="not one of: regression"):
        _ours("AutoModelForSequenceClassification", folder, problem_type="ranking")
    with pytest.raises(TypeError, match="num_labels"):
        _ours("AutoModel", folder, num_labels=2)


def test_quantized_classifier_keeps_its_score_in_full_precision(checkpoints, tmp_path):
    from gpuformers import WeightOnlyConfig

    ids, mask = left_padded()
    plain = _ours("AutoModelForSequenceClassification", checkpoints["qwen3"]["cls"])
    ours = _ours("AutoModelForSequenceClassification", checkpoints["qwen3"]["cls"],
                 quantization_config=WeightOnlyConfig(bits=8))
    assert type(ours.score) is torch.nn.Linear and torch.equal(ours.score.weight, plain.score.weight)
    assert type(ours.model.layers[0].mlp.down_proj) is not torch.nn.Linear
    with torch.no_grad():  # int8 weights: close to the full-precision logits
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   atol=5e-2, rtol=0)


def test_classes_by_name_load_pickle_and_refuse_another_family(checkpoints):
    import pickle

    from gpuformers.models import heads
    from gpuformers.models.gemma import Gemma3ForCausalLM
    from gpuformers.models.qwen3 import Qwen3ForCausalLM

    assert heads.Qwen3ForSequenceClassification is heads.sequence_classification_class(Qwen3ForCausalLM)
    assert issubclass(heads.Qwen3Model, Qwen3ForCausalLM) and heads.Gemma3TextModel.family is Gemma3ForCausalLM
    ids, mask = left_padded()
    ours = heads.Qwen3ForSequenceClassification.from_pretrained(checkpoints["qwen3"]["cls"], progress=False)
    moe = heads.Qwen3Model.from_pretrained(checkpoints["qwen3_moe"]["lm"], progress=False)
    assert type(moe) is heads.Qwen3MoeModel  # the checkpoint's family, a subclass of the one asked for
    again = pickle.loads(pickle.dumps(ours))
    with torch.no_grad():
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="was given a 'gemma2' checkpoint; use AutoModel.from_pretrained or "
                                         "Gemma2Model"):
        heads.Qwen3Model.from_pretrained(checkpoints["gemma2"]["lm"], progress=False)


def test_fused_moe_experts_load_from_either_key_layout(checkpoints, tmp_path):
    """transformers' fused experts (save_original_format=False), with and without "model.", into both classes."""
    folders = checkpoints["qwen3_moe"]
    ids, mask = left_padded()
    for auto in ("AutoModel", "AutoModelForCausalLM"):
        _theirs(auto, folders["lm"]).save_pretrained(tmp_path / auto, save_original_format=False)
    expected = _ours("AutoModel", folders["lm"])(ids, attention_mask=mask).last_hidden_state
    for auto in ("AutoModel", "AutoModelForCausalLM"):
        bare = _ours("AutoModel", tmp_path / auto)
        head = _ours("AutoModelForSequenceClassification", tmp_path / auto)
        with torch.no_grad():
            torch.testing.assert_close(bare(ids, attention_mask=mask).last_hidden_state, expected)
            torch.testing.assert_close(head.model(ids, mask)[0], expected)
