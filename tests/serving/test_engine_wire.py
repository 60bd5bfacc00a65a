"""The engine core <-> API server messages (serving/engine_wire.py) and the merged /metrics view (metrics.py), without
processes: a request's outputs sent as deltas come back as the engine published them, and one server's /metrics adds
the other servers' snapshots to its own counts."""

from __future__ import annotations

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
    rebuilt = [assembly.add(row) for row in rows]
    assert rebuilt == published
    assert rebuilt[1].generated_tokens is not rebuilt[2].generated_tokens  # lists of its own, as the engine's
    assert deltas._sent == {}  # the finished request is forgotten


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
