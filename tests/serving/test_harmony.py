"""gpt-oss's harmony format on /v1/chat/completions: the gpt_oss reasoning parser (analysis -> reasoning_content,
final -> content; whole, and streamed in any split of characters or of tokens), the openai tool-call parser (the
commentary channel's calls to functions.NAME), their choice from the chat template and on the command line, and
requests through the app with the openai client, whole and streamed. The app runs in-process on the scripted engine
of test_tool_calls.py, with a small byte-level tokenizer built here that has harmony's special tokens and a chat
template that writes "<|channel|>"."""

from __future__ import annotations

import argparse
import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from gpuformers.serving.detokenizer import IncrementalDetokenizer  # noqa: E402
from gpuformers.serving.harmony import HarmonyReasoningParser, HarmonyToolCallParser  # noqa: E402
from gpuformers.serving.reasoning import detect_reasoning_parser, get_reasoning_parser  # noqa: E402
from gpuformers.serving.tool_calls import detect_tool_call_parser, get_tool_call_parser  # noqa: E402
from tests.fixtures.tokenizers import byte_level_bpe  # noqa: E402
from tests.serving.test_tool_calls import TOOL, USER, ScriptedManager, calls_of  # noqa: E402

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|endoftext|>"]
THINKING = "The user asks about the weather in Paris. I should answer."
ANALYSIS = f"<|channel|>analysis<|message|>{THINKING}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 21 °C."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "unit": "°C"}')
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me look it up."
ANSWER = ANALYSIS + FINAL + "<|return|>"


# ---------------------------------------------------------------------------------------------- the parser

@pytest.mark.parametrize("text, reasoning, content", [
    (ANALYSIS + FINAL + "<|return|>", THINKING, "It is sunny in Paris, 21 °C."),
    (ANALYSIS + FINAL, THINKING, "It is sunny in Paris, 21 °C."),  # the engine kept <|return|> out of the text
    (ANALYSIS + FINAL + "<|return|><|endoftext|>", THINKING, "It is sunny in Paris, 21 °C."),
    ("<|channel|>final<|message|>Hi!<|return|>", None, "Hi!"),  # no analysis: no reasoning
    ("<|channel|>analysis<|message|>Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    (ANALYSIS + "<|start|>assistant<|chan", THINKING, None),  # cut inside the next header: nothing of it
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL, THINKING + "\nMore.",
     "It is sunny in Paris, 21 °C."),  # two analysis messages, joined by a newline
    (ANALYSIS + PREAMBLE + "<|end|>" + FINAL, THINKING, "Let me look it up.\nIt is sunny in Paris, 21 °C."),
    ("<|channel|>final<|message|>a <|en", None, "a <|en"),  # a terminator prefix that never became one
    ("Plain text, <|no header|> here", None, "Plain text, <|no header|> here"),  # not harmony: as it is
    ("<|chan", None, "<|chan"),
    ("", None, ""),
])
def test_whole_answers(text, reasoning, content):
    assert HarmonyReasoningParser().split(text) == (reasoning, content)


def test_tool_calls_come_out_of_the_commentary_channel():
    split = lambda text: HarmonyReasoningParser().split(text)  # noqa: E731
    for text in (ANALYSIS + CALL + "<|call|>", ANALYSIS + CALL):  # with and without the <|call|> eos token
        reasoning, content = split(text)
        assert reasoning == THINKING and "<|channel|>" not in content
        text, calls = HarmonyToolCallParser.parse(content)
        assert text == "" and calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    # the recipient before the channel (another placement harmony allows), after a preamble
    other = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}"
    text, calls = HarmonyToolCallParser.parse(split(ANALYSIS + PREAMBLE + "<|end|>" + other)[1])
    assert text == "Let me look it up." and calls_of(calls) == [("get_time", {})]
    # arguments cut by max_tokens: no call, the text stays content; a built-in tool's call is reasoning
    text, calls = HarmonyToolCallParser.parse(split(CALL[:-12])[1])
    assert calls == [] and '{"city": "Paris"' in text
    reasoning, content = split('<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>')
    assert reasoning == '{"q": "x"}' and content is None


TEXTS = [ANALYSIS + FINAL + "<|return|>", ANALYSIS + PREAMBLE + "<|end|>" + FINAL, ANALYSIS + CALL + "<|call|>",
         "<|channel|>final<|message|>a <|en", "Plain <|end|> text", "<|channel|>analysis<|message|>cut <|ret",
         ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL, " ", "<|chan"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_in_any_split_equals_the_whole_answer(text):
    whole = split_whole(text)
    generator = random.Random(0)
    for _ in range(200):
        cuts = sorted(generator.sample(range(1, len(text)), generator.randint(0, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(pieces, whole) == (whole.split_reasoning, whole.split_content, whole.reasoning_end)


def stream(pieces, whole: HarmonyReasoningParser) -> tuple[str, str, int | None]:
    """Feed the pieces to a parser: (reasoning, content, reasoning_end); check that nothing it gives out is taken
    back (no part of a marker) against `whole`, a parser that split the whole answer."""
    parser, reasoning, content = HarmonyReasoningParser(), "", ""
    for piece in pieces:
        new_reasoning, new_content = parser.feed(piece)
        reasoning, content = reasoning + new_reasoning, content + new_content
        assert whole.split_reasoning.startswith(reasoning) and whole.split_content.startswith(content)
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content, parser.reasoning_end


def split_whole(text: str) -> HarmonyReasoningParser:
    """A parser that split the whole text; its reasoning and content ("" for None) kept on it."""
    whole = HarmonyReasoningParser()
    reasoning, content = whole.split(text)
    whole.split_reasoning, whole.split_content = reasoning or "", content or ""
    return whole


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """A byte-level BPE tokenizer trained on a few harmony-like sentences, with harmony's special tokens and a
    chat template that writes the channels and the tools, as gpt-oss's does."""
    from gpuformers.tokenizer import PreTrainedTokenizerFast

    corpus = [THINKING, "It is sunny in Paris.", "Let me look it up.", 'commentary analysis final functions json',
              '{"city": "Paris", "unit": "C"}'] * 4
    backend = byte_level_bpe(corpus, vocab_size=400)
    template = (
        "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n{% for t in tools %}"
        "type {{ t.function.name }} = (_: any) => any;\n{% endfor %}}<|end|>{% endif %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
        "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    return PreTrainedTokenizerFast(backend, eos_token="<|return|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL, chat_template=template)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_streamed_token_by_token_equals_the_whole_answer(harmony_tokenizer, text):
    """As the server streams: token ids decoded incrementally with the special tokens kept, in random groups."""
    ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    assert harmony_tokenizer.convert_tokens_to_ids("<|channel|>") in ids  # the markers are single special tokens
    assert harmony_tokenizer.decode(ids, skip_special_tokens=False) == text
    whole = split_whole(text)
    generator = random.Random(1)
    for _ in range(50):
        detokenizer, pieces, k = IncrementalDetokenizer(harmony_tokenizer, skip_special_tokens=False), [], 0
        while k < len(ids):
            step = generator.randint(1, 4)
            pieces.append("".join(detokenizer.add(t) for t in ids[k:k + step]))
            k += step
        pieces.append(detokenizer.flush())
        assert stream(pieces, whole) == (whole.split_reasoning, whole.split_content, whole.reasoning_end)


def test_reasoning_end_covers_the_analysis_messages():
    assert split_whole(ANSWER).reasoning_end == len(ANALYSIS)  # through its <|end|>
    assert split_whole(ANALYSIS + CALL + "<|call|>").reasoning_end == len(ANALYSIS)  # a call is not reasoning
    assert split_whole("<|channel|>analysis<|message|>cut").reasoning_end == len("<|channel|>analysis<|message|>cut")
    assert split_whole("<|channel|>final<|message|>Hi").reasoning_end is None


def test_registry_detection_and_the_command_line(harmony_tokenizer):
    from gpuformers.serving.cli import add_serve_arguments

    assert get_reasoning_parser("gpt_oss") is HarmonyReasoningParser
    assert get_tool_call_parser("openai") is HarmonyToolCallParser
    assert HarmonyReasoningParser.keeps_special_tokens and not get_reasoning_parser("qwen3").keeps_special_tokens
    assert detect_reasoning_parser(harmony_tokenizer) == "gpt_oss"
    assert detect_tool_call_parser(harmony_tokenizer.chat_template) == "openai"
    assert detect_tool_call_parser("<|im_start|>{{ messages }} <tool_call>") == "hermes"  # unchanged for Qwen
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["m", "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("gpt_oss", "openai")


# ---------------------------------------------------------------------------------------------- through the app

class HarmonyManager(ScriptedManager):
    """The scripted engine with gpt-oss's eos tokens (generation_config.json: <|return|>, <|endoftext|>,
    <|call|>); each answer is scripted with its own terminator, which the engine keeps as its last token."""

    def __init__(self, tokenizer, answers):
        super().__init__(tokenizer, answers)
        self.generation_config.eos_token_ids = tokenizer.convert_tokens_to_ids(["<|return|>", "<|endoftext|>",
                                                                                "<|call|>"])

    def script(self, answer: str) -> list[int]:
        return self.tokenizer.encode(answer, add_special_tokens=False)  # (its terminator is in the answer)


def client_for(tokenizer, answers, **app_options):
    import openai
    from fastapi.testclient import TestClient

    from gpuformers.serving.server import build_app

    manager = HarmonyManager(tokenizer, answers)
    http = TestClient(build_app(manager, tokenizer, "m", **app_options), base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), manager



def test_a_whole_answer(harmony_tokenizer):
    client, manager = client_for(harmony_tokenizer, [ANSWER, "<|channel|>analysis<|message|>Cut off"])
    answer = client.chat.completions.create(model="m", messages=USER, n=2)
    first, second = answer.choices
    assert first.message.reasoning_content == THINKING and first.message.content == "It is sunny in Paris, 21 °C."
    assert first.finish_reason == "stop"  # <|return|> is an eos token
    assert second.message.reasoning_content == "Cut off" and second.message.content is None
    assert second.finish_reason == "length"
    ids = harmony_tokenizer.encode(ANALYSIS, add_special_tokens=False)
    cut = harmony_tokenizer.encode("<|channel|>analysis<|message|>Cut off", add_special_tokens=False)
    assert answer.usage.completion_tokens_details.reasoning_tokens == len(ids) + len(cut)
    assert manager.prompts[0].endswith("<|start|>assistant")
    # without the parser, the text as generated: special tokens skipped, the channels glued together
    client, _ = client_for(harmony_tokenizer, [ANSWER], reasoning_parser="none")
    assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == (
        "analysis" + THINKING + "assistantfinalIt is sunny in Paris, 21 °C.")


def test_a_streamed_answer(harmony_tokenizer, monkeypatch):
    # one output per 5 ms engine step: outputs published at once may reach the handler as one (output_inbox.py)
    monkeypatch.setattr(HarmonyManager, "step_seconds", 0.005)
    client, _ = client_for(harmony_tokenizer, [ANSWER])
    chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    reasonings = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    contents = [d.content or "" for d in deltas]
    assert "".join(reasonings) == THINKING and "".join(contents) == "It is sunny in Paris, 21 °C."
    assert sum(bool(r) for r in reasonings) > 1 and sum(bool(c) for c in contents) > 1  # it did stream
    assert max(i for i, r in enumerate(reasonings) if r) < min(i for i, c in enumerate(contents) if c)
    assert not any("<|" in r + c for r, c in zip(reasonings, contents))  # no piece of a marker went out
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(
        harmony_tokenizer.encode(ANALYSIS, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call(harmony_tokenizer, stream):
    client, manager = client_for(harmony_tokenizer, [ANALYSIS + PREAMBLE + "<|end|>" + CALL + "<|call|>"])
    if stream:
        chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[TOOL], stream=True))
        deltas = [chunk.choices[0].delta for chunk in chunks]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        assert not any("<|" in (d.content or "") for d in deltas)
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        answer = client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
        message, finish_reason = answer.choices[0].message, answer.choices[0].finish_reason
        reasoning, content, calls = message.reasoning_content, message.content, message.tool_calls
    assert reasoning == THINKING and content == "Let me look it up." and finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "°C"})]
    assert "type get_weather" in manager.prompts[0]  # the template showed the model its tools


@pytest.mark.parametrize("stream", [False, True])
def test_responses_put_the_analysis_in_a_reasoning_item(harmony_tokenizer, stream):
    client, _ = client_for(harmony_tokenizer, [ANSWER])
    if stream:
        events = list(client.responses.create(model="m", input="Weather in Paris?", stream=True))
        deltas = [e.delta for e in events if e.type in ("response.reasoning_text.delta", "response.output_text.delta")]
        assert deltas and not any("<|" in delta for delta in deltas)
        out = events[-1].response
    else:
        out = client.responses.create(model="m", input="Weather in Paris?")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == THINKING and out.output_text == "It is sunny in Paris, 21 °C."
