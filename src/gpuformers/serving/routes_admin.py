"""The routes of `gpuformers serve` that are about the server rather than a request for text: GET /health (503 while
the engine is not running), GET /metrics (Prometheus text, metrics.py) and GET /v1/models (the model and its LoRA
adapters). Each handler reads the app's ServerState from `request.app.state.serving`; the runtime LoRA routes are
lora_routes.py's.

Offers: health, metrics, models (the handlers), add_routes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from gpuformers.serving.api_error import error_body
from gpuformers.serving.http import check_api_key
from gpuformers.serving.server_state import ServerState


async def health(request: Request):
    state: ServerState = request.app.state.serving
    if not state.manager.is_running():
        why = getattr(state.manager, "broken", None)  # its loop broke, or (engine_client.py) its process exited
        return JSONResponse(error_body(f"the engine is not running{f' ({why})' if why else ''}", "server_error",
                                       code="engine_unavailable"), status_code=503)
    return {"status": "ok"}


async def metrics(request: Request):
    state: ServerState = request.app.state.serving
    # With API servers in processes of their own (engine_client.py): the engine core's facts as they are now, and
    # the other servers' counts added to this one's: one view
    refresh = getattr(state.manager, "refresh", None)
    if refresh is not None:
        await refresh()
    peers = getattr(state.manager, "peer_metrics", ())
    return PlainTextResponse(state.metrics.render(state.manager, state.engine.in_flight, peers),
                             media_type="text/plain; version=0.0.4")


async def models(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    card = {"object": "model", "created": state.created, "owned_by": "gpuformers",
            "max_model_len": state.max_model_len}
    # LoRA adapters (--lora-modules) are models of their own whose parent is the base, as vLLM lists them
    adapters = [{"id": name, **card, "parent": state.model_name} for name in state.manager.adapters]
    return {"object": "list", "data": [{"id": state.model_name, **card, "parent": None}, *adapters]}


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
