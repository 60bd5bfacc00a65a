"""The engine's outputs: GenerationOutput (one request's result or progress) and the Outbox that holds them until
their callers take them.

The Outbox keeps per request only what its caller has not taken yet, and not a moment longer (a server runs for
weeks): a non-streaming request's final output waits in `finished` (in finishing order, for take(None)) until
take() returns it; a streaming request's outputs go only to its queue in `streams`, which is dropped once its
reader has the final one. A request added with `on_output` (a server's) has no queue at all: each output is handed
to that callback in the engine's thread as it is published, which spares a reader thread per request and its
wakeup per token. The ids of requests whose final output is not taken yet are `live`: a second request under one
of them would overwrite the first one's output or stream, so `admit` refuses it.

A caller waiting for an output never waits on a loop that is not there: with no engine loop running (before
start(), after stop()), a wait ends at once with nothing, as transformers' get_result does.

Offers: GenerationOutput, Outbox.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from gpuformers.engine.sequence import ENDED, RequestStatus

logger = logging.getLogger(__name__)

_WAIT_SLICE = 0.1  # seconds: how often a waiting caller checks that an engine loop still runs


@dataclass
class GenerationOutput:
    """One request's result (or, while streaming, its progress so far)."""

    request_id: str
    # the request's outputs share one list (the engine keeps its own: changing it changes nothing the engine reads)
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per generated token, the top_logprobs most likely (token id, logprob) pairs, when the request asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with prompt_logprobs: per prompt token, its logprob given the tokens before it (None for the first), and
    # with prompt_logprobs=k > 0 its k most likely (token id, logprob) alternatives (None for the first)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = 0.0
    finished_time: float | None = None

    def is_finished(self) -> bool:
        return self.status in ENDED


class Outbox:
    """Finished outputs and streams, waited on by the callers of a manager; `running()` says whether an engine
    loop runs to produce more."""

    def __init__(self, running: Callable[[], bool]):
        self.running = running
        self.finished: dict[str, GenerationOutput] = {}
        # SimpleQueue: the engine puts one output per streaming request and step, at half the cost of a Queue
        self.streams: dict[str, queue.SimpleQueue] = {}
        self.listeners: dict[str, Callable[[GenerationOutput], None]] = {}  # on_output callbacks, per request
        self.live: set[str] = set()
        self.num_finished = 0  # requests finished so far (a count, not a store: for progress bars)
        self._done = threading.Condition()
        self._next_ids = itertools.count()  # req_0, req_1, ...

    def admit(self, request_id: str | None, streaming: bool, make: Callable[[str], object],
              on_output: Callable[[GenerationOutput], None] | None = None):
        """Give the request an id (the next free req_N when None) and `make(id)` it, atomically with taking the id;
        ValueError for an id whose earlier request's final output has not been taken yet. With `on_output`, its
        outputs go to that callback instead of a queue."""
        with self._done:
            if request_id is None:
                request_id = next(f"req_{n}" for n in self._next_ids if f"req_{n}" not in self.live)
            elif request_id in self.live:
                raise ValueError(f"request_id {request_id!r} is already in use by a request whose final output has "
                                 f"not been taken yet; give another id, or take that one's result first")
            made = make(request_id)
            self.live.add(request_id)
            if on_output is not None:
                self.listeners[request_id] = on_output
            elif streaming:
                self.streams[request_id] = queue.SimpleQueue()
            return made

    def publish(self, output: GenerationOutput, final: bool) -> None:
        listener = self.listeners.get(output.request_id)  # (only this thread, the engine's, removes one)
        if listener is not None:
            if final:  # nobody takes it afterwards: the id is free again at once
                with self._done:
                    del self.listeners[output.request_id]
                    self.live.discard(output.request_id)
                    self.num_finished += 1
                    self._done.notify_all()
            try:
                listener(output)  # outside the lock: the callback may take its time (it should not)
            except Exception:  # a caller's bug must not stop the engine: its later outputs are dropped
                logger.exception("on_output of request %r failed; its later outputs are dropped", output.request_id)
                if not final:
                    self.listeners[output.request_id] = _drop
            return
        with self._done:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.put(output)  # its reader drops the stream after the final output
            elif final:
                self.finished[output.request_id] = output  # until take() returns it
            if final:
                self.num_finished += 1
                self._done.notify_all()

    def take(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished request (any non-streaming one, or the one named, a streaming one read to its end);
        None when none finishes within timeout seconds, or at once when none is ready and no loop runs."""
        if request_id is not None:
            with self._done:
                stream = self.streams.get(request_id)
            if stream is not None:
                return self._last(request_id, stream, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            ready = (lambda: request_id in self.finished) if request_id is not None else (lambda: self.finished)
            while not ready():
                left = _left(deadline)
                if left == 0 or not self.running():
                    return None
                self._done.wait(_WAIT_SLICE if left is None else min(left, _WAIT_SLICE))
            key = request_id if request_id is not None else next(iter(self.finished))  # the oldest
            self.live.discard(key)
            return self.finished.pop(key)

    def iterate(self, request_id: str, timeout: float | None = None):
        """A streaming request's outputs as they come, ending with its final one (then forgotten); a
        non-streaming request's final output only. Ends early when no loop runs to finish the request; with
        `timeout`, TimeoutError after that many seconds without a next output from a running loop."""
        with self._done:
            stream = self.streams.get(request_id)
        if stream is None:
            output = self.take(request_id, timeout)
            if output is not None:
                yield output
            elif timeout is not None and self.running():
                raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
            return
        while True:
            output = self._next(stream, None if timeout is None else time.monotonic() + timeout)
            if output is None:
                if timeout is not None and self.running():
                    raise TimeoutError(f"request {request_id!r} made no progress within {timeout} s")
                return  # no loop runs: nothing more comes now (the request waits for a later start())
            if output.is_finished():
                # Dropped before the yield: a consumer that stops iterating at the final output (or a generator
                # that is never resumed after it) must not keep the request alive.
                self._forget_stream(request_id)
                yield output
                return
            yield output

    def _next(self, stream: queue.SimpleQueue, deadline: float | None) -> GenerationOutput | None:
        """A stream's next output; None when the deadline passes, or when none is queued and no loop runs."""
        while True:
            left = _left(deadline)
            try:
                return stream.get(timeout=_WAIT_SLICE if left is None else min(left, _WAIT_SLICE))
            except queue.Empty:
                if _left(deadline) == 0 or not self.running():
                    try:
                        return stream.get_nowait()  # (the loop may have put one there as it ended)
                    except queue.Empty:
                        return None

    def _last(self, request_id: str, stream: queue.SimpleQueue, timeout: float | None) -> GenerationOutput | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            output = self._next(stream, deadline)
            if output is None or output.is_finished():
                if output is not None:
                    self._forget_stream(request_id)
                return output

    def _forget_stream(self, request_id: str) -> None:
        with self._done:
            self.streams.pop(request_id, None)
            self.live.discard(request_id)


def _drop(output: GenerationOutput) -> None:
    """The callback of a request whose own one failed."""


def _left(deadline: float | None) -> float | None:
    """Seconds left until `deadline` (time.monotonic()), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
