"""Tool calls out of a model's text: the parsers that find the calls a chat model writes, whole or while it streams,
keyed by the name `gpuformers serve --tool-call-parser NAME` takes, and the checks the server makes on a model's chat
template (which parser it implies, whether it renders tools at all).

A parser is fed the answer's text piece by piece and gives back the content to send (text outside the calls) and
each call once it is complete. Text that may still turn into a call's opening tag is held back, so a client never
sees half a "<tool_call>". Whitespace touching a call is dropped ("Let me look.\\n\\n<tool_call>..." -> content
"Let me look."), and a call whose body does not parse is given back as plain content, tags included, as vLLM does.
Feeding the text in one piece or in any split gives the same content and calls.

Offers: ToolCall, ToolCallParser, HermesToolCallParser, TOOL_CALL_PARSERS, register_tool_call_parser,
get_tool_call_parser, detect_tool_call_parser, template_renders_tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gpuformers.engine.structured import json_schema_ebnf


@dataclass
class ToolCall:
    """One function call the model made; `arguments` is a JSON string, as OpenAI's API sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict:
        """The call as a message's `tool_calls` entry (a streamed delta adds its `index`)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """The base of the parsers for formats that wrap each call in an opening and a closing tag. A subclass gives the
    tags and `parse_call`, which turns a call's body into a ToolCall (None when the body is malformed).

    One parser follows one answer: `feed(text)` for each new piece, `finish()` at its end; each returns
    (content, new calls). `parse(text)` does both for a whole answer."""

    name = ""
    start_tag = ""
    end_tag = ""

    def __init__(self):
        self.buffer = ""  # text fed but not given out yet: a possible tag start, trailing whitespace, a call's body
        self.in_call = False  # the buffer holds the body of an opened call
        self.gap = ""  # the whitespace dropped before the open call: given back if the call is malformed
        self.after_call = False  # whitespace right after a call is dropped
        self.calls: list[ToolCall] = []  # every call so far; a call's position here is its index in deltas

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        """Whether a chat template teaches the model this format (it shows the opening tag)."""
        return cls.start_tag in chat_template

    def parse_call(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    @classmethod
    def forced_calls(cls, tools: list[dict], name: str | None = None) -> dict | None:
        """The structural-tag format (engine/structured.py) of an answer that is one or more calls of `tools` in
        this format, each call's arguments held to its function's parameters schema; with `name`, exactly one call
        of that function (tool_choice "required" / a named function). None: not done for this format."""
        return None

    @classmethod
    def parse(cls, text: str) -> tuple[str, list[ToolCall]]:
        parser = cls()
        content, calls = parser.feed(text)
        rest, more = parser.finish()
        return content + rest, calls + more

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content: list[str] = []
        new_calls: list[ToolCall] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.end_tag)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(self.end_tag):]
                self._close(body, self.end_tag, content, new_calls)
                continue
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                self.after_call = not self.buffer
            start = self.buffer.find(self.start_tag)
            if start < 0:
                # Hold back the longest tail that could still become the opening tag, and the whitespace before
                # it (dropped if a call follows).
                keep = next((k for k in range(min(len(self.start_tag) - 1, len(self.buffer)), 0, -1)
                             if self.start_tag.startswith(self.buffer[-k:])), 0)
                ready = self.buffer[:len(self.buffer) - keep].rstrip()
                content.append(ready)
                self.buffer = self.buffer[len(ready):]
                break
            before = self.buffer[:start]
            content.append(before.rstrip())
            self.gap = before[len(before.rstrip()):]
            self.buffer, self.in_call = self.buffer[start + len(self.start_tag):], True
        return "".join(content), new_calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: the held-back text, and a last call left open (a model may stop right after the
        body, without the closing tag)."""
        content: list[str] = []
        new_calls: list[ToolCall] = []
        if self.in_call:
            self._close(self.buffer, "", content, new_calls)
        elif not self.after_call:
            content.append(self.buffer)
        self.buffer = ""
        return "".join(content), new_calls

    def _close(self, body: str, end_tag: str, content: list[str], new_calls: list[ToolCall]) -> None:
        call = self.parse_call(body)
        if call is None:
            content.append(self.gap + self.start_tag + body + end_tag)
        else:
            self.calls.append(call)
            new_calls.append(call)
        self.in_call, self.gap, self.after_call = False, "", call is not None


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_tool_call_parser(cls: type[ToolCallParser]) -> type[ToolCallParser]:
    TOOL_CALL_PARSERS[cls.name] = cls
    return cls


@register_tool_call_parser
class HermesToolCallParser(ToolCallParser):
    """The Hermes format of Qwen2.5, Qwen3 and NousResearch Hermes models, one block per call:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
    """

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    @classmethod
    def forced_calls(cls, tools: list[dict], name: str | None = None) -> dict | None:
        # One tag per function, its name fixed and its arguments a JSON object its schema allows; calls follow each
        # other as the template writes them (a newline between), at least one, and just one for a named function
        tags = [{"type": "tag", "begin": f'{cls.start_tag}\n{{"name": {json.dumps(f["name"], ensure_ascii=False)}, '
                                         f'"arguments": ',
                 # the arguments as a json_schema structured output holds JSON (compact, the schema strict)
                 "content": {"type": "grammar", "grammar": json_schema_ebnf(f.get("parameters") or {"type": "object"},
                                                                         strict=bool(f.get("parameters")))},
                 "end": f"}}\n{cls.end_tag}"}
                for f in (tool["function"] for tool in tools) if name is None or f["name"] == name]
        return {"type": "triggered_tags", "triggers": [cls.start_tag], "tags": tags, "at_least_one": True,
                "stop_after_first": name is not None}

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str):  # OpenAI's arguments are a JSON object (as a string)
            return None
        return ToolCall(call["name"], arguments)


def load_parser_modules() -> None:
    """The parsers defined in modules of their own register (in this registry and reasoning.py's) on import:
    harmony.py's (gpt-oss), which builds on this module's base class and so cannot be imported by it at the top."""
    from gpuformers.serving import harmony  # noqa: F401


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    load_parser_modules()
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not one of: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[name]


def detect_tool_call_parser(chat_template: str | dict | None) -> str | None:
    """The name of the parser whose format the chat template shows the model (None: no known format). A tokenizer
    with several named templates is searched in all of them."""
    load_parser_modules()
    if not chat_template:
        return None
    text = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template
    return next((name for name, cls in TOOL_CALL_PARSERS.items() if cls.detect(text)), None)


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts a list of tools into the prompt: a conversation rendered with a
    probe tool differs from the same one without it. A template that fails on the probe counts as rendering tools
    (a real request then gets the template's own error)."""
    probe = [{"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=probe, add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error: let the request's own render report it
        return True
    return "probe_tool_7f3a" in with_tools and with_tools != without
