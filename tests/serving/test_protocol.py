"""Request validation without a server: what parse_completion / parse_chat accept, and their error objects."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from gpuformers.serving.metrics import Histogram, Metrics  # noqa: E402
from gpuformers.serving.protocol import APIError, parse_chat, parse_completion  # noqa: E402


def test_completion_defaults_and_fields():
    request = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "n": 2,
                                "stop": "x", "seed": 3, "logprobs": 0, "echo": True, "user": "ignored"})
    assert (request.prompt_text, request.max_tokens, request.temperature, request.n) == ("hi", 5, 0.0, 2)
    assert request.stop == ["x"] and request.seed == 3 and request.logprobs and request.top_logprobs == 0
    assert request.echo and not request.chat
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt_ids == [1, 2]  # a batch of one
    assert parse_completion({"model": "m", "prompt": ["text"]}).prompt_text == "text"


def test_chat_messages_are_normalised():
    request = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}],
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 7})
    assert request.messages == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": ""}]
    assert request.include_usage and request.max_tokens == 7 and request.chat


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "prompt": "hi", "max_tokens": -2}, "max_tokens", "max_tokens=-2 must be >= 1"),
    ({"model": "m", "prompt": "hi", "temperature": 3}, "temperature", "temperature=3 must be in [0.0, 2.0]"),
    ({"model": "m", "prompt": "hi", "temperature": float("nan")}, "temperature", "finite number"),
    ({"model": "m", "prompt": "hi", "n": True}, "n", "must be an integer, got bool"),
    ({"model": "m", "prompt": "hi", "colour": "red"}, "colour", "unknown field(s): colour"),
    ({"prompt": "hi"}, "model", "model is required"),
])
def test_errors_name_the_field_and_the_value(body, param, words):
    with pytest.raises(APIError) as error:
        parse_completion(body)
    assert error.value.status == 400 and error.value.param == param and words in error.value.message
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_histogram_buckets_are_cumulative():
    histogram = Histogram("h", "help", (0.1, 1.0))
    for seconds in (0.05, 0.5, 5.0):
        histogram.observe(seconds)
    lines = histogram.lines()
    assert 'h_bucket{le="0.1"} 1' in lines and 'h_bucket{le="1.0"} 2' in lines and 'h_bucket{le="+Inf"} 3' in lines
    text = Metrics().render()
    assert "gpuformers_requests_in_flight 0" in text and text.endswith("\n")
