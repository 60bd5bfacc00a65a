"""The engine core <-> API server messages (serving/engine_wire.py) and the merged /metrics view (metrics.py), without
processes: a request's outputs sent as deltas come back as the engine published them, and one server's /metrics adds
the other servers' snapshots to its own counts."""

from __future__ import annotations

import copy

from gpuformers.engine.outputs import GenerationOutput
from gpuformers.engine.sequence import RequestStatus
from gpuformers.serving.connections import ConnectionStats
from gpuformers.serving.engine_wire import OutputAssembly, OutputDeltas, pack, unpack
from gpuformers.serving.metrics import Metrics


def test_deltas_rebuild_each_output_with_logprobs_and_send_each_token_once():
    published = []
    tokens, logprobs, tops = [], [], []
    for step in range(4):  # three streamed outputs, then the final one
        tokens.append(100 + step)
        logprobs.append(-0.5 * step if step != 2 else float("-inf"))  # a masked token's -inf survives
        tops.append([(100 + step, logprobs[-1]), (7, -3.0)])
        published.append(GenerationOutput(
            request_id="srv-1", prompt_ids=[1, 2, 3], generated_tokens=list(tokens), logprobs=list(logprobs),
            top_logprobs=list(tops), prompt_logprobs=[None, -1.0, -2.0], prompt_top_logprobs=[None, [(2, -1.0)],
                                                                                              [(3, -2.0)]],
            status=RequestStatus.FINISHED if step == 3 else RequestStatus.DECODING, created_time=5.0,
            finished_time=9.0 if step == 3 else None))
    deltas, assembly = OutputDeltas(), OutputAssembly("srv-1", [1, 2, 3])
    rows = [unpack(pack(deltas.row(output))) for output in published]
    assert [len(row[2]) for row in rows] == [1, 1, 1, 1]  # each token travels once
    assert rows[1][5] == [] and rows[0][5] == [None, -1.0, -2.0]  # and the prompt's logprobs once
    # each output as it is when added (what its reader sees: the next row extends the same lists, no copy per token)
    rebuilt = [copy.deepcopy(assembly.add(row)) for row in rows]
    assert rebuilt == published
    assert deltas._sent == {}  # the finished request is forgotten


def test_a_streams_rows_between_its_first_and_last_carry_only_its_new_tokens():
    """A stream without logprobs: its first and last rows are whole (created_time, finished_time), the ones between
    only the new tokens and the status; the outputs rebuilt are the ones published, created_time kept throughout.
    With prompt logprobs arriving over two prefill chunks, the second row is whole again."""
    def stream(prompt_logprobs_at_step_1: bool) -> list[GenerationOutput]:
        published = []
        for step in range(5):
            prompt = [None, -1.0] + ([-2.0] if prompt_logprobs_at_step_1 and step >= 1 else [])
            published.append(GenerationOutput(
                "srv-2", [1, 2, 3], [50 + k for k in range(step)], prompt_logprobs=prompt,
                status=RequestStatus.FINISHED if step == 4 else RequestStatus.DECODING, created_time=5.0,
                finished_time=9.0 if step == 4 else None))
        return published

    for late_prompt_logprobs in (False, True):
        published = stream(late_prompt_logprobs)
        deltas, assembly = OutputDeltas(), OutputAssembly("srv-2", [1, 2, 3])
        rows = [unpack(pack(deltas.row(output))) for output in published]
        short = [1, 2, 3] if not late_prompt_logprobs else [2, 3]
        assert [index for index, row in enumerate(rows) if len(row) == 3] == short
        assert all(len(row) == 10 for index, row in enumerate(rows) if index not in short)
        assert [copy.deepcopy(assembly.add(row)) for row in rows] == published
        assert deltas._sent == {}


def test_metrics_render_adds_the_other_servers_counts():
    mine, theirs = Metrics(), Metrics()
    mine.connections, theirs.connections = ConnectionStats(), ConnectionStats()
    mine.count_request("/v1/completions", 200)
    theirs.count_request("/v1/completions", 200)
    theirs.count_request("/v1/chat/completions", 400)
    mine.count_tokens(10, 20)
    theirs.count_tokens(1, 2)
    mine.observe_ttft(0.02)
    theirs.observe_ttft(3.0)
    theirs.connections.accepted = 5
    theirs.connections.closed["idle"] = 2
    text = mine.render(None, in_flight=1, peers=[unpack(pack(theirs.snapshot(in_flight=3)))])
    assert 'gpuformers_requests_total{endpoint="/v1/completions",status="200"} 2' in text
    assert 'gpuformers_requests_total{endpoint="/v1/chat/completions",status="400"} 1' in text
    assert "gpuformers_prompt_tokens_total 11" in text and "gpuformers_generation_tokens_total 22" in text
    assert "gpuformers_requests_in_flight 4" in text
    assert 'gpuformers_time_to_first_token_seconds_bucket{le="0.025"} 1' in text
    assert 'gpuformers_time_to_first_token_seconds_bucket{le="5.0"} 2' in text
    assert "gpuformers_time_to_first_token_seconds_count 2" in text
    assert "gpuformers_connections_accepted_total 5" in text
    assert 'gpuformers_connections_closed_total{reason="idle"} 2' in text
    # this server's own counts are left as they were
    assert 'status="200"} 1' in mine.render(None)


def test_an_api_servers_in_flight_counts_of_one_loop_pass_reach_the_core_as_one_message(tmp_path):
    """A burst of requests starting or ending together changes an API server's count many times in one pass of its
    event loop: the core gets the last count, once; and /metrics' view of the other servers is made when asked, from
    the core's latest message."""
    import asyncio
    import os

    import zmq

    from gpuformers.serving.engine_client import EngineClient

    context = zmq.Context()
    core = context.socket(zmq.PULL)
    core.bind(f"ipc://{tmp_path}/in")
    facts = {"generation_config": {}, "vocab_size": 10, "max_position_embeddings": 64, "num_blocks": 4,
             "block_size": 16, "adapters": []}
    client = EngineClient(str(tmp_path), 0, os.getppid(), facts)

    async def burst():
        client.start()
        for count in (1, 2, 3, 2):
            client.report_in_flight(count)
        await asyncio.sleep(0.05)
        client.report_in_flight(5)
        await asyncio.sleep(0.05)
        client.stop()

    try:
        asyncio.run(burst())
        received = []
        while core.poll(1000):
            received.append(unpack(core.recv()))
            if len(received) == 2:
                break
        assert received == [["in_flight", 0, 2], ["in_flight", 0, 5]]
        snapshot = Metrics().snapshot(in_flight=7)
        client._deliver([[0, 0, 4, 0, None, [2, 6]], [], {0: Metrics().snapshot(), 1: snapshot}, False])
        assert client.peer_metrics == [{**snapshot, "in_flight": 6}]  # the core's count, not the snapshot's
    finally:
        core.close(linger=0)
        client._out.close(linger=0)
        client._in.close(linger=0)
        client._context.term()
        context.term()


def test_an_api_server_behind_the_core_hands_each_request_its_newest_output_once(tmp_path):
    """Steps' messages waiting together (the API server fell behind): each request's rows are added up in order and
    on_output gets its newest output once (one chunk instead of one per step), a request finished in an earlier
    message still gets its final output, and the facts are the newest message's. One message at a time: an output
    per message. And _read takes every waiting message off the core's socket."""
    import os

    import zmq

    from gpuformers.serving.engine_client import EngineClient

    context = zmq.Context()
    core_in, core_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_in.bind(f"ipc://{tmp_path}/in")
    core_out.bind(f"ipc://{tmp_path}/out-0")
    facts = {"generation_config": {}, "vocab_size": 10, "max_position_embeddings": 64, "num_blocks": 4,
             "block_size": 16, "adapters": []}
    client = EngineClient(str(tmp_path), 0, os.getppid(), facts)
    received = {"a": [], "b": []}

    def on_output(output):  # (a copy: an API server's outputs share lists the next rows extend)
        received[output.request_id].append((list(output.generated_tokens), output.status))

    deltas = OutputDeltas()

    def step(number: int, outputs: list[GenerationOutput]) -> list:  # the core's message of engine step `number`
        return unpack(pack([[0, 2, 4, number, None, [2]], [deltas.row(o) for o in outputs], None, False]))

    def out(request_id, tokens, status=RequestStatus.DECODING):
        return GenerationOutput(request_id, [1], list(tokens), status=status)

    try:
        for request_id in ("a", "b"):
            client.add_request([1], request_id=request_id, on_output=on_output)
        client._deliver(step(1, [out("a", [5]), out("b", [7])]))
        assert received == {"a": [([5], RequestStatus.DECODING)], "b": [([7], RequestStatus.DECODING)]}
        client._deliver(step(2, [out("a", [5, 6]), out("b", [7, 8], RequestStatus.FINISHED)]),
                        step(3, [out("a", [5, 6, 9])]), step(4, [out("a", [5, 6, 9, 3])]))
        assert received["a"] == [([5], RequestStatus.DECODING), ([5, 6, 9, 3], RequestStatus.DECODING)]
        assert received["b"] == [([7], RequestStatus.DECODING), ([7, 8], RequestStatus.FINISHED)]
        assert client.num_steps == 4 and "b" not in client._requests
        for number, tokens in ((5, [5, 6, 9, 3, 4]), (6, [5, 6, 9, 3, 4, 2])):  # through the socket this time
            status = RequestStatus.FINISHED if number == 6 else RequestStatus.DECODING
            core_out.send(pack(step(number, [out("a", tokens, status)])))
        for _ in range(100):
            if client.num_steps == 6:
                break
            client._in.poll(100)
            client._read()
        assert client.num_steps == 6 and received["a"][-1] == ([5, 6, 9, 3, 4, 2], RequestStatus.FINISHED)
        assert not client._requests
    finally:
        for sock in (core_in, core_out, client._out, client._in):
            sock.close(linger=0)
        client._context.term()
        context.term()
