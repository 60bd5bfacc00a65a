"""`gpuformers serve --api-server-count 2`: the engine core in one process, HTTP in two API server processes sharing
the port (serving/engine_core.py, api_server.py, engine_client.py), driven by the openai client.

Greedy answers equal model.generate, streamed and whole, through either API server (some of test_server.py's and
test_structured_output.py's tests run again here against this server: their `server` fixture is this module's);
/metrics on either server counts the requests of both; connections are spread evenly over the servers; killing an API server leaves the other serving and cancels
its requests in the core; killing the core ends the requests in flight with a 503 and /health says unhealthy,
and its run folder (the ZMQ sockets) does not stay in the temp folder.
The whole serving suite runs against this mode with GPUFORMERS_TEST_API_SERVER_COUNT=2 (conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.serving.conftest import MODEL_NAME, ServerProcess, greedy_reference
from tests.serving.test_server import (client, decode, test_a_batch_of_prompts_answers_each_as_alone,  # noqa: F401
                                       test_concurrent_streams_with_disconnects, test_greedy_chat_equals_generate,
                                       test_greedy_completion_equals_generate, test_logprobs_match_the_model,
                                       test_stop_string_cuts_the_text,
                                       test_streaming_chat_matches_the_whole_answer_and_ends_in_done,
                                       test_top_logprobs_are_the_model_top_tokens)
from tests.serving.test_structured_output import test_json_schema_answers_validate  # noqa: F401

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(checkpoint, "--num-blocks", "160", "--api-server-count", "2", "--log-level", "debug")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def api_servers(server) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children()


def listening_api_servers(server, count: int = 2, timeout: float = 60) -> list[psutil.Process]:
    """The API servers once `count` of them listen on the port (/health answers as soon as the first does)."""
    deadline = time.monotonic() + timeout
    while True:
        ready = [p for p in api_servers(server) if any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
                                                       for c in p.net_connections(kind="tcp"))]
        if len(ready) >= count:
            return ready
        assert time.monotonic() < deadline, f"{len(ready)} of {count} API servers listen"
        time.sleep(0.2)


def connections_to_each(server, tries: int = 40) -> dict[int, httpx.Client]:
    """One kept-alive connection accepted by each API server: {pid: client}."""
    listening_api_servers(server)
    found: dict[int, httpx.Client] = {}
    spare = []
    for _ in range(tries):
        before = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
                  if c.raddr and c.raddr.port == server.port}
        http = httpx.Client(timeout=30)
        http.get(f"{server.base}/health")
        port, = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
                 if c.raddr and c.raddr.port == server.port and c.status == psutil.CONN_ESTABLISHED} - before
        pid = next(p.pid for p in api_servers(server) for c in p.net_connections(kind="tcp")
                   if c.raddr and c.raddr.port == port and c.laddr.port == server.port)
        if pid in found:
            spare.append(http)
        else:
            found[pid] = http
        if len(found) == 2:
            break
    for http in spare:
        http.close()
    assert len(found) == 2, f"{tries} connections all went to {list(found)}"
    return found


def completions_count(text: str) -> float:
    label = 'gpuformers_requests_total{endpoint="/v1/completions",status="200"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(label))


def test_both_api_servers_answer_greedy_tokens_and_metrics_count_both(server, reference):
    """Through a connection to each API server: whole and streamed greedy answers equal generate(); then /metrics,
    asked on either server, counts the requests answered by both."""
    _, tokenizer = reference
    ids = tokenizer.encode("A tale of two servers")
    expected = decode(reference, greedy_reference(reference, ids, 10))
    before = completions_count(httpx.get(f"{server.base}/metrics").text)
    both = connections_to_each(server)
    try:
        sent = 0
        for pid, http in both.items():
            for _ in range(2):
                body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 10, "temperature": 0}
                assert http.post(f"{server.url}/completions", json=body).json()["choices"][0]["text"] == expected
                with http.stream("POST", f"{server.url}/completions", json={**body, "stream": True}) as response:
                    events = [line for line in response.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == expected
                sent += 2
        deadline = time.monotonic() + 10
        seen = {}
        while True:
            seen = {pid: completions_count(http.get(f"{server.base}/metrics").text) for pid, http in both.items()}
            if all(count - before == sent for count in seen.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(count - before == sent for count in seen.values()), (before, sent, seen)
    finally:
        for http in both.values():
            http.close()


def test_connections_are_spread_evenly_over_the_api_servers(server):
    """Each API server listens on a socket of its own (SO_REUSEPORT), so the kernel spreads new connections between
    them: of 400 kept-alive connections each server accepted 40-60% (a fair coin's 400 flips fall outside that once
    in ~15,000 runs; with the one inherited socket one server took 2-4x the other's share under load, and 64% of
    these connections, made one at a time to idle servers)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_REUSEPORT spreads connections on Linux only (elsewhere one socket is inherited)")
    pids = [p.pid for p in listening_api_servers(server)]
    conns = []
    try:
        for _ in range(400):
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            conns.append(conn)
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")  # answered: accepted by a server, and kept alive
        mine = {conn.getsockname()[1] for conn in conns}
        served = {pid: sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
                           if c.laddr.port == server.port and c.raddr and c.raddr.port in mine) for pid in pids}
    finally:
        for conn in conns:
            conn.close()
    assert sum(served.values()) == 400, served
    assert all(160 <= count <= 240 for count in served.values()), served


def test_api_servers_yield_the_cpu_to_the_engine_core(server):
    """Each API server runs API_SERVER_NICE below the engine core's priority, so on a machine short of cores the
    kernel runs the engine loop first (a front end that falls behind sends several tokens per chunk instead)."""
    from gpuformers.serving.api_server import API_SERVER_NICE

    if not hasattr(os, "nice"):
        pytest.skip("process priorities (os.nice) are POSIX")
    core = psutil.Process(server.process.pid)
    servers = listening_api_servers(server)
    assert API_SERVER_NICE > 0
    assert [p.nice() for p in servers] == [min(19, core.nice() + API_SERVER_NICE)] * len(servers)


def test_max_pending_bounds_the_api_servers_together(checkpoint):
    """--max-pending 1 with 2 API servers: while a stream holds the one slot through one server, a request through
    the other gets 429 at once (the limit counts every server's requests until their responses end; a share of it
    each would let both in); once the stream ends, the other server takes a request again. The holder reads one
    chunk through a small receive window and stops, so its response cannot end however fast the engine is."""
    process = ServerProcess(checkpoint, "--num-blocks", "64", "--api-server-count", "2", "--max-pending", "1")
    holder = None
    try:
        server = process.wait_ready()
        both = connections_to_each(server)
        body = json.dumps({"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        holder.connect(("127.0.0.1", server.port))
        holder.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while b"data: " not in head:  # the headers, then the stream's first event; no more is read
            chunk = holder.recv(1024)
            assert chunk, head
            head += chunk
        port = holder.getsockname()[1]
        serving = next(p.pid for p in api_servers(server) for c in p.net_connections(kind="tcp")
                       if c.raddr and c.raddr.port == port and c.laddr.port == server.port)
        other = next(http for pid, http in both.items() if pid != serving)
        small = {"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 2}
        start = time.monotonic()
        refused = other.post(f"{server.url}/completions", json=small)
        assert refused.status_code == 429 and "--max-pending" in refused.json()["error"]["message"]
        assert time.monotonic() - start < 2.0
        holder.close()  # the client leaves: its request is cancelled and the slot given back
        holder = None
        deadline = time.monotonic() + 20
        while (answer := other.post(f"{server.url}/completions", json=small)).status_code == 429:
            assert time.monotonic() < deadline, "the slot never came back"
            time.sleep(0.2)
        assert answer.status_code == 200
        for http in both.values():
            http.close()
    finally:
        if holder is not None:
            holder.close()
        process.stop()


def test_request_ids_run_through_both_processes_logs(server):
    """--log-level debug: the API server logs a response's id beside its engine request ids, and the engine core
    logs each of those ids with the API server it came from."""
    answer = httpx.post(f"{server.url}/completions", json={"model": MODEL_NAME, "prompt": "ids", "max_tokens": 3,
                                                          "n": 2}, timeout=30).json()
    deadline = time.monotonic() + 10
    while True:
        log = Path(server.log.name).read_text()
        mine = [line for line in log.splitlines() if f"{answer['id']}: engine requests" in line]
        if mine:
            engine_ids = mine[0].split("engine requests ")[1].split()
            core = [line for line in log.splitlines() if " engine-core " in line and any(i in line for i in engine_ids)]
            if len(core) == 4:  # each id's arrival and end
                break
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.2)
    assert " api-server-" in mine[0] and len(engine_ids) == 2
    assert all("(api server " in line for line in core)


def test_killing_an_api_server_leaves_the_other_serving(server, reference):
    """An API server killed mid-stream: its engine request is cancelled in the core (the KV blocks come free and the
    steps stop), and the other server goes on answering, new connections included."""
    both = connections_to_each(server)
    victim, survivor = list(both)
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with both[victim].stream("POST", f"{server.url}/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
    finally:
        for http in both.values():
            http.close()
    c = client(server)
    for _ in range(6):  # new connections: each accepted by the one left
        out = c.completions.create(model=MODEL_NAME, prompt="Still here?", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while True:  # the killed server's request was cancelled: nothing runs, every block is free
        metrics = server.metrics()
        if metrics["gpuformers_kv_blocks_used"] == 0 and metrics["gpuformers_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)
    steps = metrics["gpuformers_engine_steps_total"]
    time.sleep(1.2)
    assert server.metrics()["gpuformers_engine_steps_total"] == steps
    assert server.process.poll() is None
    assert "api server 0" in server.output() or "api server 1" in server.output()


def test_killing_the_engine_core_fails_requests_in_flight_with_503(server):
    """The core killed while requests run: the whole one ends in a 503, the streamed one in an error event with
    code engine_unavailable, /health answers 503 and new requests too; then the API servers exit."""
    survivors = api_servers(server)
    run_dir = Path(survivors[0].cmdline()[-2]).parent  # the core's private folder: its ZMQ sockets, the config
    assert (run_dir / "in").exists()
    results = {}

    def whole():
        body = {"model": MODEL_NAME, "prompt": [9, 10], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        results["whole"] = httpx.post(f"{server.url}/completions", json=body, timeout=30)

    thread = threading.Thread(target=whole)
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        thread.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    thread.join(30)
    assert results["whole"].status_code == 503, results["whole"].text
    assert results["whole"].json()["error"]["code"] == "engine_unavailable"
    assert any('"engine_unavailable"' in line for line in rest), rest[-3:]
    health = httpx.get(f"{server.base}/health", timeout=5)
    assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
    refused = httpx.post(f"{server.url}/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                         timeout=5)
    assert refused.status_code == 503
    gone = psutil.wait_procs(survivors, timeout=40)[0]  # ORPHAN_EXIT_SECONDS after they saw the core go (one
    # restarted by the previous test may still be starting)
    assert len(gone) == len(survivors)
    assert not run_dir.exists(), "the killed core's run folder was left in the temp folder"


def test_run_folders_of_cores_that_no_longer_run_are_removed(tmp_path):
    """A run folder whose core and API servers were all killed is removed by the next core's start; the folder of a
    core that runs, and one not yet holding its config, are left alone."""
    from gpuformers.serving.engine_core import RUN_DIR_PREFIX, remove_stale_run_dirs

    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = {}
    for name, pid in (("dead", dead.pid), ("alive", os.getpid()), ("starting", None)):
        folder = folders[name] = tmp_path / f"{RUN_DIR_PREFIX}{name}"
        folder.mkdir()
        (folder / "in").touch()
        if pid is not None:
            (folder / "api_server.json").write_text(json.dumps({"core_pid": pid}))
    assert remove_stale_run_dirs(str(tmp_path)) == [str(folders["dead"])]
    assert not folders["dead"].exists() and folders["alive"].exists() and folders["starting"].exists()
