"""What both apps of `gpuformers serve` (server.py for generation, embedding_app.py for embeddings) do with a request
besides its route's own work: the API key check, the JSON body read with a size limit (refused from its
Content-Length, or once the bytes read pass it, never buffered whole) and without lone UTF-16 surrogates, and the
OpenAI-shaped 500 (counted in /metrics) for an error nothing else caught.

Offers: MAX_BODY_BYTES, check_api_key_setting, check_api_key, declared_body_size, read_json,
add_unexpected_error_handler.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from gpuformers.serving.api_error import APIError, error_body

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused before parsing
# The status of a request whose client left before it was whole or answered (nginx's and vLLM's number for it)
CLIENT_CLOSED_REQUEST = 499


def check_api_key_setting(api_key: str | None) -> None:
    """A ValueError for a key no client could send or that anyone could guess: empty, or with spaces around it
    (HTTP strips those from a header). None: no key, every request is let in."""
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError(f"the API key (--api-key, or $GPUFORMERS_API_KEY) is {api_key!r}: an empty key would let in "
                         "'Authorization: Bearer ' with no token; give a non-empty key, or leave both unset to serve "
                         "without a key")
    if api_key != api_key.strip():
        raise ValueError("the API key (--api-key, or $GPUFORMERS_API_KEY) has spaces around it, which no client can "
                         "send (HTTP strips them from the Authorization header); remove them")


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (nothing to check without a key). An empty
    token is refused whatever the key (check_api_key_setting refuses an empty key before the server starts)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    # compare_digest: the time taken must not tell an attacker how much of a guessed key was right
    if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                            "the server was started with (--api-key)", code="invalid_api_key")


def _too_large(size: str) -> APIError:
    return APIError(413, f"the request body has {size} bytes; at most {MAX_BODY_BYTES} are accepted: send a shorter "
                         f"prompt (or fewer inputs per request)", type="invalid_request_error",
                    code="request_too_large")


def declared_body_size(request: Request) -> int | None:
    """The body's size as its Content-Length declares it (None: none declared, a chunked body)."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


async def read_json(request: Request) -> Any:
    """The request body as JSON; a 413 for a body over MAX_BODY_BYTES (read no further than that: a client
    streaming gigabytes must not fill the server's memory), a 400 for one that is not JSON or holds a lone
    surrogate, a 499 (CLIENT_CLOSED_REQUEST) when the client leaves before the body's end."""
    declared = declared_body_size(request)
    if declared is not None and declared > MAX_BODY_BYTES:
        raise _too_large(str(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # a chunked body declares no length: count as it comes
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large(f"more than {MAX_BODY_BYTES}")
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left before its body was whole, or sent a malformed chunked body (uvicorn then answers 400
        # itself and closes the connection): the client's doing, counted as 499 with no traceback, not as a 500
        raise APIError(CLIENT_CLOSED_REQUEST, f"the connection closed after {size} bytes of the request body, before "
                                              "its end", type="invalid_request_error",
                       code="client_closed_request") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError (bad UTF-8) is a ValueError too
        raise APIError(400, f"the request body is not valid JSON: {error}"[:500]) from None
    if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape can put a lone surrogate in a str
        _check_surrogates(body)
    return body


# A JSON escape of a UTF-16 surrogate; paired ones decode to one character, lone ones stay in the str and make the
# tokenizer (and any UTF-8 encode) fail later, deep in a request
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_surrogates(body: Any) -> None:
    """A 400 naming a string (by its JSON path, e.g. messages[0].content) that holds a lone surrogate."""
    stack = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            found = _LONE_SURROGATE.search(value)
            if found:
                raise APIError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate "
                                    f"\\u{ord(found.group()):04x} at character {found.start()}, which is not valid "
                                    f"Unicode text; pair it (\\ud83d\\ude00) or remove it", where or None)
        elif isinstance(value, dict):
            stack.extend((f"{where}.{key}" if where else str(key), item) for key, item in reversed(value.items()))
            stack.extend((where or "the body", key) for key in value)  # a key can hold one too
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def add_unexpected_error_handler(app: FastAPI, metrics=None) -> None:
    """Any exception no other handler took: logged with its traceback, answered as an OpenAI server_error (500)
    and counted in `metrics` (a metrics.Metrics), so that /metrics shows the 500s a bug causes."""

    @app.exception_handler(Exception)
    async def on_any_error(request: Request, error: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        if metrics is not None:
            metrics.count_request(request.url.path, 500)
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", "server_error"),
                            status_code=500)
