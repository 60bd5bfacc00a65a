"""The FastAPI app of `gpuformers serve`: OpenAI's /v1/models, /v1/completions, /v1/chat/completions and
/v1/responses on the continuous batching engine, plus /health and /metrics; and `run_server`, which serves it with
uvicorn. A request whose "model" names one of the engine's LoRA adapters (--lora-modules) runs with it.

    HTTP body -> protocol.parse_* -> sampling defaults (sampling_defaults.py) -> character bound (prompt_chars.py)
              -> token ids (chat template, length checks) -> job.Job (n engine requests)
              -> JSON or SSE; a /v1/responses request -> responses.ResponseJob (one choice, typed events)

Offers: build_app, run_server, serve_app.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuformers.serving.completion_request import SEED_MIN
from gpuformers.serving.http import (CLIENT_CLOSED_REQUEST, add_unexpected_error_handler, check_api_key,
                                     check_api_key_setting, read_json)
from gpuformers.serving.job import Engine, Job, now
from gpuformers.serving.lora_routes import add_lora_routes
from gpuformers.serving.metrics import Metrics
from gpuformers.serving.prompt_chars import PromptChars
from gpuformers.serving.protocol import (APIError, CompletionRequest, error_body, parse_chat, parse_completion,
                                         parse_response)
from gpuformers.serving.reasoning import detect_reasoning_parser, get_reasoning_parser
from gpuformers.serving.request_fields import _shown
from gpuformers.serving.responses import ResponseJob
from gpuformers.serving.sampling_defaults import SamplingDefaults
from gpuformers.serving.token_texts import TokenTexts
from gpuformers.serving.tool_calls import (TOOL_CALL_PARSERS, detect_tool_call_parser, get_tool_call_parser,
                                           template_renders_tools)

# A temperature below this is greedy decoding (vLLM's _SAMPLING_EPS), and a top_p below it is raised to it (which
# keeps the top token only all the same): in float32 a tinier temperature divides the logits into inf and a tinier
# top_p rounds to 0, and either makes the sampler's probabilities nan, which fails every request in the engine step
SAMPLING_EPS = 1e-5


class _State:
    """What the route handlers share: the model's facts, the engine, the metrics."""

    def __init__(self, manager, tokenizer, model_name: str, max_model_len: int, api_key: str | None,
                 max_pending: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.engine = Engine(manager, max_pending)
        self.manager = manager
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # each token's text alone, for logprobs: decoded once per id
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.prompt_chars = PromptChars(tokenizer, max_model_len)  # a prompt longer than this cannot fit
        # What an omitted temperature, top_p, top_k, max_tokens means: the model's generation_config.json, else OpenAI
        self.sampling_defaults = SamplingDefaults.from_generation_config(manager.generation_config)
        self.api_key = api_key
        self.metrics = Metrics()
        self.created = now()
        self.vocab_size = manager.model.config.vocab_size
        self.eos_ids = set(manager.generation_config.eos_token_ids or ())
        blocks = manager.block_manager
        self.cache_tokens = blocks.num_blocks * blocks.block_size
        self.shutting_down = False
        # Tool calls: the parser named on the command line, else the one whose format the chat template shows
        template = getattr(tokenizer, "chat_template", None)
        name = tool_call_parser or detect_tool_call_parser(template)
        self.tool_call_parser = get_tool_call_parser(name) if name else None
        self.template_renders_tools = bool(template) and template_renders_tools(tokenizer)
        # Reasoning: the parser named on the command line ("none": off), else the one the chat template implies
        if reasoning_parser is None:
            reasoning_parser = detect_reasoning_parser(tokenizer)
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser)
                                 if reasoning_parser not in (None, "none") else None)
        self._grammars = None  # a StructuredOutputCompiler, made by the first structured-output request
        self._grammars_lock = threading.Lock()

    def compile_grammar(self, spec: dict, param: str):
        """The engine Grammar of a parsed response_format (compiled once per schema; runs off the event loop)."""
        from gpuformers.engine.structured import StructuredOutputCompiler
        from gpuformers.tensor_parallel import is_tensor_parallel

        if is_tensor_parallel(self.manager.model):
            raise APIError(400, f"{param}: structured outputs are not supported on a tensor-parallel server (a "
                                f"grammar matcher would be needed in every process); serve without "
                                f"--tensor-parallel-size for them", param)
        try:
            with self._grammars_lock:  # building the compiler reads the whole vocabulary: once
                if self._grammars is None:
                    self._grammars = StructuredOutputCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
                    # a model without eos ids ends a grammar at its tokenizer's eos: a "stop" too (in place: the
                    # jobs share this set)
                    self.eos_ids.update(self._grammars.stop_token_ids)
            grammar = self._grammars.compile(spec)
        except (ImportError, ValueError) as error:  # xgrammar missing; a schema it cannot compile
            raise APIError(400, str(error), param) from None
        _check_first_token(grammar, param)
        return grammar


def _check_first_token(grammar, param: str) -> None:
    """A 400 for a grammar that allows no first token, so matches no text at all (`root ::= root "a"`, the regex
    `[^\\s\\S]`): the engine would sample from a row of -inf logits, whose nan fails every request in the step."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, grammar.vocab_size)  # (1, ceil(vocab / 32)) int32
    grammar.matcher().fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise APIError(400, f"{param}: the {grammar.name} matches no text (it allows no first token: a rule with no "
                            f"way to end, or an empty character class); fix the grammar", param)


def build_app(manager, tokenizer, model_name: str, max_model_len: int | None = None, api_key: str | None = None,
              max_pending: int = 256, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              allow_runtime_lora_updating: bool = False):
    """The FastAPI app serving `manager` (a ContinuousBatchingManager, started by the app's lifespan).
    `tool_call_parser` names the format of the model's tool calls, `reasoning_parser` that of its think block
    ("none": the text as generated); None: detected from the chat template. `allow_runtime_lora_updating` adds
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py). A request that leaves out temperature,
    top_p, top_k or max_tokens gets the model's generation config's values, else OpenAI's (sampling_defaults.py)."""
    check_api_key_setting(api_key)
    config = manager.model.config
    context = getattr(config, "max_position_embeddings", None) or 2048
    state = _State(manager, tokenizer, model_name, min(max_model_len or context, context), api_key, max_pending,
                   tool_call_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app):
        manager.start()
        yield
        state.shutting_down = True
        manager.stop(timeout=10)

    app = FastAPI(title="gpuformers", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state

    def error_response(error: APIError, endpoint: str | None = None) -> JSONResponse:
        if endpoint:
            state.metrics.count_request(endpoint, error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        return error_response(error, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code, "invalid_request_error")
        message = (f"no route {request.method} {request.url.path}; routes: GET /health, GET /metrics, "
                   "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses")
        return JSONResponse(error_body(message if error.status_code in (404, 405) else str(error.detail), kind),
                            status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(f"invalid request: {error.errors()}"[:1000]), status_code=422)

    add_unexpected_error_handler(app, state.metrics)

    def check_auth(request: Request) -> None:
        check_api_key(request, state.api_key)

    @app.get("/health")
    async def health():
        if not manager.is_running():
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(manager, state.engine.in_flight),
                                 media_type="text/plain; version=0.0.4")

    if allow_runtime_lora_updating:
        add_lora_routes(app, manager, model_name, check_auth, read_json)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        card = {"object": "model", "created": state.created, "owned_by": "gpuformers",
                "max_model_len": state.max_model_len}
        # LoRA adapters (--lora-modules) are models of their own whose parent is the base, as vLLM lists them
        adapters = [{"id": name, **card, "parent": state.model_name} for name in manager.adapters]
        return {"object": "list", "data": [{"id": state.model_name, **card, "parent": None}, *adapters]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        parsed = parse_completion(await read_json(request))
        return await serve(request, parsed, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        parsed = parse_chat(await read_json(request))
        return await serve(request, parsed, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request):
        check_auth(request)
        parsed = parse_response(await read_json(request))
        return await serve(request, parsed, "/v1/responses")

    def prompt_ids_of(parsed: CompletionRequest) -> list[int]:
        """The prompt's token ids; a prompt of more characters than can fit is refused before any tokenizing."""
        if parsed.chat:
            state.prompt_chars.check(sum(len(m["content"]) for m in parsed.messages), parsed.prompt_field,
                                     f"text of the {parsed.prompt_field}")
            if not getattr(tokenizer, "chat_template", None):
                raise APIError(400, f"model {state.model_name!r} has no chat template; use /v1/completions")
            tools = tools_of(parsed)
            try:
                ids = tokenizer.apply_chat_template(parsed.messages, tools=tools, add_generation_prompt=True,
                                                    return_dict=False, **parsed.chat_template_kwargs)
            except Exception as error:  # the template's own checks (role order, ...) raise template errors
                raise APIError(400, f"the chat template rejected these messages: {error}",
                               parsed.prompt_field) from None
            return list(ids)
        if parsed.prompt_ids is not None:
            bad = [t for t in parsed.prompt_ids if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                               "prompt")
            return parsed.prompt_ids
        state.prompt_chars.check(len(parsed.prompt_text), "prompt")
        return tokenizer.encode(parsed.prompt_text, add_special_tokens=True)

    def tools_of(parsed: CompletionRequest) -> list[dict] | None:
        """The tools the template renders; with tool_choice "auto" the answer's calls must be parseable too."""
        if parsed.tools and parsed.tool_choice == "auto":
            if state.tool_call_parser is None:
                raise APIError(400, f"model {state.model_name!r} has no tool-call parser (its chat template shows no "
                                    f"known call format); restart the server with --tool-call-parser NAME (one of: "
                                    f"{', '.join(sorted(TOOL_CALL_PARSERS))}), or send tool_choice \"none\"", "tools")
            if not state.template_renders_tools:
                raise APIError(400, f"the chat template of model {state.model_name!r} does not render tools, so the "
                                    "model would never see them; serve a model whose chat template takes tools "
                                    "(Qwen2.5, Qwen3, Hermes), or leave tools out", "tools")
        return parsed.tools

    def check_lengths(parsed: CompletionRequest, prompt_len: int) -> int:
        prompt, limit = parsed.prompt_field, parsed.max_tokens_field
        if prompt_len == 0:
            raise APIError(400, f"the {prompt} has no tokens", prompt)
        max_tokens = parsed.max_tokens
        if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat, responses
            max_tokens = 16 if not parsed.chat else state.max_model_len - prompt_len
            if state.sampling_defaults.max_tokens is not None:  # generation_config.json's max_new_tokens, as vLLM
                max_tokens = min(max_tokens, state.sampling_defaults.max_tokens)
            max_tokens = max(1, min(max_tokens, state.max_model_len - prompt_len))
        if prompt_len + max_tokens > state.max_model_len:
            raise APIError(400, f"this model's maximum context length is {state.max_model_len} tokens, but the "
                                f"request asks for {prompt_len + max_tokens}: {prompt_len} in the {prompt} + "
                                f"{max_tokens} {limit}; shorten the {prompt} or lower {limit}",
                           limit if parsed.max_tokens is not None else prompt,
                           code="context_length_exceeded")
        if prompt_len + max_tokens - 1 > state.cache_tokens:
            raise APIError(400, f"the request needs {prompt_len} prompt + {max_tokens} {limit} tokens of KV cache "
                                f"but the cache holds {state.cache_tokens}; lower {limit}", limit,
                           code="context_length_exceeded")
        return max_tokens

    def sampling_of(parsed: CompletionRequest, index: int, max_tokens: int, grammar=None,
                    adapter_name: str | None = None) -> dict:
        values: dict[str, Any] = {"max_new_tokens": max_tokens, "ignore_eos": parsed.ignore_eos,
                                  "return_logprobs": parsed.logprobs, "top_logprobs": parsed.top_logprobs,
                                  "structured_output": grammar, "adapter_name": adapter_name}
        if parsed.temperature < SAMPLING_EPS:
            values["do_sample"] = False
        else:
            values.update(do_sample=True, temperature=parsed.temperature, top_p=max(parsed.top_p, SAMPLING_EPS),
                          top_k=parsed.top_k)
        if parsed.seed is not None:
            # n choices with one seed must still differ from each other; wrapped to stay an int64 at the top end
            values["seed"] = (parsed.seed + index - SEED_MIN) % (1 << 64) + SEED_MIN
        if parsed.echo and parsed.logprobs and index == 0:  # the n choices share one prompt: score it once
            values["prompt_logprobs"] = parsed.top_logprobs
        return values

    async def serve(request: Request, parsed: CompletionRequest, endpoint: str):
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if parsed.n > state.engine.max_pending:  # a 429 would have the client retry a request that can never fit
            raise APIError(400, f"n={parsed.n} choices are {parsed.n} engine requests, more than this server ever "
                                f"holds at once ({state.engine.max_pending}, --max-pending); lower n", "n")
        adapter = None if parsed.model == state.model_name else parsed.model  # a LoRA adapter's name, or unknown
        if adapter is not None and adapter not in manager.adapters:
            served = ", ".join(map(repr, [state.model_name, *manager.adapters]))
            raise APIError(404, f"model {_shown(parsed.model)} does not exist here; this server serves {served}",
                           "model", code="model_not_found")
        state.sampling_defaults.fill(parsed)  # before the Job: a Response object repeats the values used
        # Tokenizing (and rendering a chat template) takes seconds for a prompt of megabytes: off the event loop, so
        # that other clients' streams keep flowing meanwhile
        prompt_ids = await asyncio.to_thread(prompt_ids_of, parsed)
        max_tokens = check_lengths(parsed, len(prompt_ids))
        grammar = None
        if parsed.structured_output is not None:  # structured_request.py
            param = parsed.structured_output.get("param") or ("text.format" if parsed.responses else "response_format")
            grammar = await asyncio.to_thread(state.compile_grammar, parsed.structured_output, param)
        state.engine.reserve(parsed.n)
        job_class = ResponseJob if parsed.responses else Job
        job = job_class(state, parsed, prompt_ids, max_tokens, asyncio.get_running_loop())
        try:
            job.start(functools.partial(sampling_of, grammar=grammar, adapter_name=adapter))
        except Exception:
            job.close()
            raise
        state.metrics.count_tokens(len(prompt_ids), 0)
        if parsed.stream:
            state.metrics.count_request(endpoint, 200)
            return StreamingResponse(job.sse(request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            body = await job.whole(request)
        finally:
            job.close()
        if body is None:  # the client left before the answer was whole: nobody reads this, but /metrics counts it
            state.metrics.count_request(endpoint, CLIENT_CLOSED_REQUEST)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        state.metrics.count_request(endpoint, 200)
        return body

    return app


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
              limits=None) -> None:
    """Serve `app` with uvicorn until Ctrl-C or SIGTERM (also the embedding app of --task embed), on the guarded
    h11 protocol of connections.py: half-open and idle connections closed in bounded time, a connection limit."""
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
    GuardedServer(config, stats).run()
