"""Benchmark: the server's own host work per streamed token, the Python that `gpuformers serve` runs for each token
it streams besides the engine's step: handing the engine's output to the event loop,
incremental detokenization, stop-string checks, the SSE chunk's JSON, and writing it through Starlette and uvicorn.
It runs in the server's threads and competes with the engine loop for the GIL: at 256 streaming clients, 100 us per
token would be 25 ms per engine step, five times a GPU's ~5 ms decode step of a small model.

How. The server runs in this process (build_app served by uvicorn on 127.0.0.1) over a continuous batching engine
whose model is a stand-in (as in bench_engine_host.py): its decoder returns zeros and its sampler returns, for each
request, the tokens of a fixed text from an offset its prompt gives (the real Qwen3 tokenizer's ids for English
prose, code, CJK and emoji, so some characters are split over byte-level pieces). A client process (this script
with --client: raw non-blocking sockets and one selector, no tokenizer, so its own cost stays out of this process
and small; its CPU while streaming is reported, since on a machine of few cores it takes from the server's) opens N
streaming requests at once (max_tokens T, ignore_eos, include_usage) and reads them to the end. The CPU time of this
process's threads over the round comes from each thread's CPU clock:

    engine       the engine loop: scheduling, inputs, the stand-in model and sampler, publishing (and handing each
                 output to the event loop: the server's on_output callback runs in this thread)
    event loop   uvicorn's loop: HTTP, Starlette, the SSE generator (detokenizing, stop strings, chunk JSON)
    other        the rest of the process's threads

"process us/token" = all of it / tokens streamed, the figure that counts, since every thread shares one GIL;
"server us/token" = (event loop + other) / tokens streamed. It holds the per-request work too (the HTTP
request, the chat template, the role and usage chunks), spread over T tokens. Wall time, engine steps and ms per
step come with it. `--device-ms` gives each step a device time (default 5, a GPU decode step of a small model): a
launched step's tokens are ready that long after the stand-in device is free to start it, so with async batching
the host prepares the next step meanwhile, as on a GPU; ms per step above it means the host (engine and server,
one GIL) bounds the step. uvicorn runs as `gpuformers serve` runs it: httptools and uvloop when installed
(uvicorn[standard]), else h11 and asyncio (`--http`, `--loop` choose).

Beside each round, the stand-in engine alone (run_until_done, no server) on the same prompts gives the tokens per
second the front end has to keep up with; "served / engine alone" is the issue's "keep up" figure (>= 0.9 asked).

`--api-server-count N` (N > 1) serves the same engine as `gpuformers serve --api-server-count N` does: the engine core
(serving/engine_core.py) in this process and N real API server processes, so the front end's own CPU is measured
apart from the engine's: "api server i" is that process's CPU clock, "engine thread" the engine loop's (with the
core's per-step messages), "core main" the thread taking the API servers' requests
(bench_serving_host_processes.py).

Every answer is checked: its streamed text equals the decode of its tokens (cut before the first stop string the
text holds, with --stop), it ends with `data: [DONE]` and finish_reason "length" ("stop" when cut), and its usage
counts T tokens. `--profile` adds a cProfile run of the event loop at the largest N, timed by its CPU clock
(several times slower: for where the time goes, not for the table).

    python benchmarks/bench_serving_host.py                        # 64, 128, 256 clients, 128 tokens each (~1 min)
    python benchmarks/bench_serving_host.py --clients 256 --profile
    python benchmarks/bench_serving_host.py --clients 64 256 --api-server-count 2
    python benchmarks/bench_serving_host.py --endpoint completions --stop "<|im_end|>" --logprobs 2 --device-ms 0
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / ".cache" / "assets" / "qwen3-tokenizer"

# What the stand-in model "generates": each request streams this text's tokens from its own offset, round and round
TEXT = """The continuous batching engine schedules every running request at each step, so a server that streams
tokens to many clients has to keep up with it: one chunk per token per client. Here is some code:

    def fibonacci(n: int) -> list[int]:
        a, b, out = 0, 1, []
        for _ in range(n):
            out.append(a)
            a, b = b, a + b
        return out

Les élèves étudient à l'école; die Größe der Straße ändert sich. 你好，世界！今日は良い天気ですね。
Emoji travel in several byte-level pieces: 👋🏽 🇫🇷 🧑‍💻 😀✨ — and numbers like 3.14159, 2**10 = 1024, 1e-5.
Ещё немного текста на русском языке, and then the story goes on: the model keeps writing until max_tokens.
"""

# ---------------------------------------------------------------------------------------------- the stand-in model

class StandInDevice:
    """The stand-in model: a decoder of zeros and a sampler that follows the script; a step's tokens are ready
    `step_seconds` after the device is free to run it (steps queue behind each other, as on a GPU stream)."""

    def __init__(self, hidden_size: int, script: list[int], step_seconds: float):
        import torch  # here, not at the top: the client process does without it

        self.torch = torch
        self.hidden_size, self.script, self.step_seconds = hidden_size, script, step_seconds
        self.ready_at = 0.0  # when the last launched step's tokens are ready
        self.offsets: dict[str, int] = {}  # request id -> its script offset (ids are unique: never reused)

    def decoder(self, input_ids, position_ids, past_key_values):
        self.ready_at = max(time.perf_counter(), self.ready_at) + self.step_seconds
        return self.torch.zeros(*input_ids.shape, self.hidden_size), None

    def sample(self, logits, sequences, counts):
        """sample_on_device's results: the script's next token for each sequence, logprobs when asked for."""
        torch = self.torch
        offsets, script, size = self.offsets, self.script, len(self.script)
        for seq in sequences:  # a GPU samples in a few kernels: the stand-in's Python per row kept small
            if seq.request_id not in offsets:
                offsets[seq.request_id] = self.offset(seq.prompt_ids)
        tokens = torch.tensor([script[(offsets[seq.request_id] + seq.num_output_tokens) % size] for seq in sequences])
        want = [i for i, seq in enumerate(sequences) if seq.params.return_logprobs]
        out = [tokens]
        if want:
            out.append(torch.full((len(want),), -0.25))
            k = max(sequences[i].params.top_logprobs for i in want)
            if k:  # (rows, k): the chosen token and the ones after it in the vocabulary
                ids = tokens[want][:, None] + torch.arange(k)
                out += [torch.linspace(-0.25, -4.0, k).expand(len(want), k), ids]
        return tokens, want, out

    def token(self, prompt_ids: list[int], index: int) -> int:
        """Generated token `index` of the request with this prompt: the script from an offset the prompt gives (so
        the checks can work the answer out too)."""
        return self.script[(self.offset(prompt_ids) + index) % len(self.script)]

    @staticmethod
    def offset(prompt_ids: list[int]) -> int:
        return sum(prompt_ids) * 7919


def install(manager, device: StandInDevice) -> None:
    """Give the manager's runner the stand-in model and device (the engine's own code is left as it is)."""
    from gpuformers.engine import model_runner

    runner = manager.runner
    runner.decoder = device.decoder
    runner.compute_logits = lambda hidden: hidden  # the sampler below ignores the logits
    model_runner.sample_on_device = device.sample
    launch, collect = runner.launch, runner.collect

    def launched(batch, previous=None):
        step = launch(batch, previous)
        step.ready_at = device.ready_at
        return step

    def collected(step):
        wait = getattr(step, "ready_at", 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the device is still running the step
        return collect(step)

    runner.launch, runner.collect = launched, collected


# ---------------------------------------------------------------------------------------------- the requests

def request_body(args, index: int, tokens: int) -> dict:
    body = {"model": "bench", "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if args.stop:
        body["stop"] = args.stop
    words = f"Request {index}: tell me a long story about the number {index * 37}."
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": words}]
        if args.logprobs:
            body.update(logprobs=True, top_logprobs=args.logprobs)
    else:
        body["prompt"] = words
        if args.logprobs:
            body["logprobs"] = args.logprobs
    return body


def prompt_ids_of(tokenizer, body: dict) -> list[int]:
    """The prompt's token ids as the server makes them."""
    if "messages" in body:
        return list(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=False))
    return tokenizer.encode(body["prompt"], add_special_tokens=True)


# ---------------------------------------------------------------------------------------------- the client process

def run_clients(port: int, path: str, bodies: list[dict]) -> list[dict]:
    """Every request at once over raw non-blocking sockets and one epoll selector, each response's bytes kept as
    they come (parsed after the clock): about the least CPU a client can spend per chunk (a recv and an append), so
    that on a machine of few cores the clients leave the server what they can. (An asyncio stream per request took
    22.5-23.7 us of the client's CPU per token against 14.8-16.0 us this way, both with the process's start and the
    parsing, at 256 streams of 512 tokens on 2 cores; the round's own CPU, reported, is 7-13 us.)"""
    import selectors

    selector = selectors.DefaultSelector()
    results = []
    for body in bodies:
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        result = {"parts": [], "start": time.perf_counter(), "first": None, "end": None}
        sock.connect_ex(("127.0.0.1", port))
        selector.register(sock, selectors.EVENT_WRITE, (result, request))
        results.append(result)
    waiting = len(results)
    while waiting:
        for key, _ in selector.select():
            sock, (result, request) = key.fileobj, key.data
            if request is not None:  # connected: the whole request in one send (a few hundred bytes)
                sent = sock.send(request)
                if sent < len(request):
                    selector.modify(sock, selectors.EVENT_WRITE, (result, request[sent:]))
                else:
                    selector.modify(sock, selectors.EVENT_READ, (result, None))
                continue
            data = sock.recv(1 << 16)
            if data:
                if result["first"] is None and b"data: " in data:
                    result["first"] = time.perf_counter()
                result["parts"].append(data)
                continue
            result["end"] = time.perf_counter()
            selector.unregister(sock)
            sock.close()
            waiting -= 1
    selector.close()
    return [{"raw": b"".join(r.pop("parts")), **r} for r in results]


def parse_stream(raw: bytes, chat: bool) -> dict:
    """An HTTP/1.1 response of server-sent events -> its text, chunk count, finish reason, usage."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        pieces, at = [], 0
        while True:
            end = body.index(b"\r\n", at)
            size = int(body[at:end].split(b";")[0], 16)
            if size == 0:
                break
            pieces.append(body[end + 2:end + 2 + size])
            at = end + 2 + size + 2
        body = b"".join(pieces)
    text, chunks, finish, usage, done = [], 0, None, None, False
    for event in body.decode().split("\n\n"):
        if not event.startswith("data: "):
            continue
        if event == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            chunks += 1
            text.append((choice["delta"].get("content") if chat else choice["text"]) or "")
            finish = choice["finish_reason"] or finish
    return {"status": status, "text": "".join(text), "chunks": chunks, "finish_reason": finish, "usage": usage,
            "done": done}


def client_main(spec: dict) -> None:
    """--client: run the requests of `spec` at once, print what came back as JSON (parsed after the clock)."""
    cpu = time.process_time()
    results = run_clients(spec["port"], spec["path"], spec["bodies"])
    cpu = time.process_time() - cpu
    start, end = min(r["start"] for r in results), max(r["end"] for r in results)
    ttft = sorted((r["first"] or r["end"]) - r["start"] for r in results)
    answers = [parse_stream(r["raw"], spec["chat"]) for r in results]
    json.dump({"wall": end - start, "ttft_p50": ttft[len(ttft) // 2], "answers": answers, "cpu": cpu}, sys.stdout)


# ---------------------------------------------------------------------------------------------- the server side

class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a thread of this process, its event loop reachable for profiling."""

    def __init__(self, app, manager, http: str = "auto", loop: str = "auto"):
        import importlib.util

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # what uvicorn's "auto" picks, as `gpuformers serve` runs it: httptools and uvloop when installed
        # (uvicorn[standard]), else h11 and asyncio
        if http == "auto":
            http = "httptools" if importlib.util.find_spec("httptools") else "h11"
        if loop == "auto":
            loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
        self.http, self.loop_name = http, loop
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                     http=http, loop=loop)
        self.server = uvicorn.Server(self.config)
        self.manager, self.loop = manager, None
        self.thread = threading.Thread(target=self._run, name="server-loop", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.02)

    def _run(self) -> None:
        self.loop = self.config.get_loop_factory()()
        self.loop.run_until_complete(self.server.serve())

    def call(self, function) -> None:
        """Run `function` in the event loop's thread and wait for it."""
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (function(), done.set()))
        done.wait()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def run(self, driver):
        try:
            return driver()
        finally:
            self.stop()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the engine thread, the event loop's, and the whole process."""
        return {"engine": thread_cpu(self.manager._thread), "event loop": thread_cpu(self.thread),
                "process": time.process_time()}


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def run_round(server, manager, tokenizer, device: StandInDevice, args, clients: int, tokens: int) -> dict:
    """One round of `clients` streams of `tokens` tokens: CPU per thread or process (server.cpu()), wall time;
    every answer checked."""
    bodies = [request_body(args, index, tokens) for index in range(clients)]
    spec = {"port": server.port, "path": "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions",
            "bodies": bodies, "chat": args.endpoint == "chat"}
    before, driver, steps = server.cpu(), time.thread_time(), manager.num_steps
    finished = subprocess.run([sys.executable, __file__, "--client"], input=json.dumps(spec), capture_output=True,
                              text=True, cwd=REPO)
    after, driver = server.cpu(), time.thread_time() - driver
    if finished.returncode != 0:
        sys.exit(f"the client failed:\n{finished.stderr[-3000:]}")
    report = json.loads(finished.stdout)
    check(report["answers"], bodies, tokenizer, device, tokens)
    cpu = {name: after[name] - before[name] for name in after}
    # the process's threads not named: the total less those named and this (the driver's) thread
    cpu["process"] -= driver + sum(cpu[name] for name in ("engine", "event loop", "core main") if name in cpu)
    cpu["other threads" if "event loop" in cpu else "core other threads"] = cpu.pop("process")
    streamed = sum(answer["usage"]["completion_tokens"] for answer in report["answers"])  # fewer when a stop cut
    return {"wall_s": report["wall"], "tokens": streamed, "steps": manager.num_steps - steps, "cpu": cpu,
            "chunks": sum(a["chunks"] for a in report["answers"]), "ttft_p50": report["ttft_p50"],
            "client": report["cpu"]}


def engine_alone(manager, tokenizer, args, clients: int, tokens: int) -> tuple[float, float]:
    """Output tok/s of the stand-in engine alone (run_until_done in this thread, no server) on the round's prompts,
    what the front end is to keep up with; and the thread's CPU seconds per token (the engine thread's figure when
    nothing else runs: beside a served round's, what the front end's processes and their streaming add to it)."""
    prompts = [prompt_ids_of(tokenizer, request_body(args, index, tokens)) for index in range(clients)]
    start, cpu = time.perf_counter(), time.thread_time()
    for prompt in prompts:
        manager.add_request(prompt, max_new_tokens=tokens, ignore_eos=True, do_sample=False)
    manager.run_until_done()
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    produced = 0
    while (output := manager.get_result(timeout=0)) is not None:
        produced += len(output.generated_tokens)
    return produced / seconds, cpu / produced


def check(answers: list[dict], bodies: list[dict], tokenizer, device: StandInDevice, tokens: int) -> None:
    """Each answer is the decode of its tokens (cut before the first stop string, if one occurs), whole."""
    for index, (answer, body) in enumerate(zip(answers, bodies)):
        prompt = prompt_ids_of(tokenizer, body)
        expected = tokenizer.decode([device.token(prompt, k) for k in range(tokens)], skip_special_tokens=True)
        cut = min((i for i in (expected.find(stop) for stop in body.get("stop", [])) if i >= 0), default=None)
        if cut is not None:
            expected = expected[:cut]
        finish = "length" if cut is None else "stop"
        problems = []
        if answer["status"] != 200 or not answer["done"]:
            problems.append(f"status {answer['status']}, [DONE] {answer['done']}")
        if answer["text"] != expected:
            problems.append(f"text {answer['text'][:80]!r}... differs from the decode {expected[:80]!r}...")
        if answer["finish_reason"] != finish or (cut is None and (answer["usage"] or {}).get("completion_tokens")
                                                 != tokens):
            problems.append(f"finish_reason {answer['finish_reason']} (expected {finish}), usage {answer['usage']}")
        if problems:
            sys.exit(f"request {index}: " + "; ".join(problems))


def profile_round(server: ServerThread, manager, tokenizer, device, args, clients: int, tokens: int) -> str:
    """The top functions by own time in the event loop over one round, per streamed token."""
    # Timed by the thread's CPU clock: a call's waits (for the GIL, a queue, the socket) are not counted as its time
    loop_profile = cProfile.Profile(time.thread_time)
    server.call(loop_profile.enable)
    try:
        streamed = run_round(server, manager, tokenizer, device, args, clients, tokens)["tokens"]
    finally:
        server.call(loop_profile.disable)
    out = []
    for name, profiles in (("event loop", [loop_profile]),):
        stats = pstats.Stats(profiles[0], stream=io.StringIO())
        for profile in profiles[1:]:
            stats.add(profile)
        rows = []
        for (file, line, function), (_, calls, own, cumulative, _) in stats.stats.items():
            where = f"{Path(file).name}:{line}({function})" if file != "~" else function
            rows.append((own, cumulative, calls, where))
        rows.sort(reverse=True)
        own_total = sum(r[0] for r in rows)
        out.append(f"\n{name}: {own_total / streamed * 1e6:.1f} us of CPU per token under the profiler (several times "
                   f"the unprofiled cost: compare shares, not sizes); the top {args.top} functions by own time:")
        out.append("| us/token own | us/token cumulative | calls/token | function |")
        out.append("| ---: | ---: | ---: | --- |")
        for own, cumulative, calls, where in rows[:args.top]:
            out.append(f"| {own / streamed * 1e6:.2f} | {cumulative / streamed * 1e6:.2f} | "
                       f"{calls / streamed:.2f} | {where} |")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 128, 256], help="concurrent streams per round")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each stream runs (ignore_eos)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--device-ms", type=float, default=5.0, help="the stand-in device's time per step")
    parser.add_argument("--stop", nargs="+", help="stop strings sent with each request (their search and hold-back "
                        "cost; one the text holds cuts the answer there, and the check expects the cut)")
    parser.add_argument("--logprobs", type=int, default=0, help="top logprobs per token (chat; completions' "
                        "logprobs=k)")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto", help="uvicorn's HTTP "
                        "implementation (auto: httptools when installed, as `gpuformers serve` runs)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="uvicorn's event loop")
    parser.add_argument("--api-server-count", type=int, default=1, help="N > 1: the front end in N API server "
                        "processes of its own, the stand-in engine in this process's engine core, as `gpuformers "
                        "serve --api-server-count N` runs (bench_serving_host_processes.py)")
    parser.add_argument("--profile", action="store_true", help="also profile one round at the largest --clients "
                        "(the in-process front end's event loop)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per profiled thread kind")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(json.load(sys.stdin))
    if args.profile and args.api_server_count > 1:
        raise NotImplementedError("--profile with --api-server-count > 1 is not implemented (it profiles the "
                                  "in-process event loop); profile an API server process with py-spy instead")
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        sys.exit(f"the Qwen3 tokenizer is missing at {TOKENIZER_DIR}; fetch it with scripts/fetch_test_assets.sh")
    import torch

    torch.set_num_threads(1)
    from gpuformers import AutoTokenizer
    from gpuformers.serving.server import build_app

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    script = tokenizer.encode(TEXT, add_special_tokens=False)
    from bench_engine_host import stand_in_model  # (imports torch: the client process never needs it)

    model = stand_in_model(vocab=151936)  # the tokenizer's vocabulary: the prompts hold its ids
    most, block_size = max(args.clients), 256
    blocks_each = -(-(64 + args.max_tokens) // block_size) + 1
    manager = model.init_continuous_batching(
        eos_token_id=None, block_size=block_size, num_blocks=most * blocks_each, max_batch_tokens=most * 64,
        max_requests_per_batch=most, use_async_batching=True)
    device = StandInDevice(model.config.hidden_size, script, args.device_ms / 1e3)
    install(manager, device)
    engine_alone(manager, tokenizer, args, 8, 16)  # warm up
    alone, alone_cpu = {}, {}
    for clients in args.clients:
        alone[clients], alone_cpu[clients] = engine_alone(manager, tokenizer, args, clients, args.max_tokens)
    if args.api_server_count > 1:
        from bench_serving_host_processes import ProcessServers

        server = ProcessServers(manager, tokenizer, args.api_server_count, max_pending=most)
    else:
        server = ServerThread(build_app(manager, tokenizer, "bench", max_pending=most), manager, args.http, args.loop)

    def rounds():
        run_round(server, manager, tokenizer, device, args, 8, 16)  # warm up: first-call costs, imports
        results = {clients: run_round(server, manager, tokenizer, device, args, clients, args.max_tokens)
                   for clients in args.clients}
        profile = profile_round(server, manager, tokenizer, device, args, most, args.max_tokens) if args.profile else ""
        return results, profile

    results, profile = server.run(rounds)
    where = (f"in {args.api_server_count} API server processes (the engine core in this one)"
             if args.api_server_count > 1 else f"in this process, uvicorn with {server.http} and {server.loop_name}")
    print(f"server host work per streamed token: {args.endpoint} streams of {args.max_tokens} tokens, stand-in "
          f"model, device {args.device_ms:g} ms per step, the front end {where}"
          f"{', stop ' + repr(args.stop) if args.stop else ''}"
          f"{', logprobs ' + str(args.logprobs) if args.logprobs else ''}")
    print("| clients | " + " | ".join(str(c) for c in results) + " |")
    print("| --- |" + " --- |" * len(results))

    def us(seconds: float, r: dict) -> str:
        return f"{seconds / r['tokens'] * 1e6:.1f}"

    def front(r: dict) -> float:  # the front end's CPU: all but the engine thread's
        return sum(v for name, v in r["cpu"].items() if name != "engine")

    rows = {
        "tokens streamed": lambda r: f"{r['tokens']}",
        "chunks streamed": lambda r: f"{r['chunks']}",
        "wall s": lambda r: f"{r['wall_s']:.2f}",
        "engine steps": lambda r: f"{r['steps']}",
        "ms per step": lambda r: f"{r['wall_s'] / max(r['steps'], 1) * 1e3:.1f}",
        "TTFT p50 ms": lambda r: f"{r['ttft_p50'] * 1e3:.0f}",
        "streamed tok/s": lambda r: f"{r['tokens'] / r['wall_s']:.0f}",
        "engine alone tok/s": lambda r: f"{alone[r['clients']]:.0f}",
        "served / engine alone": lambda r: f"**{r['tokens'] / r['wall_s'] / alone[r['clients']]:.2f}**",
        "all CPU us/token": lambda r: f"**{us(sum(r['cpu'].values()), r)}**",
        "  engine thread us/token": lambda r: us(r["cpu"]["engine"], r),
        "  (the engine alone's thread us/token)": lambda r: f"{alone_cpu[r['clients']] * 1e6:.1f}",
        "  front end us/token (all but the engine thread)": lambda r: us(front(r), r),
        **{f"    {name} us/token": (lambda r, name=name: us(r["cpu"][name], r))
           for name in next(iter(results.values()))["cpu"] if name != "engine"},
        "client process us/token (while streaming; not the server's)": lambda r: us(r["client"], r),
        "front end ms per step": lambda r: f"{front(r) / max(r['steps'], 1) * 1e3:.1f}",
        "wall us/token": lambda r: f"{r['wall_s'] / r['tokens'] * 1e6:.1f}",
    }
    for name, cell in rows.items():
        print(f"| {name} | " + " | ".join(cell({**r, 'clients': c}) for c, r in results.items()) + " |")
    print(profile)

if __name__ == "__main__":
    main()
