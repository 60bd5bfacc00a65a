"""Stopping criteria: eos per row, lengths, time, and stop strings that span tokens (against transformers'
StopStringCriteria on a tiny byte-level BPE and on the real Qwen3 tokenizer)."""

from __future__ import annotations

import time

import pytest
import torch

from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.stopping import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
    build_stopping_criteria,
    token_bytes,
)
from tests.assets import qwen3_tokenizer_dir
from tests.fixtures.tokenizers import byte_level_bpe

CORPUS = [
    "The capital of France is Paris. Paris is a city.",
    "Stop here. Stopping now, the stopper stops.",
    "Answer: forty-two\n\nQuestion: what is it?",
] * 20


def tiny_byte_level_tokenizer():
    """A 300-token byte-level BPE trained here: common words merge, rare bytes (é, €, emoji) stay split."""
    return byte_level_bpe(CORPUS, special_tokens=("<eos>",))


@pytest.fixture(scope="module")
def hf_tiny_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tiny_byte_level_tokenizer(), eos_token="<eos>")


def test_eos_list_per_row():
    crit = EosTokenCriteria([5, 9])
    ids = torch.tensor([[1, 2, 5], [5, 2, 3], [4, 4, 9], [9, 5, 0]])
    assert crit(ids, None).tolist() == [True, False, True, False]  # only the newest token counts
    assert EosTokenCriteria(7)(torch.tensor([[7], [8]]), None).tolist() == [True, False]


def test_max_length_and_max_new_tokens():
    crit = build_stopping_criteria(GenerationConfig(max_new_tokens=3), prompt_length=5)
    assert crit.max_length == 8
    assert not crit(torch.zeros(2, 7, dtype=torch.long), None).any()
    assert crit(torch.zeros(2, 8, dtype=torch.long), None).all()
    assert build_stopping_criteria(GenerationConfig(), 5).max_length == 25  # default: 20 new tokens
    assert build_stopping_criteria(GenerationConfig(), 5, max_position_embeddings=16).max_length == 16
    assert build_stopping_criteria(GenerationConfig(max_length=9), 5).max_length == 9
    assert MaxLengthCriteria(4)(torch.zeros(3, 4, dtype=torch.long), None).tolist() == [True] * 3


def test_max_time():
    assert not MaxTimeCriteria(60.0)(torch.zeros(2, 3, dtype=torch.long), None).any()
    assert MaxTimeCriteria(0.5, initial_timestamp=time.time() - 1.0)(torch.zeros(2, 3, dtype=torch.long), None).all()
    crit = build_stopping_criteria(GenerationConfig(max_time=0.05), 3)
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert not crit(ids, None).any()
    time.sleep(0.1)
    assert crit(ids, None).all()


def test_builder_order_and_combination():
    gc = GenerationConfig(max_new_tokens=4, max_time=10.0, eos_token_id=[2, 3])
    crit = build_stopping_criteria(gc, 2)
    assert [type(c).__name__ for c in crit] == ["MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria"]
    ids = torch.tensor([[0, 0, 3], [0, 0, 1]])
    assert crit(ids, None).tolist() == [True, False]


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        build_stopping_criteria(GenerationConfig(stop_strings="Paris"), 3)


def _pieces(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_stop_string_spanning_tokens_stops_at_the_right_place(hf_tiny_tokenizer):
    tok = hf_tiny_tokenizer
    crit = StopStringCriteria(tok, ["is a", "\n\n"])
    # "is a" is split over several tokens; the row is done exactly when the token that completes it arrives
    ids = _pieces(tok, "Paris") + _pieces(tok, " is") + _pieces(tok, " ") + _pieces(tok, "a") + _pieces(tok, " city")
    done = [bool(crit(torch.tensor([ids[:n]]), None)) for n in range(1, len(ids) + 1)]
    complete_at = len(_pieces(tok, "Paris") + _pieces(tok, " is") + _pieces(tok, " ") + _pieces(tok, "a"))
    assert done.index(True) == complete_at - 1
    assert done[complete_at:] == [False] * (len(ids) - complete_at)  # a stop string in the past does not stop again
    # per row in a batch
    batch = torch.tensor([_pieces(tok, "forty-two\n\n")[-3:], _pieces(tok, "Answer: for")[-3:]])
    assert crit(batch, None).tolist() == [True, False]


def _compare_with_transformers(tokenizer, stop_strings, sequences):
    from transformers.generation.stopping_criteria import StopStringCriteria as HFStopStringCriteria

    ours = StopStringCriteria(tokenizer, stop_strings)
    theirs = HFStopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    positives = 0
    for seq in sequences:
        a, b = ours(seq, None), theirs(seq, None)
        assert a.tolist() == b.tolist(), f"{[tokenizer.decode(row) for row in seq]!r}: ours {a}, transformers {b}"
        positives += int(b.sum())
    return positives


def _targeted_sequences(tokenizer, texts, seed, rows=6, count=150, length=8):
    """Random sequences over the tokens of `texts` cut into single characters, words and whole texts, so that stop
    strings appear split in many ways."""
    vocab = set()
    for text in texts:
        vocab.update(_pieces(tokenizer, text))
        for ch in text:
            vocab.update(_pieces(tokenizer, ch))
        for word in text.split(" "):
            vocab.update(_pieces(tokenizer, " " + word))
    vocab = torch.tensor(sorted(vocab))
    g = torch.Generator().manual_seed(seed)
    return [vocab[torch.randint(0, len(vocab), (rows, length), generator=g)] for _ in range(count)]


def test_stop_strings_match_transformers_tiny_tokenizer(hf_tiny_tokenizer):
    stops = ["Paris", "is a", "\n\n", "op", "é"]
    texts = ["Paris is a city", "stop\n\nstopper", "café", "forty-two"]
    sequences = _targeted_sequences(hf_tiny_tokenizer, texts, seed=0)
    for text in texts:  # and every prefix of real text
        ids = _pieces(hf_tiny_tokenizer, text)
        sequences += [torch.tensor([ids[:n]]) for n in range(1, len(ids) + 1)]
    positives = _compare_with_transformers(hf_tiny_tokenizer, stops, sequences)
    assert positives > 50  # the comparison covered many stops, not only "keep going"


def test_stop_strings_match_transformers_qwen3():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    stops = ["Paris", ".\n", "}}", "東京", "🙂"]
    texts = ["The capital is Paris.\nDone", "{{x}} and }}", "東京は日本", "ok 🙂 ok"]
    sequences = _targeted_sequences(tok, texts, seed=1, count=60)
    positives = _compare_with_transformers(tok, stops, sequences)
    assert positives > 20


def test_token_bytes_of_a_bare_tokenizers_object():
    tok = tiny_byte_level_tokenizer()
    flat, offsets = token_bytes(tok)
    vocab = tok.get_vocab()
    assert offsets.shape[0] == max(vocab.values()) + 2
    raw = bytes(flat.tolist())
    for text in ["café", "Paris is", "€"]:
        ids = tok.encode(text).ids
        assert b"".join(raw[offsets[i]:offsets[i + 1]] for i in ids) == text.encode("utf-8")
