"""Incremental detokenization: text out of a growing list of token ids, decoding only a short tail per token.

Decoding the whole answer again at every new token costs O(length) per token, O(length^2) per answer. Decoding
only the new token on its own is wrong for two kinds of tokenizers: byte-level BPE pieces may end inside a UTF-8
character (the decode ends in U+FFFD until the next piece completes it), and SentencePiece-style decoders drop the
leading space of the first token of a decode. So each step decodes a window that starts one emitted group back:

    token_ids:   ... t4 t5 | t6 t7 | t8
                           ^prefix ^read      t8 is new
    prefix_text = decode(t6 t7)               (already emitted; the context for the space rule)
    window_text = decode(t6 t7 t8)
    new text    = window_text[len(prefix_text):], taken only when window_text does not end in U+FFFD

When the new text is taken, prefix moves to read and read to the end. A character split over several pieces keeps
the window growing until it is whole (a handful of tokens at most), so the work per token stays bounded. At the
end of an answer `flush` takes whatever the tail holds, so the text always equals a full decode of the same ids.

Offers: IncrementalDetokenizer.
"""

from __future__ import annotations

import bisect

REPLACEMENT = "\ufffd"  # what a decode puts where a UTF-8 character is incomplete


class IncrementalDetokenizer:
    """`add(token_id)` -> the text that token completes ("" while a character is still incomplete)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.text_ends: list[int] = []  # per token: len(text) once that token was added
        self.prefix_offset = 0  # token_ids[prefix_offset:read_offset] were emitted last: the decode context
        self.read_offset = 0  # token_ids[read_offset:] are not in text yet
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset]), kept until the offsets move

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _take(self, final: bool) -> str:
        window = self._decode(self.token_ids[self.prefix_offset:])
        if len(window) <= len(self._prefix_text) or (window.endswith(REPLACEMENT) and not final):
            return ""  # nothing visible yet (a special token skipped), or a character still incomplete
        new = window[len(self._prefix_text):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        return new

    def add(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        new = self._take(final=False)
        self.text_ends.append(len(self.text))
        return new

    def flush(self) -> str:
        """The end of the answer: take the tail even when it ends inside a character (as a full decode does)."""
        if self.read_offset == len(self.token_ids):
            return ""
        new = self._take(final=True)
        if self.text_ends:
            self.text_ends[-1] = len(self.text)
        return new

    def num_tokens_for(self, length: int) -> int:
        """The fewest leading tokens whose text covers the first `length` characters."""
        if length <= 0:
            return 0
        return min(bisect.bisect_left(self.text_ends, length) + 1, len(self.token_ids))  # text_ends never drops
