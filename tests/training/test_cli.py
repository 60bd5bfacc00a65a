"""`gpuformers train`: fine-tune a tiny model from a JSONL of text and chat rows, then resume it."""

from __future__ import annotations

import json
import shutil

import pytest

from gpuformers import AutoTokenizer, cli
from gpuformers.training.data import _GENERATION_TAG, tokenize_chat

TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def _write_tiny_tokenizer(folder) -> None:
    """A whitespace word-level tokenizer over 100 words whose ids fit the tiny model's 128-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(100)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))


@pytest.fixture
def model_with_tokenizer(tiny_checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, folder)
    _write_tiny_tokenizer(folder)
    return folder


def test_sft_mask_on_a_simple_template_with_and_without_generation_tags(model_with_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(model_with_tokenizer)
    chat = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"},
            {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    row = tokenize_chat(tokenizer, chat)
    trained = [tokenizer.convert_ids_to_tokens(t) for t, l in zip(row["input_ids"], row["labels"]) if l != -100]
    assert trained == ["w3", "w4", "<eos>", "w6", "<eos>"]
    # a template that marks the replies with {% generation %} gives the same mask through the tokenizer
    tokenizer.chat_template = TEMPLATE.replace("{{ m.content }} <eos>", "{% if m.role == 'assistant' %}"
                                               "{% generation %}{{ m.content }} <eos>{% endgeneration %}"
                                               "{% else %}{{ m.content }} <eos>{% endif %}")
    assert _GENERATION_TAG.search(tokenizer.get_chat_template())
    assert tokenize_chat(tokenizer, chat) == row


def test_train_verb_fine_tunes_saves_and_resumes(model_with_tokenizer, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"text": f"w{i} w{i + 1} w{i + 2}"} for i in range(6)] + [
        {"messages": [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i + 10} w{i}"}]}
        for i in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    common = ["train", "--model", str(model_with_tokenizer), "--data", str(data), "--output-dir", str(out),
              "--batch-size", "4", "--cpu", "--save-steps", "2", "--logging-steps", "1", "--lr", "1e-3"]
    assert cli.main(common + ["--max-steps", "4"]) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "checkpoint-4" / "optimizer.pt").is_file()
    assert cli.main(common + ["--max-steps", "6", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5, 6]  # the resumed run started at step 5
    assert cli.main(common + ["--max-steps", "2", "--packing", "--max-length", "16",
                              "--output-dir", str(tmp_path / "packed")]) == 0


def test_train_verb_reports_a_bad_data_file(model_with_tokenizer, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["train", "--model", str(model_with_tokenizer), "--data", str(bad), "--cpu"]) != 0
    assert "bad.jsonl line 1 is not JSON" in capsys.readouterr().err
