"""ChoiceText, the incremental detokenizer of the server: stop strings cut the text and are never streamed, and
an incomplete UTF-8 character is held back until it is whole. A table tokenizer keeps these tests exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from gpuformers.engine.sequence import RequestStatus  # noqa: E402
from gpuformers.serving.job import ChoiceText  # noqa: E402


class TableTokenizer:
    """Token id -> bytes; decode joins the bytes and replaces an incomplete UTF-8 tail with U+FFFD."""

    PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!", 0: b""}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def outputs(ids, last=RequestStatus.FINISHED):
    for k in range(1, len(ids) + 1):
        status = last if k == len(ids) else RequestStatus.DECODING
        yield SimpleNamespace(generated_tokens=ids[:k], logprobs=[-1.0] * k, top_logprobs=[], status=status,
                              error=None)


def stream(ids, stops=(), eos=(0,), last=RequestStatus.FINISHED):
    choice = ChoiceText(TableTokenizer(), list(stops), 100, set(eos))
    pieces = []
    for output in outputs(ids, last):
        pieces.append(choice.update(output))
        if choice.finished:
            break
    return choice, pieces


def test_plain_text_streams_token_by_token():
    choice, pieces = stream([1, 2, 3, 4])
    assert pieces == ["Hel", "lo", " wor", "ld"] and choice.text == "Hello world"
    assert choice.finish_reason == "length" and choice.num_tokens_kept() == 4


def test_a_split_utf8_character_waits_for_its_second_byte():
    _, pieces = stream([1, 5, 6, 7])
    assert pieces == ["Hel", "", "é", "!"]


def test_stop_string_is_cut_and_never_sent_even_across_tokens():
    choice, pieces = stream([1, 2, 3, 4, 7], stops=["lo w"])
    assert "".join(pieces) == "Hel" and choice.text == "Hel"
    assert choice.finish_reason == "stop"
    assert choice.num_tokens_kept() == 1  # the answer covers the first token only


def test_eos_finish_reason_and_failure():
    choice, _ = stream([1, 0])
    assert choice.finish_reason == "stop" and choice.text == "Hel"
    failed, _ = stream([1, 2], last=RequestStatus.FAILED)
    assert failed.error and failed.finish_reason is None


# ---------------------------------------------------------------------------------------------- a real tokenizer

# Byte-level BPE splits emoji (4 bytes, skin tones, flags) and CJK (3 bytes) over several tokens.
TEXT = "Hello 👋🏽 world! 你好，世界。Ünïcödé ✨ — 日本語のテキスト 🇫🇷🧑‍💻 done. Ещё 😀😀😀 end"


@pytest.fixture(scope="module")
def qwen3():
    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def stream_with(tokenizer, ids, stops=()):
    choice = ChoiceText(tokenizer, list(stops), 10_000, set())
    pieces = []
    for output in outputs(ids):
        pieces.append(choice.update(output))
        if choice.finished:
            break
    return choice, pieces


def test_streamed_text_equals_the_whole_decode_with_a_byte_level_bpe(qwen3):
    ids = qwen3.encode(TEXT)
    assert sum("\ufffd" in qwen3.decode([t]) for t in ids) >= 6  # many characters really are split over tokens
    choice, pieces = stream_with(qwen3, ids)
    assert "".join(pieces) == choice.text == qwen3.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)  # never a half character on the wire
    assert sum(1 for piece in pieces if piece) < len(ids)  # split characters came out whole, in one piece
    # An answer cut anywhere (max_tokens), even inside a character, ends exactly as the full decode does.
    for k in range(1, len(ids)):
        choice, pieces = stream_with(qwen3, ids[:k])
        assert "".join(pieces) == choice.text == qwen3.decode(ids[:k], skip_special_tokens=True), k


@pytest.mark.parametrize("stop", ["界。Ünï", "🏽 wor", "😀😀 e", "🇫🇷"])
def test_stop_strings_spanning_tokens_cut_the_stream(qwen3, stop):
    ids = qwen3.encode(TEXT)
    choice, pieces = stream_with(qwen3, ids, stops=[stop, "never there"])
    expected = TEXT[:TEXT.find(stop)]
    assert "".join(pieces) == choice.text == expected
    assert choice.finish_reason == "stop"
    kept = choice.num_tokens_kept()
    # the fewest tokens whose text holds the answer
    assert qwen3.decode(ids[:kept]).startswith(expected) and not qwen3.decode(ids[:kept - 1]).startswith(expected)


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.tokens, self.longest = tokenizer, 0, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.tokens += len(ids)
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_work_per_token_is_bounded(qwen3):
    """A long answer decodes a few tokens per new token, not the whole answer again (which would be
    n^2 / 2 = 2M token decodes here)."""
    ids = qwen3.encode(TEXT * 50)
    counting = CountingTokenizer(qwen3)
    choice, pieces = stream_with(counting, ids, stops=["no such stop"])
    assert "".join(pieces) == qwen3.decode(ids)
    assert len(ids) > 1500
    assert counting.calls <= 2 * len(ids) + 2
    assert counting.tokens <= 8 * len(ids)
    assert counting.longest <= 8  # the longest character here spans 4 tokens, plus the context window
