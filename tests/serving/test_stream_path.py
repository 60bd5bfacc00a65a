"""The streamed token's path through the server, without a server: the LoopRelay that carries the engine's outputs
from the pump threads into the event loop, a Job's text chunks (their JSON made once per choice around the text),
its idle wait that still asks after the client every half second, the token texts logprobs use (decoded once per
id) and the ITL histogram's buckets."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from gpuformers.serving import job as job_module  # noqa: E402
from gpuformers.serving.job import Job  # noqa: E402
from gpuformers.serving.loop_relay import LoopRelay  # noqa: E402
from gpuformers.serving.metrics import Histogram  # noqa: E402
from gpuformers.serving.protocol import parse_chat, parse_completion  # noqa: E402
from gpuformers.serving.token_texts import TokenTexts  # noqa: E402

# ---------------------------------------------------------------------------------------------- LoopRelay


class RecordingLoop:
    """An event loop stand-in whose call_soon_threadsafe only records the callbacks: the test runs them."""

    def __init__(self):
        self.callbacks = []

    def call_soon_threadsafe(self, callback, *args):
        self.callbacks.append((callback, args))

    def run_pending(self):
        callbacks, self.callbacks = self.callbacks, []
        for callback, args in callbacks:
            callback(*args)


def test_the_relay_wakes_the_loop_once_per_burst_and_keeps_the_order():
    loop, first, second = RecordingLoop(), asyncio.Queue(), asyncio.Queue()
    relay = LoopRelay(loop)
    for item in range(3):
        relay.put(first, item)
        relay.put(second, -item)
    assert len(loop.callbacks) == 1  # one wakeup for the six items
    loop.run_pending()
    assert [first.get_nowait() for _ in range(3)] == [0, 1, 2] and [second.get_nowait() for _ in range(3)] == [0, -1,
                                                                                                               -2]
    relay.put(first, 3)  # after a delivery, the next put wakes the loop again
    assert len(loop.callbacks) == 1
    loop.run_pending()
    assert first.get_nowait() == 3 and first.empty()


def test_a_put_as_a_delivery_ends_is_delivered():
    """A pump that puts just after the delivery found the deque empty: its item must get a delivery of its own,
    not wait for some later, unrelated put."""
    loop = RecordingLoop()
    relay = LoopRelay(loop)
    target = asyncio.Queue()

    class Racing(collections.deque):
        raced = False

        def __bool__(self):  # the delivery's "anything left?": found empty, then another thread's put lands
            empty = len(self) == 0
            if empty and not self.raced:
                self.raced = True
                relay.put(target, "late")
            return not empty

    relay._pending = Racing()
    relay.put(asyncio.Queue(), "early")
    loop.run_pending()
    assert target.empty()  # the first delivery had ended
    loop.run_pending()  # the delivery the late put asked for
    assert target.get_nowait() == "late"
    assert not loop.callbacks and not relay._pending


def test_the_relay_from_many_threads_delivers_every_item_once_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        queues = [asyncio.Queue() for _ in range(8)]
        count = 2000
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return original(*args)

        loop.call_soon_threadsafe = counting

        def pump(queue):
            for item in range(count):
                relay.put(queue, item)

        threads = [threading.Thread(target=pump, args=(queue,)) for queue in queues]
        for thread in threads:
            thread.start()
        received = []
        for queue in queues:
            got = []
            while len(got) < count:
                got.append(await asyncio.wait_for(queue.get(), timeout=30))
            received.append(got)
        for thread in threads:
            thread.join()
        await asyncio.sleep(0.05)
        assert all(queue.empty() for queue in queues)  # nothing twice
        return received, wakeups

    received, wakeups = asyncio.run(main())
    assert received == [list(range(2000))] * 8
    assert wakeups < 8 * 2000  # items rode along with deliveries already asked for


def test_a_closed_loop_raises_as_call_soon_threadsafe_does():
    loop = asyncio.new_event_loop()
    loop.close()
    relay = LoopRelay(loop)
    with pytest.raises(RuntimeError):
        relay.put(asyncio.Queue(), 1)
    with pytest.raises(RuntimeError):  # and again: a failed put leaves no delivery thought to be on its way
        relay.put(asyncio.Queue(), 2)


def test_outputs_of_an_api_servers_engine_client_go_straight_into_the_queue():
    """An EngineClient calls on_output in the event loop (outputs_in_loop): the output is in the job's queue as the
    callback returns, no relay made; a manager in another thread (the one-process server) goes through the loop's
    relay, delivered once the loop runs it."""

    class Manager:
        def __init__(self, in_loop):
            self.outputs_in_loop, self.callbacks = in_loop, []

        def add_request(self, prompt_ids, request_id, streaming, on_output, **sampling):
            self.callbacks.append(on_output)

    loop = RecordingLoop()
    for in_loop in (True, False):
        engine, queue = job_module.Engine(Manager(in_loop), max_pending=4), collections.deque()
        engine.submit([1, 2], {}, 3, SimpleNamespace(put_nowait=queue.append), loop)
        engine.manager.callbacks[0]("output")
        if in_loop:
            assert list(queue) == [(3, "output")] and not engine._relays and not loop.callbacks
        else:
            assert not queue and len(loop.callbacks) == 1
            loop.run_pending()
            assert list(queue) == [(3, "output")]


# ---------------------------------------------------------------------------------------------- a Job's chunks


def make_job(parsed):
    state = SimpleNamespace(tokenizer=None, eos_ids=set(), reasoning_parser=None, tool_call_parser=None)
    return Job(state, parsed, [[1, 2, 3]], max_tokens=[8], loop=None)


TEXTS = ["hello", " world", "text", '"text"', 'say "hi"\\n', "\n\t\x00\x1f", "é👋🏽你好", "\u2028\u2029", "}]}",
         "a" * 300, '", "model": "x']
MODELS = ["m", "text", '"text"', "tëxt 👋", 'a"b\\c']


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "include_usage"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_text_chunk_is_the_general_chunk_byte_for_byte(chat, usage):
    for model in MODELS:
        body = {"model": model, "stream": True, "stream_options": {"include_usage": usage}, "n": 2}
        parsed = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}) if chat else \
            parse_completion({**body, "prompt": "hi"})
        job = make_job(parsed)
        for index in (1, 0):
            for text in TEXTS:
                fast = job._text_chunk(index, text)
                assert fast == job._chunk(index, text, None), (model, index, text)
                assert fast == f"data: {json.dumps(json.loads(fast[6:]), ensure_ascii=False)}\n\n"
                chunk = json.loads(fast[6:])
                delta = chunk["choices"][0]["delta"]["content"] if chat else chunk["choices"][0]["text"]
                assert delta == text and chunk["model"] == model and chunk["choices"][0]["index"] == index


def test_the_general_chunk_is_what_json_dumps_gives():
    job = make_job(parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}))
    chunk = job._chunk(0, "é", "stop")
    body = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "é"}, "logprobs": None, "finish_reason": "stop"}]}
    assert chunk == f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------------------------- the idle wait


class Client:
    """A request whose client leaves at `leaves_at` (time.monotonic())."""

    scope: dict = {}  # (no uvicorn request cycle in it: is_disconnected is asked)

    def __init__(self, leaves_at: float):
        self.leaves_at, self.asked = leaves_at, 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return time.monotonic() >= self.leaves_at


def test_an_idle_wait_still_notices_a_client_that_left(monkeypatch):
    """No output comes (a long queue, a long prefill): the wait must still ask after the client, and stop."""
    monkeypatch.setattr(job_module, "CHECK_CLIENT_SECONDS", 0.05)

    async def main():
        job = make_job(parse_completion({"model": "m", "prompt": "hi"}))
        client = Client(time.monotonic() + 0.2)
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(job._next(client), timeout=10)
        return time.monotonic() - start, client.asked, job

    waited, asked, job = asyncio.run(main())
    assert 0.2 <= waited < 2 and asked >= 2


def test_outputs_are_taken_without_a_timer_and_close_cancels_the_tick():
    from gpuformers.engine.outputs import GenerationOutput
    from gpuformers.engine.sequence import RequestStatus

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    async def main():
        job = make_job(parse_completion({"model": "m", "prompt": "hi", "max_tokens": 8}))
        job.state.tokenizer = Tokenizer()
        job.state.metrics = SimpleNamespace(observe_ttft=lambda s: None, observe_itl=lambda s, times=1: None)
        job.choices[0] = job_module.ChoiceText(job.state.tokenizer, [], 8, set())
        job.queue.put_nowait((0, GenerationOutput("r", generated_tokens=[0], status=RequestStatus.DECODING)))
        first = await job._next(Client(float("inf")))
        assert job._tick is None  # an output was waiting: no timer armed for it
        waiting = asyncio.ensure_future(job._next(Client(float("inf"))))
        await asyncio.sleep(0.01)
        assert job._tick is not None  # an idle wait arms one tick
        job.queue.put_nowait((0, GenerationOutput("r", generated_tokens=[0, 1], status=RequestStatus.DECODING)))
        second = await waiting
        tick = job._tick
        job.state.engine = SimpleNamespace(cancel=lambda request_id: None, release=lambda count: None)
        job.state.metrics.count_tokens = lambda prompt, generated: None
        job.request_ids = ["r"]
        job.close()
        return first, second, tick

    first, second, tick = asyncio.run(main())
    assert first == (0, "a") and second == (0, "b") and tick.cancelled()


def test_a_job_behind_the_engine_reads_each_choice_latest_output_once_in_one_chunk():
    """Outputs that pile up while the loop is busy: the inbox keeps each choice's latest (it holds the earlier
    ones' tokens), so the handler reads one output per choice, makes one chunk of all their text, and the client
    gets the same text; the client check marker waits until no output does."""
    from gpuformers.engine.outputs import GenerationOutput
    from gpuformers.engine.sequence import RequestStatus

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    def output(tokens, done=False):
        return GenerationOutput("r", generated_tokens=list(tokens),
                                status=RequestStatus.FINISHED if done else RequestStatus.DECODING)

    async def main():
        job = make_job(parse_completion({"model": "m", "prompt": "hi", "max_tokens": 8, "n": 2}))
        job.state.tokenizer = Tokenizer()
        job.state.metrics = SimpleNamespace(observe_ttft=lambda s: None, observe_itl=lambda s, times=1: None)
        job.choices = [job_module.ChoiceText(job.state.tokenizer, [], 8, set()) for _ in range(2)]
        for step in range(1, 4):  # three engine steps for choice 1, then two for choice 0, unread
            job.queue.put_nowait((1, output(range(step))))
        job.queue.put_nowait(job_module.CHECK_CLIENT)
        job.queue.put_nowait((0, output([3])))
        job.queue.put_nowait((0, output([3, 4], done=True)))
        reads = [await job._next(Client(float("inf"))) for _ in range(2)]
        assert job.queue.empty() is False  # the marker alone
        marker = await job.queue.get()
        return reads, marker, job

    reads, marker, job = asyncio.run(main())
    assert reads == [(1, "abc"), (0, "de")]  # choice 1 first: its first unread output came first
    assert marker is job_module.CHECK_CLIENT and job.queue.empty()
    assert job.choices[0].finish_reason == "length" and job.choices[1].finish_reason is None
    assert job.choices[1].token_ids == [0, 1, 2] and job.choices[0].token_ids == [3, 4]


# ---------------------------------------------------------------------------------------------- token texts


def test_token_texts_decode_each_id_once_with_special_tokens_kept():
    class CountingTokenizer:
        calls = []

        def decode(self, ids, skip_special_tokens=False):
            self.calls.append((list(ids), skip_special_tokens))
            return "<|end|>" if ids == [0] and not skip_special_tokens else f"t{ids[0]}"

    tokenizer = CountingTokenizer()
    texts = TokenTexts(tokenizer)
    assert [texts[t] for t in (5, 0, 5, 7, 0)] == ["t5", "<|end|>", "t5", "t7", "<|end|>"]
    assert tokenizer.calls == [([5], False), ([0], False), ([7], False)]  # once per id, as decode([id]) does


def test_token_texts_are_the_real_tokenizers_single_token_decodes():
    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Hi 👋🏽 你好", add_special_tokens=False) + [151645]  # pieces of characters; <|im_end|>
    for _ in range(2):
        assert [texts[t] for t in ids] == [tokenizer.decode([t]) for t in ids]


# ---------------------------------------------------------------------------------------------- the histogram


def test_histogram_buckets_hold_each_value_in_the_first_bound_not_below_it():
    histogram = Histogram("h", "help", (0.1, 1.0, 2.5))
    for seconds in (0.0, 0.1, 0.10001, 1.0, 2.5, 2.6, 100.0, float("nan")):
        histogram.observe(seconds)
    lines = histogram.lines()
    # <= bound, as Prometheus' le: 0.1 and 1.0 and 2.5 count in their own bucket; nan only in +Inf
    assert 'h_bucket{le="0.1"} 2' in lines and 'h_bucket{le="1.0"} 4' in lines and 'h_bucket{le="2.5"} 5' in lines
    assert 'h_bucket{le="+Inf"} 8' in lines and "h_count 8" in lines
    with pytest.raises(ValueError, match="must be ascending"):
        Histogram("h", "help", (1.0, 0.1))


def test_tokens_of_one_chunk_are_observed_together_as_separately():
    """The tokens of one streamed chunk share their interval: observe(s, times=k) counts as k observe(s) calls."""
    together, apart = Histogram("h", "help", (0.1, 1.0)), Histogram("h", "help", (0.1, 1.0))
    for seconds, times in ((0.05, 3), (0.5, 1), (5.0, 2), (float("nan"), 2)):
        together.observe(seconds, times)
        for _ in range(times):
            apart.observe(seconds)
    assert together.lines() == apart.lines()
    assert "h_count 8" in together.lines()


# ------------------------------------------------------------------------------------- chunks written as outputs arrive


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        if 25 in ids:
            raise ValueError("token 25 cannot be decoded")
        return "".join(chr(ord("a") + i) for i in ids)


def streamed(body: dict, outputs: list, writer_takes=None, assembled: bool = False, bursts: int = 1,
             timed: list | None = None) -> list[tuple[str, str]]:
    """Job.sse of a request whose engine outputs are `outputs` ((choice, token ids, done) each, put as they come
    while the stream's coroutine runs), with a direct writer that takes a chunk when writer_takes(call number) is
    true (None: no writer): each chunk as ("direct" or "yield", text), in the order the client gets them.
    `assembled`: the outputs are an API server's (engine_wire.OutputAssembly: one set of lists per request, extended
    by each row); `bursts`: outputs put per pass of the loop (several: the coroutine reads only the latest);
    `timed`: gets the number of tokens each latency observation covered."""
    from gpuformers.serving.engine_wire import STATUSES, OutputAssembly
    from gpuformers.engine.outputs import GenerationOutput
    from gpuformers.engine.sequence import RequestStatus

    parsed = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}) if "chat" in body.pop("kind") \
        else parse_completion({**body, "prompt": "hi"})
    got = []

    async def main():
        job = make_job(parsed)
        job.id, job.created = "cmpl-x", 0  # two streams' chunks compared byte for byte
        job.state.tokenizer = LetterTokenizer()
        observed = timed if timed is not None else []
        job.state.metrics = SimpleNamespace(observe_ttft=lambda s: observed.append(1),
                                            observe_itl=lambda s, times=1: observed.append(times),
                                            count_tokens=lambda prompt, generated: None)
        job.state.engine = SimpleNamespace(cancel=lambda request_id: None, release=lambda count: None)
        job.state.manager = SimpleNamespace(is_running=lambda: True)
        job.state.token_texts = TokenTexts(job.state.tokenizer)
        job.choices = [job_module.ChoiceText(job.state.tokenizer, parsed.stop, 8, set())
                       for _ in range(job.num_choices)]
        job.request_ids = [f"r{index}" for index in range(job.num_choices)]
        calls = []
        if writer_takes is not None:
            def write(data: bytes) -> bool:
                calls.append(data)
                if writer_takes(len(calls)):
                    got.append(("direct", data.decode()))
                    return True
                return False

            job.stream_to(write)

        async def consume():
            async for chunk in job.sse(Client(float("inf"))):
                got.append(("yield", chunk))

        task = asyncio.ensure_future(consume())
        assemblies = [OutputAssembly(f"r{index}", [1, 2, 3]) for index in range(job.num_choices)]
        for number, (index, tokens, done) in enumerate(outputs):
            if number % bursts == 0:
                for _ in range(3):  # the coroutine sends what it holds and waits again
                    await asyncio.sleep(0)
            status = RequestStatus.FINISHED if done else RequestStatus.DECODING
            if assembled:  # the row of the tokens since this choice's last one
                assembly = assemblies[index]
                new = list(tokens)[len(assembly.tokens):]
                output = assembly.add([f"r{index}", STATUSES.index(status), new, [-0.25 * t for t in new],
                                       [[[t, -0.25 * t], [t + 1, -1.5]] for t in new], [], None, None, 0.0, None])
            else:
                output = GenerationOutput(f"r{index}", generated_tokens=list(tokens),
                                          logprobs=[-0.25 * t for t in tokens],
                                          top_logprobs=[[(t, -0.25 * t), (t + 1, -1.5)] for t in tokens],
                                          status=status)
            job.put_nowait((index, output))
        await asyncio.wait_for(task, timeout=10)
        return job

    job = asyncio.run(main())
    assert job.closed and job._writer is None
    return got


# two choices, a stop string cutting choice 1 ("de"), text held back while it could still become one
OUTPUTS = [(0, [0], False), (1, [2], False), (0, [0, 1], False), (1, [2, 3], False), (0, [0, 1, 2], False),
           (1, [2, 3, 4], False), (0, [0, 1, 2, 5], True), (1, [2, 3, 4, 6], False)]


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_chunks_written_as_outputs_arrive_are_the_chunks_the_stream_yields(kind, logprobs):
    body = {"kind": kind, "model": "m", "stream": True, "n": 2, "stop": ["de"],
            "stream_options": {"include_usage": True}}
    if logprobs:  # each chunk carries the logprobs of the tokens since the last one: bookkeeping across both paths
        body.update({"logprobs": True, "top_logprobs": 2} if kind == "chat" else {"logprobs": 2})
    through_the_coroutine = streamed(dict(body), OUTPUTS)
    written = streamed(dict(body), OUTPUTS, writer_takes=lambda call: True)
    assert "".join(text for _, text in written) == "".join(text for _, text in through_the_coroutine)
    assert all(way == "yield" for way, _ in through_the_coroutine)
    # every output's chunks but the last's went straight to the writer; the stream's end came from the coroutine
    # (the finish chunks, usage and [DONE] in one write)
    direct = [text for way, text in written if way == "direct"]
    assert len(direct) >= 4 and written[-1][0] == "yield" and written[-1][1].endswith("data: [DONE]\n\n")
    assert '"finish_reason": "length"' in written[-1][1] and '"completion_tokens": 5' in written[-1][1]
    assert any('"finish_reason": "stop"' in text for text in direct)  # choice 1's, cut at "de": "c" only


@pytest.mark.parametrize("bursts", [1, 3], ids=["each_output_read", "outputs_pile_up"])
@pytest.mark.parametrize("writer", [False, True], ids=["coroutine", "written_as_they_arrive"])
def test_an_api_servers_outputs_extending_one_set_of_lists_stream_the_same(writer, bursts):
    """An API server's outputs of a request share lists that each row extends (no copy per token): the stream is
    the one snapshots give, and the latency histograms see the same tokens, when several outputs pile up before
    the stream reads the latest too."""
    body = {"kind": "chat", "model": "m", "stream": True, "n": 2, "stop": ["de"], "logprobs": True,
            "top_logprobs": 2, "stream_options": {"include_usage": True}}
    takes = (lambda call: True) if writer else None
    timed_snapshots, timed_assembled = [], []
    snapshots = streamed(dict(body), OUTPUTS, takes, bursts=bursts, timed=timed_snapshots)
    assembled = streamed(dict(body), OUTPUTS, takes, assembled=True, bursts=bursts, timed=timed_assembled)
    assert "".join(text for _, text in assembled) == "".join(text for _, text in snapshots)
    # the same latency observations (tokens read together share one): none lost or counted twice
    assert timed_assembled == timed_snapshots and sum(timed_snapshots) >= 6


def test_chunks_the_writer_refuses_go_through_the_coroutine_first_in_order():
    body = {"kind": "completions", "model": "m", "stream": True, "n": 2, "stop": ["de"]}
    expected = "".join(text for _, text in streamed(dict(body), OUTPUTS))
    for refused in ({1}, {2, 3}, {1, 3, 5}, set(range(1, 20))):
        calls = []
        got = streamed(dict(body), OUTPUTS, writer_takes=lambda call: calls.append(call) or call not in refused)
        assert "".join(text for _, text in got) == expected, refused
        assert sum(way == "direct" for way, _ in got) == len([call for call in calls if call not in refused]) > 0 \
            or refused == set(range(1, 20))
        # each refused chunk came out of the coroutine next, before anything later
        yielded = [index for index, (way, _) in enumerate(got) if way == "yield"]
        assert len(yielded) >= 1 + len([call for call in calls if call in refused])


def test_an_error_while_writing_an_output_is_raised_by_the_stream():
    """A chunk that fails to be made outside the coroutine fails the stream as it would inside it (not a stream
    that hangs for an output that never comes)."""
    body = {"kind": "completions", "model": "m", "stream": True, "stop": ["de"]}
    with pytest.raises(ValueError, match="token 25"):
        streamed(dict(body), [(0, [0], False), (0, [0, 25], False), (0, [0, 25, 1], True)],
                 writer_takes=lambda call: True)


def test_a_client_that_left_is_seen_in_uvicorns_request_cycle_without_asking_the_server():
    cycle = SimpleNamespace(disconnected=False)
    request = SimpleNamespace(scope={"extensions": {job_module.HTTP_CYCLE: cycle}})
    assert asyncio.run(job_module.client_left(request)) is False
    cycle.disconnected = True
    assert asyncio.run(job_module.client_left(request)) is True
    asked = Client(0.0)  # no cycle: Starlette's is_disconnected is asked
    assert asyncio.run(job_module.client_left(asked)) is True and asked.asked == 1
