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

Byte-level BPE tokenizers (a ByteLevel decoder: GPT-2, Llama 3, Qwen, SmolLM2) take a faster path with the same
output: each id's bytes come from a table (byte_pieces.py) and go through an incremental UTF-8 decode, which keeps
an incomplete character's bytes back; the text since `read` is held, as above, while bytes are kept back or it
ends in U+FFFD (an invalid byte: the window would end in U+FFFD too). Measured with timeit, Qwen3 tokenizer, one
answer of ~500 tokens added one by one and flushed, per add (2 shared CPU cores): window path 3.4-3.6 us, byte
table 0.60-0.66 us, on English text and on CJK / emoji text alike (profiles of a loaded API server had put the
window path at ~8-10 us per token). The table costs ~4 ms once per tokenizer and process, at its first
detokenizer. After `flush` (or an id tokenizers refuses) the detokenizer goes on with the window path, from the
offsets the fast path keeps.

Offers: IncrementalDetokenizer.
"""

from __future__ import annotations

import bisect
from codecs import utf_8_decode

from gpuformers.serving.byte_pieces import byte_pieces

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
        # decode(token_ids[prefix_offset:read_offset]), kept until the offsets move; None: not decoded yet
        self._prefix_text: str | None = ""
        # The byte-level fast path: id -> bytes (None where not filled yet); None: decode through the tokenizer
        self._pieces = byte_pieces(tokenizer)
        self._table = self._pieces.table(skip_special_tokens) if self._pieces is not None else None
        self._kept_bytes = b""  # the bytes of an incomplete character at the end of token_ids[read_offset:]
        self._held = ""  # the text of token_ids[read_offset:] held back: ends in U+FFFD, or _kept_bytes follow

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _take(self, final: bool) -> str:
        if self._prefix_text is None:  # just left the fast path
            self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset:])
        if len(window) <= len(self._prefix_text) or (window.endswith(REPLACEMENT) and not final):
            return ""  # nothing visible yet (a special token skipped), or a character still incomplete
        new = window[len(self._prefix_text):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        return new

    def _leave_fast_path(self) -> None:
        """Go on with the window path from the same offsets (what it holds back it decodes again from the ids)."""
        self._table = None
        self._kept_bytes, self._held = b"", ""
        self._prefix_text = None

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        table = self._table
        if table is not None:
            piece = table[token_id] if 0 <= token_id < len(table) else None
            if piece is None:  # first sight of this id (or past the table)
                piece = self._pieces.piece(token_id, self.skip_special_tokens)
                if piece is None:  # an id tokenizers refuses, or a piece that disagrees: the window path decides
                    self._leave_fast_path()
                    return self.add(token_id)
            self.token_ids.append(token_id)
            new = ""
            if piece:
                data = self._kept_bytes + piece if self._kept_bytes else piece
                decoded, used = utf_8_decode(data, "replace", False)
                self._kept_bytes = data[used:] if used < len(data) else b""
                held = self._held + decoded if self._held else decoded
                if self._kept_bytes or held.endswith(REPLACEMENT):
                    self._held = held  # the window path holds text that ends in U+FFFD too
                else:
                    new, self._held = held, ""
                    self.text += new
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.text_ends.append(len(self.text))
            return new
        self.token_ids.append(token_id)
        new = self._take(final=False)
        self.text_ends.append(len(self.text))
        return new

    def flush(self) -> str:
        """The end of the answer: take the tail even when it ends inside a character (as a full decode does)."""
        if self.read_offset == len(self.token_ids):
            return ""
        if self._table is not None:
            new = self._held + (utf_8_decode(self._kept_bytes, "replace", True)[0] if self._kept_bytes else "")
            if new:
                self.text += new
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._leave_fast_path()  # an add after the end: as before (the window may start inside a character)
        else:
            new = self._take(final=True)
        if self.text_ends:
            self.text_ends[-1] = len(self.text)
        return new

    def num_tokens_for(self, length: int) -> int:
        """The fewest leading tokens whose text covers the first `length` characters."""
        if length <= 0:
            return 0
        return min(bisect.bisect_left(self.text_ends, length) + 1, len(self.token_ids))  # text_ends never drops
