"""Streamers: whole words, never broken UTF-8, the same text through a thread, and a timeout that raises."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from gpuformers.generation.streamers import StreamerTimeout, TextIteratorStreamer, TextStreamer
from tests.assets import qwen3_tokenizer_dir
from tests.fixtures.tokenizers import byte_level_bpe

TEXT = "Le café coûte 3 € 🙂 aujourd'hui, merci.\nNouvelle ligne: the capital of France is Paris."


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained here on English only, so é, €, û and the emoji are split into byte tokens."""
    return byte_level_bpe(["the capital of France is Paris. New line, thanks."] * 50, special_tokens=("<eos>",))


class Recorder(TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pieces: list[str] = []
        self.ended = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)
        self.ended = stream_end


def _feed(streamer, prompt: list[int], tokens: list[int]) -> None:
    streamer.put(torch.tensor([prompt]))  # generate: the prompt first, (1, seq)
    for t in tokens:
        streamer.put(torch.tensor([t]))  # then each new token
    streamer.end()


def test_multibyte_characters_are_split_across_tokens(tokenizer):
    # the premise of the UTF-8 test: some single tokens decode to broken characters on their own
    ids = tokenizer.encode(TEXT).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_text_streamer_releases_whole_words_never_broken_utf8(tokenizer):
    prompt, new = tokenizer.encode("Prompt: ").ids, tokenizer.encode(TEXT).ids
    streamer = Recorder(tokenizer)
    _feed(streamer, prompt, new)
    assert streamer.ended
    assert "".join(streamer.pieces) == tokenizer.decode(prompt + new)
    released = [p for p in streamer.pieces[:-1] if p]
    assert len(released) >= 8, "text should stream before end(), not all at once"
    for piece in streamer.pieces:
        assert "\ufffd" not in piece, f"broken UTF-8 released: {piece!r}"
    for piece in released:
        assert piece[-1].isspace(), f"a word was released before it was complete: {piece!r}"
    assert "café " in released or any(p.endswith("café ") for p in released)


def test_skip_prompt_and_decode_kwargs(tokenizer):
    prompt, new = tokenizer.encode("Prompt: ").ids, tokenizer.encode("the capital is Paris. ").ids
    eos = tokenizer.token_to_id("<eos>")
    streamer = Recorder(tokenizer, skip_prompt=True, skip_special_tokens=True)
    _feed(streamer, prompt, new + [eos])
    assert "".join(streamer.pieces) == "the capital is Paris. "


def test_text_streamer_prints_to_stdout(tokenizer, capsys):
    ids = tokenizer.encode("the capital of France is Paris.").ids
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    _feed(streamer, [ids[0]], ids)
    assert capsys.readouterr().out == "the capital of France is Paris.\n"


def test_cjk_streams_per_character_without_broken_bytes():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    text = "東京は日本の首都です。𠀀𠀁と鿕"  # rare ideographs are several byte tokens in Qwen's vocab
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    streamer = Recorder(tok)
    _feed(streamer, [], ids)
    assert "".join(streamer.pieces) == text
    assert all("\ufffd" not in p for p in streamer.pieces)
    assert len([p for p in streamer.pieces if p]) >= 5  # no spaces, yet it streams


def test_batch_of_two_is_refused(tokenizer):
    with pytest.raises(ValueError, match="batch of 2"):
        TextStreamer(tokenizer).put(torch.zeros(2, 3, dtype=torch.long))


def test_iterator_streamer_from_another_thread(tokenizer):
    prompt, new = tokenizer.encode("Prompt: ").ids, tokenizer.encode(TEXT).ids
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=10.0)

    def produce():  # stands in for generate() running in its thread
        streamer.put(torch.tensor([prompt]))
        for t in new:
            streamer.put(torch.tensor([[t]]))
            time.sleep(0.001)
        streamer.end()

    worker = threading.Thread(target=produce)
    worker.start()
    received = list(streamer)
    worker.join()
    assert "".join(received) == tokenizer.decode(new)
    assert len(received) >= 8 and all(received)
    assert all("\ufffd" not in piece for piece in received)


def test_iterator_streamer_timeout_raises(tokenizer):
    streamer = TextIteratorStreamer(tokenizer, timeout=0.05)
    start = time.perf_counter()
    with pytest.raises(StreamerTimeout, match="timeout=0.05") as err:
        next(iter(streamer))
    assert time.perf_counter() - start < 2.0
    assert isinstance(err.value, queue.Empty) and isinstance(err.value, TimeoutError)  # both idioms catch it
