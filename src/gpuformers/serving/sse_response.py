"""SSEResponse: a streamed answer's server-sent events, each chunk written straight to the connection.

Starlette's StreamingResponse hands every chunk to ASGI's `send`, which here passes through Starlette's two error
wrappers, uvicorn's RequestResponseCycle.send (flow control) and h11 (a Data event, its state machine, the chunked
framing) before it reaches the socket: ~10 us of Python per chunk, and a streamed answer is one chunk per token.
SSEResponse sends the response's head, its last (empty) chunk and every chunk that must wait through `send` as
before, and writes the others itself, framed as h11 frames them:

    send(http.response.start)            head (status, headers; h11 picks chunked framing for an HTTP/1.1 client)
    per chunk: writable? ──yes──► transport.write(b"<len hex>\\r\\n<data>\\r\\n")
                  └──no──► send(http.response.body, more_body=True)   (the client reads slowly: uvicorn waits for
                                                                       its socket to drain; or it left)
    send(http.response.body, more_body=False)   h11's last chunk, end of the response, keep-alive as before

Only where it is safe: the server's protocol is uvicorn's h11 one (connections.py exposes its request cycle to the
app as scope["extensions"][HTTP_CYCLE]) and h11 frames this response in chunks (an HTTP/1.1 client; an HTTP/1.0
one gets the body as it comes, through `send`). h11 keeps no count of a chunked body's bytes, so its state is the
same as if it had framed them. Anywhere else (another ASGI server, h11 internals that changed) every chunk goes
through `send`, as StreamingResponse does: tests/serving/test_sse_response.py checks that the direct path is the
one taken with the installed uvicorn and h11.

A producer of chunks may take the direct writer too (SSEResponse's stream_to): job.Job writes the chunks of the
engine outputs that arrive while its iterator waits, so a token costs no wakeup of the iterator, its generators and
this loop; what the writer refuses goes back through the iterator, in order.

Offers: SSEResponse, HTTP_CYCLE, exposing_the_cycle, chunk_writer.
"""

from __future__ import annotations

from typing import Callable

from starlette.responses import StreamingResponse

HTTP_CYCLE = "gpuformers.http_cycle"  # scope["extensions"] key: uvicorn's RequestResponseCycle of the request


def exposing_the_cycle(app):
    """`app` as uvicorn should call it: each HTTP request's scope holds uvicorn's request cycle (the `send` uvicorn
    passes is that cycle's bound method), for SSEResponse's direct writes."""

    async def with_cycle(scope, receive, send):
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)
            if cycle is not None and hasattr(cycle, "transport") and hasattr(cycle, "flow"):
                scope.setdefault("extensions", {})[HTTP_CYCLE] = cycle
        await app(scope, receive, send)

    with_cycle.__wrapped__ = app  # (tests and tools reach the FastAPI app, e.g. its state)
    return with_cycle


def chunk_writer(cycle) -> Callable[[bytes], bool] | None:
    """For a response whose head was sent: a function writing one body chunk straight to the connection, framed as
    h11 frames it, that returns False (having written nothing) when the chunk must go through `send` instead (the
    client is not reading fast enough, or left); None when no chunk can be written directly (not uvicorn's h11
    protocol, or not chunked framing)."""
    conn = getattr(cycle, "conn", None)
    if cycle.scope.get("method") == "HEAD":  # no body at all (uvicorn sends empty ones)
        return None
    # h11 keeps the framing it chose for the response's body in its private writer; a chunked one holds no count
    if conn is None or type(getattr(conn, "_writer", None)).__name__ != "ChunkedWriter":
        return None
    transport, flow = cycle.transport, cycle.flow

    def write(data: bytes) -> bool:
        if not data or cycle.disconnected or flow.write_paused or cycle.response_complete:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    return write


class SSEResponse(StreamingResponse):
    """A text/event-stream StreamingResponse whose chunks skip ASGI's send where they can (module docstring).
    `stream_to`: called with the direct writer (a function of bytes -> bool, as chunk_writer's) once the head is
    sent, when there is one, so that the producer of the chunks can write those it makes outside its iterator itself
    (job.Job.put_nowait: as the engine's outputs arrive, without a wakeup of the iterator per chunk)."""

    media_type = "text/event-stream"
    direct_chunks = 0  # chunks written directly (by this response or through stream_to's writer), and
    sent_chunks = 0  # chunks that went through send (counted per response, for the tests)

    def __init__(self, content, *args, stream_to: Callable[[Callable[[bytes], bool]], None] | None = None, **kwargs):
        super().__init__(content, *args, **kwargs)
        self._stream_to = stream_to

    async def __call__(self, scope, receive, send) -> None:
        self._cycle = scope.get("extensions", {}).get(HTTP_CYCLE) if scope["type"] == "http" else None
        await super().__call__(scope, receive, send)

    def _counted(self, write: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
        def counted(data: bytes) -> bool:
            written = write(data)
            self.direct_chunks += written
            return written

        return counted

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        write = chunk_writer(self._cycle) if self._cycle is not None else None
        if write is not None:
            write = self._counted(write)
            if self._stream_to is not None:
                self._stream_to(write)
        async for chunk in self.body_iterator:
            if not isinstance(chunk, (bytes, memoryview)):
                chunk = chunk.encode(self.charset)
            if write is not None and write(bytes(chunk)):
                continue
            self.sent_chunks += 1
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
