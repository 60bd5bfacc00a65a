"""ChoiceText, the incremental detokenizer of the server: stop strings cut the text and are never streamed, and
an incomplete UTF-8 character is held back until it is whole. A table tokenizer keeps these tests exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from gpuformers.engine.sequence import RequestStatus  # noqa: E402
from gpuformers.serving.server import ChoiceText  # noqa: E402


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
