"""EngineClient: an API server process's stand-in for the ContinuousBatchingManager that runs in the engine core
process (`gpuformers serve --api-server-count N`, engine_core.py). It has the part of the manager's interface the
server uses (add_request with on_output, cancel_request, is_running, start / stop, adapters, generation_config,
model.config's vocab_size and max_position_embeddings, block_manager's and scheduler's sizes, num_steps), so the
request handling (server_state.py, serve_job.py, job.py) is one implementation for both modes.

    event loop: add_request ──["add", ...]──► core          (msgpack over ZMQ: engine_wire.py)
    event loop: ◄── one message per engine step: rows of this server's requests ── core
                row -> OutputAssembly -> GenerationOutput -> the request's on_output (into its job's inbox)

The core's messages are read in the event loop itself (a reader on the ZMQ socket's file descriptor), not in a
thread of their own: a receiver thread had to take the GIL from the event loop for every message and hand each
output over through the loop's self-pipe (the two threads' switches cost more than the reading).

A timer in the loop also watches the core: this process's parent. When the core exits (killed, or its engine loop
broke) the process is re-parented; every request in flight then gets a failed final output (job.py answers 503),
is_running() turns False (GET /health answers 503, new requests 503), the core's run folder (its ZMQ sockets) is
removed, and ORPHAN_EXIT_SECONDS later this server stops itself (a supervisor restarting the core must find the port
free).

Offers: EngineClient, ORPHAN_EXIT_SECONDS.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Callable

from gpuformers.serving.engine_wire import OutputAssembly, pack, unpack

logger = logging.getLogger(__name__)

ORPHAN_EXIT_SECONDS = 5.0  # how long a server whose core is gone answers 503 before it stops
METRICS_EVERY = 0.5  # seconds between two snapshots of this server's counts sent to the core
FRESH_SECONDS = 0.05  # the other servers' requests in flight, older than this, are asked again near --max-pending
_WATCH_SECONDS = 0.1  # how often the loop looks at the core's liveness (and reads what an edge may have missed)


class _Sized:
    """A count where the server's metrics read a list's length (len(manager.scheduler.waiting))."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0

    def __len__(self) -> int:
        return self.count


class EngineClient:
    """The engine core, seen from API server `index`; `facts` are what the core told it at its start (api_server.py):
    the model's and cache's sizes, the adapters, the generation config."""

    outputs_in_loop = True  # on_output is called in the event loop that started this client (job.Engine.submit)

    def __init__(self, run_dir: str, index: int, core_pid: int, facts: dict):
        import zmq

        from gpuformers.generation.config import GenerationConfig

        self.index, self.core_pid, self.run_dir = index, core_pid, run_dir
        self.generation_config = GenerationConfig.from_dict(facts["generation_config"])
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=facts["vocab_size"],
                                                            max_position_embeddings=facts["max_position_embeddings"]))
        self.block_manager = SimpleNamespace(num_blocks=facts["num_blocks"], block_size=facts["block_size"],
                                             num_free_blocks=facts["num_blocks"])
        self.scheduler = SimpleNamespace(waiting=_Sized(), running=_Sized())
        self.num_steps = 0
        self.adapters: list[str] = list(facts["adapters"])
        self._running: list[int] = []  # each API server's engine requests, as the core's latest message said
        self._facts_time = 0.0  # when that message came (time.monotonic())
        self._peers: dict[int, dict] = {}
        self.metrics_of: Callable[[], dict] | None = None  # this server's snapshot (set by api_server.py)
        self.broken: str | None = None  # why the core is gone
        self._context = zmq.Context()
        self._out = self._context.socket(zmq.PUSH)  # to the core (sends hold _send_lock: any thread may send)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(f"ipc://{run_dir}/in")
        self._in = self._context.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.connect(f"ipc://{run_dir}/out-{index}")
        self._send_lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self._requests: dict[str, tuple[OutputAssembly, Callable]] = {}
        self._grammars: collections.OrderedDict = collections.OrderedDict()  # id(grammar) -> (grammar, key)
        self._loop = None  # the event loop reading the core's messages, from start() to stop()
        self._timer = None
        self._next_metrics = 0.0
        self._waiters: collections.deque = collections.deque()  # futures of refresh() calls
        self._in_flight: int | None = None  # this server's count not yet sent to the core (report_in_flight)

    # --- the manager's interface ---------------------------------------------------------------------------

    def start(self) -> "EngineClient":
        """Read the core's messages in the running event loop (the app's lifespan calls this)."""
        import asyncio

        if self._loop is None:
            import zmq

            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._in.getsockopt(zmq.FD), self._read)
            self._watch()
        return self

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop listening to the core (the core's engine goes on serving the other API servers)."""
        if self._loop is not None:
            import zmq

            self._loop.remove_reader(self._in.getsockopt(zmq.FD))
            if self._timer is not None:
                self._timer.cancel()
            self._loop = None

    def is_running(self) -> bool:
        return self.broken is None and self._loop is not None

    def add_request(self, input_ids: list[int], request_id: str | None = None, streaming: bool = True,
                    on_output: Callable | None = None, structured_output=None, **sampling) -> str:
        """Send one engine request to the core; its outputs reach `on_output` in the event loop. An error the
        core's add_request raises comes back as the request's failed final output."""
        if self.broken is not None:
            raise RuntimeError(f"the engine core is gone ({self.broken})")
        if on_output is None:
            raise ValueError("an API server's requests need on_output (they stream from the core process)")
        request_id = request_id or f"srv-{uuid.uuid4().hex}"
        prompt = list(input_ids)
        self._requests[request_id] = (OutputAssembly(request_id, prompt), on_output)
        if structured_output is not None:
            sampling["structured_output"] = self._grammar_key(structured_output)
        self._send(["add", self.index, request_id, prompt, sampling])
        logger.debug("%s: %d prompt tokens, sent to the engine core", request_id, len(prompt))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self._send(["cancel", request_id])

    def report_in_flight(self, count: int) -> None:
        """This server's requests in flight (job.py's count, held until each response ends), which the core hands
        the other servers for --max-pending: the latest count of a pass of the event loop, in one message (a burst
        of requests starting or ending together changes it hundreds of times in one pass; each message was a ZMQ
        send and a wakeup of the core)."""
        if self._loop is None:  # (no loop reading the core: at once)
            self._send(["in_flight", self.index, count])
            return
        if self._in_flight is None:
            self._loop.call_soon(self._send_in_flight)
        self._in_flight = count

    def _send_in_flight(self) -> None:
        count, self._in_flight = self._in_flight, None
        if count is not None:
            self._send(["in_flight", self.index, count])

    @property
    def peer_metrics(self) -> list[dict]:
        """The other servers' latest snapshots, with their requests in flight as the core's latest message counted
        them (routes_admin's /metrics; made when asked, not on every message)."""
        running = self._running
        return [{**snap, "in_flight": running[server] if server < len(running) else 0}
                for server, snap in self._peers.items()]

    def load_adapter(self, *args, **kwargs):
        raise NotImplementedError("loading LoRA adapters at run time with --api-server-count > 1 is not "
                                  "implemented; serve them with --lora-modules, or run one API server")

    delete_adapter = load_adapter

    # --- inside ---------------------------------------------------------------------------------------------

    def _send(self, message: list) -> None:
        data = pack(message)
        with self._send_lock:  # a ZMQ socket is used by one thread at a time
            self._out.send(data)

    def _grammar_key(self, grammar) -> str:
        """The key the core knows `grammar` by, sending the compiled grammar first when it does not yet (the
        compiler hands out one Grammar object per spec, so each is sent once)."""
        known = self._grammars.get(id(grammar))
        if known is not None and known[0] is grammar:
            self._grammars.move_to_end(id(grammar))
            return known[1]
        key = uuid.uuid4().hex
        compiled = grammar.compiled
        self._send(["grammar", key, grammar.name, grammar.vocab_size, list(compiled.tokenizer_info.stop_token_ids),
                    compiled.serialize_json()])
        self._grammars[id(grammar)] = (grammar, key)  # the grammar kept alive: its id stays its own
        while len(self._grammars) > 512:
            self._grammars.popitem(last=False)
        return key

    def _read(self) -> None:
        """Every message the core sent that is waiting. The socket's descriptor signals only the edge from none
        waiting to some, so all are read each time (and the watch reads again, should an edge be missed)."""
        import zmq

        sock, messages = self._in, []
        try:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                messages.append(unpack(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            pass
        if messages:
            self._deliver(*messages)

    def _watch(self) -> None:
        """Every _WATCH_SECONDS in the loop: is the core still this process's parent; this server's counts to the
        core every METRICS_EVERY."""
        self._timer = None
        if self._loop is None:
            return
        self._read()
        if os.getppid() != self.core_pid:
            self._core_gone()
            return
        now = time.monotonic()
        if now >= self._next_metrics and self.metrics_of is not None:
            self._next_metrics = now + METRICS_EVERY
            self._send(["metrics", self.index, self.metrics_of()])
        self._timer = self._loop.call_later(_WATCH_SECONDS, self._watch)

    async def refresh(self, timeout: float = 1.0) -> None:
        """Wait (at most `timeout` s) for the core's facts as they are now: its next pass of the engine loop sends
        them, with the other servers' latest counts (/metrics calls this first: routes_admin.py)."""
        import asyncio

        if not self.is_running():
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self._send(["facts?", self.index])
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass

    async def peers_in_flight(self, wanted: int, limit: int) -> int:
        """The other API servers' engine requests in flight (--max-pending bounds all the servers' together; serve_job
        adds them to this server's own): as the core's latest message said, or, when that is over FRESH_SECONDS old
        and `wanted` (this server's, the new request's included) plus them is over half of `limit`, as the core's
        next pass says. (A server with streams running hears from the core every engine step; an idle one only
        twice a second.)"""
        if time.monotonic() - self._facts_time > FRESH_SECONDS and wanted + self._peers_running() > limit // 2:
            await self.refresh()
        return self._peers_running()

    def _peers_running(self) -> int:
        return sum(count for server, count in enumerate(self._running) if server != self.index)

    def _deliver(self, *messages: list) -> None:
        """The core's messages, oldest first: the facts of each, then each request's rows added up in order and
        only its newest output handed to on_output. Several messages wait when this server fell behind the engine
        (its CPU taken by other processes): a stream then gets the steps' tokens in one chunk, as a job behind its
        outputs sends them (output_inbox.py), instead of a chunk (and a socket write) per step to catch up on."""
        requests, newest = self._requests, {}
        for message in messages:
            facts, rows, peers, asked = message
            self.scheduler.waiting.count, self.scheduler.running.count, free, self.num_steps, broken, running = facts
            self._running, self._facts_time = running, time.monotonic()
            if broken is not None and self.broken is None:  # the core's engine loop broke: it exits next
                self.broken = f"the engine core's loop stopped: {broken}"
            self.block_manager.num_free_blocks = free
            if peers is not None:
                self._peers = {server: snap for server, snap in peers.items() if server != self.index}
            if asked:
                while self._waiters:
                    future = self._waiters.popleft()
                    if not future.done():
                        future.set_result(None)
            for row in rows:
                request_id = row[0]
                entry = requests.get(request_id)
                if entry is None:
                    continue
                assembly, on_output = entry
                output = assembly.add(row)
                if output.is_finished():
                    del requests[request_id]
                newest[request_id] = (output, on_output)
        for request_id, (output, on_output) in newest.items():
            try:
                on_output(output)
            except Exception:  # as the manager does: a callback that fails gets nothing more
                logger.exception("on_output of request %r failed; its later outputs are dropped", request_id)
                requests.pop(request_id, None)

    def _core_gone(self) -> None:
        self.broken = f"the engine core process {self.core_pid} exited"
        # A core that was killed (SIGKILL, the OOM killer) could not remove its run folder (the ZMQ sockets, the
        # config, the tokenizer): the API servers, which outlive it, do (each tries; the first wins)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        logger.error("%s: failing the %d requests in flight; this API server stops in %g s", self.broken,
                     len(self._requests), ORPHAN_EXIT_SECONDS)
        for request_id, (assembly, on_output) in list(self._requests.items()):
            try:
                on_output(assembly.failed(self.broken))
            except Exception:
                logger.exception("on_output of request %r failed", request_id)
        self._requests.clear()
        timer = threading.Timer(ORPHAN_EXIT_SECONDS, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

