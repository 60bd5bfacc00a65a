"""The grammar a chat answer is held to (serving/answer_grammar.py): tool_choice "required" and a named function
held to the model's own call format (Hermes, the Qwen3 template's), and structured outputs that leave a thinking
model's think block free. Checked on the real Qwen3 tokenizer: what the grammar the engine receives accepts and
refuses, token by token, and the answers the server makes of such outputs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from tests.serving.test_tool_calls import TOOL, ScriptedManager, qwen3_tokenizer  # noqa: E402,F401

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
THINKING = {"enable_thinking": True}


class RecordingManager(ScriptedManager):
    """A scripted engine that also keeps each request's sampling arguments (the grammar among them)."""

    def __init__(self, tokenizer, answers):
        super().__init__(tokenizer, answers)
        self.sampling: list[dict] = []

    def add_request(self, prompt_ids, request_id, on_output=None, **sampling):
        self.sampling.append(sampling)
        super().add_request(prompt_ids, request_id, on_output=on_output, **sampling)


def serve(tokenizer, answers):
    from fastapi.testclient import TestClient

    from gpuformers.serving.server import build_app

    manager = RecordingManager(tokenizer, answers)
    return TestClient(build_app(manager, tokenizer, "m")), manager


def accepts(grammar, tokenizer, eos: int, text: str) -> bool:
    """Whether the grammar lets the engine write `text` and then end."""
    matcher = grammar.matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False) + [eos])


def ask(http, **fields) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 64, **fields}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_required_holds_the_answer_to_one_or_more_calls_in_the_models_format(qwen3_tokenizer):
    http, manager = serve(qwen3_tokenizer, [CALL])
    answer = ask(http, tools=[TOOL, TIME], tool_choice="required",
                 chat_template_kwargs={"enable_thinking": False})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    grammar = manager.sampling[0]["structured_output"]
    ok = lambda text: accepts(grammar, qwen3_tokenizer, manager.eos, text)  # noqa: E731
    assert ok(CALL) and ok(TIME_CALL) and ok(CALL + "\n" + TIME_CALL)
    assert not ok("It is sunny in Paris.")  # an answer without a call
    assert not ok("Sure. " + CALL)  # text before the call
    assert not ok(CALL.replace('"Paris"', "3"))  # arguments its schema refuses
    assert not ok(CALL.replace("get_weather", "get_wether"))  # a function that is not a tool
    assert not ok(TIME_CALL.replace("utc", "pst"))


def test_a_named_function_is_exactly_one_call_of_it(qwen3_tokenizer):
    http, manager = serve(qwen3_tokenizer, [TIME_CALL])
    answer = ask(http, tools=[TOOL, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 chat_template_kwargs={"enable_thinking": False})
    call = answer["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"]) == {"zone": "utc"}
    grammar = manager.sampling[0]["structured_output"]
    ok = lambda text: accepts(grammar, qwen3_tokenizer, manager.eos, text)  # noqa: E731
    assert ok(TIME_CALL) and not ok(CALL) and not ok(TIME_CALL + "\n" + TIME_CALL)


def test_a_forced_call_comes_after_the_think_block(qwen3_tokenizer):
    thought = "<think>\nThe user wants the weather.\n</think>\n\n"
    http, manager = serve(qwen3_tokenizer, [thought + CALL])
    answer = ask(http, tools=[TOOL], tool_choice="required", chat_template_kwargs=THINKING)
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    grammar = manager.sampling[0]["structured_output"]
    ok = lambda text: accepts(grammar, qwen3_tokenizer, manager.eos, text)  # noqa: E731
    assert ok(thought + CALL) and ok(CALL) and not ok(thought + "It is sunny.")


def test_a_structured_output_leaves_the_think_block_free(qwen3_tokenizer):
    thought = "<think>\nA JSON object with the city {maybe}.\n</think>\n\n"
    http, manager = serve(qwen3_tokenizer, [thought + '{"city": "Paris"}'])
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    answer = ask(http, response_format=response_format, chat_template_kwargs=THINKING)
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "A JSON object with the city {maybe}."
    assert json.loads(message["content"]) == {"city": "Paris"}
    grammar = manager.sampling[0]["structured_output"]
    ok = lambda text: accepts(grammar, qwen3_tokenizer, manager.eos, text)  # noqa: E731
    assert ok(thought + '{"city": "Paris"}') and ok('{"city": "Paris"}')
    assert not ok(thought + '{"city": 3}') and not ok(thought + "Paris") and not ok('{"city":"Paris"}')
    # thinking off: the template closed the block in the prompt, and the plain schema holds from the first token
    ask(http, response_format=response_format, chat_template_kwargs={"enable_thinking": False})
    plain = manager.sampling[1]["structured_output"]
    assert plain.name == "json_schema 'city'"
    assert accepts(plain, qwen3_tokenizer, manager.eos, '{"city": "Paris"}')
    assert not accepts(plain, qwen3_tokenizer, manager.eos, thought + '{"city": "Paris"}')


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "drop one of them"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}], "tool_choice": "required"},
     "tool_choice", 'Unsupported type "strng"'),  # a schema the grammar cannot follow: a 400, not a 500
])
def test_bad_combinations_are_400s(qwen3_tokenizer, fields, param, words):
    http, manager = serve(qwen3_tokenizer, [CALL])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **fields}
    reply = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert words in reply.json()["error"]["message"] and not manager.sampling
