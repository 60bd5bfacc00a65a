"""Load test: half-open connections against `gpuformers serve` (slow-loris), on 127.0.0.1 only.

Starts the server on a random-weight Qwen3-shaped checkpoint (or --model) with --header-timeout H, then for
--seconds keeps --connections connections half-open: each sends the start of a request's headers and then one more
header byte every --trickle seconds, and is opened again as soon as the server closes it. Meanwhile a fresh
connection asks GET /health every 0.2 s, from a process of its own (the flooding process runs at nice 10). Then it
stops opening new ones and waits for the server to close the ones still open. It checks what the server guarantees (docs/serving.md, "Connections: timeouts and limits"):

- /health answers, each in under 1 s, the whole time;
- every half-open connection is closed by the server, none later than 2 x H (+1 s of slack) after it opened (a
  connection's first byte may wait H, its headers H more; these clients send their first bytes at once, so they
  are closed about H after they opened, plus however late the server's loop got to them);
- the server's log stays small (asyncio's accept() errors are rate-limited).

    python benchmarks/load_half_open.py                  # 2,000 connections for 60 s, --header-timeout 10
    python benchmarks/load_half_open.py --quick          # 200 connections for 10 s, --header-timeout 2
    python benchmarks/load_half_open.py --server-nice -5 # as root on a machine shared with other work

Exits 1 when a check fails. Raises this process's soft open-file limit to the hard one (the server does the same).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import free_port, make_checkpoint, metrics, percentile  # noqa: E402

HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: "
SLACK = 1.0  # seconds past the header timeout that the server may take to close a connection


class HalfOpen:
    """The half-open connections' tally."""

    def __init__(self):
        self.opened = self.closed_by_server = self.failed_to_open = 0
        self.lifetimes: list[float] = []  # open -> closed by the server, seconds
        self.open_now = 0


async def half_open_slot(host: str, port: int, stop_at: float, trickle: float, tally: HalfOpen,
                         last: list) -> None:
    """One slot: a half-open connection, opened again each time the server closes it, until stop_at. The one open
    at stop_at is left open (in `last`) for the final check."""
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (OSError, asyncio.TimeoutError):
            tally.failed_to_open += 1
            await asyncio.sleep(0.5)
            continue
        opened = time.monotonic()
        tally.opened += 1
        tally.open_now += 1
        writer.write(HEADERS)
        closed = asyncio.ensure_future(until_closed(reader))
        while not closed.done():
            await asyncio.wait([closed], timeout=trickle)
            if time.monotonic() >= stop_at and not closed.done():
                last.append((opened, closed, writer))  # still open when the flood stops
                return
            if not closed.done():
                try:
                    writer.write(b"a")  # slow-loris: a byte now and then, never the headers' end
                except OSError:
                    pass
        tally.open_now -= 1
        tally.closed_by_server += 1
        tally.lifetimes.append(closed.result() - opened)
        writer.close()


async def until_closed(reader: asyncio.StreamReader) -> float:
    """When the server closed the connection (after its 408, or nothing)."""
    try:
        await reader.read()
    except OSError:  # reset: closed as well
        pass
    return time.monotonic()


def probe_health(port: int, seconds: float, results) -> None:
    """GET /health on a fresh connection every 0.2 s for `seconds`; each answer's latency (connect included), put on
    `results` with the failures. Runs in a process of its own: the flood's event loop must not delay it."""
    latencies, failures = [], []
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                reply = b""
                while chunk := sock.recv(4096):
                    reply += chunk
            if not reply.startswith(b"HTTP/1.1 200 "):
                failures.append(f"{reply[:60]!r}")
        except OSError as error:
            failures.append(f"{type(error).__name__}: {error}")
        latencies.append(time.monotonic() - started)
        time.sleep(max(0.0, 0.2 - (time.monotonic() - started)))
    results.put((latencies, failures))


async def flood(port: int, connections: int, seconds: float, header_timeout: float, trickle: float) -> dict:
    host, tally, last = "127.0.0.1", HalfOpen(), []
    stop_at = time.monotonic() + seconds
    peak, lag = 0, 0.0

    async def watch():  # the peak of open connections, and how late this (client) loop runs
        nonlocal peak, lag
        while time.monotonic() < stop_at:
            peak = max(peak, tally.open_now)
            before = time.monotonic()
            await asyncio.sleep(0.5)
            lag = max(lag, time.monotonic() - before - 0.5)

    results = multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe_health, args=(port, seconds, results))
    prober.start()
    # The flood yields the CPU to the server and the prober (on a small machine it would otherwise starve them, as
    # an attacker's own machine does not)
    os.nice(10)
    await asyncio.gather(watch(), *(half_open_slot(host, port, stop_at, trickle, tally, last)
                                    for _ in range(connections)))
    # The flood has stopped: each connection still open must be closed by the server within its header timeout.
    deadline = time.monotonic() + header_timeout + SLACK + 1.0
    late = 0
    for opened, closed, writer in last:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            await asyncio.wait([closed], timeout=remaining)
        if closed.done():
            tally.closed_by_server += 1
            tally.lifetimes.append(closed.result() - opened)
        else:
            late += 1
            closed.cancel()
        writer.close()
    latencies, failures = results.get(timeout=30)
    prober.join()
    return {"tally": tally, "still_open": late, "held_at_stop": len(last), "peak": peak, "latencies": latencies,
            "failures": failures, "client_lag": lag}


def raise_own_file_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            sys.exit(f"this test needs {needed} open files but the hard limit is {hard}; run it with a smaller "
                     f"--connections or a higher limit (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    parser.add_argument("--trickle", type=float, default=2.0, help="seconds between two header bytes")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a random micro Qwen3)")
    parser.add_argument("--quick", action="store_true", help="200 connections, 10 s, --header-timeout 2")
    parser.add_argument("--server-nice", type=int, default=0,
                        help="the server's niceness; below 0 (root only) on a machine busy with other work, so that "
                             "the server gets the CPU it would have to itself in production")
    args = parser.parse_args(argv)
    if args.quick:
        args.connections, args.seconds, args.header_timeout, args.trickle = 200, 10.0, 2.0, 0.5
    files = raise_own_file_limit(args.connections + 512)
    print(f"client: open-file limit {files}; server: --header-timeout {args.header_timeout:g}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_checkpoint(Path(tmp), "micro")
        port, log_path = free_port(), Path(tmp) / "server.log"
        command = [sys.executable, "-m", "gpuformers", "serve", str(model), "--port", str(port), "--log-level",
                   "warning", "--header-timeout", str(args.header_timeout), "--num-blocks", "64"]
        with open(log_path, "w") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"},
                                      preexec_fn=(lambda: os.nice(args.server_nice)) if args.server_nice else None)
        try:
            wait_ready(port, server)
            started, cpu = time.monotonic(), cpu_seconds(server.pid)
            result = asyncio.run(flood(port, args.connections, args.seconds, args.header_timeout, args.trickle))
            took = time.monotonic() - started
            result["server_cpu"] = cpu_seconds(server.pid) - cpu
            counters = metrics(f"http://127.0.0.1:{port}")
        finally:
            server.terminate()
            server.wait(30)
        log_bytes = log_path.stat().st_size
    return report(args, result, took, counters, log_bytes)


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(port: int, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    sys.exit("the server did not start within 300 s")


def report(args, result: dict, took: float, counters: dict, log_bytes: int) -> int:
    tally, latencies = result["tally"], sorted(result["latencies"])
    lifetimes = sorted(tally.lifetimes)
    longest = lifetimes[-1] if lifetimes else float("nan")
    print(f"half-open connections: {args.connections} held for {args.seconds:g} s (peak {result['peak']} open at "
          f"once), {tally.opened} opened in all, {tally.failed_to_open} failed to open")
    print(f"  closed by the server: {tally.closed_by_server} of {tally.opened}; held p50 "
          f"{percentile(lifetimes, 50):.2f} s, p99 {percentile(lifetimes, 99):.2f} s, max {longest:.2f} s "
          f"(--header-timeout {args.header_timeout:g}); {result['held_at_stop']} open when the flood stopped, "
          f"{result['still_open']} of them still open {args.header_timeout + SLACK + 1:g} s later")
    print(f"/health: {len(latencies)} probes, p50 {percentile(latencies, 50) * 1000:.1f} ms, "
          f"p99 {percentile(latencies, 99) * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms, "
          f"{len(result['failures'])} failed{': ' + result['failures'][0] if result['failures'] else ''}")
    shown = {name: counters.get(f"gpuformers_{name}") for name in
             ("connections_accepted_total", "connections_refused_total", "accept_errors_total", "connections_open")}
    print(f"server: {shown}; {result['server_cpu']:.1f} CPU-seconds used; log {log_bytes} bytes")
    print(f"run took {took:.0f} s; the flooding client's event loop ran up "
          f"to {result['client_lag']:.2f} s late; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    checks = {
        "every /health answered in under 1 s": not result["failures"] and latencies[-1] < 1.0,
        "every half-open connection closed by the server": result["still_open"] == 0
        and tally.closed_by_server == tally.opened,
        f"none held past 2 x --header-timeout + {SLACK:g} s": longest <= 2 * args.header_timeout + SLACK,
        "the log stayed under 100 kB": log_bytes < 100_000,
    }
    for check, passed in checks.items():
        print(f"  {'ok  ' if passed else 'FAIL'} {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
