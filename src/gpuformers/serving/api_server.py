"""One API server process of `gpuformers serve --api-server-count N` (N > 1), started by the engine core
(engine_core.py) as `python -m gpuformers.serving.api_server CONFIG INDEX`: the same FastAPI app as the one-process
server (server.build_app: routes, validation, chat templates, tokenization, detokenization, stop strings, tool-call
and reasoning parsing, SSE) over an EngineClient (engine_client.py) instead of the engine itself, served by uvicorn
on a listening socket of its own bound to the port with SO_REUSEPORT (Linux: the kernel spreads connections between
the API servers), or on the one listening socket inherited from the core (elsewhere).

An API server lowers its own scheduling priority (nice +API_SERVER_NICE) before it serves: where the machine has fewer
free cores than busy processes, the kernel then runs the engine core's loop first, the process that keeps the
accelerator fed (or, on the CPU, computes every token). An API server that falls behind loses nothing: the core's
messages waiting for it are read together and each request gets only its newest output (engine_client.py), and a
job reads only each choice's newest output (output_inbox.py), so it sends several tokens in one chunk and catches
up, while an engine slowed by its front ends would slow every stream. Where cores are free, the priority changes
nothing.

CONFIG is the core's JSON file (in its private run folder): the app's settings, the port (and the inherited socket's
file descriptor, if any), the core's pid and the facts of its model; the API key comes in $GPUFORMERS_API_KEY, not on
the command line.

Offers: main, API_SERVER_NICE.
"""

from __future__ import annotations

import json
import logging
import socket
import sys

# How much an API server lowers its priority (os.nice): at +10 the kernel gives a busy engine core about nine times an
# API server's share of a contended core (bench_serving.py --compare at 256 streams on 2 cores: faster in 5 of 5
# quiet alternated pairs, 7,296 -> 7,805 tok/s on average, slower in one pair under load; BENCHMARKS.md, session 20)
API_SERVER_NICE = 10


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_path, index = argv[0], int(argv[1])
    with open(config_path) as file:
        config = json.load(file)
    # gpuformers' own lines at --log-level (other libraries' at warning), each naming the process that wrote it
    logging.basicConfig(format=f"%(asctime)s api-server-{index} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("gpuformers").setLevel(config["log_level"].upper())
    import os

    if hasattr(os, "nice"):  # (POSIX) the engine core runs first where cores are short (module docstring)
        os.nice(API_SERVER_NICE)

    from gpuformers import AutoTokenizer
    from gpuformers.serving.connections import ConnectionLimits
    from gpuformers.serving.engine_client import EngineClient
    from gpuformers.serving.engine_core import listening_socket
    from gpuformers.serving.server import build_app, serve_app

    tokenizer = AutoTokenizer.from_pretrained(config["tokenizer"])
    client = EngineClient(config["run_dir"], index, config["core_pid"], config["facts"])
    app = build_app(client, tokenizer, config["model_name"], config["max_model_len"],
                    os.environ.get("GPUFORMERS_API_KEY"), config["max_pending"], config["tool_call_parser"],
                    config["reasoning_parser"])
    state = app.state.serving
    client.metrics_of = lambda: state.metrics.snapshot(state.engine.in_flight)
    if config["fd"] is not None:
        sock = socket.socket(fileno=config["fd"])
    else:  # last, once the app is ready: the kernel hands this server connections from the moment it listens
        sock = listening_socket(config["host"], config["port"], config["backlog"], reuse_port=True)
    limits = ConnectionLimits(*config["limits"])
    serve_app(app, config["host"], config["port"], config["log_level"], config["shutdown_timeout"], limits,
              sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
