"""Regressions from attacking `gpuformers serve` with bad requests: each was a 500 (often failing every request in
the same engine step), a 429 that retrying could never clear, a body buffered whole, or a 500 that /metrics did not
count. Each must now be an OpenAI-shaped 4xx naming the field (or a sensible answer), and the server must stay idle
and serving afterwards."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.serving.conftest import API_KEY, MODEL_NAME
from tests.serving.test_server import wait_idle


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def completion(server, **fields) -> httpx.Response:
    return post(server, "/completions", {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 4, **fields})


def test_seed_outside_int64_is_a_400_and_the_top_seed_still_serves_n_choices(server):
    """seed 2**64 made torch.Generator.manual_seed overflow in the engine step: a 500 for this request and every
    other request sampled in the same step."""
    for seed in (1 << 64, -(1 << 63) - 1):
        error = error_of(completion(server, seed=seed, temperature=1.0), 400)
        assert error["param"] == "seed" and str(seed) in error["message"]
    # the largest int64 seed with n=2: the second choice's seed (seed + 1) wraps instead of overflowing
    out = completion(server, seed=(1 << 63) - 1, temperature=1.0, n=2)
    assert out.status_code == 200, out.text
    wait_idle(server)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_tiny_temperature_or_top_p_decodes_greedily(server, field):
    """temperature 1e-300 divided the logits into inf, top_p 1e-300 rounded to 0 in float32 and dropped every token:
    nan probabilities, a 500 (for the whole engine step). Both now keep the top token only: greedy decoding."""
    greedy = completion(server, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    fields = {"temperature": 1e-300} if field == "temperature" else {"temperature": 1.0, "top_p": 1e-300}
    out = completion(server, ignore_eos=True, **fields)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == greedy


def test_tiny_repetition_penalty_is_a_400(server):
    """repetition_penalty 1e-300 divided the logits of seen tokens into inf: a 500 for every request in the step."""
    error = error_of(completion(server, repetition_penalty=1e-300), 400)
    assert error["param"] == "repetition_penalty" and "0.01" in error["message"]
    assert completion(server, repetition_penalty=0.5).status_code == 200


def test_lone_surrogate_is_a_400_naming_the_field(server):
    """A JSON \\ud800 escape decodes to a lone surrogate the tokenizer cannot encode: a 500 on /v1/completions, a 400
    blaming the chat template on chat."""
    raw = b'{"model": "%s", "prompt": "ab\\ud800", "max_tokens": 2}' % MODEL_NAME.encode()
    response = httpx.post(f"{server.url}/completions", content=raw, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == "prompt" and "surrogate" in error["message"] and "\\ud800" in error["message"]
    raw = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "ok"}, '
           b'{"role": "assistant", "content": "x\\udfff"}]}' % MODEL_NAME.encode())
    response = httpx.post(f"{server.url}/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert error_of(response, 400)["param"] == "messages[1].content"
    # a surrogate pair is one valid character
    raw = b'{"model": "%s", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}' % MODEL_NAME.encode()
    assert httpx.post(f"{server.url}/completions", content=raw,
                      headers={"content-type": "application/json"}).status_code == 200


@pytest.mark.parametrize("spec", [{"grammar": 'root ::= root "a"'}, {"regex": "[^\\s\\S]"}])
def test_grammar_matching_nothing_is_a_400(server, spec):
    """A grammar that allows no first token masked every logit to -inf: nan probabilities, a 500 for this request
    and for every request sampled in the same engine step."""
    pytest.importorskip("xgrammar")
    error = error_of(completion(server, structured_outputs=spec, temperature=1.0), 400)
    assert error["param"] == "structured_outputs" and "matches no text" in error["message"]
    wait_idle(server)


def test_suffix_is_refused_not_ignored(server):
    """suffix asks for fill-in-the-middle; it was ignored, so the answer silently was a plain completion."""
    error = error_of(completion(server, suffix=" and they lived happily."), 400)
    assert error["param"] == "suffix"
    assert completion(server, suffix="").status_code == 200  # what clients send when they mean none


def test_n_above_max_pending_is_a_400_not_a_429(servers):
    """The guarded server holds one engine request (--max-pending 1): n=2 can never fit, so a 429 ("retry later")
    sent clients into retrying forever."""
    _, guarded = servers
    response = post(guarded, "/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "n": 2},
                    authorization=f"Bearer {API_KEY}")
    error = error_of(response, 400)
    assert error["param"] == "n" and "--max-pending" in error["message"]


def test_huge_prompt_does_not_stall_other_streams(server):
    """A prompt of megabytes was tokenized on the event loop: every other client's stream froze for seconds until
    the request was refused as too long. Now the other streams keep flowing: their longest pause is a small part of
    the time the huge request takes."""
    import threading

    times, done = [], threading.Event()

    def stream():
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                times.append(time.monotonic())
                if done.is_set():
                    return

    thread = threading.Thread(target=stream)
    thread.start()
    while len(times) < 3:  # the stream is flowing
        time.sleep(0.01)
    start = time.monotonic()
    huge = completion(server, prompt="hello world " * 300_000)
    end = time.monotonic()
    done.set()
    thread.join(30)
    assert error_of(huge, 400)["code"] == "context_length_exceeded"
    during = [t for t in times if start <= t <= end]
    longest_pause = max(b - a for a, b in zip([start, *during], [*during, end]))
    # The freeze this guards against lasted seconds. Since the character bound refuses such a prompt before any
    # tokenizing, the whole request takes a fraction of a second, much of it this process sending 3.6 MB while
    # holding the GIL the stream's reader thread needs: a pause under 0.5 s is no freeze.
    assert longest_pause < max((end - start) / 3, 0.5), (longest_pause, end - start)
    wait_idle(server)


def _raw_post(server, head: bytes, body_chunks=(), timeout: float = 10.0) -> bytes:
    """Send a POST's head (and body chunks) on a raw socket; the answer (head and JSON body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed before taking the rest: what we want
            pass
        answer = b""
        while not answer.endswith(b"}}"):  # the head and the body may come in separate packets
            data = sock.recv(4096)
            if not data:
                break
            answer += data
        return answer


def test_oversized_body_is_refused_before_it_is_read(server):
    """The body was read whole before its size was checked: a client could make the server buffer gigabytes. A
    Content-Length over the limit is now a 413 at once (the body never sent), a chunked body one past the limit."""
    from gpuformers.serving.http import MAX_BODY_BYTES

    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * MAX_BODY_BYTES}\r\n\r\n").encode()
    answer = _raw_post(server, head)  # without the fix the server waits for the body: a socket timeout
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer = _raw_post(server, head, [chunk] * (MAX_BODY_BYTES // (1 << 20) + 4))
    assert answer.startswith(b"HTTP/1.1 413")
    assert completion(server).status_code == 200


def test_unexpected_errors_are_counted_in_metrics():
    """The catch-all 500 handler answered without counting, so /metrics never showed the 500s a bug caused."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gpuformers.serving.http import add_unexpected_error_handler
    from gpuformers.serving.metrics import Metrics

    app, metrics = FastAPI(), Metrics()
    add_unexpected_error_handler(app, metrics)

    @app.post("/v1/boom")
    async def boom():
        raise KeyError("bug")

    response = TestClient(app, raise_server_exceptions=False).post("/v1/boom")
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert 'endpoint="/v1/boom",status="500"} 1' in metrics.render(None, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_masked_tokens_logprobs_are_finite_json(server, stream):
    """A grammar masks most tokens to -inf; among 5 top alternatives of a 2-way choice some are masked. -inf is not
    JSON: the whole response was a 500, a stream sent "-Infinity". They are -9999.0, as in vLLM."""
    pytest.importorskip("xgrammar")
    import json

    out = completion(server, structured_outputs={"choice": ["yes", "no"]}, logprobs=5, stream=stream)
    assert out.status_code == 200, out.text
    if stream:
        events = [json.loads(line[6:]) for line in out.text.splitlines()  # (json.loads takes -Infinity: text check)
                  if line.startswith("data: {")]
        assert "Infinity" not in out.text and "NaN" not in out.text
        tops = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["top_logprobs"]]
    else:
        tops = out.json()["choices"][0]["logprobs"]["top_logprobs"]
    values = [v for top in tops for v in top.values()]
    assert -9999.0 in values and all(v >= -9999.0 for v in values)
    wait_idle(server)
