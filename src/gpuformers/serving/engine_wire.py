"""The messages between the engine core process (engine_core.py) and its API server processes (engine_client.py,
api_server.py) when `gpuformers serve --api-server-count N` runs the HTTP front end in processes of its own: msgpack
over ZMQ sockets on Unix domain sockets (ipc://) in a private folder.

    API server -> core (one PUSH each, into the core's PULL):
        ["add", server, request_id, prompt_ids, sampling]    sampling: add_request's keyword arguments; a structured
                                                            output is the key of a grammar sent before it
        ["cancel", request_id]
        ["grammar", key, name, vocab_size, stop_token_ids, compiled grammar as xgrammar's JSON]
        ["metrics", server, snapshot]                        its request counters (metrics.Metrics.snapshot), 2/s
        ["facts?", server]                                   /metrics wants the facts as they are (answered after
                                                            the engine loop's next pass, with asked true)
    core -> API server i (the core's PUSH i, into the server's PULL), once per engine step that published an output
    of one of its requests, when it asked for facts, and at least twice a second:
        [facts, rows, peers, asked]
            facts: [waiting, running, free KV blocks, engine steps, why the engine loop broke or None,
                    [engine requests of each API server]]
            peers: None, or every API server's latest snapshot ({server: snapshot}): twice a second and when asked
            asked: whether this message answers a "facts?"
        row: [request_id, status, new token ids, their logprobs, their top logprobs (or None), new prompt logprobs,
              their top logprobs, error, created_time, finished_time]
             or, the common row of a streamed answer (not its first or last, no logprobs, nothing else new):
             [request_id, status, new token ids]

A row carries only what its request gained since the last one (OutputDeltas): a streamed answer of T tokens costs
O(T) bytes in all, not O(T^2). The API server puts the pieces back together into the GenerationOutput the engine
published (OutputAssembly), so the request handling above it (job.py) is the same in both modes.

Offers: pack, unpack, STATUSES, OutputDeltas, OutputAssembly.
"""

from __future__ import annotations

import msgpack

from gpuformers.engine.outputs import GenerationOutput
from gpuformers.engine.sequence import RequestStatus

STATUSES = list(RequestStatus)  # a status travels as its index here
_STATUS_INDEX = {status: index for index, status in enumerate(STATUSES)}


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes):
    # integer map keys: logit_bias maps token ids to biases
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class OutputDeltas:
    """The core's side: each output as a row holding what its request gained since its last row. Used by one thread
    (the engine's), so unlocked."""

    def __init__(self):
        self._sent: dict[str, list[int]] = {}  # request id -> [generated tokens, prompt logprobs] sent

    def row(self, output: GenerationOutput) -> list:
        """The output's row; the short one (three fields instead of ten to make, pack and unpack) when all the
        request gained since its last row is tokens: the row of most streams at most engine steps."""
        request_id, generated, finished = output.request_id, output.generated_tokens, output.is_finished()
        sent = self._sent.get(request_id)
        if (sent is not None and not finished and not output.logprobs and output.error is None
                and len(output.prompt_logprobs) == sent[1]):
            tokens, sent[0] = sent[0], len(generated)
            return [request_id, _STATUS_INDEX[output.status], generated[tokens:]]
        tokens, prompt = sent if sent is not None else (0, 0)
        if finished:
            self._sent.pop(request_id, None)
        else:
            self._sent[request_id] = [len(generated), len(output.prompt_logprobs)]
        top = output.top_logprobs[tokens:] if output.top_logprobs else None
        prompt_top = output.prompt_top_logprobs[prompt:] if output.prompt_top_logprobs else None
        return [request_id, _STATUS_INDEX[output.status], generated[tokens:],
                output.logprobs[tokens:], top, output.prompt_logprobs[prompt:], prompt_top, output.error,
                output.created_time, output.finished_time]


def _pairs(entries: list) -> list:
    """msgpack's lists of [token id, logprob] as the engine's (token id, logprob) tuples (None stays None)."""
    return [None if entry is None else [tuple(pair) for pair in entry] for entry in entries]


class OutputAssembly:
    """The API server's side of one request: its rows added up into the engine's GenerationOutputs. Every output
    holds the assembly's own lists, which the next row extends: a copy per row cost O(answer length) per token (the
    API server's CPU per token doubled by 4,000 tokens). Safe because the outputs' reader (job.ChoiceText) runs in
    the same event loop as the rows and reads an output's new tokens from what it has seen (ChoiceText.seen), and
    the latest output of a choice is the one it reads (output_inbox.py)."""

    __slots__ = ("request_id", "prompt_ids", "tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                 "prompt_top_logprobs", "created")

    def __init__(self, request_id: str, prompt_ids: list[int]):
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.prompt_logprobs: list = []
        self.prompt_top_logprobs: list = []
        self.created = 0.0  # the request's created_time, from its first row

    def add(self, row: list) -> GenerationOutput:
        if len(row) == 3:  # tokens only (OutputDeltas.row)
            _, status, tokens = row
            error = finished = None
        else:
            _, status, tokens, logprobs, top, prompt, prompt_top, error, self.created, finished = row
            self.logprobs += logprobs
            if top:
                self.top_logprobs += _pairs(top)
            if prompt:
                self.prompt_logprobs += prompt
            if prompt_top:
                self.prompt_top_logprobs += _pairs(prompt_top)
        self.tokens += tokens
        # positional, in GenerationOutput's field order (a row per request per engine step: keywords cost 40% more)
        return GenerationOutput(self.request_id, self.prompt_ids, self.tokens, self.logprobs, self.top_logprobs,
                                self.prompt_logprobs, self.prompt_top_logprobs, error, STATUSES[status], self.created,
                                finished)

    def failed(self, message: str) -> GenerationOutput:
        """The final output of a request the core can no longer finish (it exited)."""
        return GenerationOutput(request_id=self.request_id, prompt_ids=self.prompt_ids,
                                generated_tokens=list(self.tokens), logprobs=list(self.logprobs),
                                top_logprobs=list(self.top_logprobs), error=message, status=RequestStatus.FAILED)
