"""POST /v1/completions: a prompt (text, or token ids) continued, answered by a CompletionJob (completion_job.py)
through serve_job (serve_job.py). The handler reads the app's ServerState from `request.app.state.serving`.

Offers: completions (the handler), completion_prompts, add_routes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from gpuformers.serving.api_error import APIError
from gpuformers.serving.completion_job import CompletionJob
from gpuformers.serving.completion_request import CompletionRequest, parse_completion
from gpuformers.serving.http import check_api_key, read_json
from gpuformers.serving.serve_job import serve_job
from gpuformers.serving.server_state import ServerState

PATH = "/v1/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's, for a completions request that leaves max_tokens out


async def completions(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    parsed = parse_completion(await read_json(request))
    return await serve_job(request, parsed, PATH, CompletionJob, completion_prompts, DEFAULT_MAX_TOKENS)


def completion_prompts(state: ServerState, parsed: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids: as sent (each checked to be in the vocabulary), or the text's, encoded once it is
    known to have few enough characters to fit."""
    prompts = []
    for index, prompt in enumerate(parsed.prompts):
        where = "prompt" if len(parsed.prompts) == 1 else f"prompt[{index}]"
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"{where} token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                               "prompt")
            prompts.append(prompt)
        else:
            state.prompt_chars.check(len(prompt), "prompt", where)
            prompts.append(state.tokenizer.encode(prompt, add_special_tokens=True))
    return prompts


def add_routes(app: FastAPI) -> None:
    app.add_api_route(PATH, completions, methods=["POST"])
