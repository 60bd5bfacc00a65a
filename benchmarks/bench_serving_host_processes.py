"""bench_serving_host.py --api-server-count N: the stand-in engine served as `gpuformers serve --api-server-count N`
serves it, the engine core in this process (serving/engine_core.EngineCore over the stand-in manager) and N API server
processes of its own (`python -m gpuformers.serving.api_server`, the real ones), so the front end's own CPU is
measured apart from the engine's: each API server's CPU clock (psutil), the engine thread's and the core's other
threads' (ZMQ in and out, the per-step messages) from their own clocks.

EngineCore.serve() must run on the main thread (it takes SIGTERM); the benchmark's rounds run in a driver thread,
which ends the core with a SIGTERM to this process when they are done.

Offers: ProcessServers.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time


def _thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class ProcessServers:
    """The engine core over `manager` (a stand-in engine, not started) and `count` API server processes on a free
    port of 127.0.0.1. `run(driver)` serves while driver() runs and returns what it returned."""

    def __init__(self, manager, tokenizer, count: int, max_pending: int):
        from gpuformers.serving.connections import ConnectionLimits
        from gpuformers.serving.engine_core import EngineCore, listening_socket, spreads_connections

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        limits = ConnectionLimits().resolved()
        spread = spreads_connections()
        sock = listening_socket("127.0.0.1", port, None if spread else limits.backlog, reuse_port=spread)
        # --max-pending bounds the API servers together: room for every stream of a round
        config = {"model_name": "bench", "max_model_len": None, "max_pending": max_pending, "tool_call_parser": None,
                  "reasoning_parser": None, "log_level": "warning", "shutdown_timeout": 10, "host": "127.0.0.1",
                  "backlog": limits.backlog,
                  "limits": [limits.header_timeout, limits.keep_alive_timeout, limits.max_connections]}
        self.manager, self.count, self.port = manager, count, port
        self.core = EngineCore(manager, tokenizer, count, sock, config)
        self.http = self.loop_name = "as `gpuformers serve` runs it"

    def run(self, driver):
        """Serve (the core on this, the main, thread) while driver() runs in a thread, once every API server
        listens; then stop everything and return driver()'s result (or raise its error)."""
        outcome = {}

        def drive():
            try:
                self._wait_listening()
                outcome["value"] = driver()
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = error
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # the core's graceful stop

        self.driver = threading.Thread(target=drive, name="bench-driver")
        self.driver.start()
        self.core.serve()
        self.driver.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _wait_listening(self, timeout: float = 120) -> None:
        import psutil

        deadline = time.monotonic() + timeout
        while True:
            pids = [p.pid for p in self.core._processes if p is not None]  # the benchmark peeks at the core's own
            listening = sum(1 for pid in pids if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                                                     for c in psutil.Process(pid).net_connections(kind="tcp")))
            if listening == self.count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{listening} of {self.count} API servers listen after {timeout} s")
            time.sleep(0.1)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the engine thread, the core's main thread (requests in, API servers watched), the
        core's other threads (the driver's own time is taken out by the caller), and each API server process."""
        import psutil

        out = {"engine": _thread_cpu(self.manager._thread), "core main": _thread_cpu(threading.main_thread()),
               "process": time.process_time()}
        for index, process in enumerate(self.core._processes):
            times = psutil.Process(process.pid).cpu_times()
            out[f"api server {index}"] = times.user + times.system
        return out
