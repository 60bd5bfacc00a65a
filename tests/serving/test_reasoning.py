"""Reasoning on /v1/chat/completions: the qwen3 and deepseek_r1 think-block parsers (whole, and streamed in any
split), their choice from the chat template, `--reasoning-parser`, the chat_template_kwargs request field, and
requests through the app with the openai client (the scripted engine and real Qwen3 tokenizer of
test_tool_calls.py): message.reasoning_content, reasoning_content deltas, tool calls after the reasoning, usage."""

from __future__ import annotations

import argparse
import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from gpuformers.serving.protocol import APIError, parse_chat  # noqa: E402
from gpuformers.serving.reasoning import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,  # noqa: E402
                                          detect_reasoning_parser, get_reasoning_parser)
from gpuformers.serving.tool_calls import HermesToolCallParser  # noqa: E402
from tests.serving.test_tool_calls import (CALL, TOOL, USER, calls_of, client_for,  # noqa: E402,F401,F811
                                           plain_template, qwen3_tokenizer)

THOUGHT = "<think>\nThe user asks about the weather. I should call get_weather.\n</think>\n\n"
ANSWER = THOUGHT + "Let me look it up."
REASONING = "The user asks about the weather. I should call get_weather."


# ---------------------------------------------------------------------------------------------- the parsers

@pytest.mark.parametrize("parser, text, reasoning, content", [
    (Qwen3ReasoningParser, ANSWER, REASONING, "Let me look it up."),
    (Qwen3ReasoningParser, "Plain answer, no thinking.\n", None, "Plain answer, no thinking.\n"),  # as generated
    (Qwen3ReasoningParser, "  I like <think> tags.", None, "  I like <think> tags."),  # not at the start: content
    (Qwen3ReasoningParser, "<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty block: no reasoning
    (Qwen3ReasoningParser, "<think>\nStill thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    (Qwen3ReasoningParser, THOUGHT, REASONING, None),  # the block and nothing after it
    (Qwen3ReasoningParser, "<thi", None, "<thi"),  # a tag prefix that never became the tag
    (Qwen3ReasoningParser, "", None, ""),
    (DeepSeekR1ReasoningParser, REASONING + "\n</think>\n\nSunny.", REASONING, "Sunny."),  # template opened it
    (DeepSeekR1ReasoningParser, ANSWER, REASONING, "Let me look it up."),  # a leading <think> is skipped
    (DeepSeekR1ReasoningParser, "Thinking until max_tokens", "Thinking until max_tokens", None),  # no end: reasoning
    (DeepSeekR1ReasoningParser, "a </thin b", "a </thin b", None),
])
def test_whole_answers(parser, text, reasoning, content):
    assert parser().split(text) == (reasoning, content)


TEXTS = [ANSWER, "Plain <think> answer </think> here", "<think>a</think", "  <think>\n x </ think> </think>  y ",
         "<think>\nThinking, cut off at </thi", THOUGHT + CALL + "\nDone.", "<thin", " ", REASONING + "</think>\n"]


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_in_any_split_equals_the_whole_answer(parser, text):
    whole = parser()
    whole_reasoning, whole_content = whole.split(text)
    generator = random.Random(0)
    for _ in range(200):
        cuts = sorted(generator.sample(range(1, len(text)), generator.randint(0, min(12, len(text) - 1))))
        streamed, reasoning, content = parser(), "", ""
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            new_reasoning, new_content = streamed.feed(piece)
            assert not new_reasoning or not content  # no reasoning once the content has started
            reasoning, content = reasoning + new_reasoning, content + new_content
            # never a character that is taken back: no half tag, no whitespace that a tag then drops
            assert (whole_reasoning or "").startswith(reasoning) and (whole_content or "").startswith(content)
        more_reasoning, more_content = streamed.finish()
        assert reasoning + more_reasoning == (whole_reasoning or "")
        assert content + more_content == (whole_content or "")
        assert streamed.reasoning_end == whole.reasoning_end


def test_reasoning_end_covers_the_think_block():
    parser = Qwen3ReasoningParser()
    parser.split(ANSWER)
    assert parser.reasoning_end == ANSWER.index("</think>") + len("</think>")
    cut = DeepSeekR1ReasoningParser()
    cut.split("no end tag")
    assert cut.reasoning_end == len("no end tag")  # an open block covers all of it
    plain = Qwen3ReasoningParser()
    plain.split("Hello")
    assert plain.reasoning_end is None


def test_tool_calls_come_from_the_content_only():
    drafted = "<think>\nMaybe " + CALL + "? No, ask first.\n</think>\n\nWhich city?"
    reasoning, content = Qwen3ReasoningParser().split(drafted)
    assert "get_weather" in reasoning and HermesToolCallParser.parse(content) == ("Which city?", [])
    reasoning, content = Qwen3ReasoningParser().split(THOUGHT + CALL)
    text, calls = HermesToolCallParser.parse(content)
    assert reasoning == REASONING and text == "" and calls_of(calls) == [("get_weather",
                                                                          {"city": "Paris", "unit": "°C"})]


def test_registry_detection_and_the_command_line(qwen3_tokenizer):
    from gpuformers.serving.cli import add_serve_arguments

    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="'r1' is not one of: deepseek_r1, gpt_oss, qwen3"):
        get_reasoning_parser("r1")
    assert detect_reasoning_parser(qwen3_tokenizer) == "qwen3"  # hybrid Qwen3: the model opens the block itself
    assert detect_reasoning_parser(opening_template(qwen3_tokenizer)) == "deepseek_r1"  # the prompt opens it
    assert detect_reasoning_parser(plain_template(qwen3_tokenizer)) is None
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["m", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    assert parser.parse_args(["m"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--reasoning-parser", "granite"])


def opening_template(tokenizer):
    """The tokenizer with a template whose generation prompt opens the think block (as Qwen3-Thinking-2507's)."""
    opening = plain_template(tokenizer)
    opening.chat_template = opening.chat_template.replace("<|im_start|>assistant\n{% endif %}",
                                                          "<|im_start|>assistant\n<think>\n{% endif %}")
    assert opening.chat_template != plain_template(tokenizer).chat_template
    return opening


# ---------------------------------------------------------------------------------------------- chat_template_kwargs

def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_template_kwargs_are_parsed():
    assert parse_chat(chat(chat_template_kwargs={"enable_thinking": False})).chat_template_kwargs == {
        "enable_thinking": False}
    assert parse_chat(chat()).chat_template_kwargs == {}
    assert parse_chat(chat(chat_template_kwargs=None)).chat_template_kwargs == {}


def test_reasoning_effort_reaches_the_template_as_openai_names_it():
    # OpenAI's top-level field (the openai client's reasoning_effort=); gpt-oss's template reads the same name.
    assert parse_chat(chat(reasoning_effort="high")).chat_template_kwargs == {"reasoning_effort": "high"}
    both = parse_chat(chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high", "x": 1}))
    assert both.chat_template_kwargs == {"reasoning_effort": "high", "x": 1}  # the explicit template variable wins
    with pytest.raises(APIError) as error:
        parse_chat(chat(reasoning_effort="extreme"))
    assert error.value.status == 400 and error.value.param == "reasoning_effort" and "'extreme'" in error.value.message


@pytest.mark.parametrize("value, param, words", [
    ([{"enable_thinking": False}], "chat_template_kwargs", "must be an object of template variables"),
    ("enable_thinking=false", "chat_template_kwargs", "got str"),
    ({"tools": []}, "chat_template_kwargs.tools", "may not set tools"),
    ({"add_generation_prompt": False, "tokenize": False, "enable_thinking": False},
     "chat_template_kwargs.add_generation_prompt", "may not set add_generation_prompt, tokenize"),
    ({"messages": []}, "chat_template_kwargs.messages", "leave it out"),
])
def test_bad_chat_template_kwargs(value, param, words):
    with pytest.raises(APIError) as error:
        parse_chat(chat(chat_template_kwargs=value))
    assert error.value.status == 400 and error.value.param == param and words in error.value.message


def test_enable_thinking_false_renders_as_transformers(qwen3_tokenizer):
    """The ids the engine gets equal transformers' apply_chat_template(..., enable_thinking=False)."""
    import transformers

    from tests.assets import qwen3_tokenizer_dir

    hf = transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    client, manager = client_for(qwen3_tokenizer, ["Hi there."])
    answer = client.chat.completions.create(model="m", messages=USER,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    client.chat.completions.create(model="m", messages=USER)
    expected = hf.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    default = hf.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)
    assert manager.prompts[0] == hf.decode(expected) and manager.prompts[1] == hf.decode(default)
    assert manager.prompts[0].endswith("<think>\n\n</think>\n\n") and manager.prompts[0] != manager.prompts[1]
    assert answer.choices[0].message.content == "Hi there." and answer.choices[0].message.reasoning_content is None
    assert answer.usage.prompt_tokens == len(expected)


def test_bad_chat_template_kwargs_through_the_app(qwen3_tokenizer):
    import openai

    client, manager = client_for(qwen3_tokenizer, ["hi"])
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=USER, extra_body={"chat_template_kwargs": {"tools": []}})
    assert error.value.status_code == 400 and error.value.body["param"] == "chat_template_kwargs.tools"
    assert error.value.body["type"] == "invalid_request_error" and not manager.prompts  # refused before the engine


# ---------------------------------------------------------------------------------------------- through the app

def think_tokens(tokenizer, answer: str) -> int:
    """The tokens of the answer's think block, "</think>" included."""
    ids = tokenizer.encode(answer, add_special_tokens=False)
    return ids.index(tokenizer.convert_tokens_to_ids("</think>")) + 1


def test_a_whole_answer_with_reasoning(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [ANSWER, "No thinking today.", "<think>\nCut off"])
    answer = client.chat.completions.create(model="m", messages=USER, n=3)
    first, second, third = (choice.message for choice in answer.choices)
    assert first.reasoning_content == REASONING and first.content == "Let me look it up."  # auto-detected: qwen3
    assert second.reasoning_content is None and second.content == "No thinking today."
    assert third.reasoning_content == "Cut off" and third.content is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == (
        think_tokens(qwen3_tokenizer, ANSWER) + len(qwen3_tokenizer.encode("<think>\nCut off")))


def test_a_streamed_answer_with_reasoning(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [ANSWER])
    chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    kinds = [("reasoning" if getattr(d, "reasoning_content", None) else "content") for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content") and len(set(kinds)) == 2  # reasoning first
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "Let me look it up."
    assert not any("<" in (getattr(d, "reasoning_content", None) or "") + (d.content or "") for d in deltas)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == think_tokens(qwen3_tokenizer, ANSWER)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_after_reasoning(qwen3_tokenizer, stream):
    client, _ = client_for(qwen3_tokenizer, [THOUGHT + CALL])
    if stream:
        chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[TOOL], stream=True))
        deltas = [chunk.choices[0].delta for chunk in chunks]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        answer = client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
        message, finish_reason = answer.choices[0].message, answer.choices[0].finish_reason
        reasoning, content, calls = message.reasoning_content, message.content or "", message.tool_calls
    assert reasoning == REASONING and content == "" and finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "°C"})]


def test_reasoning_parser_choice(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [ANSWER], reasoning_parser="none")  # off: the text as generated
    message = client.chat.completions.create(model="m", messages=USER).choices[0].message
    assert message.content == ANSWER and "reasoning_content" not in (message.model_extra or {})
    # deepseek_r1, chosen on the command line or detected from a template that opens the block
    for options, tokenizer in (({"reasoning_parser": "deepseek_r1"}, qwen3_tokenizer),
                               ({}, opening_template(qwen3_tokenizer))):
        client, _ = client_for(tokenizer, [REASONING + "\n</think>\n\nSunny.", "Thinking, then cut"], **options)
        answer = client.chat.completions.create(model="m", messages=USER, n=2)
        assert [(c.message.reasoning_content, c.message.content) for c in answer.choices] == [
            (REASONING, "Sunny."), ("Thinking, then cut", None)]
    # /v1/completions is never parsed
    client, _ = client_for(qwen3_tokenizer, [ANSWER])
    assert client.completions.create(model="m", prompt="hi", max_tokens=50).choices[0].text == ANSWER


# ---------------------------------------------------------------------------------------------- /v1/responses

def test_responses_put_the_reasoning_in_a_reasoning_item(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [ANSWER, "No thinking today.", "<think>\nCut off"])
    out = client.responses.create(model="m", input="Weather in Paris?")
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", REASONING)]
    assert message.type == "message" and out.output_text == "Let me look it up."
    assert out.usage.output_tokens_details.reasoning_tokens == think_tokens(qwen3_tokenizer, ANSWER)
    plain = client.responses.create(model="m", input="Weather in Paris?")
    assert [item.type for item in plain.output] == ["message"] and plain.output_text == "No thinking today."
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    thinking = client.responses.create(model="m", input="Weather in Paris?")  # only thought: no message
    assert [item.type for item in thinking.output] == ["reasoning"] and thinking.output_text == ""


@pytest.mark.parametrize("answer, items", [(ANSWER, ["reasoning", "message"]), ("No thinking today.", ["message"]),
                                           ("<think>\nCut off", ["reasoning"])])
def test_streamed_responses_with_reasoning(qwen3_tokenizer, answer, items):
    client, _ = client_for(qwen3_tokenizer, [answer])
    events = list(client.responses.create(model="m", input="Weather in Paris?", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in added] == [e.item.type for e in done] == items
    assert [e.output_index for e in added] == list(range(len(items)))
    # every delta lies between its item's added and done events, and belongs to it
    for added_event, done_event in zip(added, done):
        inside = events[events.index(added_event) + 1:events.index(done_event)]
        assert all(e.item_id == added_event.item.id for e in inside if hasattr(e, "item_id"))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == "response.completed"
    whole_reasoning = [item for item in final.output if item.type == "reasoning"]
    assert reasoning == (whole_reasoning[0].content[0].text if whole_reasoning else "")
    assert text == final.output_text and "<" not in reasoning + text


def test_responses_without_a_reasoning_parser_are_unchanged(qwen3_tokenizer):
    client, _ = client_for(qwen3_tokenizer, [ANSWER], reasoning_parser="none")
    events = list(client.responses.create(model="m", input="Weather in Paris?", stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[-1].response.output_text == ANSWER and [i.type for i in events[-1].response.output] == ["message"]
