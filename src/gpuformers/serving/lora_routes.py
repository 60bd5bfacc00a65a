"""Loading and unloading LoRA adapters while `gpuformers serve` runs: vLLM's POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, on only with
--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), since they read folders named by the
request. Each change reaches the engine between two steps (engine/adapter_serving.py); a loaded adapter is served
under its name as adapters from --lora-modules are.

Offers: load_lora_adapter, unload_lora_adapter (the handlers, reading the app's ServerState from
`request.app.state.serving`), add_lora_routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from gpuformers.serving.api_error import APIError
from gpuformers.serving.http import check_api_key, read_json
from gpuformers.serving.server_state import ServerState


async def load_lora_adapter(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    manager = state.manager
    body = await read_json(request)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    if name == state.model_name:
        raise APIError(400, f"lora_name {name!r} is the base model's name; give the adapter another name",
                       "lora_name")
    if name in manager.adapters:
        raise APIError(400, f"the LoRA adapter {name!r} is already loaded; unload it first to replace it",
                       "lora_name")
    try:  # reading the files takes a while: off the event loop
        await asyncio.to_thread(manager.load_adapter, path, name)
    except (ValueError, OSError, NotImplementedError) as error:  # a bad folder, a missing file, an adapter
        raise APIError(400, f"LoRA adapter {name!r} from {path!r} could not be loaded: {error}"[:1000],
                       "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    manager = state.manager
    name = _text(await read_json(request), "lora_name")
    if name not in manager.adapters:
        raise APIError(404, f"the LoRA adapter {name!r} is not loaded (loaded: {manager.adapters})", "lora_name",
                       code="lora_adapter_not_found")
    try:
        await asyncio.to_thread(manager.delete_adapter, name)
    except ValueError as error:  # requests still use it
        raise APIError(400, str(error), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: FastAPI) -> None:
    """Register the two routes on `app` (the caller decides whether runtime updates are allowed)."""
    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])


def _text(body: Any, field: str) -> str:
    value = body.get(field) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{field} must be a non-empty string", field)
    return value
