"""The bytes each token id adds to a decode, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2): what
lets the incremental detokenizer (detokenizer.py) take a new token with a table lookup and an incremental UTF-8
decode instead of two calls into `tokenizers`.

When the backend's decoder is exactly ByteLevel, `tokenizers` decodes ids in three steps:

    id     -> token string: the added tokens' first, then the model's; an id with neither is dropped, and so is
              a special token's with skip_special_tokens (matched by content)
    token  -> bytes: each character back through GPT-2's byte alphabet ("Ġ" -> b" "), or the token's own UTF-8
              when a character is outside it (added tokens with a space, "<|sp é|>")
    bytes  -> text: all tokens' bytes joined, then UTF-8 with U+FFFD for each maximal invalid subpart (Rust's
              from_utf8_lossy; Python's "replace" handler, whole or incremental, gives the same text: the tests
              compare them on every 2-byte sequence and on many invalid ones)

so decode(ids) == b"".join(piece(i) for i in ids).decode("utf-8", "replace"). A tokenizer qualifies when its
decode is EncodingMixin's (no subclass decode, no clean-up of spaces that does something), its decoder is
ByteLevel (not a Sequence with others, not Metaspace / ByteFallback), and that identity holds on a few sequences
at build time (random ids, every added token, byte tokens in an invalid order, CJK and emoji text). The table is
filled lazily (the Qwen3 vocab has 151k tokens; reading it whole costs ~120 ms in get_vocab alone): each id the
first time it is seen, checked against `tokenizers`' decode of that id alone. Any difference marks the tokenizer
unusable and its detokenizers go on through tokenizer.decode.

Offers: BytePieces, byte_pieces.
"""

from __future__ import annotations

import random
import weakref

from gpuformers.tokenization.encoding import EncodingMixin
from gpuformers.tokenizer import byte_level_alphabet

# Text whose characters are split over several byte-level tokens (CJK: 3 bytes, emoji: 4, joined emoji, flags)
_SAMPLE = "Hello 👋🏽 world! 你好，世界。Ünïcödé ✨ — 日本語 🇫🇷🧑‍💻 Ещё 😀 \n\t end"
_U32 = 1 << 32  # tokenizers takes ids as u32: anything outside raises OverflowError there


class BytePieces:
    """One tokenizer's table: `table(skip_special_tokens)[id]` is the bytes that id adds to a decode, or None while
    that id was never seen (`piece` fills it)."""

    def __init__(self, backend):
        self.backend = backend  # the tokenizers.Tokenizer
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)  # a changed size means a stale table
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special = {token.content for token in added.values() if token.special}
        size = max(self.vocab_size, max(added, default=-1) + 1)
        self._tables = {False: [None] * size, True: [None] * size}  # by skip_special_tokens
        self._to_byte = {char: byte for byte, char in byte_level_alphabet().items()}
        self.usable = True  # False once a piece disagreed with tokenizers' decode

    def table(self, skip_special_tokens: bool) -> list[bytes | None]:
        return self._tables[bool(skip_special_tokens)]

    def piece(self, token_id: int, skip_special_tokens: bool) -> bytes | None:
        """The bytes `token_id` adds, filled in the table; None for an id tokenizers refuses (outside u32: its
        decode raises) or when this id's bytes do not decode to what tokenizers gives (the table is then unusable)."""
        if not 0 <= token_id < _U32:
            return None
        skip = bool(skip_special_tokens)
        token = self.backend.id_to_token(token_id)
        if token is None or (skip and token in self.special):
            piece = b""
        else:
            try:
                piece = bytes(self._to_byte[char] for char in token)
            except KeyError:  # a character outside the byte alphabet: the ByteLevel decoder keeps the token's UTF-8
                piece = token.encode("utf-8")
        if piece.decode("utf-8", "replace") != self.backend.decode([token_id], skip_special_tokens=skip):
            self.usable = False
            return None
        table = self._tables[skip]
        if token_id < len(table):  # ids past the vocab (a model's padding rows) decode to nothing, looked up each time
            table[token_id] = piece
        return piece

    def agrees_on(self, ids: list[int], skip_special_tokens: bool) -> bool:
        """Whether the pieces of `ids`, joined and decoded, give tokenizers' decode of them."""
        pieces = [self.piece(i, skip_special_tokens) for i in ids]
        if any(p is None for p in pieces):
            return False
        joined = b"".join(pieces).decode("utf-8", "replace")
        return joined == self.backend.decode(ids, skip_special_tokens=bool(skip_special_tokens))


# tokenizer -> (its backend, vocab size, BytePieces or None): built once per tokenizer, in each process
_CACHE: "weakref.WeakKeyDictionary[object, tuple[object, int, BytePieces | None]]" = weakref.WeakKeyDictionary()


def byte_pieces(tokenizer) -> BytePieces | None:
    """The tokenizer's BytePieces when its decode is the ByteLevel one that BytePieces reproduces, else None."""
    if not _decodes_plainly(tokenizer):
        return None
    backend = tokenizer._tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    try:
        cached = _CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable: not a tokenizer this module knows
        return None
    if cached is None or cached[0] is not backend or cached[1] != vocab_size:
        cached = (backend, vocab_size, _checked(BytePieces(backend)))
        _CACHE[tokenizer] = cached
    pieces = cached[2]
    return pieces if pieces is not None and pieces.usable else None


def _decodes_plainly(tokenizer) -> bool:
    """Whether tokenizer.decode(ids, skip_special_tokens=...) is exactly the backend's decode with a ByteLevel
    decoder: gpuformers' decode and clean-up (not a subclass's), and a clean-up that leaves BPE text alone."""
    cls = type(tokenizer)
    if getattr(cls, "decode", None) is not EncodingMixin.decode or \
            getattr(cls, "_clean_up", None) is not EncodingMixin._clean_up:
        return False
    backend = getattr(tokenizer, "_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return False
    # EncodingMixin._clean_up joins " ," and " n't" when clean_up_tokenization_spaces is on, except on BPE models
    return not tokenizer.clean_up_tokenization_spaces or type(backend.model).__name__ == "BPE"


def _checked(pieces: BytePieces) -> BytePieces | None:
    """`pieces` when joined pieces decode as tokenizers does on a few sequences, both with and without the special
    tokens; ~2-5 ms once per tokenizer (a few hundred ids filled, each checked alone too)."""
    backend, size = pieces.backend, len(pieces.table(False))
    generator = random.Random(0)
    added = sorted(backend.get_added_tokens_decoder())
    alphabet = byte_level_alphabet()
    byte_tokens = [i for i in (backend.token_to_id(alphabet[b]) for b in range(256)) if i is not None]
    generator.shuffle(byte_tokens)  # lone continuation bytes, cut characters, invalid lead bytes
    try:
        text = backend.encode(_SAMPLE, add_special_tokens=False).ids
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the sample is checked on the rest
        text = []
    sequences = [
        [generator.randrange(size) for _ in range(256)] if size else [],
        [i for token_id in added for i in (token_id, *text[:3])],  # every added token, between text
        byte_tokens,
        text,
        text[1::2] + byte_tokens[:8] + text[::3],
    ]
    for skip in (False, True):
        if not all(pieces.agrees_on(ids, skip) for ids in sequences):
            return None
    return pieces
