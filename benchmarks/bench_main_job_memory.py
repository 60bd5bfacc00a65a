"""Benchmark: memory of the main job on the CPU, the embedded SmolLM2-135M model (issue 24, point 4).

Two figures, each with the CPU weight copies of kernels/cpu_linear.py as they are by default and switched off
(GPUFORMERS_CPU_PACKED_ROWS=none) as the reference, in the same run:

1. Peak RSS of `gpuformers generate "What is the capital of France?"` in a fresh process (the child's ru_maxrss,
   from os.wait4), with its answer and wall time.
2. `gpuformers serve` (the embedded model) on 127.0.0.1 at a free port, then `--rounds` rounds of `--clients`
   concurrent streaming /v1/completions clients (greedy, `--max-tokens` each, prompts of 1-24 random words, new ones
   every round, so that the engine's steps meet many row counts): the server process's RSS after each round, and
   round N / round 2 (round 1 includes the warm-up).

Loopback only; each round is bounded by `--round-timeout` seconds, and the server is killed at the end.

    python benchmarks/bench_main_job_memory.py                          # 10 rounds of 200 clients, both settings
    python benchmarks/bench_main_job_memory.py --rounds 3 --clients 50  # a quicker look
    python benchmarks/bench_main_job_memory.py --skip-serve             # the generate figure alone
    python benchmarks/bench_main_job_memory.py --skip-generate --num-blocks 256 --settings default
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
import time

import httpx
import psutil

QUESTION = "What is the capital of France?"
WORDS = ("the of and to in is was for on that with as by at from it an be this which or are had not but what all "
         "were when we there can been one do has their if will each about how up out them then she many some so "
         "these would other into him time two more write go see number no way could people my than first water "
         "been call who oil its now find long down day did get come made may part").split()


def _env(copies: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GPUFORMERS_CPU_PACKED_ROWS", None)
    if not copies:
        env["GPUFORMERS_CPU_PACKED_ROWS"] = "none"  # no oneDNN copy and no batch-1 form: F.linear on the weights
    return env


def generate_peak(copies: bool) -> dict:
    """Peak RSS (MiB) of one `gpuformers generate` process, its answer and its wall time."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "gpuformers", "generate", QUESTION], env=_env(copies),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    answer = process.stdout.read().strip()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        sys.exit(f"gpuformers generate exited with {process.returncode}")
    return dict(copies=copies, peak_rss_mib=round(usage.ru_maxrss / 1024), answer=answer,
                seconds=round(time.perf_counter() - start, 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, copies: bool, clients: int, num_blocks: int | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "gpuformers", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", "--max-pending", str(max(512, 2 * clients))]
    command += ["--num-blocks", str(num_blocks)] if num_blocks else []
    process = subprocess.Popen(command, env=_env(copies), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    sys.exit("the server did not start within 300 s")


async def _stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    """One streaming request; the number of chunks with text it got."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    chunks = 0
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                chunks += 1
    raise RuntimeError("a stream ended without data: [DONE]")


async def _round(url: str, prompts: list[str], max_tokens: int, timeout: float) -> float:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(_stream(http, url, p, max_tokens) for p in prompts)), timeout)
        return time.perf_counter() - start


def serve_rounds(copies: bool, rounds: int, clients: int, max_tokens: int, timeout: float,
                 num_blocks: int | None = None) -> dict:
    """The server's RSS (MiB) after each round of `clients` concurrent streams."""
    port = _free_port()
    process = _start_server(port, copies, clients, num_blocks)
    try:
        server = psutil.Process(process.pid)
        start_rss = server.memory_info().rss / 2**20
        rng = random.Random(0)
        rss, seconds = [], []
        for _ in range(rounds):
            prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24))) for _ in range(clients)]
            seconds.append(round(asyncio.run(_round(f"http://127.0.0.1:{port}/v1/completions", prompts, max_tokens,
                                                    timeout)), 1))
            rss.append(round(server.memory_info().rss / 2**20))
            print(f"  round {len(rss)}: {seconds[-1]} s, server RSS {rss[-1]} MiB", file=sys.stderr, flush=True)
        later = rss[1:] or rss
        return dict(copies=copies, start_rss_mib=round(start_rss), rss_mib_per_round=rss, seconds_per_round=seconds,
                    last_over_second=round(rss[-1] / later[0], 3), max_over_min_from_second=round(max(later) /
                                                                                              min(later), 3))
    finally:
        process.kill()
        process.wait(30)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="serving rounds (default 10)")
    parser.add_argument("--clients", type=int, default=200, help="concurrent streaming clients per round (200)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per stream (default 8)")
    parser.add_argument("--round-timeout", type=float, default=600.0, help="seconds a round may take (600)")
    parser.add_argument("--num-blocks", type=int, help="the server's KV cache blocks (default: the server's own)")
    parser.add_argument("--settings", choices=("both", "default", "off"), default="both",
                        help="the copies as by default, off, or both (default)")
    parser.add_argument("--skip-serve", action="store_true", help="only the generate figure")
    parser.add_argument("--skip-generate", action="store_true", help="only the serving figure")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.clients < 1 or args.max_tokens < 1:
        sys.exit(f"--rounds {args.rounds}, --clients {args.clients} and --max-tokens {args.max_tokens} must be >= 1")
    print(f"torch threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs")
    for copies in {"both": (True, False), "default": (True,), "off": (False,)}[args.settings]:
        label = "default" if copies else "copies off (GPUFORMERS_CPU_PACKED_ROWS=none)"
        if not args.skip_generate:
            print(f"generate, {label}: {json.dumps(generate_peak(copies))}", flush=True)
        if not args.skip_serve:
            rounds = serve_rounds(copies, args.rounds, args.clients, args.max_tokens, args.round_timeout,
                                  args.num_blocks)
            print(f"serve {args.rounds} x {args.clients} streams of {args.max_tokens} tokens"
                  f"{f', {args.num_blocks} KV blocks' if args.num_blocks else ''}, {label}: {json.dumps(rounds)}",
                  flush=True)


if __name__ == "__main__":
    main()
