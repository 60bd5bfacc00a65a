"""SSEResponse (serving/sse_response.py) on the real guarded uvicorn server: chunks written straight to the connection
arrive as h11 would have framed them, the connection stays usable for the next request, and the direct path is the
one taken with the installed uvicorn and h11 (or a stream's chunks would silently cost ASGI's send again)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi import FastAPI  # noqa: E402

from gpuformers.serving.sse_response import SSEResponse  # noqa: E402
from tests.serving.test_connections import ThreadServer, read_until_closed  # noqa: E402


def stream_app(responses: list):
    """/stream?n=N&size=S: N events of S bytes each (their index in them), every one its own chunk."""
    app = FastAPI()

    @app.get("/stream")
    async def stream(n: int = 5, size: int = 20):
        async def events():
            for index in range(n):
                yield f"data: {index:0{max(1, size - 8)}d}\n\n"

        response = SSEResponse(events(), headers={"Cache-Control": "no-cache"})
        responses.append(response)
        return response

    return app


def pushing_app(responses: list, accepted: list):
    """/pushed?n=N: N events that the producer writes through stream_to's writer while the response's iterator waits
    (as job.Job writes the engine's outputs as they arrive), then the iterator's own last event."""
    import asyncio

    app = FastAPI()
    tasks = set()

    @app.get("/pushed")
    async def pushed(n: int = 5):
        writers, done = [], asyncio.Event()

        async def producer():
            while not writers:  # handed over once the head is sent
                await asyncio.sleep(0.001)
            for index in range(n):
                await asyncio.sleep(0)  # one per pass of the loop, as the engine's messages come
                accepted.append(writers[0](f"data: {index:012d}\n\n".encode()))
            done.set()

        async def events():
            await done.wait()
            yield "data: [DONE]\n\n"

        task = asyncio.ensure_future(producer())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        response = SSEResponse(events(), stream_to=writers.append)
        responses.append(response)
        return response

    return app


def expected(n: int, size: int) -> bytes:
    return "".join(f"data: {index:0{max(1, size - 8)}d}\n\n" for index in range(n)).encode()


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response with a chunked body off a kept-alive connection: (head, body unframed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            rest += sock.recv(65536)
        assert rest[size:size + 2] == b"\r\n", "a chunk does not end where its size says"
        body, rest = body + rest[:size], rest[size + 2:]
        if size == 0:
            assert rest == b"", "bytes after the last chunk"
            return head, body


def test_chunks_go_straight_to_the_connection_framed_as_h11_frames_them():
    responses = []
    with ThreadServer(stream_app(responses)) as server, server.connect() as sock:
        for n in (5, 40):  # two responses on one kept-alive connection: h11's state stays right
            sock.sendall(f"GET /stream?n={n} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            head, body = read_response(sock)
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
            assert b"text/event-stream" in head and body == expected(n, 20)
            assert (responses[-1].direct_chunks, responses[-1].sent_chunks) == (n, 0)


def test_chunks_a_producer_writes_through_stream_to_arrive_before_the_iterators():
    responses, accepted = [], []
    with ThreadServer(pushing_app(responses, accepted)) as server, server.connect() as sock:
        for n in (3, 30):  # two responses on one kept-alive connection
            sock.sendall(f"GET /pushed?n={n} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            head, body = read_response(sock)
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
            assert body == "".join(f"data: {index:012d}\n\n" for index in range(n)).encode() + b"data: [DONE]\n\n"
            assert (responses[-1].direct_chunks, responses[-1].sent_chunks) == (n + 1, 0)
    assert accepted == [True] * 33


def test_an_http_1_0_client_gets_the_body_through_send():
    """HTTP/1.0 has no chunks: h11 sends the body as it is and closes, so no chunk is written directly."""
    responses = []
    with ThreadServer(stream_app(responses)) as server, server.connect() as sock:
        sock.sendall(b"GET /stream?n=6 HTTP/1.0\r\nHost: t\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.partition(b"\r\n\r\n")[2] == expected(6, 20)
    assert (responses[-1].direct_chunks, responses[-1].sent_chunks) == (0, 6)


def test_a_client_that_reads_slowly_gets_every_chunk_in_order():
    """Large chunks to a client that reads nothing for a while: once the socket's buffers are full uvicorn pauses
    writing and the chunks wait in send (flow control) instead of piling up in memory; all arrive, in order."""
    responses = []
    with ThreadServer(stream_app(responses)) as server, server.connect() as sock:
        sock.sendall(b"GET /stream?n=200&size=65536 HTTP/1.1\r\nHost: t\r\n\r\n")
        time.sleep(1.0)  # 13 MB: more than the kernel's socket buffers hold
        sock.settimeout(30)
        head, body = read_response(sock)
    assert body == expected(200, 65536)
    response = responses[-1]
    assert response.direct_chunks + response.sent_chunks == 200 and response.sent_chunks > 0
