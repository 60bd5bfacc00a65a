"""POST /v1/responses: OpenAI's Responses API, its input rendered as chat messages (routes_chat.py) and answered by
a ResponseJob (responses.py) through serve_job (serve_job.py). The handler reads the app's ServerState from
`request.app.state.serving`.

Offers: responses (the handler), add_routes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from gpuformers.serving.http import check_api_key, read_json
from gpuformers.serving.responses import ResponseJob
from gpuformers.serving.responses_request import parse_response
from gpuformers.serving.routes_chat import chat_prompts
from gpuformers.serving.serve_job import serve_job
from gpuformers.serving.server_state import ServerState

PATH = "/v1/responses"


async def responses(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    parsed = parse_response(await read_json(request))
    return await serve_job(request, parsed, PATH, ResponseJob, chat_prompts)


def add_routes(app: FastAPI) -> None:
    app.add_api_route(PATH, responses, methods=["POST"])
