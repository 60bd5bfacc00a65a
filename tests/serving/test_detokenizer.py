"""IncrementalDetokenizer: byte-level BPE tokenizers take the byte table (byte_pieces.py) and give exactly the text
of the window path (two decodes per token, which other tokenizers keep) after every token, after flush, and in
text_ends; at the end that text is tokenizers' decode of all the ids, U+FFFD placement included."""

from __future__ import annotations

import codecs
import itertools
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from gpuformers.serving.byte_pieces import byte_pieces
from gpuformers.serving.detokenizer import IncrementalDetokenizer
from gpuformers.tokenizer import PreTrainedTokenizerFast, byte_level_alphabet
from tests.assets import qwen3_tokenizer_dir
from tests.fixtures.tokenizers import byte_level_bpe

TEXT = "Hello 👋🏽 world! 你好，世界。Ünïcödé ✨ — 日本語のテキスト 🇫🇷🧑‍💻 done. Ещё 😀😀😀 end\n\tcafé €"
ALPHABET = byte_level_alphabet()  # byte -> the character byte-level vocabularies spell it with


class WindowPath:
    """A tokenizer seen only through its decode: the detokenizer takes the window path, as before the byte table."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def qwen3():
    from gpuformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def gpt2_style() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on English only (so é, € and emoji are split into byte tokens), with special added
    tokens and non-special ones, some spelled in the byte alphabet ("Ġ" is a space) and some not."""
    backend = byte_level_bpe(["the capital of France is Paris. New line, thanks."] * 50,
                             special_tokens=("<|endoftext|>",))
    backend.add_tokens([AddedToken(t, special=False) for t in ("ĠHi", "café", " sp ace", "thĠe", "<tool>")])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|sp é|>", "Ġspec", "<|im_end|>")])
    return PreTrainedTokenizerFast(backend, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_style()


def stream_both(tokenizer, ids, skip_special_tokens):
    """Both paths over the same ids, compared after every add and after flush; returns the fast one."""
    fast = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    window = IncrementalDetokenizer(WindowPath(tokenizer), skip_special_tokens=skip_special_tokens)
    assert fast._table is not None and window._table is None
    for k, token_id in enumerate(ids, 1):
        assert fast.add(token_id) == window.add(token_id), (k, ids[:k])
        assert fast.text == window.text
        so_far = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        assert so_far.startswith(fast.text)
        if not so_far.endswith("\ufffd"):
            assert fast.text == so_far
    assert fast._table is not None  # the table all along, never a fall back to the window path
    assert fast.flush() == window.flush()
    assert fast.text == window.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert fast.text_ends == window.text_ends and fast.token_ids == window.token_ids == list(ids)
    assert [fast.num_tokens_for(n) for n in range(len(fast.text) + 2)] == \
        [window.num_tokens_for(n) for n in range(len(window.text) + 2)]
    return fast


def adversarial_ids(tokenizer, generator: random.Random, count: int, length: int) -> list[list[int]]:
    """Random mixes of text tokens, single-byte tokens (lead bytes, continuation bytes, bytes never valid), added
    tokens (special and not) and ids past the vocabulary (a model's padding rows)."""
    backend = tokenizer._tokenizer
    byte_tokens = [backend.token_to_id(ALPHABET[b]) for b in range(256)]
    added = sorted(backend.get_added_tokens_decoder())
    size = backend.get_vocab_size(with_added_tokens=True)
    pools = [
        tokenizer.encode(TEXT, add_special_tokens=False),
        [i for i in byte_tokens if i is not None],
        [byte_tokens[b] for b in (0xE4, 0xF0, 0x9F, 0x98, 0x80, 0xBD, 0xED, 0xA0, 0xC0, 0xFF) if byte_tokens[b]],
        added,
        list(range(size, size + 5)),
        [generator.randrange(size) for _ in range(500)],
    ]
    return [[generator.choice(generator.choice(pools)) for _ in range(length)] for _ in range(count)]


def test_python_replace_decoding_is_tokenizers_lossy_decoding():
    """The byte table's premise: Python's "replace" decode, whole or in pieces (incremental, as the detokenizer
    does it), puts U+FFFD where tokenizers' ByteLevel decoder (Rust's from_utf8_lossy) does."""
    decoder = decoders.ByteLevel()
    edges = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED,
             0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xF8, 0xFE, 0xFF]
    generator = random.Random(0)
    sequences = [bytes([a, b]) for a in range(256) for b in range(256)]  # every 2-byte sequence
    sequences += [bytes(p) for p in itertools.product(edges, repeat=3)]
    sequences += [bytes(generator.choice(edges) for _ in range(generator.randint(4, 10))) for _ in range(5000)]
    sequences += [b"\xf0\x9f\x98A", b"\x80", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf4\x90\x80\x80"]
    for data in sequences:
        lossy = decoder.decode(["".join(ALPHABET[b] for b in data)])
        assert data.decode("utf-8", "replace") == lossy, data
        cuts = sorted(generator.sample(range(len(data) + 1), generator.randint(0, len(data))))
        text, kept = [], b""
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            chunk = kept + data[start:end]
            decoded, used = codecs.utf_8_decode(chunk, "replace", False)
            text.append(decoded)
            kept = chunk[used:]
        text.append(codecs.utf_8_decode(kept, "replace", True)[0])
        assert "".join(text) == lossy, (data, cuts)


@pytest.mark.parametrize("skip", [True, False])
def test_qwen3_streams_as_the_window_path_does(qwen3, skip):
    ids = qwen3.encode(TEXT * 3)
    assert sum("\ufffd" in qwen3.decode([t]) for t in ids) >= 6  # characters really are split over tokens
    im_end, think = qwen3.convert_tokens_to_ids("<|im_end|>"), qwen3.convert_tokens_to_ids("<think>")
    stream_both(qwen3, [think, *ids[:20], im_end, *ids[20:], im_end], skip)
    for ids in adversarial_ids(qwen3, random.Random(1), count=150, length=50):
        stream_both(qwen3, ids, skip)
    stream_both(qwen3, [], skip)


@pytest.mark.parametrize("skip", [True, False])
def test_gpt2_style_added_tokens_and_invalid_bytes(gpt2, skip):
    assert "\ufffd" in gpt2.decode(gpt2.convert_tokens_to_ids(["café"]))  # "é" is a byte there: an invalid one
    assert gpt2.decode(gpt2.convert_tokens_to_ids(["Ġspec"])) == " spec"
    b = {byte: gpt2.convert_tokens_to_ids(ALPHABET[byte]) for byte in range(256)}
    for data in (b"\xf0\x9f\x98A", b"A\x80\x80B", b"\xed\xa0\x80!", b"\xc0\xafx", b"\xe4\xbd", b"\xf0\x9f", b"\xff"):
        stream_both(gpt2, [b[x] for x in data], skip)
    stream_both(gpt2, gpt2.encode("Le café coûte 3 € 🙂 <|sp é|> ĠHi thĠe <tool>Ġspec <|im_end|>"), skip)
    for ids in adversarial_ids(gpt2, random.Random(2), count=150, length=40):
        stream_both(gpt2, ids, skip)


def test_after_flush_and_after_a_refused_id_it_goes_on_as_the_window_path(gpt2):
    b = {byte: gpt2.convert_tokens_to_ids(ALPHABET[byte]) for byte in range(256)}
    fast, window = IncrementalDetokenizer(gpt2), IncrementalDetokenizer(WindowPath(gpt2))
    for detokenizer in (fast, window):  # ends inside "é", then its second byte arrives after the end
        detokenizer.add(b[ord("a")]), detokenizer.add(b[0xC3]), detokenizer.flush()
    assert fast.add(b[0xA9]) == window.add(b[0xA9]) and fast.text == window.text == "a\ufffd"
    assert fast.add(b[ord("z")]) == window.add(b[ord("z")]) and fast.text == window.text
    assert fast.flush() == window.flush() and fast.text_ends == window.text_ends
    fast, window = IncrementalDetokenizer(gpt2), IncrementalDetokenizer(WindowPath(gpt2))
    for detokenizer in (fast, window):
        detokenizer.add(b[0xE4])
        with pytest.raises(OverflowError):  # tokenizers takes ids as u32
            detokenizer.add(-1)
    assert fast._table is None and fast.token_ids == window.token_ids and fast.text_ends == window.text_ends


def test_a_piece_that_disagrees_with_tokenizers_moves_to_the_window_path():
    tokenizer = gpt2_style()
    pieces = byte_pieces(tokenizer)
    table = pieces.table(True)
    table[:] = [None] * len(table)
    pieces._to_byte["a"] = ord("b")  # a wrong table: every "a" would come out as "b"
    ids = tokenizer.encode("the capital is Paris. thanks")
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert detokenizer._table is None and byte_pieces(tokenizer) is None  # this tokenizer stays off the table


def test_added_tokens_rebuild_the_table():
    tokenizer = gpt2_style()
    assert byte_pieces(tokenizer) is not None
    tokenizer.add_tokens(["<new special>"], special_tokens=True)
    tokenizer.add_tokens(["Ġnew"])
    ids = tokenizer.encode("Paris <new special> Ġnew thanks")
    assert tokenizer.convert_tokens_to_ids("<new special>") in ids
    for skip in (True, False):
        stream_both(tokenizer, ids, skip)


def sentencepiece_style(byte_fallback: bool) -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for a space, a decoder that drops the first token's leading space; with byte fallback
    ("<0xE4>" tokens, a Sequence decoder) or a plain Metaspace decoder."""
    letters = sorted(set("the capital of France is Paris.,"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *letters, "▁t", "▁th", "▁the", "he"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e")]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=byte_fallback))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if byte_fallback:
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    else:
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_sentencepiece_style_tokenizers_keep_the_window_path(byte_fallback):
    tokenizer = sentencepiece_style(byte_fallback)
    assert byte_pieces(tokenizer) is None
    ids = tokenizer.encode("the capital of France is Paris, café €", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
    assert detokenizer._table is None
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert pieces[0] == "the"  # the first token's leading space dropped, as a whole decode does


def test_only_a_plain_byte_level_decode_takes_the_table(qwen3, gpt2):
    assert byte_pieces(qwen3) is not None and byte_pieces(gpt2) is not None
    assert byte_pieces(WindowPath(gpt2)) is None  # not a gpuformers tokenizer

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
            return super().decode(token_ids, skip_special_tokens).upper()

    assert byte_pieces(OwnDecode(gpt2._tokenizer, eos_token="<|endoftext|>")) is None
    # clean_up_tokenization_spaces joins " ," on a WordLevel model (skipped on BPE ones): the table would not
    word_level = Tokenizer(models.WordLevel({"a": 0, "Ġ,": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word_level.decoder = decoders.ByteLevel()
    assert byte_pieces(PreTrainedTokenizerFast(word_level)) is not None
    assert byte_pieces(PreTrainedTokenizerFast(word_level, clean_up_tokenization_spaces=True)) is None
    assert byte_pieces(PreTrainedTokenizerFast(gpt2._tokenizer, clean_up_tokenization_spaces=True)) is not None
