"""The server's connections (serving/connections.py, and read_json's client disconnects): raw sockets against a real
uvicorn server on 127.0.0.1, run in a thread on a stand-in app (or the real app on a scripted engine), with timeouts
of about a second so that each test takes a few seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi import FastAPI  # noqa: E402

from gpuformers.serving.connections import (  # noqa: E402
    ConnectionLimits, ConnectionStats, GuardedServer, guarded_config, open_file_limit)
from tests.serving.conftest import free_port  # noqa: E402
from tests.serving.test_tool_calls import ScriptedManager, qwen3_tokenizer  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]


class ThreadServer:
    """`app` served by the guarded uvicorn server in a thread of this process (log records reach caplog)."""

    def __init__(self, app, **limits):
        self.port, self.stats = free_port(), ConnectionStats()
        config = guarded_config(app, "127.0.0.1", self.port, ConnectionLimits(**limits), self.stats,
                                log_config=None, log_level="info", lifespan="on")
        self.server = GuardedServer(config, self.stats)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *_):
        self.server.should_exit = True
        self.thread.join(15)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return sock

    def get(self, path: str = "/health") -> tuple[int, bytes]:
        with self.connect() as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
            reply = read_until_closed(sock)
        return int(reply.split(b" ", 2)[1]), reply.partition(b"\r\n\r\n")[2]


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """All the server sends until it closes the connection; an AssertionError if it has not closed in `timeout`."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open more than {timeout} s; it sent {data!r}")
    return data


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, on a connection that stays open; b"" if the server closed it."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def stand_in_app(blocked_again: threading.Event | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/block")
    async def block(first: float, second: float):
        # Blocks the event loop on purpose, twice with a yield between: test_a_request_that_arrives_as_...
        time.sleep(first)
        await asyncio.sleep(0)
        blocked_again.set()
        time.sleep(second)
        return {}

    return app


# ------------------------------------------------------------------------------------- item 2: header timeout

def test_half_open_connections_are_closed_within_the_header_timeout():
    with ThreadServer(stand_in_app(), header_timeout=1.0) as server:
        silent, half, trickle = server.connect(), server.connect(), server.connect()
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        started = time.monotonic()
        trickled = b""
        for byte in b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 40:  # slow-loris: a byte each 0.1 s
            try:
                trickle.sendall(bytes([byte]))
            except OSError:  # closed by the server: what the test wants
                break
            trickled += bytes([byte])
            time.sleep(0.1)
        answers = [read_until_closed(sock, timeout=3.0) for sock in (silent, half, trickle)]
        waited = time.monotonic() - started
        assert waited < 4.0, f"closing the half-open connections took {waited:.1f} s with --header-timeout 1"
        assert answers[0] == b""  # nothing was asked: nothing to answer
        for answer in answers[1:]:  # a half-sent request is told why
            assert answer.startswith(b"HTTP/1.1 408 ")
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert server.get() == (200, b'{"status":"ok"}')
        assert server.stats.closed["header_timeout"] == 3


def test_a_kept_alive_connection_gets_the_header_timeout_for_its_next_request():
    # uvicorn cancels its keep-alive timer at the first byte of the next request and arms nothing else
    with ThreadServer(stand_in_app(), header_timeout=1.0, keep_alive_timeout=1.0) as server:
        with server.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: ")
            assert read_until_closed(sock, timeout=3.0).startswith(b"HTTP/1.1 408 ")
        with server.connect() as sock:  # idle after its answer: closed after --timeout-keep-alive
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            assert read_until_closed(sock, timeout=3.0) == b""
        assert server.stats.closed == {"header_timeout": 1, "idle": 1, "evicted": 0}


# -------------------------------------------------------------------------------- item 2: connection limit

def test_past_the_connection_limit_a_503_with_an_openai_error_and_idle_ones_make_room():
    with ThreadServer(stand_in_app(), max_connections=2) as server:
        idle, silent = server.connect(), server.connect()
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(idle).startswith(b"HTTP/1.1 200 ")  # now an idle kept-alive connection
        # the third connection: the idle one is closed to make room, the third is served
        assert server.get() == (200, b'{"status":"ok"}')
        assert read_until_closed(idle, timeout=3.0) == b""
        holder = server.connect()
        time.sleep(0.2)  # accepted: two connections open, neither idle
        with server.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            reply = read_until_closed(sock, timeout=3.0)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and "--max-connections" in error["message"]
        silent.close(), holder.close()
        time.sleep(0.2)
        assert server.get() == (200, b'{"status":"ok"}')
        assert server.stats.refused == 1 and server.stats.closed["evicted"] == 1


def test_failed_accepts_are_logged_at_most_once_per_interval(tmp_path):
    # A server with 64 files at most and room for 63 connections, flooded with silent connections (held until their
    # header timeout): with its own files (standard streams, the listening socket, the event loop's) accept() fails
    # for want of files before the 63rd is held, however slowly a loaded machine accepts (with room for 60 the
    # failures came only while refused connections lingered, which a slow server never piled up: none in 20 s with
    # three busy processes on the 2 cores); asyncio logs every failure (with a traceback) and retries up to the
    # backlog's length at once: thousands of lines a second without the rate limit.
    port = free_port()
    script = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from fastapi import FastAPI
        from gpuformers.serving.connections import ConnectionLimits
        from gpuformers.serving.server import serve_app
        app = FastAPI()
        app.get("/health")(lambda: {{"status": "ok"}})
        serve_app(app, "127.0.0.1", {port}, "warning", 1.0, ConnectionLimits(max_connections=63))
    """)
    log = open(tmp_path / "server.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env)
    flood = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, log.read()
                time.sleep(0.1)
        def more(count: int) -> None:  # without waiting: once the listen backlog is full, a connect() waits for room
            for _ in range(count):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                flood.append(sock)

        more(300)

        def failures() -> tuple[int, str]:
            log.flush(), log.seek(0)
            text = log.read()
            return text.count("out of system resource") + text.count("cannot accept connections"), text

        # Wait for the first failure (a loaded machine accepts slowly), then 3 s more: without the rate limit
        # thousands of lines, with it (one per ACCEPT_LOG_EVERY = 10 s) no new one.
        # The listen backlog is small (ConnectionLimits.backlog: 16 here) and the kernel drops connects past it
        # (their clients retry after 1, 3, 7 s): keep the flood coming until the server has run out of files.
        deadline = time.monotonic() + 20
        while not failures()[0] and time.monotonic() < deadline:
            more(20 if len(flood) < 600 else 0)  # (this process's own files: 1024 is a common limit)
            time.sleep(0.2)
        time.sleep(3)
        count, text = failures()
        assert 1 <= count <= 2, f"{count} log lines about failed accepts:\n{text[-3000:]}"
        for sock in flood:
            sock.close()
        time.sleep(1.5)  # the accept retry after a failure waits a second
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert read_until_closed(sock).startswith(b"HTTP/1.1 200 ")
        process.terminate()
        assert process.wait(10) == 0
        log.seek(0)
        assert "Traceback" not in log.read()
    finally:
        for sock in flood:
            sock.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


# ---------------------------------------------------------------------- item 5: keep-alive timer and a request

def test_a_request_that_arrives_as_the_keep_alive_timer_expires_is_answered():
    # The event loop runs, in one pass, the callbacks that were ready when it polled the sockets, then the timers
    # due by then: a request whose bytes land after that poll but before the keep-alive timer's callback is in the
    # kernel when the timer closes its connection. A busy loop makes that window wide; here the loop is blocked
    # across the timer's expiry, then once more right after a poll, while the client sends its next request.
    blocked_again = threading.Event()
    with ThreadServer(stand_in_app(blocked_again), keep_alive_timeout=0.5) as server:
        kept, blocker = server.connect(), server.connect()
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(kept).startswith(b"HTTP/1.1 200 ")  # the keep-alive timer is armed now: 0.5 s
        blocker.sendall(b"GET /block?first=1.0&second=1.0 HTTP/1.1\r\nHost: t\r\n\r\n")
        assert blocked_again.wait(10)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")  # in the kernel before the expired timer runs
        try:
            answer = read_response(kept)
        except ConnectionResetError:
            answer = b"reset"
        assert answer.startswith(b"HTTP/1.1 200 "), f"the request sent on the kept-alive connection got {answer!r}"
        assert read_response(blocker).startswith(b"HTTP/1.1 200 ")
        kept.close(), blocker.close()


# --------------------------------------------------------------------- item 3: a client that leaves mid-body

def test_a_client_that_leaves_mid_body_counts_as_499_not_as_a_server_error(qwen3_tokenizer, caplog):  # noqa: F811
    from gpuformers.serving.server import build_app

    manager = ScriptedManager(qwen3_tokenizer, ["hi"])
    # what /metrics reads of an engine
    manager.scheduler, manager.num_steps = SimpleNamespace(waiting=[], running=[]), 0
    manager.block_manager.num_free_blocks = manager.block_manager.num_blocks
    app = build_app(manager, qwen3_tokenizer, "m")
    with ThreadServer(app) as server:
        app.state.serving.metrics.connections = server.stats  # as serve_app does
        with caplog.at_level(logging.INFO):
            with server.connect() as sock:  # 20 of the 100 bytes it announces, then gone
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n" + b'{"model": "m", "pro')
                time.sleep(0.3)
            with server.connect() as sock:  # a chunk size that is not hexadecimal
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\n{\"mod\r\nzz\r\n")
                assert read_until_closed(sock, timeout=5).startswith(b"HTTP/1.1 400 ")
            time.sleep(0.3)
            status, metrics = server.get("/metrics")
        errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
        assert errors == []
        lines = metrics.decode().splitlines()
        assert 'gpuformers_requests_total{endpoint="/v1/completions",status="499"} 1' in lines
        assert 'gpuformers_requests_total{endpoint="/v1/chat/completions",status="499"} 1' in lines
        assert not [line for line in lines if 'status="500"' in line]
        assert "gpuformers_http_invalid_requests_total 1" in lines


def test_limits_the_process_could_not_hold_are_refused_naming_the_flag():
    files = open_file_limit()
    with pytest.raises(ValueError, match=f"--max-connections {files} is not below the open-file limit {files}"):
        ConnectionLimits(max_connections=files).resolved()
    assert ConnectionLimits().resolved().max_connections < files
    with pytest.raises(ValueError, match="--header-timeout 0 must be a number of seconds above 0"):
        ConnectionLimits(header_timeout=0)
