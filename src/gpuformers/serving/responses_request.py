"""The /v1/responses body, validated into a chat request: its `instructions` a first system message, its `input`
the messages, and the fields its Response object repeats kept in `response_fields`.

Fields that need what this server lacks (tools, reasoning, stored state) are refused by name; text.format may ask
for structured output (json_object, json_schema), as chat's response_format does.

Offers: parse_response, RESPONSE_ROLES.
"""

from __future__ import annotations

from typing import Any

from gpuformers.serving.api_error import APIError
from gpuformers.serving.chat_request import MAX_TOP_LOGPROBS, parse_message, response_format
from gpuformers.serving.completion_request import CompletionRequest, sampling_fields
from gpuformers.serving.request_fields import bool_field, int_field, model_field, shown_value, type_name

RESPONSE_ROLES = ("system", "user", "assistant", "developer")  # the Responses API's messages have no tool role


def _no_tools(body: dict) -> None:
    if body.get("tools"):
        raise APIError(400, "tools are not supported by this server yet; leave tools out", "tools")


# The Responses API's fields (and the extensions the other endpoints take). Those that would change the answer in a
# way this server cannot follow (tools, reasoning, server-side state) are refused by name in
# parse_response; _RESPONSE_IGNORED do not change the tokens and are accepted and ignored.
_RESPONSE_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k", "seed",
                    "ignore_eos", "stream", "stream_options", "metadata", "parallel_tool_calls", "tool_choice", "tools",
                    "text", "reasoning", "include", "top_logprobs", "previous_response_id", "conversation", "prompt",
                    "background"}
_RESPONSE_IGNORED = {"user", "store", "truncation", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "service_tier", "max_tool_calls"}
# Fields that need state kept between requests, which this server does not keep: any value but null is refused.
_STATEFUL = {
    "previous_response_id": "this server keeps no state between requests (no stored responses); send the whole "
                            "conversation in input",
    "conversation": "this server keeps no conversations; send the whole conversation in input",
    "prompt": "this server keeps no stored prompt templates; send the text in instructions and input",
}


def parse_response(body: Any) -> CompletionRequest:
    """A validated /v1/responses request, as a chat request: `instructions` becomes a first system message, `input`
    (a string, or a list of text messages) the rest. One output, text only."""
    model = model_field(body, _RESPONSE_FIELDS, _RESPONSE_IGNORED)
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise APIError(400, f"{name} is not supported: {why}", name)
    if body.get("background"):
        raise APIError(400, "background=true is not supported: this server keeps no responses to poll later; "
                            "leave background out", "background")
    _no_tools(body)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice {shown_value(tool_choice)} needs tools, which this server does not support; "
                            "leave tool_choice out", "tool_choice")
    text = body.get("text")
    structured_output = None
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format"}:
            raise APIError(400, f"text must be an object with only format, got {text!r}"[:300], "text")
        structured_output = response_format(text.get("format"), "text.format", flat=True)
    if body.get("reasoning"):
        raise APIError(400, "reasoning is not supported: this server renders the model's chat template as it is "
                            "(no reasoning effort or summaries); leave reasoning out", "reasoning")
    if body.get("include"):
        raise APIError(400, f"include {body['include']!r} is not supported: this server adds nothing to the output "
                            "(no logprobs, no reasoning items); leave include out"[:400], "include")
    if int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0):
        raise APIError(400, "top_logprobs is not supported on /v1/responses yet; use /v1/chat/completions with "
                            "logprobs=true and top_logprobs", "top_logprobs")
    stream = bool_field(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:  # include_obfuscation pads events against side channels: nothing to pad here
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_obfuscation"}:
            raise APIError(400, f"stream_options must be an object with only include_obfuscation, got "
                                f"{stream_options!r}"[:300], "stream_options")
        if not stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise APIError(400, f"metadata must be an object of string values, got {metadata!r}"[:300], "metadata")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, f"instructions must be a string, got {type_name(instructions)}", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input_messages(body.get("input"))
    request = CompletionRequest(model=model, chat=True, responses=True, messages=messages, stream=stream,
                                max_tokens=int_field(body, "max_output_tokens", 1), **sampling_fields(body))
    request.response_fields = {"instructions": instructions, "max_output_tokens": request.max_tokens,
                               "metadata": metadata or {}, "tool_choice": tool_choice or "auto",
                               "parallel_tool_calls": bool_field(body, "parallel_tool_calls", True)}
    if structured_output is not None:
        request.response_fields["text"] = {"format": text["format"]}  # the Response object repeats it
    request.structured_output = structured_output
    return request


def _input_messages(value: Any) -> list[dict]:
    """The Responses API's `input` as chat messages: a string is one user message; a list holds messages (items of
    type "message", or without a type), their content a string or input_text / output_text parts."""
    if value is None:
        raise APIError(400, "input is required: a string, or a list of {role, content} messages", "input")
    if isinstance(value, str):
        if not value:
            raise APIError(400, "input is empty; give at least one character", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, f"input must be a non-empty string or a non-empty list of {{role, content}} messages, got "
                            f"{value!r}"[:300], "input")
    messages = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else "message"
        if kind != "message":
            raise APIError(400, f"input[{i}].type {shown_value(kind)} is not supported: this server takes text "
                                "messages only (no tool calls or outputs, reasoning items or item references)",
                           f"input[{i}].type")
        messages.append(parse_message(item, f"input[{i}]", RESPONSE_ROLES, ("input_text", "output_text")))
    return messages
