"""The continuous batching engine: its settings, its outputs, and the manager that runs the engine loop.

    add_request ─> inbox ─> Scheduler.schedule ─> ModelRunner.launch / .collect ─> Scheduler.complete ─> outputs
                                 ^                                                        │
                                 └──────────────────────── unfinished ────────────────────┘

With asynchronous batching (`use_async_batching`, on by default with CUDA) the step is split at the device:
step N+1 is scheduled and launched while the device still runs step N, and only then are N's tokens collected.
The host work of a step (scheduling, building inputs, publishing outputs) then hides behind the device's.

    sync   host:   schedule N, launch N | wait | collect N | schedule N+1, launch N+1 | wait | collect N+1
           device:                      [step N]                                      [step N+1]
    async  host:   schedule N+1, launch N+1 | collect N | schedule N+2, launch N+2 | collect N+1 | ...
           device: [step N ........................][step N+1 .......................][step N+2 ...

`ContinuousBatchingManager` runs that loop in a background thread (`start()` / `stop()`, or a `with` block) and
takes requests at any time; `generate_batch` runs the same loop in the caller's thread until every request is done.
Names follow transformers: init_continuous_batching, add_request(s), cancel_request, get_result, request_id_iter.

Offers: ContinuousBatchingConfig, GenerationOutput, ContinuousBatchingManager.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field, fields

import torch

from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.model_runner import LaunchedStep, ModelRunner, kv_bytes_per_block
from gpuformers.engine.scheduler import SCHEDULER_TYPES, ScheduledBatch, Scheduler
from gpuformers.engine.sequence import RequestStatus, SamplingParams, Sequence
from gpuformers.sizes import format_size

logger = logging.getLogger(__name__)

_CPU_CACHE_CAP = 2 << 30  # bytes: on the CPU the cache comes out of the same RAM as everything else


@dataclass
class ContinuousBatchingConfig:
    """Engine settings; None means decided from the device at start-up (see `resolve`)."""

    block_size: int | None = None  # tokens per block: 256 on a GPU, 64 on the CPU; any power of two
    num_blocks: int | None = None  # default: from free memory times max_memory_percent
    max_batch_tokens: int | None = None  # tokens computed per step (decodes + prefill chunks)
    max_memory_percent: float = 0.9
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True  # prefix caching
    use_async_batching: bool | None = None  # default: on with CUDA (True on the CPU works, with nothing to overlap)
    use_cuda_graph: bool | None = None
    scheduler_type: str = "fifo"
    return_logprobs: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type {self.scheduler_type!r} is not one of: {', '.join(SCHEDULER_TYPES)}")
        if not 0 < self.max_memory_percent <= 1:
            raise ValueError(f"max_memory_percent={self.max_memory_percent} must be in (0, 1]")
        for name in ("block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int (or None for automatic)")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (16, 32, ..., 256)")

    def resolve(self, model) -> "ContinuousBatchingConfig":
        """A copy with every automatic setting decided for this model on its device."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        cuda = model.device.type == "cuda"
        values["block_size"] = self.block_size or (256 if cuda else 64)
        tp_size = getattr(model, "tp_size", 1)
        if self.num_blocks is None:
            per_block = kv_bytes_per_block(model.config, values["block_size"], model.dtype, tp_size)
            values["num_blocks"] = max(1, int(_free_memory(model.device) * self.max_memory_percent) // per_block)
            if tp_size > 1:  # every process must schedule (and preempt) alike: the smallest cache of them all
                from gpuformers.distributed import all_reduce_min

                values["num_blocks"] = all_reduce_min(values["num_blocks"], model.device)
        values["max_batch_tokens"] = self.max_batch_tokens or (2048 if cuda else 512)
        values["max_requests_per_batch"] = self.max_requests_per_batch or (256 if cuda else 128)
        if self.use_cuda_graph and not cuda:
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device; leave it None for automatic")
        if self.use_cuda_graph and tp_size > 1:
            raise NotImplementedError("CUDA graphs with tensor parallelism (collectives inside a captured graph) are "
                                      "not supported yet; leave use_cuda_graph None (off under tp_plan)")
        values["use_cuda_graph"] = (cuda and tp_size == 1) if self.use_cuda_graph is None else self.use_cuda_graph
        # On the CPU the "device" work runs in the calling thread, so there is nothing to overlap it with.
        values["use_async_batching"] = cuda if self.use_async_batching is None else bool(self.use_async_batching)
        return ContinuousBatchingConfig(**values)


def _free_memory(device: torch.device, cap: bool = True) -> int:
    """Free bytes on `device`; on the CPU at most _CPU_CACHE_CAP when `cap` (what the KV cache may be sized from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = _CPU_CACHE_CAP
    return min(available, _CPU_CACHE_CAP) if cap else available


@dataclass
class GenerationOutput:
    """One request's result (or, while streaming, its progress so far)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per generated token, the top_logprobs most likely (token id, logprob) pairs, when the request asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with prompt_logprobs: per prompt token, its logprob given the tokens before it (None for the first), and
    # with prompt_logprobs=k > 0 its k most likely (token id, logprob) alternatives (None for the first)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = 0.0
    finished_time: float | None = None

    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)


# GenerationConfig fields that change generate()'s tokens and that the engine does not implement, each with the test
# of "set so that it matters" (generate()'s own: build_logits_processors, beam search, stopping criteria). Fields
# left out are honoured (SamplingParams), inert here (beam-only length_penalty and early_stopping, assistant
# settings, pad and bos ids, return_dict_in_generate) or change speed only (use_cache, cache_implementation,
# compile_config, prompt_lookup_num_tokens, which gives the same tokens).
_UNHONOURED = {
    "num_beams": lambda c: c.num_beams > 1,
    "num_return_sequences": lambda c: c.num_return_sequences > 1,
    "no_repeat_ngram_size": lambda c: c.no_repeat_ngram_size > 0,
    "bad_words_ids": lambda c: c.bad_words_ids is not None,
    "forced_bos_token_id": lambda c: c.forced_bos_token_id is not None,
    "forced_eos_token_id": lambda c: c.forced_eos_token_id is not None,
    "suppress_tokens": lambda c: c.suppress_tokens is not None,
    "begin_suppress_tokens": lambda c: c.begin_suppress_tokens is not None,
    "remove_invalid_values": lambda c: c.remove_invalid_values,
    "typical_p": lambda c: c.do_sample and c.typical_p < 1.0,
    "epsilon_cutoff": lambda c: c.do_sample and 0.0 < c.epsilon_cutoff < 1.0,
    "eta_cutoff": lambda c: c.do_sample and 0.0 < c.eta_cutoff < 1.0,
    "stop_strings": lambda c: c.stop_strings is not None,
    "max_time": lambda c: c.max_time is not None,
    "output_scores": lambda c: c.output_scores,
    "output_logits": lambda c: c.output_logits,
    "output_attentions": lambda c: c.output_attentions,
    "output_hidden_states": lambda c: c.output_hidden_states,
}


def unhonoured_fields(generation_config) -> list[str]:
    """The fields of `generation_config` that would change generate()'s tokens and that the engine does not
    implement (see _UNHONOURED)."""
    return [name for name, matters in _UNHONOURED.items() if matters(generation_config)]


def check_honoured(generation_config) -> None:
    """Raise NotImplementedError naming each field of `generation_config` the engine would not honour."""
    unhonoured = [f"{name}={getattr(generation_config, name)!r}" for name in unhonoured_fields(generation_config)]
    if unhonoured:
        raise NotImplementedError(
            f"the continuous batching engine does not implement generation config field(s) {', '.join(unhonoured)}; "
            f"leave them at their defaults, or use model.generate() (per-token scores: return_logprobs=True; "
            f"stop strings: stop=[token ids])")


def sampling_params_from(generation_config, cb_config: ContinuousBatchingConfig, prompt_length: int,
                         **overrides) -> SamplingParams:
    """Per-request SamplingParams: the generation config's values, then this request's overrides. Raises
    NotImplementedError naming the generation config's fields that would change the tokens and that the engine
    does not implement (check_honoured)."""
    config = generation_config
    check_honoured(config)
    max_new = overrides.pop("max_new_tokens", None)
    if max_new is None:
        max_new = config.max_length_for(prompt_length) - prompt_length
    values = dict(
        max_new_tokens=max_new,
        do_sample=config.do_sample,
        temperature=config.temperature,
        top_k=config.top_k or 0,
        top_p=config.top_p,
        min_p=config.min_p or 0.0,
        repetition_penalty=config.repetition_penalty,
        min_new_tokens=max(0, config.min_length_for(prompt_length) - prompt_length),  # min_length counts the prompt
        eos_token_ids=tuple(config.eos_token_ids),
        seed=cb_config.seed,
        return_logprobs=cb_config.return_logprobs,
    )
    unknown = set(overrides) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise TypeError(f"unknown request settings: {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(f.name for f in fields(SamplingParams))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)


class ContinuousBatchingManager:
    def __init__(self, model, generation_config=None, continuous_batching_config=None):
        from gpuformers.generation.config import GenerationConfig

        base = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
        self.generation_config = generation_config.merged_with(base) if generation_config is not None else base
        check_honoured(self.generation_config)  # here, not at the first request
        self.config = (continuous_batching_config or ContinuousBatchingConfig()).resolve(model)
        self.model = model.eval()
        if not model.attn_implementation.startswith("paged|"):
            # The paged backends fall back to the plain ones outside engine steps, so generate() keeps working.
            base_name = model.attn_implementation if model.attn_implementation in ("sdpa", "eager") else "sdpa"
            model.set_attn_implementation(f"paged|{base_name}")
        cfg = self.config
        # Consecutive blocks matter on the CPU only (its attention then reads a view of the cache).
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, cfg.allow_block_sharing,
                                          place_contiguously=model.device.type != "cuda")
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_tokens, cfg.max_requests_per_batch,
                                   cfg.scheduler_type)
        self.runner = ModelRunner(model, cfg.num_blocks, cfg.block_size)
        logger.info("continuous batching: %s", self.memory_summary())
        if cfg.use_cuda_graph:
            from gpuformers.engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner, cfg.max_requests_per_batch)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # What the manager keeps per request until its caller takes the final output, and not a moment longer
        # (a server runs for weeks): a non-streaming request's final output waits in `_finished` (in finishing
        # order, for get_result(None)) until get_result returns it; a streaming request's outputs go only to its
        # queue in `_streams`, which request_id_iter drops once it has yielded the final one.
        self._finished: dict[str, GenerationOutput] = {}
        self._streams: dict[str, queue.Queue] = {}
        self.num_finished = 0  # requests finished so far (a count, not a store: for progress bars)
        self._done = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self.num_steps = 0
        self._in_flight: LaunchedStep | None = None  # async batching: the launched step not collected yet
        self._lockstep = None  # a Lockstep (lockstep.py) when the processes of a tensor-parallel model step together

    def memory_summary(self) -> str:
        """Where the device memory goes: the model's weights, the KV cache (and how many tokens it holds), and what
        is left free now."""
        tensors = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}.values()
        weights = sum(t.numel() * t.element_size() for t in tensors)
        cache = sum(t.numel() * t.element_size() for t in self.runner.key_caches + self.runner.value_caches)
        cfg = self.config
        return (f"weights {format_size(weights)}, KV cache {format_size(cache)} ({cfg.num_blocks} blocks of "
                f"{cfg.block_size} tokens = {cfg.num_blocks * cfg.block_size} tokens), "
                f"{format_size(_free_memory(self.model.device, cap=False))} free on {self.model.device}")

    # --- the engine -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step: schedule -> launch -> collect (the step's tokens) -> publish. With async batching the
        step collected is the previous one, so the device runs this step meanwhile. Returns False when there was
        nothing to run."""
        self._drain_inbox()
        if self._lockstep is not None and self._lockstep.stopped:
            return False  # the leader's loop has ended: no process may run another step (its collectives)
        batch = self.scheduler.schedule()
        if not batch and self._in_flight is None:
            if self.scheduler.has_work:
                raise RuntimeError(f"the scheduler could not schedule any of {len(self.scheduler.waiting)} waiting "
                                   f"requests with {self.block_manager.num_free_blocks} free blocks")
            return False
        launched = self._launch(batch) if batch else None
        if self.config.use_async_batching:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is not None:
            self._collect(done)
        return True

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep | None:
        try:
            launched = self.runner.launch(batch, self._in_flight)
        except Exception as error:  # a failed step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_batch(batch, f"{type(error).__name__}: {error}")
            return None
        self.scheduler.advance(batch)
        return launched

    def _collect(self, launched: LaunchedStep) -> None:
        try:
            sampled = self.runner.collect(launched)
        except Exception as error:
            logger.exception("engine step failed")
            self._fail_batch(launched.batch, f"{type(error).__name__}: {error}")
            return
        for seq in self.scheduler.complete(launched.batch, sampled):
            if seq.is_finished or seq.streaming:
                self._publish_one(seq, final=seq.is_finished)
        self.num_steps += 1

    def run_until_done(self, progress_bar: bool = False) -> None:
        """Step in the caller's thread until every queued request has finished (generate_batch's loop)."""
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.scheduler.waiting) + len(self.scheduler.running), desc="generate_batch")
        finished_before = self.num_finished
        while self.step() or not self._inbox.empty():
            if bar is not None:
                bar.update(self.num_finished - finished_before - bar.n)
        if bar is not None:
            bar.update(self.num_finished - finished_before - bar.n)
            bar.close()

    def _drain_inbox(self) -> None:
        commands = []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self._lockstep is not None:  # every process applies the leader's commands
            commands = self._lockstep.exchange(commands)
        for kind, item in commands:
            if kind == "add":
                if not self.scheduler.add(item):
                    self._publish_one(item, final=True)
            elif kind == "cancel":
                seq = self.scheduler.cancel(item)
                if seq is not None:
                    self._publish_one(seq, final=True)

    def _publish_one(self, seq: Sequence, final: bool) -> None:
        if self._lockstep is not None and not self._lockstep.is_leader:
            return  # a follower's outputs: the leader publishes the same ones
        output = GenerationOutput(
            request_id=seq.request_id,
            prompt_ids=list(seq.prompt_ids),
            generated_tokens=list(seq.generated_ids),
            logprobs=list(seq.logprobs),
            top_logprobs=list(seq.top_logprobs),
            prompt_logprobs=list(seq.prompt_logprobs),
            prompt_top_logprobs=list(seq.prompt_top_logprobs),
            error=seq.error,
            status=seq.status,
            created_time=seq.created_time,
            finished_time=time.time() if final else None,
        )
        with self._done:
            stream = self._streams.get(seq.request_id)
            if stream is not None:
                stream.put(output)  # its reader drops the stream after the final output
            elif final:
                self._finished[seq.request_id] = output  # until get_result returns it
            if final:
                self.num_finished += 1
                self._done.notify_all()

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> None:
        for seq in batch.sequences:
            if seq.is_finished:  # ended while the step was in flight (async batching): already published
                continue
            self.scheduler.cancel(seq.request_id)
            seq.error = message
            self._publish_one(seq, final=True)

    # --- the background thread --------------------------------------------------------------------------------

    def start(self) -> "ContinuousBatchingManager":
        if self.is_running():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="continuous-batching", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    time.sleep(0.002)  # idle: wait for requests without spinning a core
        except Exception as error:  # the engine itself broke: fail what is queued so that no caller waits forever
            logger.exception("the continuous batching loop stopped")
            self._in_flight = None
            for seq in self.scheduler.waiting + self.scheduler.running:
                self.scheduler.cancel(seq.request_id)
                seq.error = f"engine stopped: {type(error).__name__}: {error}"
                self._publish_one(seq, final=True)
        finally:
            if self._lockstep is not None:
                from gpuformers.engine.lockstep import STOP

                self._lockstep.exchange([(STOP, None)])  # the followers' loops end with this one

    # --- tensor parallelism: the processes' engines in lockstep -----------------------------------------------

    def run_in_lockstep(self) -> "ContinuousBatchingManager":
        """Make the engines of a tensor-parallel model's processes step together (lockstep.py): process 0, the
        leader, takes requests and runs the loop with start(); every other process calls follow(). Call it in
        every process, before any request."""
        from gpuformers.engine.lockstep import Lockstep

        mesh = getattr(self.model, "device_mesh", None)
        if mesh is None:
            raise ValueError("run_in_lockstep is for a tensor-parallel model (loaded with tp_plan under torchrun)")
        self._lockstep = Lockstep(mesh.get_group())
        return self

    def follow(self) -> None:
        """A follower's engine loop, in the caller's thread: step with the leader until its loop stops."""
        if self._lockstep is None or self._lockstep.is_leader:
            raise RuntimeError("follow() runs in the processes other than 0 after run_in_lockstep(); process 0 "
                               "runs the engine with start()")
        while not self._lockstep.stopped:
            try:
                self.step()
            except Exception:  # the same step failed in the leader, whose loop now ends: its "stop" comes next
                logger.exception("a tensor-parallel follower's engine step failed")

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self._stop.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "ContinuousBatchingManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- requests ---------------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, **sampling) -> str:
        """Queue one prompt (a list of token ids); returns its request id. `sampling` overrides this request's
        temperature, top_p, top_k, min_p, do_sample, stop, seed, ignore_eos, repetition_penalty, frequency_penalty,
        presence_penalty, min_new_tokens, logit_bias, return_logprobs, top_logprobs, prompt_logprobs (see
        SamplingParams; a prompt_logprobs request takes no prefix-cache hits)."""
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        if request_id is None:
            request_id = f"req_{self._next_id}"
            self._next_id += 1
        params = sampling_params_from(self.generation_config, self.config, len(input_ids),
                                      max_new_tokens=max_new_tokens, **sampling)
        seq = Sequence(request_id, list(input_ids), params, streaming=streaming)
        seq.created_time = time.time()
        if streaming:
            with self._done:
                self._streams[request_id] = queue.Queue()
        self._inbox.put(("add", seq))
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     **sampling) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming, **sampling)
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished request (any non-streaming one, or the one named); None when none finishes within
        timeout seconds. The manager forgets a request once this returns it."""
        if request_id is not None:
            with self._done:
                stream = self._streams.get(request_id)
            if stream is not None:  # a streaming request: read its stream to the end
                return self._last_output(request_id, stream, timeout)
        with self._done:
            ready = (lambda: request_id in self._finished) if request_id is not None else (lambda: self._finished)
            if not self._done.wait_for(ready, timeout):
                return None
            key = request_id if request_id is not None else next(iter(self._finished))  # the oldest
            return self._finished.pop(key)

    def _last_output(self, request_id: str, stream: queue.Queue, timeout: float | None) -> GenerationOutput | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                output = stream.get(timeout=left)
            except queue.Empty:
                return None
            if output.is_finished():
                with self._done:
                    self._streams.pop(request_id, None)
                return output

    def request_id_iter(self, request_id: str):
        """Yield a streaming request's progress after each new token, ending with its final output (after which
        the manager forgets the request). A non-streaming request yields its final output only."""
        with self._done:
            stream = self._streams.get(request_id)
        if stream is None:
            output = self.get_result(request_id)
            if output is not None:
                yield output
            return
        while True:
            output = stream.get()
            if output.is_finished():
                # Dropped before the yield: a consumer that stops iterating at the final output (or a generator
                # that is never resumed after it) must not keep the request alive.
                with self._done:
                    self._streams.pop(request_id, None)
                yield output
                return
            yield output

    # --- facts ------------------------------------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_hits(self) -> int:
        return self.block_manager.prefix_hits

    @property
    def num_discarded_samples(self) -> int:
        """Async batching: tokens sampled for a request in the step after the one that ended it (dropped)."""
        return self.scheduler.num_discarded_samples
