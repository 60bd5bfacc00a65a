"""Training data: padding and label masks, SFT masking on a real chat template, packing that changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from gpuformers import AutoModelForCausalLM, AutoTokenizer
from gpuformers.training import DataCollatorForCausalLM, PackedCollator, Trainer
from gpuformers.training.data import load_jsonl, tokenize_chat, tokenize_rows
from gpuformers.training.packing import document_mask
from tests.assets import qwen3_tokenizer_dir
from tests.training.helpers import GradientRecorder, make_rows, tiny_args

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."}]


def test_collator_pads_right_and_masks_padding():
    batch = DataCollatorForCausalLM(pad_token_id=7, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7], [4, 5, 7, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100], [-100, 5, -100, -100]]
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        DataCollatorForCausalLM()([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_language_modeling_collator_equals_transformers(padding_side):
    import transformers

    from gpuformers.training import DataCollatorForLanguageModeling

    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    ours_tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    for tokenizer in (theirs_tokenizer, ours_tokenizer):
        tokenizer.padding_side = padding_side
    pad = ours_tokenizer.pad_token_id
    rows = [{"input_ids": [1, 2, 3, pad, 5]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9, 10, 11, 12]}]
    theirs = transformers.DataCollatorForLanguageModeling(theirs_tokenizer, mlm=False, pad_to_multiple_of=4)(rows)
    ours = DataCollatorForLanguageModeling(ours_tokenizer, mlm=False, pad_to_multiple_of=4)(rows)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].tolist() == theirs[key].tolist(), key
    assert ours["labels"][0].tolist().count(-100) >= 2  # the padding and, as transformers does, the pad-id token


def test_language_modeling_collator_refuses_what_it_cannot_do():
    from gpuformers.training import DataCollatorForLanguageModeling

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    with pytest.raises(NotImplementedError, match="mlm=False"):
        DataCollatorForLanguageModeling(tokenizer)
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="pad_token = tokenizer.eos_token"):
        DataCollatorForLanguageModeling(tokenizer, mlm=False)


def _trained_segments(tokenizer, row) -> list[str]:
    segments, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            segments.append(tokenizer.decode(current))
            current = []
    return segments + ([tokenizer.decode(current)] if current else [])


def test_sft_on_the_qwen3_chat_template_trains_only_the_assistant_turns():
    import transformers

    folder = qwen3_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    row = tokenize_chat(tokenizer, CHAT)
    # the tokens are exactly what transformers' tokenizer makes of the chat
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    rendered = hf.apply_chat_template(CHAT, tokenize=False)
    assert row["input_ids"] == hf(rendered, add_special_tokens=False)["input_ids"]
    # only the replies and their end-of-turn token are targets (Qwen3 adds the empty think block to the last one)
    assert _trained_segments(tokenizer, row) == ["4.<|im_end|>", "<think>\n\n</think>\n\n6, of course.<|im_end|>"]
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_chat(tokenizer, CHAT[:2])


def test_jsonl_rows_text_and_messages(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "Hello world"}) + "\n\n" + json.dumps({"messages": CHAT}) + "\n")
    text, chat = tokenize_rows(tokenizer, load_jsonl(path))
    assert text["labels"] == text["input_ids"] and text["input_ids"][-1] == tokenizer.eos_token_id
    assert -100 in chat["labels"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match='line 1 has neither "text" nor "messages"'):
        load_jsonl(tmp_path / "bad.jsonl")


def test_document_mask_is_block_diagonal_causal():
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_packing_gives_the_same_loss_and_gradients_as_unpacked_examples(tiny_checkpoint, tmp_path):
    rows = make_rows(5, seed=11)
    packed = PackedCollator()(rows)
    assert packed["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    results = {}
    for name, collator in (("padded", DataCollatorForCausalLM()), ("packed", PackedCollator())):
        recorder = GradientRecorder()
        trainer = Trainer(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False),
                          tiny_args(tmp_path / name, max_steps=1, per_device_train_batch_size=5,
                                    train_sampling_strategy="sequential"),
                          train_dataset=rows, data_collator=collator, callbacks=[recorder])
        trainer.train()
        results[name] = (trainer.state.log_history[0]["loss"], recorder.steps[0])
    assert results["packed"][0] == pytest.approx(results["padded"][0], rel=1e-5)
    for key, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][key], grad, rtol=1e-4, atol=1e-6, msg=key)
    # without the document mask the examples would see each other: a different loss
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, progress=False)
    with torch.no_grad():
        leaky = model(packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"]).loss
    assert float(leaky) != pytest.approx(results["padded"][0], rel=1e-3)


def test_packing_with_max_length_fills_rows_and_masks_example_starts():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}]
    batch = PackedCollator(pad_token_id=0, max_length=6)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100], [-100, 7, 8, 9, -100, -100]]
