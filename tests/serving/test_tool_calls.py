"""Tool calling on /v1/chat/completions: the Hermes parser (whole, and streamed in any split), the validation of
tools, tool_choice and tool messages, and whole requests through the app with the openai client. The app runs
in-process on a scripted engine that answers with the token ids of a given text (the real Qwen3 tokenizer and chat
template), so the model's answer can be made to be a tool call."""

from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from gpuformers.serving.protocol import APIError, parse_chat  # noqa: E402
from gpuformers.serving.tool_calls import (HermesToolCallParser, detect_tool_call_parser,  # noqa: E402
                                           get_tool_call_parser, template_renders_tools)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TWO_CALLS = ('I will look both up.\n\n' + CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
             '</tool_call>')


def calls_of(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


# ---------------------------------------------------------------------------------------------- the parser

def test_text_before_several_calls():
    content, calls = HermesToolCallParser.parse(TWO_CALLS)
    assert content == "I will look both up."  # the whitespace touching the calls is dropped
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {"tz": "CET"})]
    assert calls[0].arguments == '{"city": "Paris", "unit": "°C"}'  # a JSON string, non-ASCII kept
    assert all(call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("text, content, names", [
    ("Plain answer, no call.  \n", "Plain answer, no call.  \n", []),
    ("a <tooltip> b and a <tool", "a <tooltip> b and a <tool", []),  # tag prefixes that are not a tag
    ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),  # as vLLM: content
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (CALL + "\n\nDone.", "Done.", ["get_weather"]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "", ["f"]),  # the model stopped before the end tag
    ('<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),  # cut by max_tokens
])
def test_whole_answers(text, content, names):
    parsed_content, calls = HermesToolCallParser.parse(text)
    assert parsed_content == content and [call.name for call in calls] == names


@pytest.mark.parametrize("text", [TWO_CALLS, "a <tooltip> b and a <tool", "x <tool_call>{bad}</tool_call> y",
                                  CALL + "\n\nDone.", "Hi  \n there \n <tool_call>"])
def test_streamed_in_any_split_equals_the_whole_answer(text):
    whole_content, whole_calls = HermesToolCallParser.parse(text)
    generator = random.Random(0)
    for _ in range(300):
        cuts = sorted(generator.sample(range(1, len(text)), generator.randint(0, min(12, len(text) - 1))))
        parser, sent, calls = HermesToolCallParser(), "", []
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            content, new = parser.feed(piece)
            sent += content
            calls += new
            assert whole_content.startswith(sent)  # never a character that is taken back (no half "<tool_call")
        content, new = parser.finish()
        assert sent + content == whole_content and calls_of(calls + new) == calls_of(whole_calls)


def test_registry_and_detection(qwen3_tokenizer):
    assert get_tool_call_parser("hermes") is HermesToolCallParser
    with pytest.raises(ValueError, match="'nope' is not one of: hermes"):
        get_tool_call_parser("nope")
    assert detect_tool_call_parser(qwen3_tokenizer.chat_template) == "hermes"
    assert detect_tool_call_parser({"default": "{{ messages }}", "tool_use": "... <tool_call> ..."}) == "hermes"
    assert detect_tool_call_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_renders_tools(qwen3_tokenizer)
    assert not template_renders_tools(plain_template(qwen3_tokenizer))


# ---------------------------------------------------------------------------------------------- validation

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_tools_and_tool_choice_are_parsed():
    request = parse_chat(chat(tools=[TOOL]))
    assert request.tools == [TOOL] and request.tool_choice == "auto"
    assert parse_chat(chat(tools=[TOOL], tool_choice="none")).tool_choice == "none"
    assert parse_chat(chat(tool_choice="auto")).tool_choice == "none"  # nothing to call
    assert parse_chat(chat(tools=[])).tools is None
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    assert parse_chat(chat(tools=[strict])).tools == [strict]  # accepted, not enforced


def test_tool_messages_reach_the_template():
    request = parse_chat(chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "-3 C"}]}]))
    assert request.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert request.messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": {"name": "f"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "'custom' is not supported"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name",
     "must be str, got null"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters",
     "must be an object, got str"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "tools[0].function.args",
     "unknown field(s): args"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "letters, digits, underscores or dashes"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type", "JSON Schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["city"]}}}]},
     "tools[0].function.parameters.properties", "argument name -> schema, got list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"city": "str"}}}}]},
     "tools[0].function.parameters.properties.city", "must be a schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["town"]}}}]},
     "tools[0].function.parameters.required", "'town', which is not in its properties (city)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools to call"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "not one of the tools: 'get_weather'"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id", "the id of the call"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]", '"arguments": JSON string'),
])
def test_errors_name_the_field(fields, param, words):
    with pytest.raises(APIError) as error:
        parse_chat(chat(**fields))
    assert error.value.status == 400 and error.value.param == param and words in error.value.message


# ---------------------------------------------------------------------------------------------- through the app

@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def plain_template(tokenizer):
    """The same tokenizer with a chat template that shows no tools."""
    import copy

    plain = copy.copy(tokenizer)
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return plain


class ScriptedManager:
    """A ContinuousBatchingManager stand-in whose requests answer with the token ids of scripted texts (the i-th
    request added gets answers[i % len(answers)]), then eos; it keeps each request's prompt."""

    def __init__(self, tokenizer, answers: list[str]):
        self.tokenizer, self.answers, self.prompts = tokenizer, answers, []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=151936, max_position_embeddings=4096))
        self.generation_config = SimpleNamespace(eos_token_ids=[self.eos])
        self.block_manager = SimpleNamespace(num_blocks=64, block_size=64)
        self.scripts: dict[str, list[int]] = {}

    def start(self):
        pass

    def stop(self, timeout=None):
        pass

    def is_running(self):
        return True

    def script(self, answer: str) -> list[int]:
        """The answer's token ids as the engine would generate them (ending with eos)."""
        return self.tokenizer.encode(answer, add_special_tokens=False) + [self.eos]

    def add_request(self, prompt_ids, request_id, on_output=None, **sampling):
        answer = self.answers[len(self.prompts) % len(self.answers)]
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        self.scripts[request_id] = self.script(answer)
        if on_output is not None:  # as the engine does: every output handed over from the engine's thread
            threading.Thread(target=self._publish, args=(request_id, on_output), daemon=True).start()

    step_seconds = 0.0  # between two outputs (0: all at once, which a server may read as one: output_inbox.py)

    def _publish(self, request_id, on_output):
        for output in self.request_id_iter(request_id):
            on_output(output)
            if self.step_seconds:
                time.sleep(self.step_seconds)

    def request_id_iter(self, request_id):
        from gpuformers.engine.manager import GenerationOutput
        from gpuformers.engine.sequence import RequestStatus

        ids = self.scripts[request_id]
        for k in range(1, len(ids) + 1):  # one token per step, as the engine streams
            status = RequestStatus.FINISHED if k == len(ids) else RequestStatus.DECODING
            yield GenerationOutput(request_id, generated_tokens=ids[:k], logprobs=[-0.5] * k, status=status)

    def cancel_request(self, request_id):
        pass


def client_for(tokenizer, answers, **app_options):
    """(openai client, manager) talking to the app in-process."""
    import openai
    from fastapi.testclient import TestClient

    from gpuformers.serving.server import build_app

    manager = ScriptedManager(tokenizer, answers)
    http = TestClient(build_app(manager, tokenizer, "m", **app_options), base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), manager


USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_whole_answer_with_tool_calls(qwen3_tokenizer):
    client, manager = client_for(qwen3_tokenizer, [TWO_CALLS, "It is sunny."])
    answer = client.chat.completions.create(model="m", messages=USER, tools=[TOOL], n=2)
    message = answer.choices[0].message
    assert message.content == "I will look both up." and answer.choices[0].finish_reason == "tool_calls"
    assert [call.function.name for call in message.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "°C"}
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    second = answer.choices[1]  # each choice is parsed on its own
    assert second.message.content == "It is sunny." and not second.message.tool_calls
    assert second.finish_reason == "stop"
    assert "<tools>" in manager.prompts[0] and '"name": "get_weather"' in manager.prompts[0]  # the model saw them


def test_a_streamed_answer_with_tool_calls(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [TWO_CALLS])
    chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[TOOL], stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(d.content or "" for d in deltas) == "I will look both up."
    assert not any("<" in (d.content or "") for d in deltas)  # no piece of a tag ever went out as text
    streamed = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [(c.index, c.function.name) for c in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert streamed[0].id.startswith("call_") and streamed[0].type == "function"
    assert json.loads(streamed[1].function.arguments) == {"tz": "CET"}  # each call whole, in one delta
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The openai client's stream helper accumulates the deltas (it parses arguments of strict tools only)
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    with client.chat.completions.stream(model="m", messages=USER, tools=[strict]) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.parsed_arguments == {"city": "Paris", "unit": "°C"}


def test_tool_choice_none_and_a_conversation_with_tool_results(qwen3_tokenizer):
    client, manager = client_for(qwen3_tokenizer, [CALL])
    answer = client.chat.completions.create(model="m", messages=USER, tools=[TOOL], tool_choice="none")
    assert answer.choices[0].message.content == CALL and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop" and "<tools>" in manager.prompts[0]  # shown, not parsed
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    client.chat.completions.create(model="m", messages=history, tools=[TOOL])
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in manager.prompts[1]
            and "<tool_response>\n21 C\n</tool_response>" in manager.prompts[1])


def test_tools_on_a_model_that_cannot_take_them(qwen3_tokenizer):
    import openai

    plain = plain_template(qwen3_tokenizer)
    client, _ = client_for(plain, ["hi"])
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser NAME"):
        client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
    assert client.chat.completions.create(model="m", messages=USER, tools=[TOOL], tool_choice="none").choices
    client, _ = client_for(plain, ["hi"], tool_call_parser="hermes")
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
