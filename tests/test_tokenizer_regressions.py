"""Regression tests for tokenizer mismatches with transformers found by a differential campaign (random texts and
call options fed to gpuformers' and transformers' tokenizers on the same folder, outputs compared exactly).

Each test loads one small tokenizer folder built here (a BERT-style WordPiece with a pair template, or a byte-level
BPE) with both libraries and checks one behaviour. transformers is imported inside the fixtures only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from gpuformers.tokenizer import PreTrainedTokenizerFast
from tests.fixtures.tokenizers import byte_level_bpe

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "the quick brown fox"] * 5


def _write_bert_folder(folder) -> None:
    """WordPiece with [CLS] $A [SEP] $B [SEP] and token types: pairs, overflow and words show up in its ids."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", backend.token_to_id("[CLS]")), ("[SEP]", backend.token_to_id("[SEP]"))],
    )
    backend.decoder = decoders.WordPiece()
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    """(ours, transformers') tokenizers on the same BERT-style folder."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bert")
    _write_bert_folder(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _plain(value):
    """Tensors and arrays -> (kind, dtype, nested lists), so shapes and dtypes are compared too."""
    if isinstance(value, torch.Tensor):
        return ("pt", str(value.dtype), value.tolist())
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("np-object", [_plain(row) for row in value])
        return ("np", str(value.dtype), value.tolist())
    return value


def _same(ours, theirs) -> None:
    assert {k: _plain(v) for k, v in ours.items()} == {k: _plain(v) for k, v in theirs.items()}


def test_overflowing_tokens_with_stride_match_transformers(bert_pair):
    """return_overflowing_tokens was refused (an unexpected keyword): the windows of a long text (QA, long-document
    classification) are extra rows, with overflow_to_sample_mapping a (rows,) tensor."""
    ours, theirs = bert_pair
    texts = ["the quick brown fox sat on the mat in the park", "hello world"]
    for kwargs in (
        dict(truncation=True, max_length=6, stride=2, return_overflowing_tokens=True),
        dict(truncation=True, max_length=6, stride=2, return_overflowing_tokens=True, padding=True, return_tensors="pt"),
    ):
        _same(ours(texts, **kwargs), theirs(texts, **kwargs))
    # One text still comes back as a batch of its windows.
    _same(ours(texts[0], **kwargs), theirs(texts[0], **kwargs))
    # Question-answering style: the context (second sequence) is windowed, the question kept whole.
    questions, contexts = ["the cat", "hello"], ["a dog ran in the park and the cat sat", "the quick brown fox"]
    kwargs = dict(truncation="only_second", max_length=9, stride=1, return_overflowing_tokens=True, padding=True)
    _same(ours(questions, contexts, **kwargs), theirs(questions, contexts, **kwargs))


def test_stride_too_large_is_a_clear_value_error(bert_pair):
    """A stride that leaves no room to move made the Rust backend panic (PanicException, which `except Exception`
    does not catch); it is a ValueError naming stride and max_length."""
    ours, _ = bert_pair
    with pytest.raises(ValueError, match="stride=3 is too large for max_length=9"):
        ours(
            ["the quick brown fox sat on the mat in the park"],
            ["a dog ran in the park and the cat sat"],
            truncation=True,
            max_length=9,
            stride=3,
            return_overflowing_tokens=True,
        )


def test_is_split_into_words_matches_transformers(bert_pair):
    """is_split_into_words was refused: NER-style inputs (lists of words, or a batch of them) tokenize word by word."""
    ours, theirs = bert_pair
    words = ["the", "quick", "brown", "fox"]
    for text in (words, [words, ["hello", "world"]]):
        _same(
            ours(text, is_split_into_words=True, padding=True, return_offsets_mapping=True),
            theirs(text, is_split_into_words=True, padding=True, return_offsets_mapping=True),
        )


def test_text_target_becomes_labels(bert_pair):
    """text_target (seq2seq labels) was refused: it is tokenized like text and returned as labels."""
    ours, theirs = bert_pair
    kwargs = dict(text_target=["hello world", "the cat"], padding=True)
    _same(ours(["the quick fox", "a dog"], **kwargs), theirs(["the quick fox", "a dog"], **kwargs))
    _same(ours(text_target="hello world"), theirs(text_target="hello world"))


def test_empty_single_text_pair_is_dropped_like_transformers(bert_pair):
    """transformers encodes tok("a", "") as the single text (no second [SEP]); gpuformers encoded an empty pair."""
    ours, theirs = bert_pair
    assert ours("hello world", "")["input_ids"] == theirs("hello world", "")["input_ids"]


def test_pad_to_multiple_of_must_divide_truncation_length(bert_pair):
    """Padding to a multiple of 8 while truncating to 6 cannot hold both; transformers raises, gpuformers padded
    rows past max_length."""
    ours, _ = bert_pair
    with pytest.raises(ValueError, match=r"truncation length \(6\) is not a multiple of pad_to_multiple_of \(8\)"):
        ours(["the cat", "hello"], padding=True, truncation=True, max_length=6, pad_to_multiple_of=8)


def test_return_length_and_tensor_shapes_match_transformers(bert_pair):
    """`length` of one text is a one-item list and a (1,) tensor (gpuformers gave an int and a (1, 1) tensor);
    an empty batch gives int64 tensors, not float."""
    ours, theirs = bert_pair
    for return_tensors in (None, "pt", "np"):
        _same(
            ours("the cat sat", return_length=True, return_tensors=return_tensors),
            theirs("the cat sat", return_length=True, return_tensors=return_tensors),
        )
    _same(
        ours("", add_special_tokens=False, return_tensors="pt"), theirs("", add_special_tokens=False, return_tensors="pt")
    )


def test_ragged_rows_as_numpy_match_transformers(bert_pair):
    """return_tensors="np" without padding: transformers returns object arrays of rows; gpuformers refused."""
    ours, theirs = bert_pair
    _same(ours(["the cat", "hello world the dog"], return_tensors="np"),
          theirs(["the cat", "hello world the dog"], return_tensors="np"))


def test_pad_of_one_row_keeps_its_shape(bert_pair):
    """pad() of one unbatched row with return_tensors gives (seq,) tensors, as transformers does (a data collator
    that pads single examples relies on it); gpuformers added a batch axis."""
    ours, theirs = bert_pair
    row = {"input_ids": [2, 10, 11, 3]}
    for kwargs in (dict(return_tensors="pt"), dict(return_tensors="np", padding="max_length", max_length=6)):
        _same(ours.pad(dict(row), **kwargs), theirs.pad(dict(row), **kwargs))


def test_config_added_token_flags_win_over_tokenizer_json(tmp_path):
    """Where tokenizer_config.json's added_tokens_decoder and tokenizer.json disagree on a token's flags (lstrip,
    special), transformers applies the config's; gpuformers kept tokenizer.json's, so ids and decode differed."""
    from transformers import AutoTokenizer

    backend = byte_level_bpe(CORPUS)
    from tokenizers import AddedToken

    backend.add_tokens([AddedToken("<end>", lstrip=True, special=False), AddedToken("<tool>", special=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    end, tool = backend.token_to_id("<end>"), backend.token_to_id("<tool>")
    flags = dict(lstrip=False, rstrip=False, single_word=False, normalized=False, special=True)
    config = {
        "eos_token": "<end>",
        "added_tokens_decoder": {str(end): {"content": "<end>", **flags}, str(tool): {"content": "<tool>", **flags}},
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = PreTrainedTokenizerFast.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "hello <tool> world <end>"
    assert ours.encode(text) == theirs.encode(text)
    ids = theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
