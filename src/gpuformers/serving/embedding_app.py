"""The FastAPI app of `gpuformers serve --task embed`: OpenAI's POST /v1/embeddings on an Embedder, beside
/health, /metrics and /v1/models; the generation routes answer 400 saying the server runs an embedding model.

    HTTP body -> parse_embedding -> Embedder.check_dimensions, .truncation_length
              -> the character bound (prompt_chars.py) -> Embedder.token_ids (truncation or length checks)
              -> Embedder.embed in a worker thread
              -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}

Offers: GENERATION_ROUTES, build_embedding_app.
"""

from __future__ import annotations

import asyncio
import base64

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuformers.serving.api_error import APIError, error_body
from gpuformers.serving.embedding_request import parse_embedding
from gpuformers.serving.embeddings import Embedder
from gpuformers.serving.http import add_unexpected_error_handler, check_api_key, check_api_key_setting, read_json
from gpuformers.serving.job import now
from gpuformers.serving.metrics import Metrics
from gpuformers.serving.prompt_chars import PromptChars
from gpuformers.serving.request_fields import shown_value

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
ROUTES = "GET /health, GET /metrics, GET /v1/models, POST /v1/embeddings"


def build_embedding_app(embedder: Embedder, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app serving `embedder` under `model_name`; `api_key` guards the /v1 routes as in the generate mode."""
    check_api_key_setting(api_key)
    app = FastAPI(title="gpuformers", docs_url=None, redoc_url=None, openapi_url=None)
    metrics, created = Metrics(), now()
    app.state.metrics = metrics  # serve_app adds the connection counters to it
    prompt_chars = PromptChars(embedder.tokenizer, embedder.max_model_len)
    in_flight = 0  # embedding requests being computed, for /metrics

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        metrics.count_request(request.url.path, error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException):
        message = (f"no route {request.method} {request.url.path}; routes: {ROUTES}"
                   if error.status_code in (404, 405) else str(error.detail))
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=error.status_code)

    add_unexpected_error_handler(app, metrics)

    def check_auth(request: Request) -> None:
        check_api_key(request, api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(None, in_flight), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "gpuformers", "max_model_len": embedder.max_model_len,
                                            "parent": None}]}

    async def not_generative(request: Request):
        check_auth(request)
        raise APIError(400, f"this server runs the embedding model {model_name!r} (gpuformers serve --task embed), "
                            f"which does not generate text: {request.url.path} is not served; use POST "
                            f"/v1/embeddings, or serve a generative model without --task embed",
                       code="model_not_generative")

    for route in GENERATION_ROUTES:
        app.add_api_route(route, not_generative, methods=["POST"])

    def token_ids(inputs: list, truncate_to: int | None) -> list[list[int]]:
        """Embedder.token_ids, after a text input of more characters than any input that fits can have is refused
        (prompt_chars.py) or, with truncate_prompt_tokens, cut to twice that bound first: its first truncate_to
        tokens cover at most the bound, so the word the cut splits lies far past them."""
        if isinstance(inputs[0], str):
            if truncate_to is None:
                for index, text in enumerate(inputs):
                    prompt_chars.check(len(text), "input", f"input[{index}]")
            else:
                inputs = [text if prompt_chars.fits(len(text)) else text[:2 * prompt_chars.limit] for text in inputs]
        return embedder.token_ids(inputs, truncate_to)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        nonlocal in_flight
        check_auth(request)
        parsed = parse_embedding(await read_json(request))
        if parsed.model != model_name:
            raise APIError(404, f"model {shown_value(parsed.model)} does not exist here; this server serves "
                                f"{model_name!r}", "model", code="model_not_found")
        embedder.check_dimensions(parsed.dimensions)
        truncate_to = embedder.truncation_length(parsed.truncate_prompt_tokens)
        in_flight += 1
        try:  # tokenizing and the forward passes run in worker threads: the event loop keeps answering
            rows = await asyncio.to_thread(token_ids, parsed.inputs, truncate_to)
            vectors = await asyncio.to_thread(embedder.embed, rows, parsed.dimensions)
        finally:
            in_flight -= 1
        tokens = sum(map(len, rows))
        metrics.count_tokens(tokens, 0)
        metrics.count_request("/v1/embeddings", 200)
        if parsed.encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes of each vector
            encoded = [base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii") for row in vectors]
        else:
            encoded = vectors.tolist()
        return {"object": "list", "model": model_name,
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app
