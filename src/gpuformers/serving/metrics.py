"""Server metrics in the Prometheus text format (GET /metrics), without the prometheus_client package.

Counters (requests by endpoint and status, prompt and generated tokens), gauges read from the engine when scraped
(waiting and running sequences, KV blocks used and total, engine steps, requests in flight) and two latency
histograms (time to first token, time between tokens), all under the `gpuformers_` prefix; with `connections` set
(a connections.ConnectionStats, by serve_app), the connections too: open, accepted, refused past --max-connections,
closed by the server (by reason), invalid HTTP and failed accept() calls.

With --api-server-count N > 1 each API server process counts its own requests; twice a second it sends the core a
`snapshot()` of them, the core hands every server the others' latest, and /metrics (on whichever server answers)
renders its own counts plus those: one view of all the servers. The engine's gauges and the peers' requests in
flight are the core's at the scrape; the peers' counters and histograms are at most ~0.5 s old.

Offers: Histogram, Metrics.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative buckets in seconds, as Prometheus expects them (le="+Inf" is the count)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram {name}: buckets {buckets} must be ascending, each bound once")
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, the observations it is the first to hold; last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float, times: int = 1) -> None:
        """`times` observations of `seconds` (the tokens of one chunk share their interval)."""
        # Counted in the first bucket that holds it (once per streamed chunk: no loop over the buckets); lines()
        # makes them cumulative.
        self.sum += seconds * times
        self.count += times
        # (nan is in no bucket but +Inf, as `nan <= bound` is false)
        self.counts[bisect.bisect_left(self.buckets, seconds) if seconds == seconds else -1] += times

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{bound}"}} {count}'
                for bound, count in zip(self.buckets, itertools.accumulate(self.counts))]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]
        return out


class Metrics:
    """What the server counts; `render(manager, in_flight)` gives the /metrics text."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, HTTP status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("gpuformers_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("gpuformers_inter_token_latency_seconds",
                             "Seconds between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.connections = None  # a connections.ConnectionStats, set by the server that serves the app

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, times: int = 1) -> None:
        with self._lock:
            self.itl.observe(seconds, times)

    def snapshot(self, in_flight: int = 0) -> dict:
        """This server's counts as plain data (msgpack, engine_wire.py), for the other API server processes."""
        with self._lock:
            snap = {"requests": [[endpoint, status, count] for (endpoint, status), count in self.requests.items()],
                    "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                    "ttft": [list(self.ttft.counts), self.ttft.sum, self.ttft.count],
                    "itl": [list(self.itl.counts), self.itl.sum, self.itl.count], "in_flight": in_flight}
        stats = self.connections
        if stats is not None:
            snap["connections"] = {"open": stats.open, "accepted": stats.accepted, "refused": stats.refused,
                                   "invalid_http": stats.invalid_http, "accept_errors": stats.accept_errors,
                                   "closed": dict(stats.closed)}
        return snap

    def _add(self, snap: dict) -> None:
        """Add another server's snapshot to these counts (a view made for one render)."""
        for endpoint, status, count in snap["requests"]:
            self.requests[(endpoint, status)] += count
        self.prompt_tokens += snap["prompt_tokens"]
        self.generation_tokens += snap["generation_tokens"]
        for histogram, (counts, total, count) in ((self.ttft, snap["ttft"]), (self.itl, snap["itl"])):
            histogram.counts = [a + b for a, b in zip(histogram.counts, counts)]
            histogram.sum += total
            histogram.count += count
        theirs = snap.get("connections")
        if theirs is not None and self.connections is not None:
            mine = self.connections
            for name in ("open", "accepted", "refused", "invalid_http", "accept_errors"):
                setattr(mine, name, getattr(mine, name) + theirs[name])
            for reason, count in theirs["closed"].items():
                mine.closed[reason] = mine.closed.get(reason, 0) + count

    def render(self, manager=None, in_flight: int = 0, peers=()) -> str:
        """The /metrics text; `peers`: the other API server processes' snapshots, added to this one's counts."""
        if peers:
            from gpuformers.serving.connections import ConnectionStats

            view = Metrics()
            view.connections = ConnectionStats() if self.connections is not None else None
            for snap in (self.snapshot(in_flight), *peers):
                view._add(snap)
            return view.render(manager, in_flight + sum(snap["in_flight"] for snap in peers))
        with self._lock:
            lines = ["# HELP gpuformers_requests_total HTTP requests answered, by endpoint and status.",
                     "# TYPE gpuformers_requests_total counter"]
            lines += [f'gpuformers_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}'
                      for (endpoint, status), count in sorted(self.requests.items())]
            lines += ["# HELP gpuformers_prompt_tokens_total Prompt tokens of admitted requests.",
                      "# TYPE gpuformers_prompt_tokens_total counter",
                      f"gpuformers_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP gpuformers_generation_tokens_total Tokens generated.",
                      "# TYPE gpuformers_generation_tokens_total counter",
                      f"gpuformers_generation_tokens_total {self.generation_tokens}"]
            gauges = {"requests_in_flight": ("Engine requests the server is waiting on.", in_flight)}
            if manager is not None:
                blocks = manager.block_manager
                gauges.update({
                    "num_requests_waiting": ("Sequences waiting for admission.", len(manager.scheduler.waiting)),
                    "num_requests_running": ("Sequences in the running batch.", len(manager.scheduler.running)),
                    "kv_blocks_used": ("KV cache blocks in use.", blocks.num_blocks - blocks.num_free_blocks),
                    "kv_blocks_total": ("KV cache blocks in all.", blocks.num_blocks),
                })
                lines += ["# HELP gpuformers_engine_steps_total Engine steps run (only when there is work).",
                          "# TYPE gpuformers_engine_steps_total counter",
                          f"gpuformers_engine_steps_total {manager.num_steps}"]
            for name, (help, value) in gauges.items():
                lines += [f"# HELP gpuformers_{name} {help}", f"# TYPE gpuformers_{name} gauge",
                          f"gpuformers_{name} {value}"]
            lines += self.ttft.lines() + self.itl.lines()
            if self.connections is not None:
                lines += _connection_lines(self.connections)
        return "\n".join(lines) + "\n"


def _connection_lines(stats) -> list[str]:
    """The connection-level samples (connections.ConnectionStats): what never reaches the app's request counts."""
    counters = {
        "connections_accepted_total": ("TCP connections accepted.", stats.accepted),
        "connections_refused_total": ("Connections answered 503 and closed: past --max-connections.", stats.refused),
        "http_invalid_requests_total": ("Requests that were not valid HTTP/1.1 (answered 400, closed).",
                                        stats.invalid_http),
        "accept_errors_total": ("accept() calls that failed: out of file descriptors or memory.",
                                stats.accept_errors),
    }
    lines = ["# HELP gpuformers_connections_open Connections open now.", "# TYPE gpuformers_connections_open gauge",
             f"gpuformers_connections_open {stats.open}"]
    for name, (help, value) in counters.items():
        lines += [f"# HELP gpuformers_{name} {help}", f"# TYPE gpuformers_{name} counter", f"gpuformers_{name} {value}"]
    lines += ["# HELP gpuformers_connections_closed_total Connections the server closed, by reason: header_timeout "
              "(--header-timeout), idle (--timeout-keep-alive), evicted (idle, to make room under --max-connections).",
              "# TYPE gpuformers_connections_closed_total counter"]
    lines += [f'gpuformers_connections_closed_total{{reason="{reason}"}} {count}'
              for reason, count in sorted(stats.closed.items())]
    return lines
