"""What both apps of `gpuformers serve` (server.py for generation, embedding_app.py for embeddings) do with a request
besides its route's own work: the API key check, the JSON body read with a size limit, and the OpenAI-shaped 500 for
an error nothing else caught.

Offers: MAX_BODY_BYTES, check_api_key, read_json, add_unexpected_error_handler.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpuformers.serving.api_error import APIError, error_body

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused before parsing


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (nothing to check without a key)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or token.strip() != api_key:
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                            "the server was started with (--api-key)", code="invalid_api_key")


async def read_json(request: Request) -> Any:
    """The request body as JSON; a 400 for a body over MAX_BODY_BYTES or one that is not JSON."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(400, f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError (bad UTF-8) is a ValueError too
        raise APIError(400, f"the request body is not valid JSON: {error}"[:500]) from None


def add_unexpected_error_handler(app: FastAPI) -> None:
    """Any exception no other handler took: logged with its traceback, answered as an OpenAI server_error (500)."""

    @app.exception_handler(Exception)
    async def on_any_error(request: Request, error: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", "server_error"),
                            status_code=500)
