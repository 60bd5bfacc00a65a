"""BatchEncoding: what a tokenizer call returns, a dict of token lists that turns into tensors, and the map between
tokens, words and characters of each row (word_ids, char_to_token, ...), as transformers' fast tokenizers give.

Offers: BatchEncoding, TokenSpan, CharSpan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class TokenSpan(NamedTuple):
    """Tokens [start, end) of a row: what word_to_tokens returns."""

    start: int
    end: int


class CharSpan(NamedTuple):
    """Characters [start, end) of the original text: what token_to_chars and word_to_chars return."""

    start: int
    end: int


class BatchEncoding(dict):
    """What a tokenizer call returns: a dict (`input_ids`, `attention_mask`, ...) that also reads as attributes.

    `encodings` holds the `tokenizers.Encoding` of each row (offsets, word ids) when the call made them.
    """

    def __init__(self, data: Mapping | None = None, encodings: list | None = None, tensor_type: str | None = None):
        super().__init__(data or {})
        self.encodings = encodings
        if tensor_type is not None:
            self.convert_to_tensors(tensor_type)

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"BatchEncoding has no field {name!r}; it holds: {', '.join(self) or 'nothing'}"
            ) from None

    @property
    def is_fast(self) -> bool:
        """Whether the rows' encodings (and so the token / word / character maps below) are here."""
        return self.encodings is not None

    @property
    def n_sequences(self) -> int | None:
        """1 for single texts, 2 for pairs; None without encodings."""
        return self.encodings[0].n_sequences if self.encodings else None

    def _encoding(self, method: str, batch_index: int):
        if not self.encodings:
            raise ValueError(f"{method}() needs the encodings of a tokenizer call; this BatchEncoding was built "
                             "without them (from a dict, or by pad())")
        return self.encodings[batch_index]

    def _row_and_index(self, method: str, batch_or_index: int, index: int | None):
        """f(i) reads row 0's item i, f(b, i) row b's."""
        batch_index, index = (0, batch_or_index) if index is None else (batch_or_index, index)
        return self._encoding(method, batch_index), index

    def _row_and_token(self, method: str, batch_or_index: int, index: int | None):
        """As _row_and_index, for a token index: a negative one counts from the row's end."""
        encoding, token = self._row_and_index(method, batch_or_index, index)
        return encoding, token + len(encoding) if token < 0 else token

    def tokens(self, batch_index: int = 0) -> list[str]:
        return self._encoding("tokens", batch_index).tokens

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        """Each token's word index in its text (None for special and padding tokens)."""
        return self._encoding("word_ids", batch_index).word_ids

    def sequence_ids(self, batch_index: int = 0) -> list[int | None]:
        """Each token's text of the pair: 0, 1, or None for special and padding tokens."""
        return self._encoding("sequence_ids", batch_index).sequence_ids

    def token_to_sequence(self, batch_or_token_index: int, token_index: int | None = None) -> int | None:
        encoding, token = self._row_and_token("token_to_sequence", batch_or_token_index, token_index)
        return encoding.token_to_sequence(token)

    def token_to_word(self, batch_or_token_index: int, token_index: int | None = None) -> int | None:
        encoding, token = self._row_and_token("token_to_word", batch_or_token_index, token_index)
        return encoding.token_to_word(token)

    def token_to_chars(self, batch_or_token_index: int, token_index: int | None = None) -> CharSpan | None:
        """The characters of its text a token covers; None for special and padding tokens."""
        encoding, token = self._row_and_token("token_to_chars", batch_or_token_index, token_index)
        span = encoding.token_to_chars(token)
        return CharSpan(*span) if span is not None else None

    def word_to_tokens(self, batch_or_word_index: int, word_index: int | None = None,
                       sequence_index: int = 0) -> TokenSpan | None:
        """The tokens a word of text `sequence_index` became; None if it became none (truncated away)."""
        encoding, word = self._row_and_index("word_to_tokens", batch_or_word_index, word_index)
        span = encoding.word_to_tokens(word, sequence_index)
        return TokenSpan(*span) if span is not None else None

    def word_to_chars(self, batch_or_word_index: int, word_index: int | None = None,
                      sequence_index: int = 0) -> CharSpan | None:
        encoding, word = self._row_and_index("word_to_chars", batch_or_word_index, word_index)
        span = encoding.word_to_chars(word, sequence_index)
        return CharSpan(*span) if span is not None else None

    def char_to_token(self, batch_or_char_index: int, char_index: int | None = None,
                      sequence_index: int = 0) -> int | None:
        """The token covering a character of text `sequence_index`; None for whitespace no token covers."""
        encoding, char = self._row_and_index("char_to_token", batch_or_char_index, char_index)
        return encoding.char_to_token(char, sequence_index)

    def char_to_word(self, batch_or_char_index: int, char_index: int | None = None,
                     sequence_index: int = 0) -> int | None:
        encoding, char = self._row_and_index("char_to_word", batch_or_char_index, char_index)
        return encoding.char_to_word(char, sequence_index)

    def convert_to_tensors(self, tensor_type: str | None) -> "BatchEncoding":
        """Turn every list value into a `torch.Tensor` ("pt") or a `numpy.ndarray` ("np"), in place."""
        if tensor_type is None:
            return self
        if tensor_type not in ("pt", "np"):
            raise ValueError(f'return_tensors "{tensor_type}" is not one of: pt, np (or None for Python lists)')
        import numpy as np

        for key, value in self.items():
            if hasattr(value, "shape"):
                continue
            rows = value if value and isinstance(value[0], (list, tuple)) else None
            ragged = rows is not None and len({len(row) for row in rows}) > 1
            # Values keep their shape, as in transformers: tokenizer calls hand over rows already, and a
            # per-row value (length, overflow_to_sample_mapping) is one number per row, a (batch,) tensor.
            if tensor_type == "pt":
                import torch

                if ragged:
                    raise ValueError(
                        f"Unable to create a tensor from {key!r}: its rows have different lengths "
                        f"({sorted({len(row) for row in rows})}). Pass padding=True (and truncation=True) to get "
                        "rows of the same length."
                    )
                # An empty batch has no values to infer a dtype from; ids are integers (as below for numpy).
                tensor = torch.tensor(value)
                self[key] = tensor.long() if tensor.numel() == 0 else tensor
            elif ragged:
                # numpy holds rows of different lengths as an object array of int arrays, as transformers does.
                self[key] = np.asarray([np.asarray(row) for row in rows], dtype=object)
            else:
                array = np.asarray(value)
                self[key] = array.astype(np.int64) if array.size == 0 else array
        return self

    def to(self, device, non_blocking: bool = False) -> "BatchEncoding":
        """Move every tensor to `device` (a torch.device, a string like "cuda:0", or an int); returns self."""
        import torch

        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device, non_blocking=non_blocking)
        return self
