"""The engine core process of `gpuformers serve --api-server-count N` (N > 1): the ContinuousBatchingManager
(scheduler, model runner, sampler, KV cache) in this process, the HTTP front end in N API server processes of its
own (api_server.py: HTTP, validation, chat templates, tokenization, detokenization, stop strings, tool-call and
reasoning parsing, SSE), so the front end's Python never holds the engine's GIL.

    API server 0 ─┐  ["add" | "cancel" | "in_flight" | "grammar" | ...]   ┌─ this thread: add_request / cancel_request
    API server 1 ─┼──────────────── PULL ipc://RUN/in ──────────►│
    ...           │                                               │  engine thread: step, then after_step:
                  ◄──── PUSH ipc://RUN/out-i: one message per step per server (its requests' new tokens) ──┘

Connections. On Linux each API server listens on a socket of its own bound to the port with SO_REUSEPORT, and the
kernel spreads new connections between them; this process holds the port with a socket bound the same way but not
listening (so it takes no connection). Elsewhere the listening socket is made here and inherited by every API
server. The messages are engine_wire.py's.

Crashes. An API server that exits is seen within ~0.2 s: its engine requests are cancelled (their KV blocks
freed) and, when it had run RESTART_AFTER seconds or more, it is started again; the engine goes on for the others.
When no API server is left, or the engine loop breaks, this process exits with status 1; the API servers see
their parent go, fail their requests in flight with a 503 and report unhealthy on /health (engine_client.py).
SIGTERM or Ctrl-C: each API server gets SIGTERM and its graceful shutdown (--shutdown-timeout), then the engine
stops. The run folder (RUN in the picture: private, 0700) goes with this process; when it is killed the API servers
remove it, and when they were killed too the next core started by this user does (remove_stale_run_dirs).

Offers: EngineCore, listening_socket, spreads_connections, remove_stale_run_dirs, RUN_DIR_PREFIX, RESTART_AFTER.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuformers.engine.outputs import GenerationOutput
from gpuformers.engine.sequence import RequestStatus
from gpuformers.serving.engine_wire import OutputDeltas, pack, unpack

logger = logging.getLogger(__name__)

RUN_DIR_PREFIX = "gpuformers-serve-"  # the core's private run folder in the temp folder: its ZMQ sockets and config
RESTART_AFTER = 10.0  # an API server that ran at least this long before it exited is started again
TICK_SECONDS = 0.5  # facts and the servers' metrics go out at least this often, work or not
_WATCH_SECONDS = 0.2  # how often the API server processes are looked at


def remove_stale_run_dirs(parent: str | None = None) -> list[str]:
    """Remove the run folders (RUN_DIR_PREFIX*, this user's) of engine cores that no longer run: the API servers
    remove the folder of a core that was killed, but not when they were killed with it. A folder whose core pid is
    alive (or taken again by another process) is left alone. Returns the folders removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = json.loads((folder / "api_server.json").read_text())["core_pid"]
            os.kill(pid, 0)
        except ProcessLookupError:  # its core is gone
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
        except (OSError, ValueError, KeyError, TypeError):  # not ours, being made, or its core alive
            continue
    if removed:
        logger.info("removed the run folders of engine cores that no longer run: %s", ", ".join(removed))
    return removed


def listening_socket(host: str, port: int, backlog: int | None, reuse_port: bool = False) -> socket.socket:
    """The server's TCP socket bound to host:port. `reuse_port` (Linux): with SO_REUSEPORT, so that each API server
    binds a listening socket of its own on the same port and the kernel spreads new connections between them (by a
    hash of the connection's addresses); other programs, and other users, still cannot take the port. `backlog` None:
    bound, not listening (the core's socket in that mode: it holds the port from before the API servers start until
    after they end, and takes no connection, since the kernel hands connections only to listening sockets). Else
    listening, and without `reuse_port` inheritable (the API servers accept from this one socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error}; choose another --port or --host") from None
    if backlog is not None:
        sock.listen(backlog)
        sock.set_inheritable(not reuse_port)
    return sock


def spreads_connections() -> bool:
    """Whether the API servers listen on sockets of their own (SO_REUSEPORT): Linux only, where the kernel balances
    connections between such sockets; elsewhere (BSD, macOS: the last socket bound would take them all) they accept
    from one inherited socket."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


class EngineCore:
    """Runs `manager` for `count` API server processes until SIGTERM / Ctrl-C (`serve()`). `server_config` is what
    each API server needs besides the facts of the model read here (api_server.py reads it). `sock`: from
    listening_socket, either listening (each API server inherits it) or only bound with SO_REUSEPORT (each API
    server binds its own listening socket on that port; `server_config["backlog"]` sizes its queue)."""

    def __init__(self, manager, tokenizer, count: int, sock: socket.socket, server_config: dict,
                 api_key: str | None = None):
        import zmq

        self.manager, self.tokenizer, self.count, self.sock = manager, tokenizer, count, sock
        self._inherited = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        self.api_key = api_key
        remove_stale_run_dirs()
        self._run_dir = tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX)  # 0700: the sockets' folder
        run_dir = self._run_dir.name
        tokenizer.save_pretrained(Path(run_dir) / "tokenizer")  # what the API servers load, whatever its source
        generation_config = manager.generation_config.to_dict()
        self.config_path = Path(run_dir) / "api_server.json"
        self.config_path.write_text(json.dumps({
            **server_config, "run_dir": run_dir, "core_pid": os.getpid(),
            "fd": sock.fileno() if self._inherited else None, "port": sock.getsockname()[1],
            "tokenizer": str(Path(run_dir) / "tokenizer"),
            "facts": {"generation_config": generation_config, "vocab_size": manager.model.config.vocab_size,
                      "max_position_embeddings": getattr(manager.model.config, "max_position_embeddings", None),
                      "num_blocks": manager.block_manager.num_blocks, "block_size": manager.block_manager.block_size,
                      "adapters": list(manager.adapters)}}))
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(f"ipc://{run_dir}/in")
        self._outboxes = []
        for index in range(count):
            out = self._context.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 0)
            out.setsockopt(zmq.SNDHWM, 0)  # never drop a connected server's outputs
            out.bind(f"ipc://{run_dir}/out-{index}")
            self._outboxes.append(out)
        # Per API server: its engine requests (for cancelling them when it dies) and the outputs the engine
        # published for them since the last message (deques: appended by the engine's and this thread)
        self._requests: list[set[str]] = [set() for _ in range(count)]
        # Per API server: its requests in flight as it counts them (until each response ends: a stream the engine
        # has finished may still be unread), reported on every change; what its peers' --max-pending adds
        self._in_flight = [0] * count
        self._pending: list[collections.deque] = [collections.deque() for _ in range(count)]
        self._callbacks = [self._pending[index].append for index in range(count)]
        self._deltas = OutputDeltas()
        self._peers: dict[int, dict] = {}  # API server -> its latest metrics snapshot (kept after it exits)
        self._last_tick = 0.0
        self._asked = [False] * count  # a server's /metrics waits for fresh facts: sent after the next pass
        self._grammars: collections.OrderedDict = collections.OrderedDict()  # key -> engine Grammar
        self._tokenizer_infos: dict[tuple, object] = {}
        self._processes: list[subprocess.Popen | None] = [None] * count
        self._started: list[float] = [0.0] * count
        self._stopping = False
        manager.after_step = self._flush

    # --- the engine thread ----------------------------------------------------------------------------------

    def _flush(self) -> None:
        """After each pass of the engine loop: each API server's new outputs in one message (and the facts, and
        the peers' metrics, once a second even when idle)."""
        import zmq

        now = time.monotonic()
        tick = now - self._last_tick >= TICK_SECONDS
        if tick:
            self._last_tick = now
        facts = None
        for index, pending in enumerate(self._pending):
            asked = self._asked[index]
            if not pending and not tick and not asked:
                continue
            self._asked[index] = False
            rows = []
            while pending:
                output = pending.popleft()
                rows.append(self._deltas.row(output))
                if output.is_finished():
                    self._requests[index].discard(output.request_id)
                    logger.debug("%s (api server %d): %s, %d tokens", output.request_id, index, output.status.value,
                                 len(output.generated_tokens))
            if facts is None:
                scheduler, blocks = self.manager.scheduler, self.manager.block_manager
                # broken: set before the loop fails its requests, so their servers answer 503, not 500; and each
                # server's engine requests now (its peers' /metrics count them in flight without a snapshot's lag)
                facts = [len(scheduler.waiting), len(scheduler.running), blocks.num_free_blocks,
                         self.manager.num_steps, self.manager.broken,
                         [max(len(ids), held) for ids, held in zip(self._requests, self._in_flight)]]
            try:
                self._outboxes[index].send(pack([facts, rows, self._peers if tick or asked else None, asked]),
                                           zmq.NOBLOCK)
            except zmq.Again:  # no server connected to it (it exited): its outputs have no reader
                pass

    # --- this thread: requests in, API servers watched --------------------------------------------------------

    def serve(self) -> int:
        """Start the engine and the API servers; take their requests until SIGTERM / Ctrl-C (returns 0) or until
        the engine breaks or no API server is left (returns 1)."""
        import zmq

        from gpuformers.serving.server import freeze_startup_heap

        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._on_signal)
        freeze_startup_heap()  # the model and torch out of the collector's walks (its full ones cost the engine)
        self.manager.start()
        for index in range(self.count):
            self._start_server(index)
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        next_watch = 0.0
        code = 0
        try:
            while True:
                if poller.poll(_WATCH_SECONDS * 1000):
                    while True:
                        try:
                            data = self._inbox.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(unpack(data))
                if time.monotonic() >= next_watch:
                    next_watch = time.monotonic() + _WATCH_SECONDS
                    if not self.manager.is_running():
                        logger.error("the engine loop stopped (%s): exiting; the API servers answer 503",
                                     self.manager.broken)
                        code = 1
                        self._stopping = True  # the API servers go on alone: 503s and an unhealthy /health
                        self._processes = [None] * self.count
                        break
                    alive = self._watch_servers()
                    if not alive:
                        if not self._stopping:
                            logger.error("no API server is left: exiting")
                            code = 1
                        break
        finally:
            self._shutdown()
        return code

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == "add":
            _, index, request_id, prompt, sampling = message
            key = sampling.get("structured_output")
            try:
                if key is not None:
                    if key not in self._grammars:
                        raise ValueError("its grammar never reached the engine core")
                    sampling["structured_output"] = self._grammars[key]
                self._requests[index].add(request_id)
                # share_lists: _flush reads each output's new tokens before the engine's next step, in its thread
                self.manager.add_request(prompt, request_id=request_id, streaming=True,
                                         on_output=self._callbacks[index], share_lists=True, **sampling)
                logger.debug("%s (api server %d): %d prompt tokens", request_id, index, len(prompt))
            except (ValueError, RuntimeError, TypeError) as error:  # what add_request refuses: the request fails
                self._requests[index].discard(request_id)
                self._pending[index].append(GenerationOutput(request_id=request_id, prompt_ids=prompt,
                                                             error=str(error), status=RequestStatus.FAILED))
        elif kind == "cancel":
            self.manager.cancel_request(message[1])
        elif kind == "in_flight":
            self._in_flight[message[1]] = message[2]
        elif kind == "grammar":
            self._add_grammar(*message[1:])
        elif kind == "metrics":
            self._peers[message[1]] = message[2]
        elif kind == "facts?":
            self._asked[message[1]] = True

    def _add_grammar(self, key: str, name: str, vocab_size: int, stop_token_ids: list[int], data: str) -> None:
        """A grammar an API server compiled, made an engine Grammar here (its tokenizer info built once)."""
        import xgrammar

        from gpuformers.engine.structured import Grammar, tokenizer_info

        info = self._tokenizer_infos.get(tuple(stop_token_ids))
        if info is None:
            info = self._tokenizer_infos[tuple(stop_token_ids)] = tokenizer_info(self.tokenizer, vocab_size,
                                                                                 stop_token_ids)
        self._grammars[key] = Grammar(name, xgrammar.CompiledGrammar.deserialize_json(data, info), vocab_size)
        while len(self._grammars) > 1024:
            self._grammars.popitem(last=False)

    def _start_server(self, index: int) -> None:
        env = dict(os.environ)
        if self.api_key is not None:
            env["GPUFORMERS_API_KEY"] = self.api_key  # not on the command line, which any user can read
        command = [sys.executable, "-m", "gpuformers.serving.api_server", str(self.config_path), str(index)]
        # A session of its own: Ctrl-C in a terminal reaches this process only, which passes SIGTERM on (a second
        # signal would cut uvicorn's graceful shutdown short)
        self._processes[index] = subprocess.Popen(command, env=env, pass_fds=(self.sock.fileno(),) if self._inherited else (),
                                                  start_new_session=True)
        self._started[index] = time.monotonic()
        logger.info("api server %d started (pid %d)", index, self._processes[index].pid)

    def _watch_servers(self) -> int:
        """Look at the API servers: cancel the requests of one that exited and start it again (unless it died soon
        after its start, or the server is stopping). Returns how many are running."""
        alive = 0
        for index, process in enumerate(self._processes):
            if process is None:
                continue
            code = process.poll()
            if code is None:
                alive += 1
                continue
            orphans = list(self._requests[index])
            self._requests[index].clear()
            self._in_flight[index] = 0
            for request_id in orphans:  # their final outputs go out to no one (or to the restarted server, which
                self.manager.cancel_request(request_id)  # knows none of their ids)
            if self._stopping:
                self._processes[index] = None
                continue
            logger.warning("api server %d (pid %d) exited with %s; its %d engine requests cancelled: %s", index,
                           process.pid, code, len(orphans), ", ".join(orphans[:8]) + (" ..." if len(orphans) > 8
                                                                                      else ""))
            if time.monotonic() - self._started[index] >= RESTART_AFTER:
                self._start_server(index)
                alive += 1
            else:
                logger.error("api server %d exited %.1f s after its start: not restarted", index,
                             time.monotonic() - self._started[index])
                self._processes[index] = None
        return alive

    def _on_signal(self, number, frame) -> None:
        if self._stopping:
            return
        self._stopping = True
        logger.info("stopping: the API servers finish their requests (--shutdown-timeout), then the engine stops")
        for process in self._processes:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def _shutdown(self) -> None:
        self._stopping = True
        for process in self._processes:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            if process is not None:
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.manager.stop(timeout=10)
        self.manager.after_step = None
        for sock in (self._inbox, *self._outboxes):
            sock.close()
        self._context.term()
        self.sock.close()
        self._run_dir.cleanup()
