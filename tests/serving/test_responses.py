"""OpenAI's Responses API (`POST /v1/responses`) on `gpuformers serve`, driven by the official openai client.

A response is a chat request under another shape: its greedy text and token counts must equal
/v1/chat/completions' for the same messages (and model.generate's), `instructions` must act as a first system
message, the streamed events must come in OpenAI's order and rebuild the same text, and what the server cannot do
(tools, stored state, structured output) must be refused with OpenAI error objects."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.conftest import API_KEY, MODEL_NAME, greedy_reference
from tests.serving.test_server import chat_ids, client, decode, wait_idle

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_a_response_request_is_a_chat_request():
    """Without a server: parse_response's messages, sampling and the fields its Response repeats."""
    from gpuformers.serving.protocol import parse_response

    request = parse_response({
        "model": "m", "instructions": "rules", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "input": [{"role": "developer", "content": "more rules"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                  {"type": "input_text", "text": "b"}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]}],
        "store": False, "user": "u", "truncation": "auto", "metadata": {"k": "v"}, "tool_choice": "none",
        "text": {"format": {"type": "text"}}, "stream": True, "stream_options": {"include_obfuscation": False}})
    assert request.chat and request.responses and request.n == 1 and request.stream
    assert request.messages == [{"role": "system", "content": "rules"}, {"role": "system", "content": "more rules"},
                                {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]
    assert (request.max_tokens, request.temperature, request.top_p) == (7, 0.5, 0.9)
    assert request.response_fields == {"instructions": "rules", "max_output_tokens": 7, "metadata": {"k": "v"},
                                       "tool_choice": "none", "parallel_tool_calls": True}
    assert parse_response({"model": "m", "input": "hi"}).messages == [{"role": "user", "content": "hi"}]


def chat_answer(server, messages, max_tokens: int):
    return client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                  temperature=0)


@pytest.mark.parametrize("as_parts", [False, True])
def test_greedy_response_equals_chat_completion(server, reference, as_parts):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = chat_answer(server, messages, 10)
    expected = decode(reference, greedy_reference(reference, chat_ids(reference, messages), 10))
    request_input = ([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                                      {"type": "input_text", "text": "colour."}]}]
                     if as_parts else "Name a colour.")
    out = client(server).responses.create(model=MODEL_NAME, input=request_input, max_output_tokens=10, temperature=0,
                                          store=False, metadata={"trace": "t1"}, truncation="disabled", user="u")
    assert out.output_text == chat.choices[0].message.content == expected
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL_NAME
    assert len(out.output) == 1 and out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.output[0].id.startswith("msg_") and out.output[0].content[0].type == "output_text"
    finished = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert out.status == out.output[0].status == finished
    assert out.usage.input_tokens == len(chat_ids(reference, messages)) == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.usage.input_tokens_details.cached_tokens == 0 and out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.metadata == {"trace": "t1"} and out.temperature == 0 and out.max_output_tokens == 10
    assert out.tools == [] and out.error is None


def test_instructions_are_a_first_system_message(server, reference):
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}]
    chat = chat_answer(server, messages, 8)
    out = client(server).responses.create(model=MODEL_NAME, instructions="Answer in French.", input="Name a colour.",
                                          max_output_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == len(chat_ids(reference, messages)) > len(chat_ids(reference, messages[1:]))
    assert out.instructions == "Answer in French."
    # A developer message in input is a system message too; an assistant turn replayed from an earlier output
    # (output_text parts) is part of the conversation.
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Name a colour."}]
    replayed = [{"role": "developer", "content": "Answer in French."}, history[0],
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}, history[2]]
    chat = chat_answer(server, [messages[0], *history], 8)
    out = client(server).responses.create(model=MODEL_NAME, input=replayed, max_output_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_come_in_order_and_rebuild_the_text(server):
    kwargs = dict(model=MODEL_NAME, input="Count to three.", max_output_tokens=12, temperature=0)
    whole = client(server).responses.create(**kwargs)
    events = list(client(server).responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == STREAM_ORDER + ["response.output_text.delta"] * len(deltas) + STREAM_END + [final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # (a front end behind the engine may send several steps' tokens in one delta: output_inbox.py)
    assert len(deltas) >= 1 and "".join(e.delta for e in deltas) == whole.output_text
    message_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (message_id, 0, 0) for e in deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-4].text == whole.output_text and events[-3].part.text == whole.output_text
    done = events[-1].response
    assert done.output_text == whole.output_text and done.status == whole.status
    assert done.output[0].id == message_id and done.usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper rebuilds the text from the events alone. (Its get_final_response() knows only
    # response.completed; OpenAI, and this server, end a cut answer with response.incomplete.)
    with client(server).responses.stream(**kwargs) as stream:
        helped = list(stream)
        assert [e.snapshot for e in helped if e.type == "response.output_text.delta"][-1] == whole.output_text
        if final == "response.completed":
            assert stream.get_final_response().output_text == whole.output_text
    # On the wire: each event names its type, as OpenAI's do.
    body = {**kwargs, "stream": True}
    raw = httpx.post(f"{server.url}/responses", json=body, timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.text.split("\n\n") if b]
    assert blocks[0].startswith("event: response.created\ndata: {") and blocks[-1].startswith(f"event: {final}\n")


def test_max_output_tokens_makes_an_incomplete_response(server):
    kwargs = dict(model=MODEL_NAME, input="Tell a long story.", max_output_tokens=5, temperature=0,
                  extra_body={"ignore_eos": True})
    out = client(server).responses.create(**kwargs)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 5 and out.output_text
    events = list(client(server).responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == out.output_text
    # Stopped by eos before the limit (the greedy answer is short enough), the response is complete.
    short = client(server).responses.create(model=MODEL_NAME, input="Tell a long story.", max_output_tokens=200,
                                            temperature=0)
    assert (short.status == "completed") == (short.usage.output_tokens < 200)
    assert short.incomplete_details is None or short.status == "incomplete"


BAD = [
    # (kwargs for responses.create besides model, the error's param)
    (dict(), "input"),
    (dict(input=5), "input"),
    (dict(input=[]), "input"),
    (dict(input=""), "input"),
    (dict(input=[{"role": "wizard", "content": "hi"}]), "input[0].role"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
     "input[0].content"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "4"}]), "input[0].type"),
    (dict(input="hi", instructions=["not", "text"]), "instructions"),
    (dict(input="hi", tools=[{"type": "function", "name": "add", "parameters": {}}]), "tools"),
    (dict(input="hi", tool_choice="required"), "tool_choice"),
    (dict(input="hi", previous_response_id="resp_123"), "previous_response_id"),
    (dict(input="hi", text={"format": {"type": "xml"}}), "text.format.type"),
    (dict(input="hi", reasoning={"effort": "low"}), "reasoning"),
    (dict(input="hi", background=True), "background"),
    (dict(input="hi", temperature=2.5), "temperature"),
    (dict(input="hi", top_p=0), "top_p"),
    (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
    (dict(input="hi", max_output_tokens=5000), "max_output_tokens"),
    (dict(input="x " * 3000), "input"),
    (dict(input="hi", extra_body={"n": 2}), "n"),
    (dict(input="hi", extra_body={"max_tokens": 5}), "max_tokens"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[param for _, param in BAD])
def test_bad_input_is_a_400_naming_the_field(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client(server).responses.create(model=MODEL_NAME, **kwargs)
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param and param.split("[")[0].split(".")[0] in body["message"]
    if param == "previous_response_id":
        assert "no state" in body["message"]
    if kwargs.get("input") == "x " * 3000:
        assert body["code"] == "context_length_exceeded" and "1024" in body["message"]


def test_unknown_model_and_the_api_key(servers):
    main, guarded = servers
    with pytest.raises(openai.NotFoundError):
        client(main).responses.create(model="nope", input="hi", max_output_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(guarded, api_key="wrong").responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    assert httpx.post(f"{guarded.url}/responses", json={"model": MODEL_NAME, "input": "hi"}).status_code == 401
    out = client(guarded, api_key=API_KEY).responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    assert out.usage.output_tokens <= 2


def test_a_stream_left_early_is_cancelled(server):
    before = server.metrics()
    stream = client(server).responses.create(model=MODEL_NAME, input="Go on forever.", max_output_tokens=900,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass
    stream.close()
    metrics = wait_idle(server)
    assert metrics["gpuformers_generation_tokens_total"] - before["gpuformers_generation_tokens_total"] < 900
    assert 'endpoint="/v1/responses",status="200"' in httpx.get(f"{server.base}/metrics").text
