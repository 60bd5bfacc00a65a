"""Encoding and decoding: text -> BatchEncoding with transformers' padding and truncation, ids -> text.

The `tokenizers` backend does the work; each call sets the padding and truncation it asks for on the shared
backend (under a lock) and clears them afterwards, as transformers does.

Offers: EncodingMixin (tokenize, encode, __call__, pad, decode, batch_decode), VERY_LARGE_INTEGER,
LARGE_INTEGER, PADDING_STRATEGIES, TRUNCATION_STRATEGIES, and ids_as_list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuformers.tokenization.batch_encoding import BatchEncoding

# transformers' "no limit" value for model_max_length; a length above LARGE_INTEGER means "not set".
VERY_LARGE_INTEGER = int(1e30)
LARGE_INTEGER = int(1e20)

PADDING_STRATEGIES = ("longest", "max_length", "do_not_pad")
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second", "do_not_truncate")


def ids_as_list(ids: Any) -> list[int]:
    """Token ids given as an int, a list, a torch tensor or a numpy array -> a flat list of ints."""
    if type(ids) is not list:  # a plain list, the common case (a streaming server decodes per token), is none of these
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            return [ids]
    if ids and isinstance(ids[0], (list, tuple)):
        raise TypeError(
            f"decode takes one sequence of ids, got a batch of {len(ids)}; use batch_decode, or decode(ids[0])"
        )
    return [int(i) for i in ids]


class EncodingMixin:
    """The encoding and decoding part of PreTrainedTokenizerFast.

    Reads `self._tokenizer`, `self._lock`, the padding / truncation settings and `model_max_length` that
    PreTrainedTokenizerFast.__init__ sets, and the special tokens of VocabularyMixin.
    """

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        return self._tokenizer.encode(text, pair, add_special_tokens=add_special_tokens).tokens

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """Text -> ids (a (1, seq) tensor with return_tensors="pt"); takes the padding / truncation options of __call__."""
        return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    def __call__(
        self,
        text: str | Sequence[str] | Sequence[Sequence[str]] | None = None,
        text_pair: str | Sequence[str] | Sequence[Sequence[str]] | None = None,
        text_target: str | Sequence[str] | None = None,
        text_pair_target: str | Sequence[str] | None = None,
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        stride: int = 0,
        is_split_into_words: bool = False,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
        return_token_type_ids: bool | None = None,
        return_overflowing_tokens: bool = False,
        return_special_tokens_mask: bool = False,
        return_offsets_mapping: bool = False,
        return_length: bool = False,
        split_special_tokens: bool | None = None,
        verbose: bool = True,
    ) -> BatchEncoding:
        """Tokenize one text or a batch; a single text gives flat lists (a (1, seq) tensor with return_tensors).

        `is_split_into_words=True` takes words (a list of strings, or a batch of such lists) instead of text.
        `return_overflowing_tokens=True` returns what truncation cut off as extra rows (windows that overlap by
        `stride` tokens), with `overflow_to_sample_mapping` naming the input each row came from. `text_target`
        is tokenized the same way and returned as `labels`. `verbose` is accepted for transformers' signature;
        there are no warnings to silence.
        """
        options = dict(
            add_special_tokens=add_special_tokens,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            stride=stride,
            is_split_into_words=is_split_into_words,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_tensors=return_tensors,
            return_attention_mask=return_attention_mask,
            return_token_type_ids=return_token_type_ids,
            return_overflowing_tokens=return_overflowing_tokens,
            return_special_tokens_mask=return_special_tokens_mask,
            return_offsets_mapping=return_offsets_mapping,
            return_length=return_length,
            split_special_tokens=split_special_tokens,
        )
        if text is None and text_target is None:
            raise ValueError("give the text to tokenize: text= (or text_target= for labels only)")
        encoded = self._encode(text, text_pair, **options) if text is not None else None
        if text_target is None:
            return encoded
        targets = self._encode(text_target, text_pair_target, **options)
        if encoded is None:
            return targets
        encoded["labels"] = targets["input_ids"]
        return encoded

    def _encode(
        self,
        text,
        text_pair,
        *,
        add_special_tokens,
        padding,
        truncation,
        max_length,
        stride,
        is_split_into_words,
        pad_to_multiple_of,
        padding_side,
        return_tensors,
        return_attention_mask,
        return_token_type_ids,
        return_overflowing_tokens,
        return_special_tokens_mask,
        return_offsets_mapping,
        return_length,
        split_special_tokens,
    ) -> BatchEncoding:
        # With words given, a batch is a list of word lists; otherwise a list of texts.
        item_type = (list, tuple) if is_split_into_words else str
        batched = isinstance(text, (list, tuple)) and (
            not is_split_into_words or (bool(text) and isinstance(text[0], (list, tuple)))
        )
        texts = list(text) if batched else [text]
        for item in texts:
            words = item if is_split_into_words and isinstance(item, (list, tuple)) else None
            if not isinstance(item, item_type) or (words is not None and not all(isinstance(w, str) for w in words)):
                expected = "a list of words (strings), or a batch of such lists" if is_split_into_words else (
                    "a string or a list of strings (pass is_split_into_words=True for lists of words)"
                )
                raise TypeError(f"text must be {expected}; got an item of type {type(item).__name__}: {item!r}")
        if batched and text_pair is not None:
            if isinstance(text_pair, str):
                raise TypeError("with a batch of texts, text_pair must be a list of the same length, got a string")
            pairs = list(text_pair)
            if len(pairs) != len(texts):
                raise ValueError(f"text has {len(texts)} items but text_pair has {len(pairs)}; give one pair per text")
            inputs = list(zip(texts, pairs))
        elif not batched and text_pair:
            inputs = [(text, text_pair)]
        else:
            # transformers drops an empty single text_pair ("" or []) rather than encoding an empty second sequence.
            inputs = texts

        padding_strategy, truncation_strategy, max_length = self._padding_and_truncation(
            padding, truncation, max_length
        )
        if (
            truncation_strategy != "do_not_truncate"
            and padding_strategy != "do_not_pad"
            and pad_to_multiple_of is not None
            and max_length is not None
            and max_length % pad_to_multiple_of
        ):
            raise ValueError(
                f"Truncation and padding are both activated but truncation length ({max_length}) is not a multiple of "
                f"pad_to_multiple_of ({pad_to_multiple_of}); pick a max_length that is one."
            )
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f'padding_side "{side}" is not one of: left, right')
        with self._lock:
            backend = self._tokenizer
            if truncation_strategy != "do_not_truncate":
                backend.enable_truncation(
                    max_length, stride=stride, strategy=truncation_strategy, direction=self.truncation_side
                )
            if padding_strategy != "do_not_pad":
                backend.enable_padding(
                    direction=side,
                    pad_id=self.pad_token_id,
                    pad_token=self.pad_token,
                    length=max_length if padding_strategy == "max_length" else None,
                    pad_to_multiple_of=pad_to_multiple_of,
                )
            backend.encode_special_tokens = (
                self.split_special_tokens if split_special_tokens is None else split_special_tokens
            )
            try:
                encodings = backend.encode_batch(
                    inputs, add_special_tokens=add_special_tokens, is_pretokenized=is_split_into_words
                )
            except BaseException as err:
                # `tokenizers` panics (a BaseException from Rust) when the overflow windows cannot move forward.
                if type(err).__name__ != "PanicException":
                    raise
                raise ValueError(
                    f"stride={stride} is too large for max_length={max_length}: the stride must be smaller than the "
                    f"room each sequence gets (max_length less the special tokens, shared by a pair) ({err}); lower "
                    "stride or raise max_length"
                ) from None
            finally:
                backend.no_truncation()
                backend.no_padding()
                backend.encode_special_tokens = self.split_special_tokens

        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        # Each overflow window becomes a row of its own, right after the row it overflowed from.
        rows, sample_of_row = [], []
        for sample, encoding in enumerate(encodings):
            windows = [encoding, *encoding.overflowing] if return_overflowing_tokens else [encoding]
            rows += windows
            sample_of_row += [sample] * len(windows)
        data: dict[str, list] = {"input_ids": [e.ids for e in rows]}
        if return_token_type_ids:
            data["token_type_ids"] = [e.type_ids for e in rows]
        if return_attention_mask:
            data["attention_mask"] = [e.attention_mask for e in rows]
        if return_special_tokens_mask:
            data["special_tokens_mask"] = [e.special_tokens_mask for e in rows]
        if return_offsets_mapping:
            data["offset_mapping"] = [e.offsets for e in rows]
        if return_length:
            data["length"] = [len(e.ids) for e in rows]
        if return_overflowing_tokens:
            data["overflow_to_sample_mapping"] = sample_of_row
        elif not batched and return_tensors is None:
            # A single text gives flat lists; with overflow rows it stays a batch, as in transformers.
            # (`length` is one number per row, so it stays a one-item list.)
            data = {key: (value if key == "length" else value[0]) for key, value in data.items()}
        return BatchEncoding(data, encodings=rows, tensor_type=return_tensors)

    def _padding_and_truncation(self, padding, truncation, max_length) -> tuple[str, str, int | None]:
        """Normalise the user's padding / truncation / max_length the way transformers does."""
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers: a max_length on its own means "truncate to it"
        if padding is True:
            padding_strategy = "longest"
        elif padding is False or padding is None:
            padding_strategy = "do_not_pad"
        elif str(padding) in PADDING_STRATEGIES:
            padding_strategy = str(padding)
        else:
            raise ValueError(f"padding {padding!r} is not one of: True, False, {', '.join(PADDING_STRATEGIES)}")
        if truncation is True:
            truncation_strategy = "longest_first"
        elif truncation is False or truncation is None:
            truncation_strategy = "do_not_truncate"
        elif str(truncation) in TRUNCATION_STRATEGIES:
            truncation_strategy = str(truncation)
        else:
            raise ValueError(
                f"truncation {truncation!r} is not one of: True, False, {', '.join(TRUNCATION_STRATEGIES)}"
            )
        if max_length is None:
            # With no max_length, both fall back to model_max_length, or switch off when it is not set.
            known = self.model_max_length <= LARGE_INTEGER
            if padding_strategy == "max_length":
                padding_strategy = "max_length" if known else "do_not_pad"
            if truncation_strategy != "do_not_truncate" and not known:
                truncation_strategy = "do_not_truncate"
            if known and (padding_strategy == "max_length" or truncation_strategy != "do_not_truncate"):
                max_length = self.model_max_length
        if padding_strategy != "do_not_pad" and (self.pad_token is None or self.pad_token_id is None):
            raise ValueError(
                "Asking to pad but the tokenizer does not have a padding token. Set one, e.g. "
                "`tokenizer.pad_token = tokenizer.eos_token`, or add a new one with "
                "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})`."
            )
        return padding_strategy, truncation_strategy, max_length

    def pad(
        self,
        encoded_inputs: Mapping | Sequence[Mapping],
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
        return_tensors: str | None = None,
    ) -> BatchEncoding:
        """Pad already-tokenized rows (a dict of lists, or a list of dicts as data collators pass them)."""
        if isinstance(encoded_inputs, Sequence) and not isinstance(encoded_inputs, Mapping):
            rows_as_dicts = list(encoded_inputs)
            encoded_inputs = {
                key: [row[key] for row in rows_as_dicts] for key in (rows_as_dicts[0] if rows_as_dicts else {})
            }
        data = {key: (value.tolist() if hasattr(value, "tolist") else value) for key, value in encoded_inputs.items()}
        if "input_ids" not in data:
            raise ValueError(f"pad() needs 'input_ids' among the inputs, got: {', '.join(data) or 'nothing'}")
        single = not data["input_ids"] or isinstance(data["input_ids"][0], int)
        if single:
            data = {key: [value] for key, value in data.items()}
        padding_strategy, _, max_length = self._padding_and_truncation(padding, False, max_length)
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_attention_mask and "attention_mask" not in data:
            data["attention_mask"] = [[1] * len(row) for row in data["input_ids"]]
        lengths = [len(row) for row in data["input_ids"]]
        target = max(lengths, default=0) if padding_strategy == "longest" else (max_length or 0)
        if pad_to_multiple_of and target % pad_to_multiple_of:
            target += pad_to_multiple_of - target % pad_to_multiple_of
        side = padding_side or self.padding_side
        fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1}
        if padding_strategy != "do_not_pad":
            for key, value in fill.items():
                if key in data:
                    data[key] = [
                        (
                            ([value] * (target - len(row)) + list(row))
                            if side == "left"
                            else (list(row) + [value] * (target - len(row)))
                        )
                        for row in data[key]
                    ]
        if single:
            # One unbatched row stays one row: a (seq,) tensor with return_tensors, as in transformers.
            data = {key: value[0] for key, value in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors)

    # ------------------------------------------------------------------ decoding

    def decode(
        self, token_ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Ids -> text. Byte-level BPE pieces are joined as bytes before decoding, so multi-byte characters
        (CJK, emoji) come out whole; a sequence cut inside a character ends in U+FFFD, never in a wrong letter."""
        text = self._tokenizer.decode(ids_as_list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._clean_up(text, clean_up_tokenization_spaces)

    def batch_decode(
        self, sequences: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        texts = self._tokenizer.decode_batch(
            [ids_as_list(s) for s in sequences], skip_special_tokens=skip_special_tokens
        )
        return [self._clean_up(text, clean_up_tokenization_spaces) for text in texts]

    def _clean_up(self, text: str, clean_up: bool | None) -> str:
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        # The clean-up joins " ," and " n't" for WordPiece-era tokenizers; on BPE it deletes real spaces, so
        # (like transformers) it is skipped there.
        if not clean_up or type(self._tokenizer.model).__name__ == "BPE":
            return text
        for spaced, joined in (
            (" .", "."),
            (" ?", "?"),
            (" !", "!"),
            (" ,", ","),
            (" ' ", "'"),
            (" n't", "n't"),
            (" 'm", "'m"),
            (" 's", "'s"),
            (" 've", "'ve"),
            (" 're", "'re"),
        ):
            text = text.replace(spaced, joined)
        return text
