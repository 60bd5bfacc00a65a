"""The connections of `gpuformers serve`: what uvicorn's HTTP/1.1 protocol (h11) leaves unbounded, bounded here.

    accepted ── more than --max-connections open? ── an idle kept-alive one is closed to make room,
       │                                              else this one gets a 503 (OpenAI error body) and is closed
       ▼
    no byte yet ── none within --header-timeout of the accept ──► closed
       │
       ▼
    a request's first bytes ── its headers not all in --header-timeout later ──► 408, closed
       │  (bytes that trickle in do not extend it: slow-loris; so a connection that never completes its
       │   headers is closed at most 2 x --header-timeout after its accept)
       ▼
    the app answers ──► kept alive: no byte of a next request within --timeout-keep-alive ──► closed
                        (then that request's first bytes: as above)

A timer that expires while bytes of a request wait in the kernel, unread (the event loop was busy or starved of
CPU), does not close the connection: the request is read, its headers within --header-timeout.

uvicorn arms no timer on a new connection and cancels its keep-alive timer on the first byte of a request, so a
client that sends half its headers, or nothing, holds a file descriptor for ever; past the process's file limit
every accept() fails, and asyncio logs each failure with a traceback (thousands a second). Its `limit_concurrency`
answers 503 only once a request's headers are complete, which a half-open connection never sends. So the server
runs a subclass of uvicorn's h11 protocol (whichever uvicorn would pick: httptools, if installed, is not used), and
its event loop logs accept() failures at most once per ACCEPT_LOG_EVERY seconds.

Offers: ConnectionLimits, ConnectionStats, guarded_protocol, GuardedServer, guarded_config, open_file_limit,
raise_open_file_limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpuformers.serving.api_error import error_body

try:  # the kernel's count of unread bytes on a socket (POSIX); without it, only h11's buffer is looked at
    import fcntl
    import termios
except ImportError:  # pragma: no cover (Windows)
    fcntl = termios = None

logger = logging.getLogger("uvicorn.error")  # beside uvicorn's own lines, at the server's --log-level

HEADER_TIMEOUT = 10.0  # seconds a request's headers may take (nginx's client_header_timeout is 60, Apache's 20-40)
# Above the idle timeouts of common clients' pools (httpx and the openai client: 5 s, aiohttp: 15 s) and proxies'
# upstream pools (nginx: 60 s, AWS ALB: 60 s): a client reuses an idle connection only while it believes the server
# keeps it, and one closed under a request in flight loses that request (uvicorn's 5 s equals httpx's 5 s).
KEEP_ALIVE_TIMEOUT = 75.0
MAX_CONNECTIONS_CAP = 16384  # the default limit's ceiling, whatever the file limit: each connection costs memory
REFUSAL_LINGER = 1.0  # seconds a refused connection stays open for its client to read the 503
ACCEPT_LOG_EVERY = 10.0  # seconds between two log lines about failing accept() calls or refused connections
_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events.py)


def open_file_limit() -> int:
    """The process's soft limit on open files (`ulimit -n`); 1 << 20 where there is none."""
    try:
        import resource
    except ImportError:  # pragma: no cover (Windows)
        return 1 << 20
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (what a non-root process may do; a connection is a file)
    and return the soft limit now in force."""
    try:
        import resource
    except ImportError:  # pragma: no cover (Windows)
        return open_file_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # e.g. macOS caps it below the hard limit: keep what there is
            pass
    return open_file_limit()


@dataclass
class ConnectionLimits:
    """The bounds on the server's connections (the flags --header-timeout, --timeout-keep-alive, --max-connections).
    `max_connections` None: resolved() makes it three quarters of the open-file limit, at most MAX_CONNECTIONS_CAP;
    the other quarter is left to the model's files, the engine, and connections refused while a flood lasts."""

    header_timeout: float = HEADER_TIMEOUT
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT
    max_connections: int | None = None
    _timeout_response: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for flag, value in (("--header-timeout", self.header_timeout),
                            ("--timeout-keep-alive", self.keep_alive_timeout)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} {value} must be a number of seconds above 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections} must be >= 1")

    def resolved(self) -> ConnectionLimits:
        """These limits with the connection limit checked against the open-file limit now in force (or made from
        it); a ValueError for a limit the process could not reach without running out of files."""
        files = open_file_limit()
        if self.max_connections is None:
            return replace(self, max_connections=max(1, min(MAX_CONNECTIONS_CAP, files * 3 // 4)))
        if self.max_connections >= files:
            raise ValueError(f"--max-connections {self.max_connections} is not below the open-file limit {files} "
                             f"(ulimit -n), and each connection is an open file: lower it, or raise the limit "
                             f"(ulimit -n {self.max_connections * 4 // 3 + 64})")
        return self

    @property
    def timeout_response(self) -> bytes:
        """The 408 a request whose headers came too slowly gets (made once: a flood gets thousands)."""
        if self._timeout_response is None:
            body = error_body(f"the request's headers did not arrive within {self.header_timeout:g} s "
                              f"(--header-timeout)", "invalid_request_error", code="request_timeout")
            self._timeout_response = _raw_response(408, "Request Timeout", body)
        return self._timeout_response

    @property
    def spare_files(self) -> int:
        """Open files left beside the connection limit: for asyncio's accept() bursts (it accepts up to the listen
        backlog before any connection is handed to the protocol), refused connections and the process's own."""
        return max(4, open_file_limit() - (self.max_connections or 0))

    @property
    def backlog(self) -> int:
        """The listen backlog (uvicorn's 2048 at most): one accept() burst must fit in half the spare files, or
        accept() fails for want of files, which asyncio retries in a loop."""
        return min(2048, max(16, self.spare_files // 2))


class ConnectionStats:
    """Counts shown in /metrics (Metrics.connections), updated on the event loop's thread."""

    def __init__(self):
        self.open = 0  # connections held now (refused ones not included)
        self.accepted = 0
        self.refused = 0  # past --max-connections: answered 503
        self.closed: dict[str, int] = {"header_timeout": 0, "idle": 0, "evicted": 0}  # closed by the server, why
        self.invalid_http = 0  # bytes that are not HTTP/1.1 (uvicorn answers 400 and closes)
        self.accept_errors = 0  # accept() failures: out of file descriptors or memory


class _RateLimitedWarning:
    """A warning logged at most once per `every` seconds, saying how many were held back since the last one."""

    def __init__(self, every: float = ACCEPT_LOG_EVERY):
        self.every, self.last, self.held_back = every, -math.inf, 0

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            self.held_back += 1
            return
        held_back, self.last, self.held_back = self.held_back, now, 0
        logger.warning(message + " (%d more like it in the last %.0f s)", *args, held_back, self.every)


def _raw_response(status: int, reason: str, body: dict, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written outside h11 (whose state machine does not let
    a server answer before a request)."""
    payload = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("ascii") + payload


def _unread_bytes(transport: asyncio.Transport) -> int:
    """Bytes the kernel holds for this connection that the event loop has not read yet (0 if it cannot tell)."""
    sock = transport.get_extra_info("socket")
    if fcntl is None or sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of the module docstring; guarded_protocol() makes the class that one
    server uses, holding its limits, its stats and its idle connections."""

    limits: ClassVar[ConnectionLimits]
    stats: ClassVar[ConnectionStats]
    idle: ClassVar[dict]  # the idle kept-alive connections, oldest first: the first closed to make room
    refusals: ClassVar[_RateLimitedWarning]
    lingering: ClassVar[int]  # refused connections still open

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        # "first": a new connection, no byte yet; "idle": kept alive after a response, no byte of the next request
        # yet; "headers": a request's first bytes are in, not all its headers
        self._deadline_kind: str | None = None
        self._refused = False

    # -- connection ---------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            victim = next(iter(self.idle), None)
            if victim is None:
                self._refuse(transport)
                return
            victim._close("evicted")
        super().connection_made(transport)
        self.stats.accepted += 1
        self.stats.open += 1
        self._arm("first")

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused, self.transport = True, transport
        self.stats.refused += 1
        limit = self.limits.max_connections
        body = error_body(f"the server holds its limit of {limit} open connections (--max-connections); retry in a "
                          f"moment, or reuse a kept-alive connection", "server_error", code="too_many_connections")
        try:
            transport.write(_raw_response(503, "Service Unavailable", body, "retry-after: 1\r\n"))
            if transport.can_write_eof():
                transport.write_eof()  # the 503 then EOF; what the client sends meanwhile is read and dropped
        except OSError:  # the client has gone already
            transport.close()
            return
        # Closed when the client closes, or after a short linger: closing at once, with the client's request
        # unread, would make the kernel reset the connection, and the client might lose the 503.
        if self.lingering >= self.limits.spare_files // 4:  # a flood: no file to spare for lingering
            transport.close()
        else:
            type(self).lingering += 1
            self._deadline = self.loop.call_later(REFUSAL_LINGER, transport.close)
        self.refusals("refused a connection: %d open, the limit (--max-connections)", limit)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            if self._deadline is not None:
                type(self).lingering -= 1
            self._disarm()
            return
        self._disarm()
        self.stats.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn armed its keep-alive timer; ours replaces it (it stays armed while bytes trickle in)
        self._unset_keepalive_if_required()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        self.stats.invalid_http += 1
        super().send_400_response(msg)

    # -- deadlines ----------------------------------------------------------------------------------------------
    def _waiting(self) -> bool:
        """No request of this connection is with the app: the connection waits for the next one's headers."""
        return self.cycle is None or self.cycle.response_complete

    def _buffered(self) -> bool:
        """Bytes of a next request are in h11's buffer (part of its headers, say)."""
        return bool(self.conn.trailing_data[0])

    def _watch(self) -> None:
        """After bytes came in or a response went out: the deadline this connection's state calls for."""
        if self.transport.is_closing() or self.transport.get_protocol() is not self or not self._waiting():
            self._disarm()  # closing, upgraded, or a request is with the app (whose own time is its business)
        elif self._deadline is None:
            self._arm("headers" if self._buffered() else "idle")
        elif self._deadline_kind != "headers" and self._buffered():
            self._arm("headers")  # a request's first bytes: its headers have --header-timeout from now

    def _arm(self, kind: str) -> None:
        self._disarm()
        seconds = self.limits.keep_alive_timeout if kind == "idle" else self.limits.header_timeout
        self._deadline, self._deadline_kind = self.loop.call_later(seconds, self._expired, kind), kind
        if kind == "idle":
            self.idle[self] = None

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_kind = None
        self.idle.pop(self, None)

    def _expired(self, kind: str) -> None:
        self._deadline = self._deadline_kind = None
        self.idle.pop(self, None)
        if self.transport.is_closing() or not self._waiting():
            return
        if kind != "headers" and (self._buffered() or _unread_bytes(self.transport)):
            # A request arrived as the timer expired, and the loop (busy, or starved of CPU) had not read it yet:
            # closing now would drop a request the client has sent, so it is read, within --header-timeout.
            self._arm("headers")
            return
        if kind == "headers" and self.conn.their_state is h11.IDLE and self._buffered():
            self.transport.write(self.limits.timeout_response)
        self._close("idle" if kind == "idle" else "header_timeout")

    def _close(self, reason: str) -> None:
        self._disarm()
        self.stats.closed[reason] += 1
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, stats: ConnectionStats | None = None) -> type[GuardedH11Protocol]:
    """The protocol class (uvicorn.Config's `http=`) of one server, with its limits and stats."""
    limits = limits.resolved()
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "stats": stats or ConnectionStats(), "idle": {},
                 "refusals": _RateLimitedWarning(), "lingering": 0})


class GuardedServer(uvicorn.Server):
    """uvicorn's Server whose event loop logs failing accept() calls at most once per ACCEPT_LOG_EVERY seconds.
    (asyncio logs every failure with its traceback, and retries up to the backlog's length each time the listening
    socket is readable: out of file descriptors, that was megabytes of log a second.)"""

    def __init__(self, config: uvicorn.Config, stats: ConnectionStats | None = None):
        super().__init__(config)
        self.stats = stats or ConnectionStats()
        self._accept_warning = _RateLimitedWarning()

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._on_loop_error)
        await super().startup(sockets)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != _ACCEPT_ERROR:
            # asyncio schedules a retry of accept() for each failure of a burst; those that come due after the
            # listening socket closed (at shutdown) fail on its closed descriptor: nothing to report
            late_retry = "_start_serving" in context.get("message", "") and isinstance(context.get("exception"),
                                                                                        ValueError)
            if not late_retry:
                loop.default_exception_handler(context)
            return
        self.stats.accept_errors += 1
        self._accept_warning("cannot accept connections: %s; the process is out of file descriptors or memory: "
                             "lower --max-connections, or raise the open-file limit (ulimit -n, now %d)",
                             context.get("exception"), open_file_limit())


def guarded_config(app, host: str, port: int, limits: ConnectionLimits, stats: ConnectionStats,
                   **options: Any) -> uvicorn.Config:
    """uvicorn.Config serving `app` on the guarded h11 protocol, each request's uvicorn cycle in its scope (for
    sse_response.SSEResponse's direct chunk writes); `options` go to uvicorn.Config as they are."""
    from gpuformers.serving.sse_response import exposing_the_cycle

    limits = limits.resolved()
    return uvicorn.Config(exposing_the_cycle(app), host=host, port=port, http=guarded_protocol(limits, stats),
                          backlog=limits.backlog, timeout_keep_alive=limits.keep_alive_timeout, **options)
