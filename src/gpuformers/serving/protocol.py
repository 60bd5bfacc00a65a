"""The OpenAI request and error shapes: validation of /v1/completions, /v1/chat/completions and /v1/responses
bodies.

Validation is hand-written (not pydantic) so that every bad field gets a message naming the field, its value and
what is allowed, as an OpenAI error object: {"error": {"message", "type", "param", "code"}}. A request that passes
becomes a `CompletionRequest`; the server turns it into engine requests. A Responses API request becomes a chat
request (its `instructions` a first system message, its `input` the messages) that remembers the fields its
Response object repeats.

This module only gathers the names the server imports; the code lives in:

    api_error.py           APIError, error_body: the OpenAI error object
    request_fields.py      the checks of one field (integers, numbers, booleans, stop, model, text-only formats)
    completion_request.py  CompletionRequest, the fields completions and chat share, parse_completion
    chat_request.py        parse_chat: messages, tools, tool_choice, chat_template_kwargs, reasoning_effort
    responses_request.py   parse_response: /v1/responses as a chat request

Offers: APIError, error_body, CompletionRequest, parse_completion, parse_chat, parse_response.
"""

from __future__ import annotations

from gpuformers.serving.api_error import APIError, error_body
from gpuformers.serving.chat_request import MAX_TOP_LOGPROBS, REASONING_EFFORTS, ROLES, parse_chat
from gpuformers.serving.completion_request import (MAX_COMPLETION_LOGPROBS, MAX_N, CompletionRequest,
                                                   parse_completion)
from gpuformers.serving.request_fields import MAX_STOP
from gpuformers.serving.responses_request import RESPONSE_ROLES, parse_response

__all__ = ["APIError", "error_body", "CompletionRequest", "parse_completion", "parse_chat", "parse_response",
           "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS", "MAX_COMPLETION_LOGPROBS", "ROLES", "RESPONSE_ROLES",
           "REASONING_EFFORTS"]
