"""The tokenizer: transformers' `PreTrainedTokenizerFast` API on the Rust `tokenizers` library.

A checkpoint's tokenizer is its `tokenizer.json` (read by `tokenizers`, which does the real work: normalise,
pre-tokenize, BPE / WordPiece / Unigram, post-process, byte-level decode) plus `tokenizer_config.json`, which
names the special tokens, the padding side, the maximum length and the chat template. The tokenizer wraps the
two so that code written for transformers runs unchanged:

    tok = PreTrainedTokenizerFast.from_pretrained("Qwen/Qwen3-0.6B")
    batch = tok(["hi", "a longer prompt"], padding=True, return_tensors="pt")   # BatchEncoding
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

This module is the import path; the code lives in the gpuformers.tokenization package, one job per module:
tokenizer_fast.py (the class and its constructor), vocabulary.py (special and added tokens), encoding.py
(padding, truncation, tensors, decode), chat.py (apply_chat_template), pretrained.py (from_pretrained,
save_pretrained), batch_encoding.py (BatchEncoding, TokenSpan, CharSpan), byte_level.py (byte_level_alphabet).

Offers: PreTrainedTokenizerFast, BatchEncoding, TokenSpan, CharSpan, byte_level_alphabet, VERY_LARGE_INTEGER,
LARGE_INTEGER, PADDING_STRATEGIES, TRUNCATION_STRATEGIES.
"""

from __future__ import annotations

from gpuformers.tokenization.batch_encoding import BatchEncoding, CharSpan, TokenSpan
from gpuformers.tokenization.byte_level import byte_level_alphabet
from gpuformers.tokenization.encoding import (
    LARGE_INTEGER,
    PADDING_STRATEGIES,
    TRUNCATION_STRATEGIES,
    VERY_LARGE_INTEGER,
)
from gpuformers.tokenization.tokenizer_fast import PreTrainedTokenizerFast

__all__ = [
    "PreTrainedTokenizerFast",
    "BatchEncoding",
    "TokenSpan",
    "CharSpan",
    "byte_level_alphabet",
    "VERY_LARGE_INTEGER",
    "LARGE_INTEGER",
    "PADDING_STRATEGIES",
    "TRUNCATION_STRATEGIES",
]
