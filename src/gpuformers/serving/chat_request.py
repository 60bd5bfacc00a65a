"""The /v1/chat/completions body: messages (with earlier tool calls and tool answers), tools, tool_choice,
chat_template_kwargs, reasoning_effort and response_format (structured output: structured_request.py), on top of
the fields completions share.

Offers: parse_chat, response_format, MAX_TOP_LOGPROBS, ROLES, REASONING_EFFORTS (and, to responses_request.py and
routes_tokenize.py, parse_message, tools_field, chat_template_kwargs_field).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpuformers.serving.api_error import APIError
from gpuformers.serving.completion_request import COMMON_FIELDS, CompletionRequest, parse_common
from gpuformers.serving.request_fields import bool_field, int_field, shown_value, type_name
from gpuformers.serving.structured_request import STRUCTURED_FIELDS, response_format, structured_output

MAX_TOP_LOGPROBS = 20  # chat completions' top_logprobs, as OpenAI allows
ROLES = ("system", "user", "assistant", "tool", "developer")
_CHAT_FIELDS = COMMON_FIELDS | STRUCTURED_FIELDS | {"messages", "top_logprobs", "max_completion_tokens",
                                              "response_format", "tools", "tool_choice", "chat_template_kwargs",
                                              "reasoning_effort"}
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# What the server itself gives apply_chat_template (or the template sees under these names): a request's
# chat_template_kwargs may not set them
_SERVER_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                              "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "chat_template", "return_assistant_tokens_mask",
                              "tokenizer_kwargs", "sanitize_control_tokens"}


def parse_message(message: Any, where: str, roles: tuple[str, ...], part_types: tuple[str, ...],
             tool_fields: bool = False) -> dict:
    """One {role, content} message as the chat template takes it: text parts joined, developer as system; with
    `tool_fields` also an assistant's tool_calls and a tool message's tool_call_id (and name). `where` names the
    message in errors (`messages[2]`)."""
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object, got {type_name(message)}", where)
    role = message.get("role")
    if role not in roles:
        raise APIError(400, f"{where}.role {shown_value(role)} is not one of: {', '.join(roles)}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts carry meaning for a text model
        if not all(isinstance(p, dict) and p.get("type") in part_types and isinstance(p.get("text"), str)
                   for p in content):
            kinds = " or ".join(f'{{"type": "{t}", "text": ...}}' for t in part_types)
            raise APIError(400, f"{where}.content parts must all be {kinds}; this server takes text only",
                           f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str) and not (content is None and role == "assistant"):
        raise APIError(400, f"{where}.content must be a string, got {type_name(content)}", f"{where}.content")
    normalised = {"role": "system" if role == "developer" else role, "content": content or ""}
    if tool_fields and role == "assistant" and message.get("tool_calls") is not None:
        normalised["tool_calls"] = _message_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if tool_fields and role == "tool":
        call_id, name = message.get("tool_call_id"), message.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise APIError(400, f"{where}.tool_call_id must be the id of the call this message answers, got "
                                f"{type_name(call_id)} {call_id!r}"[:300], f"{where}.tool_call_id")
        normalised["tool_call_id"] = call_id
        if name is not None:  # the called function's name, which some templates print
            if not isinstance(name, str):
                raise APIError(400, f"{where}.name must be a string, got {type_name(name)}", f"{where}.name")
            normalised["name"] = name
    return normalised


def _message_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template. Arguments that are a JSON object are
    given to it as a dict, as vLLM does: some templates iterate over them (others print a string as it is)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of {{id, type, function}} objects, got {type_name(calls)}",
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


def parse_chat(body: Any) -> CompletionRequest:
    """A validated /v1/chat/completions request."""
    request = parse_common(body, _CHAT_FIELDS, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages must be a non-empty list of {{role, content}} objects, got {messages!r}"[:300],
                       "messages")
    request.messages = [parse_message(m, f"messages[{i}]", ROLES, ("text",), tool_fields=True)
                        for i, m in enumerate(messages)]
    request.logprobs = bool_field(body, "logprobs")
    request.top_logprobs = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    request.structured_output = structured_output(body, request.min_tokens,
                                                  response_format(body.get("response_format"), "response_format"))
    request.tools = tools_field(body.get("tools"))
    request.tool_choice, request.tool_name = _tool_choice(body.get("tool_choice"), request.tools)
    request.chat_template_kwargs = chat_template_kwargs_field(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        # OpenAI's field; the chat template reads it under the same name (gpt-oss's does; others ignore it)
        if effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort {shown_value(effort)} is not one of: {', '.join(REASONING_EFFORTS)}",
                           "reasoning_effort")
        request.chat_template_kwargs = {"reasoning_effort": effort, **request.chat_template_kwargs}
    return request


def chat_template_kwargs_field(value: Any) -> dict:
    """vLLM's chat_template_kwargs: an object of extra chat template variables ({"enable_thinking": false} for
    Qwen3), none of them one the server sets itself."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(400, 'chat_template_kwargs must be an object of template variables (e.g. '
                            f'{{"enable_thinking": false}}), got {type_name(value)} {value!r}'[:300],
                       "chat_template_kwargs")
    clashes = sorted(set(value) & _SERVER_TEMPLATE_ARGUMENTS)
    if clashes:
        them = "them" if len(clashes) > 1 else "it"
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clashes)}: the server sets {them} from the "
                            f"request itself (messages, tools, ...); leave {them} out",
                       f"chat_template_kwargs.{clashes[0]}")
    return value


_FUNCTION_FIELDS = {"name": str, "description": str, "parameters": dict, "strict": bool}


def tools_field(tools: Any) -> list[dict] | None:
    """Chat's `tools`: function tools {"type": "function", "function": {name, description?, parameters?, strict?}},
    kept as sent (the chat template renders them). `strict` is accepted but not enforced: calls are not constrained
    (response_format is)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, got "
                            f"{type_name(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object, got {type_name(tool)}", where)
        if tool.get("type") != "function":
            raise APIError(400, f"{where}.type {shown_value(tool.get('type'))} is not supported: only \"function\" "
                                "tools are", f"{where}.type")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise APIError(400, f"{where} has unknown field(s): {', '.join(unknown)}; known: function, type",
                           f"{where}.{unknown[0]}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object with name (and description, parameters), got "
                                f"{type_name(function)}", f"{where}.function")
        unknown = sorted(set(function) - set(_FUNCTION_FIELDS))
        if unknown:
            raise APIError(400, f"{where}.function has unknown field(s): {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(_FUNCTION_FIELDS))}", f"{where}.function.{unknown[0]}")
        for name, kind in _FUNCTION_FIELDS.items():
            value = function.get(name)
            if (value is not None or name == "name") and not isinstance(value, kind):
                raise APIError(400, f"{where}.function.{name} must be {'an object' if kind is dict else kind.__name__}"
                                    f", got {type_name(value)} {value!r}"[:300], f"{where}.function.{name}")
        if not _FUNCTION_NAME.fullmatch(function["name"]) or function["name"] in names:
            raise APIError(400, f"{where}.function.name {function['name']!r} must be 1-64 letters, digits, "
                                "underscores or dashes, and unique among the tools"[:300], f"{where}.function.name")
        names.add(function["name"])
        if function.get("parameters") is not None:
            _check_parameters(function["parameters"], f"{where}.function.parameters")
    return tools


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


def _check_parameters(schema: dict, where: str) -> None:
    """A function's parameters: a JSON Schema of an object (as OpenAI requires), its properties schemas and its
    required list naming them. The chat template shows the schema to the model; one that is not a schema of the
    arguments would teach it nonsense, so it is refused here, naming the field."""
    if schema.get("type", "object") != "object":
        raise APIError(400, f"{where} must be a JSON Schema of an object ({{\"type\": \"object\", \"properties\": "
                            f"{{...}}}}), got type {schema.get('type')!r}"[:300], f"{where}.type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise APIError(400, f"{where}.properties must be an object of argument name -> schema, got "
                            f"{type_name(properties)}", f"{where}.properties")
    for name, sub in properties.items():
        if not isinstance(sub, (dict, bool)):
            raise APIError(400, f"{where}.properties.{name} must be a schema (an object), got {type_name(sub)}"[:300],
                           f"{where}.properties.{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(400, f"{where}.required must be a list of argument names, got {required!r}"[:300],
                       f"{where}.required")
    missing = [r for r in required if properties and r not in properties]
    if missing:
        raise APIError(400, f"{where}.required names {missing[0]!r}, which is not in its properties "
                            f"({', '.join(properties)})"[:300], f"{where}.required")


def _tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(tool_choice, the forced function's name): "auto" (the default with tools) or "none", which still shows the
    tools to the model, as vLLM does, so that a conversation holding earlier calls renders the same; "required" (one
    or more calls) and "function" (one call of the named function) are held to the model's call format by a grammar
    (answer_grammar.py)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none"):
        return (choice if tools else "none"), None
    if choice == "required" or isinstance(choice, dict) and choice.get("type") == "function":
        if not tools:
            raise APIError(400, f"tool_choice {shown_value(choice)} needs tools to call; send tools or leave "
                                f"tool_choice out", "tool_choice")
        if choice == "required":
            return "required", None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        known = [tool["function"]["name"] for tool in tools]
        if name not in known:
            raise APIError(400, f"tool_choice names the function {shown_value(name)}, which is not one of the "
                                f"tools: {', '.join(map(repr, known))}"[:300], "tool_choice.function.name")
        return "function", name
    raise APIError(400, f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                        f'{{"name": ...}}}}, got {choice!r}'[:300], "tool_choice")
