"""Chat templates rendered the way transformers renders them, so that a prompt is byte for byte the one the
model was trained on: sandboxed Jinja (templates come from the Hub: untrusted code) with trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and
`{% generation %}` blocks that mark assistant tokens for training masks. The sandbox also bounds how much a
template may make (chat_sandbox.py), and a syntax error names the file the template was read from.

Offers: render_chats, assistant_mask, note_template_source.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

#
# What transformers does, step by step, so that prompts match byte for byte:
#   messages (dicts, dataclasses, pydantic) -> plain JSON-like data, None-valued keys dropped
#   -> reasoning aliased (reasoning_content / thinking / reasoning) -> optional continue tag appended
#   -> sandboxed Jinja render with the special tokens and the caller's kwargs as variables
#   -> the continue tag and everything after it cut off.

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# (rendered blocks so far, generation spans) while a render with assistant masks runs; None otherwise.
_GENERATION_TRACK: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "chat_generation_track", default=None
)
# template text -> the file it was read from, so that a syntax error found when it is first rendered can say
# where to fix it; the most recent few, keyed by the text so that an edited template is no longer attributed.
_TEMPLATE_SOURCES: dict[str, str] = {}
_MAX_SOURCES = 64


def note_template_source(template: str, source: str) -> None:
    """Remember that `template` was read from `source` (a path, or "path (its chat_template)")."""
    _TEMPLATE_SOURCES.pop(template, None)
    _TEMPLATE_SOURCES[template] = source
    while len(_TEMPLATE_SOURCES) > _MAX_SOURCES:
        del _TEMPLATE_SOURCES[next(iter(_TEMPLATE_SOURCES))]


@lru_cache(maxsize=1)
def _chat_environment():
    """The sandboxed Jinja environment chat templates run in (they come from the Hub: untrusted code)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise ImportError(
            f"chat templates need jinja2>=3.1.6 (older versions have known sandbox escapes); found "
            f"{jinja2.__version__}. Upgrade it with: pip install 'jinja2>=3.1.6'"
        )
    from gpuformers import chat_sandbox  # imports jinja2.sandbox: after the check
    from gpuformers.chat_sandbox import BoundedSandbox, bounded_join, text_size

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; its character span is recorded."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

        def _record(self, caller) -> str:
            text = caller()
            track = _GENERATION_TRACK.get()
            if track is not None:
                blocks, spans = track
                # Rendering streams blocks in order, so what was emitted so far is where this span starts.
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    class TemplateDict:
        """`dict(...)` for templates, without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore names, which could reach interpreter internals."""

        def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja2's Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set {name!r}: names starting with '_' are refused"
                )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; chat templates want plain JSON, as
        # json.dumps writes it. Unindented JSON is at most ~6 characters per character of the value (\uXXXX
        # escapes): made at once when that is within bounds; else (and with an indent, which repeats per line
        # and level) piece by piece, so that a list repeating a long string is refused before it is in memory.
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        if indent is None and separators is None and 12 * text_size(value) <= chat_sandbox.MAX_LENGTH:
            return encoder.encode(value)
        return bounded_join(encoder.iterencode(value), "the tojson filter")

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env


@lru_cache(maxsize=32)
def _compile_chat_template(template: str):
    import jinja2

    try:
        return _chat_environment().from_string(template)
    except jinja2.TemplateSyntaxError as err:
        # jinja's error names neither the file nor, once it has rewritten the traceback, the line
        source = _TEMPLATE_SOURCES.get(template, "<chat_template string>")
        error = jinja2.TemplateSyntaxError(
            f"the chat template has a syntax error: {err.message}. Fix the template in {source}, or pass "
            f"chat_template= a working one", err.lineno, name=source, filename=source)
        error.source = template  # str(error) then quotes the line
        raise error from None


def _template_data(value: Any) -> Any:
    """Rebuild what a template sees from plain JSON types; anything else becomes an inert "<TypeName>".

    Objects such as tensors or images have methods the sandbox does not know to be dangerous, and templates
    only test whether such keys are present, so a placeholder renders the same text.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) carry extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_template_data(key): _template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_template_data(item) for item in value)
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.generic):
            return _template_data(value.item())  # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _template_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. OpenAI SDK messages
        return _template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _chat_messages(conversation: Any) -> list[dict]:
    """One conversation -> a fresh list of plain message dicts, None-valued keys dropped (templates handle a
    missing key but many print "None" or fail on a None one), reasoning copied under each name templates read."""
    messages = []
    for message in _template_data(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts (or dataclasses / pydantic models), got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _tag_final_message(messages: list[dict], field: bool | str, template: str) -> str:
    """Append the continue tag to the text the last message continues; return that text (untagged)."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty")
    field = field if isinstance(field, str) else "content"
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [name for name in _REASONING_FIELDS if messages[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(f"continue_final_message is set to {field!r} but the chat template never reads that field")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text block to continue")
    for name in fields:
        messages[-1][name] = messages[-1][name] + _CONTINUE_TAG
    return final


def _cut_at_continue_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the rendered chat: the "
            f"template changes or drops it. Final message: {final.strip()!r}; rendered chat: {rendered!r}"
        )
    at = rendered.rindex(tag)
    # A template that strips the message's trailing space also ate the tag's space: trim to match.
    return rendered[:at] if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()


def render_chats(
    template: str,
    conversations: list,
    *,
    tools: list | None,
    documents: list | None,
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    track_generation: bool,
    **variables,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Render each conversation; also return, per conversation, the character spans of {% generation %} blocks."""
    compiled = _compile_chat_template(template)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(
                    f"tools must be JSON-schema dicts like {{'type': 'function', 'function': {{'name': ..., "
                    f"'description': ..., 'parameters': {{...}}}}}}; got {type(tool).__name__} {tool!r}. Python "
                    "functions are not converted to schemas yet: write the schema out."
                )
    if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
        raise TypeError("documents must be a list of dicts, e.g. [{'title': ..., 'text': ...}]")
    tools, documents, variables = _template_data(tools), _template_data(documents), _template_data(variables)

    rendered_chats, all_spans = [], []
    for conversation in conversations:
        messages = _chat_messages(conversation)
        final = _tag_final_message(messages, continue_final_message, template) if continue_final_message else None
        context = dict(
            variables, messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt
        )
        spans: list[tuple[int, int]] = []
        if track_generation:
            blocks: list[str] = []
            token = _GENERATION_TRACK.set((blocks, spans))
            try:
                # environment.concat: the sandbox's bounded join, which render() also uses
                rendered = compiled.environment.concat(_appended(compiled.generate(**context), blocks))
            finally:
                _GENERATION_TRACK.reset(token)
        else:
            rendered = compiled.render(**context)
        if final is not None:
            rendered = _cut_at_continue_tag(rendered, final)
        rendered_chats.append(rendered)
        all_spans.append(spans)
    return rendered_chats, all_spans


def _appended(parts, blocks: list[str]):
    """Yield each part after adding it to blocks, where a {% generation %} block reads how much came before it."""
    for part in parts:
        blocks.append(part)
        yield part


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a {% generation %} span, else 0 (offsets and spans both sorted)."""
    mask = [0] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask
