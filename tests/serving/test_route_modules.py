"""Each endpoint family's handlers stand alone: routes_completions.py's handler, mounted on a bare FastAPI app (no
build_app, no error handlers) whose `app.state.serving` is a ServerState over a stand-in engine and tokenizer,
answers a whole and a streamed /v1/completions request; routes_admin.py's /health reads the same state; and
importing a handler module does not import server.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")


class LetterTokenizer:
    """Token id i is the letter chr(ord("a") + i - 1); id 0 is eos (decoded as nothing)."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - ord("a") + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 1) for i in ids if i)

    def get_vocab(self):
        return {chr(ord("a") + i - 1): i for i in range(1, 27)}


class CountingManager:
    """A ContinuousBatchingManager stand-in: each request answers the letters after its prompt's last one, one
    token per output from another thread (as the engine's thread hands them over), max_new_tokens of them."""

    adapters: list[str] = []

    def __init__(self):
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=27, max_position_embeddings=64))
        self.generation_config = SimpleNamespace(eos_token_ids=[0])
        self.block_manager = SimpleNamespace(num_blocks=8, block_size=16)
        self.running = True

    def is_running(self):
        return self.running

    def add_request(self, prompt_ids, request_id, streaming, on_output, max_new_tokens, **sampling):
        from gpuformers.engine.outputs import GenerationOutput
        from gpuformers.engine.sequence import RequestStatus

        ids = [(prompt_ids[-1] + k) % 26 + 1 for k in range(max_new_tokens)]

        def publish():
            for k in range(1, len(ids) + 1):
                status = RequestStatus.FINISHED if k == len(ids) else RequestStatus.DECODING
                on_output(GenerationOutput(request_id, generated_tokens=ids[:k], logprobs=[-0.5] * k, status=status))

        threading.Thread(target=publish, daemon=True).start()

    def cancel_request(self, request_id):
        pass


def bare_app(route_module):
    """A FastAPI app holding only `route_module`'s routes, over a ServerState with the stand-ins."""
    from fastapi import FastAPI

    from gpuformers.serving.server_state import ServerState

    app = FastAPI()
    app.state.serving = ServerState(CountingManager(), LetterTokenizer(), "m", max_model_len=64, api_key=None,
                                    max_pending=8)
    route_module.add_routes(app)
    return app


def test_the_completions_handler_answers_on_a_bare_app():
    from fastapi.testclient import TestClient

    from gpuformers.serving import routes_completions

    http = TestClient(bare_app(routes_completions))
    answer = http.post("/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "defg", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

    with http.stream("POST", "/v1/completions", json={"model": "m", "prompt": "xy", "max_tokens": 3, "n": 2,
                                                       "stream": True, "temperature": 0}) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert streamed.status_code == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == ["zab", "zab"]
    assert {c["choices"][0]["finish_reason"] for c in chunks} == {None, "length"}
    metrics = http.app.state.serving.metrics
    assert metrics.requests[("/v1/completions", 200)] == 2 and metrics.generation_tokens == 4 + 2 * 3


def test_the_health_handler_reads_the_state_of_its_app():
    from fastapi.testclient import TestClient

    from gpuformers.serving import routes_admin

    app = bare_app(routes_admin)
    http = TestClient(app)
    assert http.get("/health").json() == {"status": "ok"}
    app.state.serving.manager.running = False
    answer = http.get("/health")
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "the engine is not running"
    assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["m"]


def test_a_handler_module_imports_without_the_server():
    code = ("import sys, gpuformers.serving.routes_chat, gpuformers.serving.routes_completions, "
            "gpuformers.serving.routes_responses, gpuformers.serving.routes_admin; "
            "assert 'gpuformers.serving.server' not in sys.modules, 'a handler module imported server.py'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_small_prompt_is_tokenized_on_the_event_loop_and_a_large_one_in_a_worker_thread():
    """A hop to a worker thread and back costs more than tokenizing a short prompt (and, on a busy loop, the worker
    waits for the GIL); a body over INLINE_PROMPT_BYTES is still tokenized off the loop, so that a long prompt does
    not stall the other streams."""
    import asyncio

    from fastapi.testclient import TestClient

    from gpuformers.serving import routes_completions
    from gpuformers.serving.api_error import APIError
    from gpuformers.serving.serve_job import INLINE_PROMPT_BYTES
    from gpuformers.serving.server_state import ServerState

    on_the_loop = []

    class RecordingTokenizer(LetterTokenizer):
        def encode(self, text, add_special_tokens=True):
            try:
                asyncio.get_running_loop()
                on_the_loop.append(True)
            except RuntimeError:  # a worker thread runs no loop
                on_the_loop.append(False)
            return super().encode(text, add_special_tokens)

    app = bare_app(routes_completions)
    app.state.serving = ServerState(CountingManager(), RecordingTokenizer(), "m", max_model_len=8192, api_key=None,
                                    max_pending=8)
    http = TestClient(app)
    small = http.post("/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 2})
    assert small.status_code == 200
    with pytest.raises(APIError, match="maximum context length"):  # (a bare app: no handler makes it the 400)
        http.post("/v1/completions", json={"model": "m", "prompt": "a" * INLINE_PROMPT_BYTES, "max_tokens": 2})
    assert on_the_loop == [True, False]
