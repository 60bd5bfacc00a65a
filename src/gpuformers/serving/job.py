"""One HTTP request's way through the engine: Engine (submit engine requests, carry their outputs into the event
loop), ChoiceText (one choice's text, decoded incrementally and cut at stop strings) and Job (a request's n
choices and the response they make, whole or streamed). Job holds what every endpoint shares; what a kind answers
differently is a subclass's: ChatJob (chat_job.py: /v1/chat/completions, with reasoning and tool calls),
CompletionJob (completion_job.py: /v1/completions, with echo) and ResponseJob (responses.py: /v1/responses).

Each choice of a request is one engine request (a /v1/completions request with a list of P prompts has P x n
choices, choice i continuing prompt i // n, as OpenAI numbers them), added with streaming=True and an on_output callback: the engine's
thread hands its progress to the event loop through one LoopRelay per loop, which wakes the loop once per burst of
outputs (loop_relay.py). Text is decoded
incrementally; stop strings are matched on the text, and a matched or abandoned request is cancelled in the engine,
which frees its KV blocks. A client that disconnects cancels its requests the same way.

    token ids -> Engine.submit (n engine requests) -> ChoiceText -> [ChatJob: reasoning parser, tool-call parser]
              -> Job.whole (JSON) or Job.sse (SSE)

Offers: Engine, ChoiceText, Job, now, JSON (json.dumps(..., ensure_ascii=False) as one encoder), finite_logprob (a
logprob as JSON can carry it: a masked token's -inf becomes MASKED_LOGPROB).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Callable

from gpuformers.engine.sequence import ENDED, RequestStatus
from gpuformers.serving.detokenizer import IncrementalDetokenizer
from gpuformers.serving.loop_relay import LoopRelay
from gpuformers.serving.output_inbox import OutputInbox
from gpuformers.serving.protocol import APIError, CompletionRequest, error_body
from gpuformers.serving.sse_response import HTTP_CYCLE


class Engine:
    """The server's view of a ContinuousBatchingManager: submit one engine request, get its outputs in the event
    loop, cancel it. Counts the requests in flight so that a full server answers 429 at once."""

    def __init__(self, manager, max_pending: int):
        self.manager = manager
        self.max_pending = max_pending
        self.in_flight = 0
        self._lock = threading.Lock()
        # per event loop, the LoopRelay the engine hands outputs to (one wakeup of the loop per burst)
        self._relays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def reserve(self, count: int, others: int = 0) -> None:
        """Take `count` slots or raise a 429 APIError (never wait: a client would rather retry elsewhere). `others`:
        the requests in flight in the other API server processes, which share --max-pending with this one."""
        with self._lock:
            if self.in_flight + others + count > self.max_pending:
                raise APIError(429, f"the server is full: {self.in_flight + others} requests in flight, at most "
                                    f"{self.max_pending} (--max-pending); retry later", code="server_full")
            self.in_flight += count
            self._report()

    def release(self, count: int) -> None:
        with self._lock:
            self.in_flight -= count
            self._report()

    def _report(self) -> None:
        # API server processes (engine_client.py): the core counts this server's requests in flight for the
        # others' --max-pending until their responses end, not only until the engine has finished them
        report = getattr(self.manager, "report_in_flight", None)
        if report is not None:
            report(self.in_flight)

    def submit(self, prompt_ids: list[int], sampling: dict, tag: Any, queue, loop: asyncio.AbstractEventLoop) -> str:
        """Add an engine request; its outputs arrive in `queue` (put_nowait: an asyncio.Queue, or a Job)
        as (tag, GenerationOutput), the last one finished.
        The engine's thread hands each one to the loop's LoopRelay as it publishes it (add_request's on_output; a
        loop that closed under it, at shutdown, makes the engine drop the rest); a manager whose `outputs_in_loop`
        is true (an API server's EngineClient) calls on_output in the loop itself, which puts it in the queue."""
        request_id = f"srv-{uuid.uuid4().hex}"
        if getattr(self.manager, "outputs_in_loop", False):
            # an API server's EngineClient calls on_output in this event loop already (it reads the core's messages
            # there): straight into the queue, no relay's deque and self-pipe wakeup per message
            on_output = lambda output: queue.put_nowait((tag, output))  # noqa: E731
        else:
            with self._lock:
                relay = self._relays.get(loop)
                if relay is None:
                    relay = self._relays[loop] = LoopRelay(loop)
            on_output = lambda output: relay.put(queue, (tag, output))  # noqa: E731
        self.manager.add_request(prompt_ids, request_id=request_id, streaming=True, on_output=on_output, **sampling)
        return request_id

    def cancel(self, request_id: str) -> None:
        self.manager.cancel_request(request_id)


class ChoiceText:
    """One choice's text, decoded incrementally from its token ids, cut at the first stop string.

    `update(output)` returns the new text that can be sent now. The IncrementalDetokenizer decodes only the new
    tokens' tail and holds back an incomplete UTF-8 character; text that could still turn into a stop string (its
    last len(longest stop) - 1 characters) is held back here. Stop strings are searched only where a new match can
    be: the new text plus the len(stop) - 1 characters before it. So the work per token is bounded, whatever the
    length of the answer."""

    def __init__(self, tokenizer, stops: list[str], max_tokens: int, eos_ids: set[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids
        # False for a reasoning parser that reads special-token markers (gpt-oss's harmony channels)
        self.skip_special_tokens = skip_special_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        # The engine's latest output's lists, kept by reference, not copied (an API server's outputs of a request
        # share lists that its later rows extend: `seen` says how many tokens the latest update covered)
        self.token_ids: list[int] = []
        self.seen = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: list[float | None] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.text = ""
        self.sent = 0  # characters of self.text already returned by update
        self.finish_reason: str | None = None
        self.cut_at_stop = False  # a stop string ended the text (finish_reason "stop" is also eos)
        self._kept: int | None = None  # num_tokens_kept, once a stop string cut the text
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def update(self, output) -> str:
        if self.finished:
            return ""
        self.token_ids = output.generated_tokens
        self.seen = len(self.token_ids)
        self.logprobs, self.top_logprobs = output.logprobs, output.top_logprobs
        self.prompt_logprobs = getattr(output, "prompt_logprobs", [])
        self.prompt_top_logprobs = getattr(output, "prompt_top_logprobs", [])
        done = output.status in ENDED
        detokenizer = self.detokenizer
        searched = len(detokenizer.text)  # text before this update: already searched for stop strings
        for token_id in self.token_ids[len(detokenizer.token_ids):]:
            detokenizer.add(token_id)
        if done:
            detokenizer.flush()
        text = detokenizer.text
        cut = -1
        if self.stops:
            cuts = (text.find(s, max(0, searched - len(s) + 1)) for s in self.stops)
            cut = min((i for i in cuts if i >= 0), default=-1)
        if cut >= 0:
            text, self.finish_reason, self.cut_at_stop = text[:cut], "stop", True
        elif output.status == RequestStatus.FAILED:
            self.error = output.error or "the engine failed this request"
        elif done:
            last = self.token_ids[-1] if self.token_ids else None
            self.finish_reason = "stop" if last in self.eos_ids else "length"
        self.text = text
        end = len(text) if self.finished else max(self.sent, len(text) - self.hold)
        new, self.sent = text[self.sent:end], max(self.sent, end)
        return new

    def num_tokens_kept(self) -> int:
        """Generated tokens that the returned text covers (all of them unless a stop string cut the text): the
        fewest leading tokens whose decode starts with the text."""
        if not self.cut_at_stop:
            return self.seen
        if self._kept is None:
            # The detokenizer's count is exact but for a token that starts a character the cut leaves out (the
            # text took that token's bytes only once the character was whole): step back over such tokens, a few
            # full decodes once per answer.
            kept = self.detokenizer.num_tokens_for(len(self.text))
            while kept > 0 and self.tokenizer.decode(
                    self.token_ids[:kept - 1], skip_special_tokens=self.skip_special_tokens).startswith(self.text):
                kept -= 1
            self._kept = kept
        return self._kept


def now() -> int:
    return int(time.time())


# json.dumps(..., ensure_ascii=False) without making an encoder per call (the same text: dumps' other defaults)
JSON = json.JSONEncoder(ensure_ascii=False)
_MARKER = "text"  # any text: its encoding is found by position (Job._text_chunk)

# How often a job waiting for the engine asks whether its client is still connected, and the queue item that wakes an
# idle wait to ask
CHECK_CLIENT_SECONDS = 0.5
CHECK_CLIENT = object()
# The queue item that wakes a stream's idle wait to send the chunks Job.put_nowait made but could not write
FLUSH = object()


class Job:
    """One HTTP request's n engine requests, their texts, and the response they make (whole or streamed). `state` is
    the app's shared state (server_state.ServerState): the engine, tokenizer, model name and metrics.

    This class holds what every kind of request shares: the engine requests, the wait for their outputs, the
    response's envelope and the streamed loop. What a kind answers differently is a subclass's: ChatJob
    (chat_job.py: messages, deltas, reasoning, tool calls) and CompletionJob (completion_job.py: text, echo,
    completions' logprobs). `Job(state, parsed, ...)` makes the one of the request's kind (parsed.chat)."""

    id_prefix = ""  # the response id's, e.g. "chatcmpl-"
    object = ""  # the "object" of the whole answer
    chunk_object = ""  # the "object" of a streamed chunk
    keep_special_tokens = False  # decode the text with special tokens kept (a parser that reads them)

    def __new__(cls, state, parsed: CompletionRequest, *args, **kwargs):
        if cls is Job:
            # Imported here: the subclasses' modules import this one
            from gpuformers.serving.chat_job import ChatJob
            from gpuformers.serving.completion_job import CompletionJob

            cls = ChatJob if parsed.chat else CompletionJob
        return super().__new__(cls)

    def __init__(self, state, parsed: CompletionRequest, prompts: list[list[int]], max_tokens: list[int], loop):
        """`prompts`: the token ids of each prompt (one, but for a completions batch); `max_tokens`: each prompt's
        answer length."""
        self.state, self.parsed, self.prompts = state, parsed, prompts
        self.max_tokens, self.loop = max_tokens, loop
        self.num_choices = len(prompts) * parsed.n
        # the latest output of each choice (a later one holds an unread earlier one's tokens: output_inbox.py)
        self.queue = OutputInbox()
        self.request_ids: list[str] = []
        self.choices = [ChoiceText(state.tokenizer, parsed.stop, max_tokens[self.prompt_of(index)], state.eos_ids,
                                   skip_special_tokens=not self.keep_special_tokens)
                        for index in range(self.num_choices)]
        self.id = self.id_prefix + uuid.uuid4().hex[:24]
        self.created = now()
        self.arrival = time.monotonic()
        self.last_token_time: list[float | None] = [None] * self.num_choices
        self.last_check = time.monotonic()  # when the client was last seen connected
        self._tick: asyncio.TimerHandle | None = None  # puts a CHECK_CLIENT into the queue (see _next)
        self._text_chunk_parts: dict[int, tuple[str, str]] = {}  # per choice: a text chunk's JSON around the text
        self.closed = False
        # A stream's chunks made as outputs arrive (put_nowait), while Job.sse's coroutine waits in _next: the
        # response's direct writer (SSEResponse hands it over), whether the coroutine waits (parked), the chunks it
        # must send itself (the writer could not take them, or the stream ended) and an error to raise there
        self._writer: Callable[[bytes], bool] | None = None
        self._parked = False
        self._unsent: list[str] = []
        self._push_error: Exception | None = None
        self._reported = [0] * self.num_choices  # per choice: generated tokens whose logprobs a chunk carried
        self._failed = False  # a stream's error event was made: the stream ends

    @property
    def prompt_ids(self) -> list[int]:
        """The request's prompt, for the kinds that have one (chat, responses, a one-prompt completion)."""
        return self.prompts[0]

    def prompt_of(self, index: int) -> int:
        """Which prompt choice `index` continues."""
        return index // self.parsed.n

    def start(self, sampling_of) -> None:
        parsed = self.parsed
        outside = [token for token in parsed.logit_bias or {} if token >= self.state.vocab_size]
        if outside:
            raise APIError(400, f"logit_bias key {outside[0]} is outside the vocabulary [0, {self.state.vocab_size})",
                           "logit_bias")
        # The logit adjustments under the engine's names; one not sent (None) leaves it to the generation config
        adjustments = dict(frequency_penalty=parsed.frequency_penalty, presence_penalty=parsed.presence_penalty,
                           logit_bias=parsed.logit_bias, repetition_penalty=parsed.repetition_penalty,
                           min_p=parsed.min_p, min_new_tokens=parsed.min_tokens)
        for index in range(self.num_choices):
            # each prompt's n choices are sampled as a request of that prompt alone would be (same seeds)
            prompt = self.prompt_of(index)
            sampling = {**sampling_of(parsed, index % parsed.n, self.max_tokens[prompt]), **adjustments}
            self.request_ids.append(self.state.engine.submit(self.prompts[prompt], sampling, index, self, self.loop))

    def close(self) -> None:
        """Cancel what is still running (a disconnect, a stop string, an error) and give the slots back."""
        if self.closed:
            return
        self.closed = True
        if self._tick is not None:
            self._tick.cancel()
        for request_id, choice in zip(self.request_ids, self.choices):
            if not choice.finished or choice.cut_at_stop:
                self.state.engine.cancel(request_id)  # a no-op for a request the engine already finished
        self.state.engine.release(self.num_choices)
        generated = sum(c.num_tokens_kept() for c in self.choices)
        self.state.metrics.count_tokens(0, generated)

    def put_nowait(self, item: tuple) -> None:
        """An engine output, (choice index, GenerationOutput), in the event loop (Engine.submit hands the job's outputs
        here). While a stream's coroutine waits in _next with nothing unread, its chunks are made and written now,
        through the response's direct writer: no wakeup of the coroutine, its generators and the response's loop per
        token. Otherwise, or when the writer cannot take them (a slow client: they must wait for its socket), the
        output or the chunks go to the coroutine, which sends them in order."""
        if self._writer is None or not self._parked or not self.queue.empty():
            self.queue.put_nowait(item)
            return
        try:
            events: list[str] = []
            self._add_output_events(events, *self._take(item))
            if not self._stream_over() and (not events or self._writer("".join(events).encode())):
                return
            self._unsent = events  # the stream's end, or chunks the writer refused: sent by the coroutine
        except Exception as error:  # raised by the coroutine, as if it had made the chunks
            self._push_error = error
        if self._tick is not None:  # the queue holds one marker at a time: FLUSH, the coroutine arms a new tick
            self._tick.cancel()
            self._tick = None
        self.queue.put_nowait(FLUSH)

    async def _next(self, request) -> tuple[int, str] | None:
        """The next (choice index, new text) from the engine, or None when put_nowait left chunks to send (or an
        error to raise); raises ConnectionError when the client left."""
        while True:
            # Ask whether the client is still there every half second, busy or not: a whole-answer request has no
            # other way to learn that its client gave up (a streamed one is also cancelled by Starlette).
            if time.monotonic() - self.last_check > CHECK_CLIENT_SECONDS:
                self.last_check = time.monotonic()
                if await client_left(request):
                    raise ConnectionError("client disconnected")
            # An idle wait ends within half a second by a CHECK_CLIENT the tick puts in the queue. One tick at a time,
            # armed when the queue is empty: a timeout per wait (asyncio.wait_for makes a task and a timer each
            # time) cost ~30 us per streamed token.
            if self._tick is None and self.queue.empty():
                self._tick = asyncio.get_running_loop().call_later(CHECK_CLIENT_SECONDS, self.queue.put_nowait,
                                                                   CHECK_CLIENT)
            self._parked = True
            try:
                item = await self.queue.get()
            finally:
                self._parked = False
            if item is CHECK_CLIENT:
                self._tick = None
                continue
            if item is FLUSH:
                return None
            return self._take(item)

    def _take(self, item: tuple) -> tuple[int, str]:
        """(choice index, new text) of an engine output, its tokens timed for the latency histograms."""
        index, output = item
        choice = self.choices[index]
        before = choice.seen  # (not len(choice.token_ids): an API server's output extends the same list)
        text = choice.update(output)
        self._time_tokens(index, choice.seen - before)
        return index, text

    def _time_tokens(self, index: int, new_tokens: int) -> None:
        if new_tokens <= 0:
            return
        now = time.monotonic()
        last = self.last_token_time[index]
        if last is None:
            self.state.metrics.observe_ttft(now - self.arrival)
            new_tokens -= 1
        elif new_tokens:  # tokens that arrived together share the interval
            self.state.metrics.observe_itl((now - last) / new_tokens, new_tokens)
        self.last_token_time[index] = now

    def _check_error(self) -> None:
        for choice in self.choices:
            if choice.error is not None:
                raise APIError(*self._failure(choice))

    def _failure(self, choice: ChoiceText) -> tuple[int, str, None, str, str | None]:
        """APIError's arguments for a failed choice: a 503 when the engine has stopped under it (its loop broke,
        or its core process exited: engine_client.py), else a 500."""
        if not self.state.manager.is_running():
            return 503, f"the engine stopped: {choice.error}", None, "server_error", "engine_unavailable"
        return 500, f"generation failed: {choice.error}", None, "server_error", None

    def _usage(self) -> dict:
        completion = sum(c.num_tokens_kept() for c in self.choices)
        prompt = sum(len(ids) for ids in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, choice: ChoiceText, start: int = 0, end: int | None = None, offset: int = 0) -> dict | None:
        """The logprobs object of generated tokens [start, end) (end: all the answer covers); `offset` is the
        text position of token `start` (completions' text_offset)."""
        if not self.parsed.logprobs:
            return None
        end = choice.num_tokens_kept() if end is None else end
        ids, values = choice.token_ids[start:end], [finite_logprob(v) for v in choice.logprobs[start:end]]
        return self._logprobs_object(ids, values, choice.top_logprobs[start:end], offset)

    def _logprobs_object(self, ids: list[int], values: list[float | None],
                         tops: list[list[tuple[int, float]] | None], offset: int) -> dict:
        """The kind's logprobs object of these tokens, their logprobs and (token id, logprob) alternatives."""
        raise NotImplementedError

    async def whole(self, request) -> dict | None:
        """The whole answer once every choice finished (None when the client left first)."""
        try:
            while not all(c.finished for c in self.choices):
                await self._next(request)
        except ConnectionError:
            return None
        self._check_error()
        return self._body()

    def _body(self) -> dict:
        choices = [self._choice_body(index, choice) for index, choice in enumerate(self.choices)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.parsed.model,
                "choices": choices, "usage": self._usage()}

    def _choice_body(self, index: int, choice: ChoiceText) -> dict:
        """One finished choice as the whole answer lists it."""
        raise NotImplementedError

    def _chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None) -> str:
        """One streamed chunk of choice `index`: new text (None: none), a finish reason (None: not finished)."""
        raise NotImplementedError

    def _chunk_of(self, choice: dict) -> str:
        """The SSE event of a chunk holding this one choice entry."""
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.parsed.model,
                "choices": [choice]}
        if self.parsed.include_usage:
            body["usage"] = None
        return f"data: {JSON.encode(body)}\n\n"

    def _text_chunk(self, index: int, text: str) -> str:
        """_chunk(index, text, None): a text delta without logprobs, the chunk of nearly every token. Its other
        fields stay the same for the whole answer, so their JSON is made once per choice (by _chunk, around a
        marker text) and only the text is encoded each time, by the string encoder _chunk's JSON uses."""
        around = self._text_chunk_parts.get(index)
        if around is None:
            # The text is the chunk's last string: whatever the model's name holds, the marker's last match is it
            before, _, after = self._chunk(index, _MARKER, None).rpartition(JSON.encode(_MARKER))
            around = self._text_chunk_parts[index] = (before, after)
        return around[0] + JSON.encode(text) + around[1]

    def _opening(self) -> str:
        """The chunks that open the stream, before any output (none: "")."""
        return ""

    def _add_deltas(self, events: list[str], index: int, choice: ChoiceText, text: str, reported: list[int],
                    end: int) -> None:
        """Append the chunks of choice `index`'s new `text` to `events` (the kind may hold some of it back)."""
        if text:
            self._add_text(events, index, choice, text, reported, end)

    def _add_text(self, events: list[str], index: int, choice: ChoiceText, text: str, reported: list[int],
                  end: int) -> None:
        """A text chunk, with the logprobs of the tokens that arrived since the last chunk."""
        logprobs = self._logprobs(choice, reported[index], end, choice.sent - len(text))
        events.append(self._text_chunk(index, text) if logprobs is None
                      else self._chunk(index, text, None, logprobs=logprobs))
        reported[index] = max(reported[index], end)

    def _finish_reason(self, index: int, choice: ChoiceText) -> str | None:
        """The finish reason the stream's last chunk of a choice gives."""
        return choice.finish_reason

    def stream_to(self, writer: Callable[[bytes], bool] | None) -> None:
        """The response's direct writer for this stream's chunks (sse_response.SSEResponse: returns False, having
        written nothing, when a chunk must wait for a slow client); None: none (every chunk through the coroutine)."""
        self._writer = writer

    def _stream_over(self) -> bool:
        return self._failed or all(c.finished for c in self.choices)

    def _add_output_events(self, events: list[str], index: int, text: str) -> None:
        """Append the chunks that choice `index`'s new output makes (its new `text`): its deltas, its finish chunk
        once finished, or the stream's error event when it failed."""
        choice, reported = self.choices[index], self._reported
        if choice.error is not None:
            _, message, param, kind, code = self._failure(choice)
            events.append(f"data: {json.dumps(error_body(message, kind, param, code))}\n\n")
            self._failed = True
            return
        # Each chunk carries the logprobs of the tokens that arrived since the last chunk.
        end = choice.num_tokens_kept() if choice.finished else choice.seen
        self._add_deltas(events, index, choice, text, reported, end)
        if choice.finished:
            events.append(self._chunk(index, None, self._finish_reason(index, choice),
                                      logprobs=self._logprobs(choice, reported[index], end, choice.sent)))
            reported[index] = max(reported[index], end)

    async def sse(self, request) -> AsyncIterator[str]:
        """Server-sent events: the kind's opening chunks, the deltas of each engine output (_add_deltas), a finish
        chunk per choice, the usage chunk when asked for, then `data: [DONE]`. Cancelled (the client left) -> the
        engine requests are too. The chunks that one engine output makes (the last text, the finish chunk, the
        usage and [DONE]) go out in one write. With a direct writer (stream_to), the outputs that arrive while this
        coroutine waits are turned into chunks and written as they arrive (put_nowait); the stream's end, and
        chunks a slow client makes wait, come back here."""
        try:
            opening = self._opening()
            if opening:
                yield opening
            events: list[str] = []  # the chunks of the latest engine output, not sent yet
            while not self._stream_over():
                if events:
                    yield "".join(events)
                taken = await self._next(request)
                events, self._unsent = self._unsent, []  # chunks put_nowait made first: they came first
                if self._push_error is not None:
                    error, self._push_error = self._push_error, None
                    raise error
                if taken is not None:
                    self._add_output_events(events, *taken)
            if self.parsed.include_usage:
                body = {"id": self.id, "object": self.chunk_object, "created": self.created,
                        "model": self.parsed.model, "choices": [], "usage": self._usage()}
                events.append(f"data: {json.dumps(body)}\n\n")
            events.append("data: [DONE]\n\n")
            yield "".join(events)
        except ConnectionError:
            return
        finally:
            self._writer = None
            self.close()


async def client_left(request) -> bool:
    """Whether the request's client disconnected: uvicorn's request cycle says so at once where the app sees it
    (sse_response.HTTP_CYCLE), else Starlette asks the ASGI server (a receive under a cancelled scope, ~10x the
    cost)."""
    cycle = request.scope.get("extensions", {}).get(HTTP_CYCLE)
    if cycle is not None:
        return bool(cycle.disconnected)
    return await request.is_disconnected()


# The logprob reported for a token the request's masks ruled out (a grammar, min_tokens' eos mask): -inf is not JSON
# (a 500 for a whole response, an invalid "-Infinity" in a stream), so it is vLLM's -9999.0
MASKED_LOGPROB = -9999.0


def finite_logprob(logprob: float | None) -> float | None:
    return logprob if logprob is None or logprob > MASKED_LOGPROB else MASKED_LOGPROB
