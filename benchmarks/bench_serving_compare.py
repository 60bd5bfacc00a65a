"""bench_serving.py --compare: what the HTTP front end costs, with the real server and real (raw-socket) clients.

For each client count, each --api-server-count's `gpuformers serve` (and vLLM's server, below) is started and answers
a warm-up round of as many clients (other prompts); then --repeats rounds (default 3) of C streaming /v1/completions
clients at once (prompts of random token ids, --output-len tokens each, eos ignored; each round its own prompts, so
no round finds another's prefix in a cache), opened by a client process (this file run as a script: asyncio and raw
sockets, no tokenizer), which records when each chunk arrives. Beside them, the engine alone (a
ContinuousBatchingManager in this process on the same checkpoint and cache settings, run_until_done) on the same
requests. The rounds are interleaved (engine alone, then each server in turn, per repeat; the servers not measured
sit idle), so that a slower minute of a shared machine slows every side; each side's median round is reported with
every round's throughput beside it, and the ratios are the median of each repeat's (a round against the engine
alone's and vLLM's of the same repeat). Each server process's CPU time over a round (its CPU clocks: psutil) divided
by the tokens streamed is its host CPU per token.

    python benchmarks/bench_serving.py --compare --shape micro --client-counts 64 256 --output-len 64 64
    python benchmarks/bench_serving.py --compare --shape host --client-counts 256 --vllm-python V/bin/python

With --vllm-python, vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, from its own virtualenv) runs
the same rounds on the same checkpoint, float32: on the CPU with every core computing
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0) and VLLM_CPU_KVCACHE_SPACE=2 GiB; its processes' CPU is
counted the same way; each of our rows then has server_over_vllm (medians) and each round's ratio. Every server and
the engine alone hold up to max(--client-counts) requests per step (both servers' --max-num-seqs): each client
count runs in one batch on either side, whatever the servers' defaults (ours is 128 on the CPU, vLLM's OpenAI
server's 128 too). The clients parse both servers' JSON (vLLM's is compact: no spaces after colons).

Offers: compare (called by bench_serving.py), EngineAlone, Server, and the client process's main.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# ---------------------------------------------------------------------------------------------- the client process

async def _stream(port: int, body: dict) -> dict:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + payload)
    parts, times = [], []  # per read: its time and how many events started in it
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        events = data.count(b'"text": "') + data.count(b'"text":"')  # a text chunk's (the usage chunk has none)
        if events:
            times.append((time.perf_counter(), events))
        parts.append(data)
    writer.close()
    raw = b"".join(parts)
    usage = re.findall(rb'"completion_tokens":\s*(\d+)', raw)  # the usage chunk's (any key order, any spacing)
    tokens = int(usage[-1]) if usage else 0
    return {"start": start, "times": times, "end": time.perf_counter(), "tokens": tokens,
            "done": raw.rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in raw[-64:]}


async def _round(port: int, bodies: list[dict]) -> list[dict]:
    return await asyncio.gather(*(_stream(port, body) for body in bodies))


def client_main(port: int, path: Path) -> None:
    bodies = json.loads(path.read_text())
    cpu = time.process_time()
    results = asyncio.run(_round(port, bodies))
    path.write_text(json.dumps({"results": results, "client_cpu": time.process_time() - cpu}))


# ---------------------------------------------------------------------------------------------- the driver

def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class EngineAlone:
    """The engine alone: a ContinuousBatchingManager in this process on the checkpoint, with the servers' cache
    settings; `max_num_seqs`: the requests one step may hold (the servers' --max-num-seqs). Warmed up on `warm_up`."""

    def __init__(self, model_dir: Path, warm_up: list[tuple[list[int], int]], num_blocks: int | None,
                 compile: bool = False, max_num_seqs: int | None = None):
        import torch

        from gpuformers import AutoModelForCausalLM
        from gpuformers.engine.config import ContinuousBatchingConfig

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        model = AutoModelForCausalLM.from_pretrained(model_dir, progress=False)
        self.manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=num_blocks, max_memory_percent=0.9, compile=compile or None,
            max_requests_per_batch=max_num_seqs))
        self.manager.runner.reserve_cache()
        self.run(warm_up)

    def run(self, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
        """Output tok/s on these requests (greedy, eos ignored, all added at once) and the engine steps taken."""
        manager = self.manager
        start, steps = time.perf_counter(), manager.num_steps
        for prompt, tokens in requests:
            manager.add_request(prompt, max_new_tokens=tokens, ignore_eos=True, do_sample=False)
        manager.run_until_done()
        seconds, steps = time.perf_counter() - start, manager.num_steps - steps
        produced = 0
        while (output := manager.get_result(timeout=0)) is not None:
            produced += len(output.generated_tokens)
        assert produced == sum(tokens for _, tokens in requests), produced
        return produced / seconds, steps


def _cpu_seconds(processes) -> dict[int, float]:
    out = {}
    for process in processes:
        try:
            times = process.cpu_times()
            out[process.pid] = times.user + times.system
        except Exception:  # it exited
            pass
    return out


def _schedstats(processes) -> dict[int, tuple[float, float, int, str]]:
    """Per thread of the processes: (seconds on a CPU, seconds runnable but waiting for one, its process's pid, its
    name), from Linux's schedstat ({} elsewhere; a process that exited is left out)."""
    out = {}
    for process in processes:
        try:
            for tid in os.listdir(f"/proc/{process.pid}/task"):
                ran, waited = open(f"/proc/{process.pid}/task/{tid}/schedstat").read().split()[:2]
                name = open(f"/proc/{process.pid}/task/{tid}/comm").read().strip()
                out[int(tid)] = (int(ran) / 1e9, int(waited) / 1e9, process.pid, name)
        except (OSError, ValueError):
            pass
    return out


def _first_process_threads(process, before: dict, after: dict, tokens: int) -> list[list]:
    """The first process's (our engine core's) busiest threads: [name, CPU us per streamed token], most first (its
    Python threads are all named python: the engine loop first, then the one taking the API servers' requests)."""
    rows = [[name, ran - before.get(tid, (0.0,))[0]] for tid, (ran, _, pid, name) in after.items()
            if pid == process.pid]
    return [[name, round(1e6 * ran / tokens, 1)] for name, ran in sorted(rows, key=lambda row: -row[1])[:4]]


def _busiest_thread_waiting(before: dict, after: dict, seconds: float) -> float | None:
    """The share of the round (%) that the server's busiest thread (the engine loop: ours in the core, vLLM's in its
    engine core) spent runnable without a CPU: how much the other processes (API servers, clients) held it back."""
    deltas = [(after[tid][0] - before[tid][0], after[tid][1] - before[tid][1]) for tid in after if tid in before]
    return round(100 * max(deltas)[1] / seconds, 1) if deltas else None


def _engine_steps(port: int) -> int:
    """Our server's engine steps so far (its /metrics)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return int(float(re.search(r"^gpuformers_engine_steps_total (\S+)$", text, re.M).group(1)))


def start_vllm(python: str, model: Path, port: int, args) -> subprocess.Popen:
    """vLLM's OpenAI server on `model` (served as "bench"), ready for requests."""
    import httpx

    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
               "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
               "--max-num-seqs", str(max(args.client_counts)), "--no-enable-log-requests", "--seed", "0"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {server.returncode}: {' '.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("vLLM's server was not ready within 600 s")


class Server:
    """One server of a row: `count` API servers of ours (0: vLLM's server), started, answering rounds, stopped."""

    def __init__(self, bench, model: Path, args, count: int, tmp: Path):
        import psutil

        self.count, self.tmp, self.port = count, tmp, bench.free_port()
        if count:
            self.process = bench.start_server(model, self.port, args, "--api-server-count", str(count),
                                              "--max-num-seqs", str(max(args.client_counts)))
        else:
            self.process = start_vllm(args.vllm_python, model, self.port, args)
        core = psutil.Process(self.process.pid)
        self.processes = [core, *core.children(recursive=count == 0)]
        self.names = (["core" if count > 1 else "server"] + [f"api{i}" for i in range(len(self.processes) - 1)]
                      if count else ["vllm"] + [f"vllm{i}" for i in range(1, len(self.processes))])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)

    def _client(self, requests: list[tuple[list[int], int]]) -> dict:
        """The client process's round: every request at once, streamed; its report."""
        bodies = [{"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                   "ignore_eos": True, "stream_options": {"include_usage": True}} for prompt, tokens in requests]
        file = self.tmp / f"bodies-{self.port}.json"
        file.write_text(json.dumps(bodies))
        subprocess.run([sys.executable, __file__, str(self.port), str(file)], check=True)
        return json.loads(file.read_text())

    def warm_up(self, requests: list[tuple[list[int], int]]) -> None:
        self._client(requests)

    def round(self, requests: list[tuple[list[int], int]]) -> dict:
        """One measured round of len(requests) streaming clients: the row's figures."""
        count, processes = self.count, self.processes
        steps = _engine_steps(self.port) if count else None
        before, sched = _cpu_seconds(processes), _schedstats(processes)
        report = self._client(requests)
        after, sched_after = _cpu_seconds(processes), _schedstats(processes)
        if count:
            steps = _engine_steps(self.port) - steps
        results = report["results"]
        assert all(r["done"] and r["tokens"] == tokens for r, (_, tokens) in zip(results, requests)), \
            "an answer was not whole"
        tokens = sum(r["tokens"] for r in results)
        seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
        ttft = [r["times"][0][0] - r["start"] for r in results if r["times"]]
        itl = []
        for r in results:
            for (a, _), (b, events) in zip(r["times"], r["times"][1:]):
                itl += [(b - a) / events] * events  # chunks that arrived in one read share the gap
        cpu = {name: round(1e6 * (after.get(p.pid, 0) - before.get(p.pid, 0)) / tokens, 1)
               for name, p in zip(self.names, processes)}
        cpu["all_server"] = round(sum(cpu.values()), 1)
        cpu["client"] = round(1e6 * report["client_cpu"] / tokens, 1)
        return dict(clients=len(requests), api_server_count=count if count else "vllm", tokens=tokens,
                    seconds=round(seconds, 2), server_tok_s=round(tokens / seconds),
                    ttft_p50_ms=round(1000 * _percentile(ttft, 50), 1),
                    ttft_p99_ms=round(1000 * _percentile(ttft, 99), 1),
                    itl_p50_ms=round(1000 * _percentile(itl, 50), 2), itl_p99_ms=round(1000 * _percentile(itl, 99), 2),
                    engine_steps=steps, cpu_us_per_token=cpu,
                    busiest_thread_waiting_for_cpu_pct=_busiest_thread_waiting(sched, sched_after, seconds),
                    first_process_threads_us_per_token=_first_process_threads(processes[0], sched, sched_after,
                                                                               tokens))


def compare(args, bench) -> None:
    shape = args.shape or "micro"
    prompt_len = args.prompt_len or (16, 64)
    output_len = args.output_len or (64, 64)
    # every request's blocks fit at once (prompt + answer in 64-token blocks), the same for the server and engine
    args.num_blocks = args.num_blocks or max(512, max(args.client_counts) * -(-(prompt_len[1] + output_len[1]) // 64))
    repeats = args.repeats
    vocab = bench.SHAPES.get(shape, {}).get("vocab_size", 151936) if not args.model else 150000

    def requests_of(seed: int, clients: int) -> list[tuple[list[int], int]]:
        rng = random.Random(seed)
        return [([rng.randrange(100, min(150000, vocab)) for _ in range(rng.randint(*prompt_len))],
                 rng.randint(*output_len)) for _ in range(clients)]

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        model = Path(args.model) if args.model else bench.make_checkpoint(tmp / "model", shape)
        for clients in args.client_counts:
            # each repeat its own prompts (no prefix cached from an earlier round), the warm-up others again
            sets = [requests_of(args.seed + repeat, clients) for repeat in range(repeats)]
            # a whole round's worth: the first batch of each size and prefill chunk builds its oneDNN primitives
            # (ours and vLLM's), which made a first measured round up to 25% slower after a 32-request warm-up
            warm_up = requests_of(args.seed + 1000, clients)
            alone = EngineAlone(model, warm_up, args.num_blocks, args.compile, max(args.client_counts))
            servers, args.clients = [], clients  # (bench.start_server's --max-pending)
            try:
                for count in [*args.api_server_counts, *([0] if args.vllm_python else [])]:  # 0: vLLM's server
                    servers.append(Server(bench, model, args, count, tmp))
                    servers[-1].warm_up(warm_up)
                alone_runs, runs = [], {server.count: [] for server in servers}
                for repeat in range(repeats):  # interleaved: a slower minute of the machine hits every side
                    alone_runs.append(alone.run(sets[repeat]))
                    print(json.dumps({"clients": clients, "repeat": repeat, "engine_alone_tok_s":
                                      round(alone_runs[-1][0]), "engine_alone_steps": alone_runs[-1][1]}), flush=True)
                    for server in servers:
                        runs[server.count].append(server.round(sets[repeat]))
                        print(json.dumps({"repeat": repeat, **runs[server.count][-1]}), flush=True)
            finally:
                for server in servers:
                    server.stop()
            alone_tok_s = [tok_s for tok_s, _ in alone_runs]
            vllm = [row["server_tok_s"] for row in runs.get(0, [])]
            for count, measured in runs.items():
                tok_s = [row["server_tok_s"] for row in measured]
                # the median round's figures, with each round's throughput and ratios beside them
                row = dict(sorted(measured, key=lambda row: row["server_tok_s"])[len(measured) // 2])
                row.update(repeats=repeats, server_tok_s=round(_percentile(tok_s, 50)), server_tok_s_each=tok_s,
                           engine_alone_tok_s=round(_percentile(alone_tok_s, 50)),
                           engine_alone_tok_s_each=[round(value) for value in alone_tok_s],
                           engine_alone_steps=alone_runs[0][1],
                           # each round against the engine alone's (and vLLM's) of the same repeat, run beside it
                           server_over_engine=round(_percentile([a / b for a, b in zip(tok_s, alone_tok_s)], 50), 2),
                           server_over_engine_each=[round(a / b, 2) for a, b in zip(tok_s, alone_tok_s)])
                if vllm and count:
                    row.update(server_over_vllm=round(_percentile([a / b for a, b in zip(tok_s, vllm)], 50), 2),
                               server_over_vllm_each=[round(a / b, 2) for a, b in zip(tok_s, vllm)])
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"shape={shape} prompt_len={prompt_len} output_len={output_len} num_blocks={args.num_blocks} "
          f"repeats={repeats} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} cores={os.cpu_count()}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=shape, rows=rows), indent=2))


if __name__ == "__main__":
    client_main(int(sys.argv[1]), Path(sys.argv[2]))
