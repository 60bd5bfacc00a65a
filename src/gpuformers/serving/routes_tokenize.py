"""POST /tokenize and POST /detokenize, vLLM's shapes: the served model's tokenizer (and chat template) as the
generation endpoints use it, so that a client can count a prompt's tokens against `max_model_len` or read back ids
before it sends a request.

    /tokenize   {"prompt": "text", "add_special_tokens": true}                     -> {"count", "max_model_len",
                {"messages": [...], "add_generation_prompt": true, "tools": [...],      "tokens", "token_strs"}
                 "continue_final_message": false, "chat_template_kwargs": {...}}
    /detokenize {"tokens": [ids]}                                                   -> {"prompt": "text"}

`model` may be left out (vLLM's rule); when it is sent it must name the served model or one of its adapters (they
share the tokenizer). The chat form renders the same ids as /v1/chat/completions would send to the engine (its
messages are read by chat_request.py, the template rendered by routes_chat.chat_prompt_ids), with vLLM's defaults:
add_generation_prompt true, add_special_tokens false. Tokenizing a long text runs off the event loop.

Offers: tokenize, detokenize (the handlers), add_routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from gpuformers.serving.api_error import APIError
from gpuformers.serving.chat_request import ROLES, chat_template_kwargs_field, parse_message, tools_field
from gpuformers.serving.completion_request import CompletionRequest
from gpuformers.serving.http import check_api_key, read_json
from gpuformers.serving.request_fields import bool_field, known_fields, shown_value, type_name
from gpuformers.serving.routes_chat import chat_prompt_ids
from gpuformers.serving.server_state import ServerState

_TEXT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "return_token_strs", "tools", "chat_template_kwargs"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


async def tokenize(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    body = await read_json(request)
    chat = isinstance(body, dict) and "messages" in body
    _check_fields(state, body, _CHAT_FIELDS if chat else _TEXT_FIELDS)
    ids = await asyncio.to_thread(_chat_ids if chat else _text_ids, state, body)
    answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    if bool_field(body, "return_token_strs"):
        answer["token_strs"] = [state.token_texts[t] for t in ids]
    return answer


async def detokenize(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    body = await read_json(request)
    _check_fields(state, body, _DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, f"tokens must be a list of token ids, got {type_name(tokens)} {shown_value(tokens)}",
                       "tokens")
    bad = [t for t in tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})", "tokens")
    return {"prompt": await asyncio.to_thread(state.tokenizer.decode, tokens)}


def _check_fields(state: ServerState, body: Any, allowed: set[str]) -> None:
    """A JSON object of known fields whose `model`, if sent, is served here (vLLM's rule: it may be left out)."""
    known_fields(body, allowed)
    if body.get("model") is not None:
        state.adapter_of(body["model"])


def _text_ids(state: ServerState, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, f"prompt must be a string (or send messages for a chat), got {type_name(prompt)}",
                       "prompt")
    state.prompt_chars.check(len(prompt), "prompt")
    return list(state.tokenizer.encode(prompt, add_special_tokens=bool_field(body, "add_special_tokens", True)))


def _chat_ids(state: ServerState, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages must be a non-empty list of {{role, content}} objects, got "
                            f"{shown_value(messages)}", "messages")
    if bool_field(body, "add_special_tokens"):
        # The template writes the special tokens itself; adding BOS on top would count a token the engine never sees
        raise APIError(400, "add_special_tokens=true is not supported with messages: the chat template already "
                            "writes the model's special tokens; leave it out", "add_special_tokens")
    generation_prompt = bool_field(body, "add_generation_prompt", True)
    continue_final = bool_field(body, "continue_final_message")
    if generation_prompt and continue_final:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true: the first starts "
                            "a new assistant message, the second continues the last one; set one of them to false",
                       "continue_final_message")
    parsed = CompletionRequest(model=state.model_name, chat=True)
    parsed.messages = [parse_message(m, f"messages[{i}]", ROLES, ("text",), tool_fields=True)
                       for i, m in enumerate(messages)]
    parsed.tools = tools_field(body.get("tools"))
    parsed.tool_choice = "none"  # counting tokens needs no tool-call parser: the template renders the tools as is
    parsed.chat_template_kwargs = chat_template_kwargs_field(body.get("chat_template_kwargs"))
    return chat_prompt_ids(state, parsed, add_generation_prompt=generation_prompt,
                           continue_final_message=continue_final)


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
