"""OpenAI's harmony format (gpt-oss) out of a model's text: the reasoning parser that splits a harmony answer into
its reasoning (the analysis channel) and its content (the final channel), and the tool-call parser for the function
calls it makes (the commentary channel addressed `to=functions.NAME`), keyed by the names `gpuformers serve
--reasoning-parser gpt_oss` and `--tool-call-parser openai` take (vLLM's name for the latter).

A harmony answer is a list of messages, each a header, `<|message|>`, a body and a terminator. The chat template's
generation prompt ends with `<|start|>assistant`, so the first header starts at `<|channel|>`:

    <|channel|>analysis<|message|>The user asks ...<|end|>                       -> reasoning
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>           -> content
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>                                                      -> a tool call (one line)

The markers are special tokens, so the parser needs the answer decoded with them kept: its `keeps_special_tokens`
tells job.py to decode so. A channel's body is given out as it streams; a tail that could still become a
terminator (`<|end|>`, `<|return|>`, `<|call|>`, ...) is held back and headers are never given out, so a client
never sees a marker. Feeding the text in one piece or in any split gives the same reasoning and content.

- analysis (and a message to a built-in tool, `to=browser.search`, `to=python`) -> reasoning
- final, commentary without a recipient (a preamble before a call), a message without a channel -> content
- a message to `functions.NAME` -> content as `<|start|>assistant to=functions.NAME<|message|>ARGS<|call|>` (one
  harmony form of the call), which the "openai" tool-call parser turns into a ToolCall on a request with tools;
  on one without tools (or with tool_choice "none") that text stays in the content.
- text that does not start with a header (a template that opened the final channel itself) -> content as it is.

`<|return|>` and `<|call|>` end the answer (gpt-oss's generation_config.json lists them as eos tokens), but the
parser does not rely on seeing them: the engine may stop without the token in the text, and an answer cut by
max_tokens inside a body ends that body. Consecutive messages that land in the same field are joined by a newline.

Offers: HarmonyReasoningParser, HarmonyToolCallParser.
"""

from __future__ import annotations

import json
import re

from gpuformers.serving.reasoning import ReasoningParser, register_reasoning_parser
from gpuformers.serving.tool_calls import ToolCall, ToolCallParser, register_tool_call_parser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
# What ends a message's body: <|end|> (more messages follow), <|return|> / <|call|> (the answer's end, when the
# engine keeps its eos token in the text), <|start|> (a model that skipped <|end|>), <|endoftext|> (gpt-oss's pad).
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>", START, "<|endoftext|>")
CALL_START = "<|start|>assistant to=functions."  # how a function call is handed to HarmonyToolCallParser
CALL_END = "<|call|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@register_reasoning_parser
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony answers: the analysis channel is the reasoning, the final channel the content, function
    calls go to the content for the "openai" tool-call parser (module docstring).

    `reasoning_end` is the number of characters up to the end of the last reasoning message, terminator included
    (None: no reasoning message), for counting reasoning tokens."""

    name = "gpt_oss"
    keeps_special_tokens = True

    @classmethod
    def block_ahead(cls, prompt_tail: str) -> str | None:
        return "maybe"  # the analysis channel may come first, whatever the prompt

    @classmethod
    def grammar_around(cls, answer: dict, block: str) -> dict | None:
        """Not done: the final channel's message would need its harmony header kept free before the grammar."""
        return None

    def __init__(self):
        super().__init__()
        # "opening": the answer's start, before it shows whether it opens with a header; "header": inside a
        # message's header (up to <|message|>); "body": inside its body, which goes to `self.field`
        self.state = "opening"
        self.field = "content"  # "reasoning", "content" or "call"
        self.call_name = ""  # the function a "call" body is addressed to
        self.written = {"reasoning": False, "content": False}  # a field has text: the next message is joined by "\n"
        self.body_started = False  # the current body gave out text already (its separator went with it)

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        self.fed += len(text)
        out = {"reasoning": [], "content": []}
        if self.state == "opening":
            stripped = self.buffer.lstrip()
            if any(marker.startswith(stripped) for marker in (CHANNEL, START)):  # a header may still come: wait
                return "", ""
            if stripped.startswith((CHANNEL, START)):
                self.state = "header"
            else:  # no header: the text is the content as it is
                self._open_body("content", "")
        while True:
            if self.state == "header":
                end = self.buffer.find(MESSAGE)
                if end < 0:
                    break
                header, self.buffer = self.buffer[:end], self.buffer[end + len(MESSAGE):]
                self._open_body(*self._route(header))
                continue
            ends = [(i, marker) for marker in TERMINATORS if (i := self.buffer.find(marker)) >= 0]
            if not ends:
                if self.field != "call":  # a call is given out whole, once it ends
                    # Hold back the longest tail that could still become a terminator
                    keep = next((k for k in range(min(max(map(len, TERMINATORS)) - 1, len(self.buffer)), 0, -1)
                                 if any(m.startswith(self.buffer[-k:]) for m in TERMINATORS)), 0)
                    self._give(self.buffer[:len(self.buffer) - keep], out)
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end, marker = min(ends)
            body, self.buffer = self.buffer[:end], self.buffer[end + len(marker):]
            self._close_body(body, out)
            # <|start|> opens the next message's header at once; the others end the body before it
            self.state = "header"
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str]:
        """The end of the answer: the held-back body (a header left unfinished is dropped; text that never became
        a header is content)."""
        out = {"reasoning": [], "content": []}
        rest, self.buffer = self.buffer, ""
        if self.state == "opening":
            out["content"].append(rest)
        elif self.state == "body":
            self._close_body(rest, out)
        self.state = "header"
        return "".join(out["reasoning"]), "".join(out["content"])

    def _route(self, header: str) -> tuple[str, str]:
        """(field, function name) of a message from its header, e.g. "<|start|>assistant<|channel|>commentary
        to=functions.get_weather <|constrain|>json" -> ("call", "get_weather")."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            if recipient.group(1).startswith("functions."):
                return "call", recipient.group(1)[len("functions."):]
            return "reasoning", ""  # a built-in tool's call (browser, python): part of the thinking
        if channel is not None and channel.group(1) == "analysis":
            return "reasoning", ""
        return "content", ""

    def _open_body(self, field: str, call_name: str) -> None:
        self.state, self.field, self.call_name, self.body_started = "body", field, call_name, False

    def _give(self, text: str, out: dict[str, list[str]]) -> None:
        """Body text of a reasoning or content message, with the newline that joins it to the field's last one."""
        if not text:
            return
        if not self.body_started and self.written[self.field]:
            text = "\n" + text
        self.body_started = self.written[self.field] = True
        out[self.field].append(text)

    def _close_body(self, body: str, out: dict[str, list[str]]) -> None:
        if self.field == "call":
            out["content"].append(f"{CALL_START}{self.call_name}{MESSAGE}{body}{CALL_END}")
            return
        self._give(body, out)
        if self.field == "reasoning":
            self.reasoning_end = self.fed - len(self.buffer)


@register_tool_call_parser
class HarmonyToolCallParser(ToolCallParser):
    """gpt-oss's function calls, as HarmonyReasoningParser hands them on in the content (the harmony answer itself
    goes through that parser first):

        <|start|>assistant to=functions.get_weather<|message|>{"city": "Paris"}<|call|>

    The arguments are given as the model wrote them; a call whose arguments are not a JSON object (cut by
    max_tokens) stays in the content."""

    name = "openai"
    start_tag = CALL_START
    end_tag = CALL_END

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return CHANNEL in chat_template  # gpt-oss's template writes the channels; the call form is ours

    def parse_call(self, body: str) -> ToolCall | None:
        name, found, arguments = body.partition(MESSAGE)
        name, arguments = name.strip(), arguments.strip() or "{}"
        if not found or not name:
            return None
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(name, arguments) if isinstance(parsed, dict) else None
