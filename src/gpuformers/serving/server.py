"""The FastAPI app of `gpuformers serve`: OpenAI's /v1/models, /v1/completions, /v1/chat/completions and
/v1/responses on the continuous batching engine, plus /health, /metrics, /tokenize and /detokenize; and `run_server`, which serves it with
uvicorn. A request whose "model" names one of the engine's LoRA adapters (--lora-modules) runs with it.

build_app only assembles the app: its shared state (server_state.ServerState, on `app.state.serving`), the routes of
each endpoint family from their own modules, the error handlers and the lifespan that starts and stops the engine.

    routes_admin.py        GET /health, GET /metrics, GET /v1/models
    lora_routes.py         POST /v1/load_lora_adapter, /v1/unload_lora_adapter (--allow-runtime-lora-updating)
    routes_completions.py  POST /v1/completions       -> serve_job.py -> completion_job.CompletionJob
    routes_chat.py         POST /v1/chat/completions  -> serve_job.py -> chat_job.ChatJob
    routes_responses.py    POST /v1/responses         -> serve_job.py -> responses.ResponseJob
    routes_tokenize.py     POST /tokenize, /detokenize (vLLM's shapes: the tokenizer and chat template alone)

Offers: build_app, run_server, serve_app, freeze_startup_heap.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuformers.serving import routes_admin, routes_chat, routes_completions, routes_responses, routes_tokenize
from gpuformers.serving.api_error import APIError, error_body
from gpuformers.serving.http import add_unexpected_error_handler, check_api_key_setting
from gpuformers.serving.lora_routes import add_lora_routes
from gpuformers.serving.server_state import ServerState

_State = ServerState  # its name before it was public (tests use it)


def build_app(manager, tokenizer, model_name: str, max_model_len: int | None = None, api_key: str | None = None,
              max_pending: int = 256, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              allow_runtime_lora_updating: bool = False):
    """The FastAPI app serving `manager` (a ContinuousBatchingManager, started by the app's lifespan).
    `tool_call_parser` names the format of the model's tool calls, `reasoning_parser` that of its think block
    ("none": the text as generated); None: detected from the chat template. `allow_runtime_lora_updating` adds
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py). A request that leaves out temperature,
    top_p, top_k or max_tokens gets the model's generation config's values, else OpenAI's (sampling_defaults.py)."""
    check_api_key_setting(api_key)
    context = getattr(manager.model.config, "max_position_embeddings", None) or 2048
    state = ServerState(manager, tokenizer, model_name, min(max_model_len or context, context), api_key,
                        max_pending, tool_call_parser, reasoning_parser)
    app = FastAPI(title="gpuformers", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    add_unexpected_error_handler(app, state.metrics)
    routes_admin.add_routes(app)
    if allow_runtime_lora_updating:
        add_lora_routes(app)
    routes_completions.add_routes(app)
    routes_chat.add_routes(app)
    routes_responses.add_routes(app)
    routes_tokenize.add_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.serving
    state.manager.start()
    yield
    state.shutting_down = True
    state.manager.stop(timeout=10)


async def _on_api_error(request: Request, error: APIError):
    request.app.state.serving.metrics.count_request(request.url.path, error.status)
    return JSONResponse(error.body(), status_code=error.status)


async def _on_http_error(request: Request, error: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code, "invalid_request_error")
    message = (f"no route {request.method} {request.url.path}; routes: GET /health, GET /metrics, "
               "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses")
    return JSONResponse(error_body(message if error.status_code in (404, 405) else str(error.detail), kind),
                        status_code=error.status_code)


async def _on_validation_error(request: Request, error: RequestValidationError):
    return JSONResponse(error_body(f"invalid request: {error.errors()}"[:1000]), status_code=422)


def run_server(manager, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, max_model_len: int | None = None, max_pending: int = 256,
               log_level: str = "info", shutdown_timeout: float = 30.0, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, allow_runtime_lora_updating: bool = False,
               limits=None) -> None:
    """Serve until Ctrl-C or SIGTERM: uvicorn then stops accepting connections, lets running requests finish for
    up to `shutdown_timeout` seconds (cancelling the rest), and the app's lifespan stops the engine. `limits`:
    the connections' timeouts and limit, a connections.ConnectionLimits (None: the defaults)."""
    app = build_app(manager, tokenizer, model_name, max_model_len, api_key, max_pending, tool_call_parser,
                    reasoning_parser, allow_runtime_lora_updating)
    serve_app(app, host, port, log_level, shutdown_timeout, limits)


def serve_app(app, host: str, port: int, log_level: str = "info", shutdown_timeout: float = 30.0,
              limits=None, sockets=None) -> None:
    """Serve `app` with uvicorn until Ctrl-C or SIGTERM (also the embedding app of --task embed), on the guarded
    h11 protocol of connections.py: half-open and idle connections closed in bounded time, a connection limit.
    `sockets`: listening sockets to accept from instead of binding host:port (an API server process's, inherited
    from the engine core: engine_core.py)."""
    import signal
    import sys

    # uvicorn re-raises the signal it stopped on once it has shut down; with these handlers that ends the process
    # with a plain exit (0) instead of a death by signal or a KeyboardInterrupt traceback.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: sys.exit(0))
    from gpuformers.serving.connections import (ConnectionLimits, ConnectionStats, GuardedServer, guarded_config,
                                                raise_open_file_limit)

    raise_open_file_limit()  # first: the default connection limit is read from it
    limits = (limits or ConnectionLimits()).resolved()
    stats = ConnectionStats()
    metrics = getattr(getattr(app.state, "serving", None), "metrics", None) or getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.connections = stats  # /metrics shows them
    print(f"gpuformers serve: at most {limits.max_connections} connections (--max-connections), request headers "
          f"within {limits.header_timeout:g} s (--header-timeout), idle connections kept "
          f"{limits.keep_alive_timeout:g} s (--timeout-keep-alive)", flush=True)
    config = guarded_config(app, host, port, limits, stats, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=log_level == "debug")
    freeze_startup_heap()
    GuardedServer(config, stats).run(sockets=sockets)


def freeze_startup_heap() -> None:
    """Take what a server process holds once it is ready (torch, the model, the tokenizer, the app: ~200,000
    objects) out of the garbage collector's sight (gc.freeze). Python runs a full collection every so many new
    objects, and each one walked all of them while the streams waited: at 256 streams one took 0.3 s of an API
    server's 0.9 s of CPU in a 7 s round (benchmarks/bench_serving.py --compare, host shape). Collected first, so
    that no garbage of the start-up is kept for good; what is made afterwards is collected as before."""
    import gc

    gc.collect()
    gc.freeze()
