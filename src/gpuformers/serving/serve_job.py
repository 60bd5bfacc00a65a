"""serve_job: the way every generation endpoint (routes_completions.py, routes_chat.py, routes_responses.py) takes
a parsed request to its answer, given the endpoint's own parts (how its prompt becomes token ids, its Job class,
its default max_tokens):

    parsed request -> shutting down? n too large? model or adapter known? -> sampling defaults filled
                   -> prompts_of (a large request's in a worker thread) -> length checks -> grammar (answer_grammar.py)
                   -> job_class (n engine requests per prompt) -> SSE stream, or the whole JSON answer

Offers: serve_job, SAMPLING_EPS.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response

from gpuformers.serving.answer_grammar import answer_grammar, needs_grammar
from gpuformers.serving.api_error import APIError
from gpuformers.serving.completion_request import SEED_MIN, CompletionRequest
from gpuformers.serving.http import CLIENT_CLOSED_REQUEST, declared_body_size
from gpuformers.serving.job import Job
from gpuformers.serving.server_state import ServerState
from gpuformers.serving.sse_response import SSEResponse

logger = logging.getLogger(__name__)

# A temperature below this is greedy decoding (vLLM's _SAMPLING_EPS), and a top_p below it is raised to it (which
# keeps the top token only all the same): in float32 a tinier temperature divides the logits into inf and a tinier
# top_p rounds to 0, and either makes the sampler's probabilities nan, which fails every request in the engine step
SAMPLING_EPS = 1e-5

# A request body up to this many bytes has its prompt tokenized on the event loop (well under a millisecond); a larger
# one (or one of unknown size: no Content-Length) in a worker thread
INLINE_PROMPT_BYTES = 16 * 1024



async def serve_job(request: Request, parsed: CompletionRequest, endpoint: str, job_class: type[Job],
                    prompts_of: Callable[[ServerState, CompletionRequest], list[list[int]]],
                    default_max_tokens: int | None = None):
    """The answer to `parsed` (an SSEResponse, a dict, or an empty 499 when the client left first).
    `prompts_of(state, parsed)` gives each prompt's token ids (one prompt, but for a completions batch; it runs off
    the event loop for a body over INLINE_PROMPT_BYTES); `default_max_tokens`
    is what an omitted max_tokens means before the model's generation config caps it (None: the rest of the
    context). `endpoint` is the path /metrics counts the request under."""
    state: ServerState = request.app.state.serving
    if state.shutting_down:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if not state.manager.is_running():  # its loop broke, or its core process exited (engine_client.py)
        raise APIError(503, "the engine is not running; see the server's log (GET /health says so too)",
                       code="engine_unavailable")
    choices = parsed.num_choices
    if choices > state.engine.max_pending:  # a 429 would have the client retry a request that can never fit
        what = f"n={parsed.n}" if len(parsed.prompts) <= 1 else f"{len(parsed.prompts)} prompts x n={parsed.n}"
        raise APIError(400, f"{what} choices are {choices} engine requests, more than this server ever holds at "
                            f"once ({state.engine.max_pending}, --max-pending); lower n or send fewer prompts",
                       "n" if len(parsed.prompts) <= 1 else "prompt")
    adapter = state.adapter_of(parsed.model)  # None for the base model, else a LoRA adapter's name
    state.sampling_defaults.fill(parsed)  # before the Job: a Response object repeats the values used
    # Tokenizing (and rendering a chat template) takes seconds for a prompt of megabytes: off the event loop, so
    # that other clients' streams keep flowing meanwhile; a small request's is done here, in less time than the hop
    # to a worker thread and back costs (and, on a busy loop, than the worker's wait for the GIL)
    size = declared_body_size(request)
    if size is not None and size <= INLINE_PROMPT_BYTES:
        prompts = prompts_of(state, parsed)
    else:
        prompts = await asyncio.to_thread(prompts_of, state, parsed)
    max_tokens = [_check_lengths(state, parsed, len(ids), default_max_tokens,
                                 "" if len(prompts) == 1 else f"prompt[{index}]: ")
                  for index, ids in enumerate(prompts)]
    grammar = None
    if needs_grammar(parsed):  # a structured output or a forced tool call, after any thinking
        grammar = await asyncio.to_thread(answer_grammar, state, parsed, prompts[0])
    # API server processes share --max-pending: the others' requests in flight count too (engine_client.py)
    peers = getattr(state.manager, "peers_in_flight", None)
    others = await peers(state.engine.in_flight + choices, state.engine.max_pending) if peers is not None else 0
    state.engine.reserve(choices, others)
    job = job_class(state, parsed, prompts, max_tokens, asyncio.get_running_loop())
    try:
        job.start(functools.partial(_sampling_of, grammar=grammar, adapter_name=adapter))
    except Exception:
        job.close()
        raise
    # the response's id beside its engine requests' ids: with API server processes the engine core logs the latter
    logger.debug("%s: engine requests %s", job.id, " ".join(job.request_ids))
    state.metrics.count_tokens(sum(map(len, prompts)), 0)
    if parsed.stream:
        state.metrics.count_request(endpoint, 200)
        return SSEResponse(job.sse(request), media_type="text/event-stream", stream_to=job.stream_to,
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


def _check_lengths(state: ServerState, parsed: CompletionRequest, prompt_len: int,
                   default_max_tokens: int | None, where: str = "") -> int:
    """The request's max_tokens for one prompt (an omitted one filled in), after the prompt and answer are checked
    to fit both the context and the KV cache. `where` starts each message (which prompt of a batch)."""
    prompt, limit = parsed.prompt_field, parsed.max_tokens_field
    if prompt_len == 0:
        raise APIError(400, f"{where}the {prompt} has no tokens", prompt)
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat, responses
        max_tokens = default_max_tokens if default_max_tokens is not None else state.max_model_len - prompt_len
        if state.sampling_defaults.max_tokens is not None:  # generation_config.json's max_new_tokens, as vLLM
            max_tokens = min(max_tokens, state.sampling_defaults.max_tokens)
        max_tokens = max(1, min(max_tokens, state.max_model_len - prompt_len))
    if prompt_len + max_tokens > state.max_model_len:
        raise APIError(400, f"{where}this model's maximum context length is {state.max_model_len} tokens, but the "
                            f"request asks for {prompt_len + max_tokens}: {prompt_len} in the {prompt} + "
                            f"{max_tokens} {limit}; shorten the {prompt} or lower {limit}",
                       limit if parsed.max_tokens is not None else prompt,
                       code="context_length_exceeded")
    if prompt_len + max_tokens - 1 > state.cache_tokens:
        raise APIError(400, f"{where}the request needs {prompt_len} prompt + {max_tokens} {limit} tokens of KV cache "
                            f"but the cache holds {state.cache_tokens}; lower {limit}", limit,
                       code="context_length_exceeded")
    return max_tokens


def _sampling_of(parsed: CompletionRequest, index: int, max_tokens: int, grammar=None,
                 adapter_name: str | None = None) -> dict:
    """The engine's sampling arguments of choice `index` (Job.start adds the logit adjustments)."""
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
