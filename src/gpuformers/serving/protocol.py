"""The OpenAI request and error shapes: validation of /v1/completions, /v1/chat/completions and /v1/responses
bodies.

Validation is hand-written (not pydantic) so that every bad field gets a message naming the field, its value and
what is allowed, as an OpenAI error object: {"error": {"message", "type", "param", "code"}}. A request that passes
becomes a `CompletionRequest`; the server turns it into engine requests. A Responses API request becomes a chat
request (its `instructions` a first system message, its `input` the messages) that remembers the fields its
Response object repeats.

Offers: APIError, error_body, CompletionRequest, parse_completion, parse_chat, parse_response.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 16  # choices per request: each is a full engine request
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # chat completions' top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' logprobs, as OpenAI allows
ROLES = ("system", "user", "assistant", "tool", "developer")
RESPONSE_ROLES = ("system", "user", "assistant", "developer")  # the Responses API's messages have no tool role


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             422: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    """A validated request. Exactly one of `prompt_ids` (completions) and `messages` (chat, responses) is set."""

    model: str
    chat: bool
    responses: bool = False  # a Responses API request (chat=True too): answered as a Response object
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # chat: the function tools, as the client sent them (rendered by the template)
    tool_choice: str = "none"  # chat: "auto" (calls are parsed out of the answer) or "none" (the text as it is)
    # chat: extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": False} for Qwen3
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    ignore_eos: bool = False
    # Logit adjustments (OpenAI's, then vLLM's extensions); None: not sent (the model's generation config decides)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    # The request fields a Response object repeats (instructions, max_output_tokens, metadata, ...); responses only
    response_fields: dict = field(default_factory=dict)

    @property
    def prompt_field(self) -> str:
        """The request field that holds the prompt, for error messages."""
        return "input" if self.responses else "messages" if self.chat else "prompt"

    @property
    def max_tokens_field(self) -> str:
        """The request field that bounds the answer's length, for error messages."""
        return "max_output_tokens" if self.responses else "max_tokens"


# Fields an OpenAI client may send that we accept and ignore (they do not change the tokens we produce).
_IGNORED = {"user", "parallel_tool_calls", "store", "metadata", "service_tier", "best_of", "suffix"}
_ADJUSTMENTS = {"frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "stream_options",
           "logprobs", "ignore_eos"} | _ADJUSTMENTS
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "response_format", "tools",
                          "tool_choice", "chat_template_kwargs", "reasoning_effort"}
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# What the server itself gives apply_chat_template (or the template sees under these names): a request's
# chat_template_kwargs may not set them
_SERVER_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                              "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "chat_template", "return_assistant_tokens_mask",
                              "tokenizer_kwargs", "sanitize_control_tokens"}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: dict, name: str, low: int | None = None, high: int | None = None, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {_type_name(value)} {value!r}", name)
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise APIError(400, f"{name}={value} must be {bounds}", name)
    return value


def _float(body: dict, name: str, low: float, high: float, default: float | None,
           low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"{name} must be a finite number, got {_type_name(value)} {value!r}", name)
    if value > high or value < low or (low_open and value == low):
        raise APIError(400, f"{name}={value} must be in {'(' if low_open else '['}{low}, {high}]", name)
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {_type_name(value)} {value!r}", name)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"stop must be a string or a list of strings, got {value!r}", "stop")
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP} are allowed", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop sequences must not be empty strings", "stop")
    return stops


def _model(body: Any, allowed: set[str], ignored: set[str]) -> str:
    """The model name of a JSON object body whose fields are all `allowed` or `ignored`."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - allowed - ignored)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}; known: {', '.join(sorted(allowed))}",
                       unknown[0])
    model = body.get("model")
    if model is None:
        raise APIError(400, "model is required: give the name /v1/models lists", "model")
    if not isinstance(model, str) or not model:
        raise APIError(400, f"model must be a non-empty string, got {_type_name(model)} {model!r}", "model")
    return model


def _common(body: Any, allowed: set[str], chat: bool) -> CompletionRequest:
    model = _model(body, allowed, _IGNORED)
    max_tokens = _int(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise APIError(400, f"stream_options must be an object with only include_usage, got {stream_options!r}",
                           "stream_options")
        if not body.get("stream"):
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        include_usage = _bool(stream_options, "include_usage")
    return CompletionRequest(model=model, chat=chat, max_tokens=max_tokens, n=_int(body, "n", 1, MAX_N, 1),
                             stop=_stop(body), stream=_bool(body, "stream"), include_usage=include_usage,
                             **_sampling(body), **_adjustments(body, max_tokens))


def _sampling(body: dict) -> dict:
    """The sampling fields of every endpoint (top_k, seed and ignore_eos are extensions to OpenAI's)."""
    return dict(temperature=_float(body, "temperature", 0.0, 2.0, 1.0),
                top_p=_float(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
                top_k=_int(body, "top_k", -1, None, 0) if body.get("top_k") != -1 else 0,
                seed=_int(body, "seed", default=None), ignore_eos=_bool(body, "ignore_eos"))


def _adjustments(body: dict, max_tokens: int | None) -> dict:
    """The logit adjustments of completions and chat: OpenAI's frequency_penalty, presence_penalty (in [-2, 2])
    and logit_bias ({"token id": bias in [-100, 100]}), and vLLM's repetition_penalty (in (0, 2]), min_p and
    min_tokens (at most max_tokens). Each is None when not sent."""
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={min_tokens} must be at most max_tokens ({max_tokens})", "min_tokens")
    return dict(frequency_penalty=_float(body, "frequency_penalty", -2.0, 2.0, None),
                presence_penalty=_float(body, "presence_penalty", -2.0, 2.0, None), logit_bias=_logit_bias(body),
                repetition_penalty=_float(body, "repetition_penalty", 0.0, 2.0, None, low_open=True),
                min_p=_float(body, "min_p", 0.0, 1.0, None), min_tokens=min_tokens)


def _logit_bias(body: dict) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f'logit_bias must be an object of {{"token id": bias}}, got {_type_name(value)}',
                       "logit_bias")
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {key!r} must be a token id (a string of digits)"[:300], "logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise APIError(400, f"logit_bias[{key!r}]={amount!r} must be a number in [-100, 100]"[:300],
                           "logit_bias")
        bias[int(key)] = float(amount)
    return bias


def _message(message: Any, where: str, roles: tuple[str, ...], part_types: tuple[str, ...],
             tool_fields: bool = False) -> dict:
    """One {role, content} message as the chat template takes it: text parts joined, developer as system; with
    `tool_fields` also an assistant's tool_calls and a tool message's tool_call_id (and name). `where` names the
    message in errors (`messages[2]`)."""
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object, got {_type_name(message)}", where)
    role = message.get("role")
    if role not in roles:
        raise APIError(400, f"{where}.role {role!r} is not one of: {', '.join(roles)}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts carry meaning for a text model
        if not all(isinstance(p, dict) and p.get("type") in part_types and isinstance(p.get("text"), str)
                   for p in content):
            kinds = " or ".join(f'{{"type": "{t}", "text": ...}}' for t in part_types)
            raise APIError(400, f"{where}.content parts must all be {kinds}; this server takes text only",
                           f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str) and not (content is None and role == "assistant"):
        raise APIError(400, f"{where}.content must be a string, got {_type_name(content)}", f"{where}.content")
    normalised = {"role": "system" if role == "developer" else role, "content": content or ""}
    if tool_fields and role == "assistant" and message.get("tool_calls") is not None:
        normalised["tool_calls"] = _message_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if tool_fields and role == "tool":
        call_id, name = message.get("tool_call_id"), message.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise APIError(400, f"{where}.tool_call_id must be the id of the call this message answers, got "
                                f"{_type_name(call_id)} {call_id!r}"[:300], f"{where}.tool_call_id")
        normalised["tool_call_id"] = call_id
        if name is not None:  # the called function's name, which some templates print
            if not isinstance(name, str):
                raise APIError(400, f"{where}.name must be a string, got {_type_name(name)}", f"{where}.name")
            normalised["name"] = name
    return normalised


def _message_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template. Arguments that are a JSON object are
    given to it as a dict, as vLLM does: some templates iterate over them (others print a string as it is)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of {{id, type, function}} objects, got {_type_name(calls)}",
                       where)
    normalised = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            raise APIError(400, f'{where}[{i}] must be {{"id": ..., "type": "function", "function": {{"name": '
                                f'string, "arguments": JSON string}}}}, got {call!r}'[:300], f"{where}[{i}]")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]
        entry = {"type": "function", "function": {"name": function["name"],
                                                  "arguments": arguments if isinstance(arguments, dict)
                                                  else function["arguments"]}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        normalised.append(entry)
    return normalised


def parse_completion(body: Any) -> CompletionRequest:
    """A validated /v1/completions request; `prompt` is a string or a list of token ids (one prompt)."""
    request = _common(body, _COMPLETION_FIELDS, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty; give at least one character or token id", "prompt")
        request.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per request "
                            "(send one request per prompt)", "prompt")
    else:
        raise APIError(400, f"prompt must be a non-empty string or a non-empty list of token ids, got {prompt!r}"[:300],
                       "prompt")
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if logprobs is not None:
        request.logprobs, request.top_logprobs = True, logprobs
    request.echo = _bool(body, "echo")
    if request.echo and request.stream and request.logprobs:
        raise APIError(400, "echo=true with logprobs is not supported with stream=true (the prompt's logprobs come "
                            "only in a whole response); drop stream, echo or logprobs", "echo")
    return request


def parse_chat(body: Any) -> CompletionRequest:
    """A validated /v1/chat/completions request."""
    request = _common(body, _CHAT_FIELDS, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages must be a non-empty list of {{role, content}} objects, got {messages!r}"[:300],
                       "messages")
    request.messages = [_message(m, f"messages[{i}]", ROLES, ("text",), tool_fields=True)
                        for i, m in enumerate(messages)]
    request.logprobs = _bool(body, "logprobs")
    request.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    response_format = body.get("response_format")
    if response_format is not None:
        _text_only(response_format, "response_format", "response_format", "the prompt")
    request.tools = _tools(body.get("tools"))
    request.tool_choice = _tool_choice(body.get("tool_choice"), request.tools)
    request.chat_template_kwargs = _chat_template_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        # OpenAI's field; the chat template reads it under the same name (gpt-oss's does; others ignore it)
        if effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort {effort!r} is not one of: {', '.join(REASONING_EFFORTS)}",
                           "reasoning_effort")
        request.chat_template_kwargs = {"reasoning_effort": effort, **request.chat_template_kwargs}
    return request


def _chat_template_kwargs(value: Any) -> dict:
    """vLLM's chat_template_kwargs: an object of extra chat template variables ({"enable_thinking": false} for
    Qwen3), none of them one the server sets itself."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(400, 'chat_template_kwargs must be an object of template variables (e.g. '
                            f'{{"enable_thinking": false}}), got {_type_name(value)} {value!r}'[:300],
                       "chat_template_kwargs")
    clashes = sorted(set(value) & _SERVER_TEMPLATE_ARGUMENTS)
    if clashes:
        them = "them" if len(clashes) > 1 else "it"
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clashes)}: the server sets {them} from the "
                            f"request itself (messages, tools, ...); leave {them} out",
                       f"chat_template_kwargs.{clashes[0]}")
    return value


_FUNCTION_FIELDS = {"name": str, "description": str, "parameters": dict, "strict": bool}


def _tools(tools: Any) -> list[dict] | None:
    """Chat's `tools`: function tools {"type": "function", "function": {name, description?, parameters?, strict?}},
    kept as sent (the chat template renders them). `strict` is accepted but not enforced: no constrained decoding."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, got "
                            f"{_type_name(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object, got {_type_name(tool)}", where)
        if tool.get("type") != "function":
            raise APIError(400, f"{where}.type {tool.get('type')!r} is not supported: only \"function\" tools are",
                           f"{where}.type")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise APIError(400, f"{where} has unknown field(s): {', '.join(unknown)}; known: function, type",
                           f"{where}.{unknown[0]}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object with name (and description, parameters), got "
                                f"{_type_name(function)}", f"{where}.function")
        unknown = sorted(set(function) - set(_FUNCTION_FIELDS))
        if unknown:
            raise APIError(400, f"{where}.function has unknown field(s): {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(_FUNCTION_FIELDS))}", f"{where}.function.{unknown[0]}")
        for name, kind in _FUNCTION_FIELDS.items():
            value = function.get(name)
            if (value is not None or name == "name") and not isinstance(value, kind):
                raise APIError(400, f"{where}.function.{name} must be {'an object' if kind is dict else kind.__name__}"
                                    f", got {_type_name(value)} {value!r}"[:300], f"{where}.function.{name}")
        if not function["name"] or function["name"] in names:
            raise APIError(400, f"{where}.function.name {function['name']!r} must be non-empty and unique among "
                                "the tools", f"{where}.function.name")
        names.add(function["name"])
    return tools


def _tool_choice(choice: Any, tools: list[dict] | None) -> str:
    """"auto" (the default with tools) or "none"; "none" still shows the tools to the model, as vLLM does, so that a
    conversation holding earlier calls renders the same. Forcing calls needs constrained decoding: refused."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none"):
        return choice if tools else "none"
    forced = (choice == "required" or isinstance(choice, dict) and choice.get("type") == "function")
    if forced:
        what = '"required"' if choice == "required" else f"naming a function {choice!r}"[:200]
        raise APIError(400, f"tool_choice {what} is not supported: forcing a tool call needs constrained decoding, "
                            "which this server does not have; use tool_choice \"auto\" and ask for the call in the "
                            "prompt", "tool_choice")
    raise APIError(400, f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                        f'{{"name": ...}}}}, got {choice!r}'[:300], "tool_choice")


def _text_only(spec, name: str, param: str, where: str) -> None:
    """An output format (a {"type": ...} object or a bare type) must be plain text: no constrained decoding here."""
    kind = spec.get("type") if isinstance(spec, dict) else spec
    if kind != "text":
        raise APIError(400, f"{name} {kind!r} is not supported: this server has no constrained decoding; use type "
                            f"\"text\" (or leave it out) and ask for JSON in {where}", param)


def _no_tools(body: dict) -> None:
    if body.get("tools"):
        raise APIError(400, "tools are not supported by this server yet; leave tools out", "tools")


# The Responses API's fields (and the extensions the other endpoints take). Those that would change the answer in a
# way this server cannot follow (tools, structured output, reasoning, server-side state) are refused by name in
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
    model = _model(body, _RESPONSE_FIELDS, _RESPONSE_IGNORED)
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise APIError(400, f"{name} is not supported: {why}", name)
    if body.get("background"):
        raise APIError(400, "background=true is not supported: this server keeps no responses to poll later; "
                            "leave background out", "background")
    _no_tools(body)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice {tool_choice!r} needs tools, which this server does not support; leave "
                            "tool_choice out", "tool_choice")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format"}:
            raise APIError(400, f"text must be an object with only format, got {text!r}"[:300], "text")
        _text_only(text.get("format") or {"type": "text"}, "text.format type", "text", "the input")
    if body.get("reasoning"):
        raise APIError(400, "reasoning is not supported: this server renders the model's chat template as it is "
                            "(no reasoning effort or summaries); leave reasoning out", "reasoning")
    if body.get("include"):
        raise APIError(400, f"include {body['include']!r} is not supported: this server adds nothing to the output "
                            "(no logprobs, no reasoning items); leave include out"[:400], "include")
    if _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0):
        raise APIError(400, "top_logprobs is not supported on /v1/responses yet; use /v1/chat/completions with "
                            "logprobs=true and top_logprobs", "top_logprobs")
    stream = _bool(body, "stream")
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
        raise APIError(400, f"instructions must be a string, got {_type_name(instructions)}", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input_messages(body.get("input"))
    request = CompletionRequest(model=model, chat=True, responses=True, messages=messages, stream=stream,
                                max_tokens=_int(body, "max_output_tokens", 1), **_sampling(body))
    request.response_fields = {"instructions": instructions, "max_output_tokens": request.max_tokens,
                               "metadata": metadata or {}, "tool_choice": tool_choice or "auto",
                               "parallel_tool_calls": _bool(body, "parallel_tool_calls", True)}
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
            raise APIError(400, f"input[{i}].type {kind!r} is not supported: this server takes text messages only "
                                "(no tool calls or outputs, reasoning items or item references)", f"input[{i}].type")
        messages.append(_message(item, f"input[{i}]", RESPONSE_ROLES, ("input_text", "output_text")))
    return messages
