"""The continuous batching engine: the manager that runs the engine loop, and its outputs (its settings: config.py).

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
LoRA adapters (load_adapter / delete_adapter, a request's adapter_name) are served side by side over the one base
model (lora.py, adapter_serving.py); while the loop runs, loading or deleting one is a command it applies between
two steps.

Offers: ContinuousBatchingManager, and GenerationOutput (from outputs.py, where the outputs wait for their callers).
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import os
import queue
import random
import threading
import time
from typing import Callable

import torch

from gpuformers.engine.adapter_serving import AdapterService, cuda_graphs_with_adapters
from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.config import ContinuousBatchingConfig, check_honoured, free_memory, sampling_params_from
from gpuformers.engine.lora import AdapterBank
from gpuformers.engine.model_runner import LaunchedStep, ModelRunner
from gpuformers.engine.outputs import GenerationOutput, Outbox
from gpuformers.engine.scheduler import ScheduledBatch, Scheduler
from gpuformers.engine.sequence import Sequence
from gpuformers.engine.state_slots import HybridBlockManager, StatePool, has_mamba_layers
from gpuformers.engine.structured import check_structured_output, constrains
from gpuformers.kernels.cpu_matmul_probe import measure_up_to
from gpuformers.sizes import format_size

logger = logging.getLogger(__name__)

class ContinuousBatchingManager:
    def __init__(self, model, generation_config=None, continuous_batching_config=None,
                 adapters: dict[str, str] | None = None):
        from gpuformers.generation.config import GenerationConfig

        base = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
        self.generation_config = generation_config.merged_with(base) if generation_config is not None else base
        check_honoured(self.generation_config)  # here, not at the first request
        asked = continuous_batching_config or ContinuousBatchingConfig()
        if adapters and asked.use_cuda_graph:
            raise cuda_graphs_with_adapters()
        self.config = asked.resolve(model)
        self.model = model.eval()
        if not model.attn_implementation.startswith("paged|"):
            # The paged backends fall back to the plain ones outside engine steps, so generate() keeps working.
            paged = ("sdpa", "eager", "flash_attention_4")  # the others attend as "sdpa" in engine steps
            base_name = model.attn_implementation if model.attn_implementation in paged else "sdpa"
            model.set_attn_implementation(f"paged|{base_name}")
        cfg = self.config
        # ContinuousBatchingConfig.seed: the source of the seeds of sampled requests that bring none (add_request)
        self._request_seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        # Consecutive blocks matter on the CPU only (its attention then reads a view of the cache).
        contiguous = model.device.type != "cuda"
        self.states = None  # a model with mamba layers: their per-sequence state slots (state_slots.py)
        if has_mamba_layers(model):
            if adapters:
                raise NotImplementedError(f"LoRA adapters served by the engine on {type(model).__name__} (a model "
                                          f"with mamba layers) are not supported yet; merge the adapter first")
            self.states = StatePool(model, cfg.max_requests_per_batch, cfg.num_state_snapshots)
            self.block_manager = HybridBlockManager(cfg.num_blocks, cfg.block_size, self.states,
                                                    cfg.allow_block_sharing, place_contiguously=contiguous)
        else:
            self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, cfg.allow_block_sharing,
                                              place_contiguously=contiguous)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_tokens, cfg.max_requests_per_batch,
                                   cfg.scheduler_type)
        self.runner = ModelRunner(model, cfg.num_blocks, cfg.block_size, prepack_weights=cfg.prepack_weights,
                                  states=self.states, compile=cfg.compile)
        if cfg.prepack_weights:  # which row counts take the packed weights: measured now, not in the first steps
            measure_up_to(cfg.max_batch_tokens)
        self.adapter_bank = self.runner.adapter_bank = AdapterBank(model)
        # load_adapter / delete_adapter; asked.use_cuda_graph None: automatic (off while LoRA adapters are loaded)
        self.adapter_service = AdapterService(self.adapter_bank, self.scheduler, self.runner, cfg,
                                              asked.use_cuda_graph, self._between_steps)
        logger.info("continuous batching: %s", self.memory_summary())
        if cfg.use_cuda_graph and not adapters:
            self.adapter_service.use_cuda_graphs(True)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox = Outbox(self.is_running)  # outputs until their callers take them (outputs.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.broken: str | None = None  # why the background loop stopped, when an error stopped it
        self.num_steps = 0
        self._in_flight: LaunchedStep | None = None  # async batching: the launched step not collected yet
        self._lockstep = None  # a Lockstep (lockstep.py) when the processes of a tensor-parallel model step together
        # Called in the loop's thread after each pass of start()'s loop (a step, or an idle wait) and once as the
        # loop ends: serving/engine_core.py sends the outputs a step published, one message per front end
        self.after_step: Callable[[], None] | None = None
        try:
            for name, folder in (adapters or {}).items():
                self.load_adapter(folder, name)
        except Exception:
            self.adapter_bank.uninstall()  # the model as it was
            raise

    def memory_summary(self) -> str:
        """Where the device memory goes: the model's weights (and LoRA adapters'), the KV cache (and how many tokens
        it holds), and what is left free now."""
        tensors = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}.values()
        weights = sum(t.numel() * t.element_size() for t in tensors)
        cache = sum(t.numel() * t.element_size() for t in self.runner.kv_tensors())
        cfg = self.config
        bank = self.adapter_bank
        adapters = f", {len(bank)} LoRA adapter(s) {format_size(bank.nbytes)}" if bank else ""
        packed = self.runner.packed
        adapters += f", prepacked linear weights {format_size(packed.nbytes)}" if packed else ""
        states = (f", state slots {format_size(self.states.nbytes)} ({self.states.live_slots} sequences + "
                  f"{self.states.snapshot_slots} prefix snapshots)") if self.states is not None else ""
        return (f"weights {format_size(weights)}{adapters}, KV cache {format_size(cache)} ({cfg.num_blocks} blocks "
                f"of {cfg.block_size} tokens = {cfg.num_blocks * cfg.block_size} tokens){states}, "
                f"{format_size(free_memory(self.model.device, cap=False))} free on {self.model.device}")

    # --- the engine -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step: schedule -> launch -> collect (the step's tokens) -> publish. With async batching the
        step collected is the previous one, so the device runs this step meanwhile. Returns False when there was
        nothing to run."""
        self._drain_inbox()
        if self._lockstep is not None and self._lockstep.stopped:
            return False  # the leader's loop has ended: no process may run another step (its collectives)
        if self._in_flight is not None and constrains(self._in_flight.sampling):
            # a grammar's next mask needs the token in flight (structured.py): collect it before scheduling
            done, self._in_flight = self._in_flight, None
            self._collect(done)
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
            finished = seq.is_finished
            if finished or seq.streaming:
                self._publish_one(seq, final=finished)
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
                if item.adapter_id != self.adapter_bank.adapter_id(item.adapter_name):
                    item.fail(f"adapter {item.adapter_name!r} was deleted or reloaded before the request started")
                    self._publish_one(item, final=True)
                elif not self.scheduler.add(item):
                    self._publish_one(item, final=True)
            elif kind == "cancel":
                seq = self.scheduler.cancel(item)
                if seq is not None:
                    self._publish_one(seq, final=True)
            elif kind == "call":  # a change to the loaded adapters (_between_steps)
                change, done = item
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(change())
                    except Exception as error:
                        done.set_exception(error)

    def _publish_one(self, seq: Sequence, final: bool) -> None:
        if self._lockstep is not None and not self._lockstep.is_leader:
            return  # a follower's outputs: the leader publishes the same ones
        # One output per streaming request and step: positional arguments, in GenerationOutput's field order
        # (keywords cost 40% more); the prompt is one copy per request, shared by its outputs. Two calls written out:
        # one call over a tuple of the lists (copied or not) cost 25-50% more per output.
        if final or seq.shares_output_lists:
            # a final output's lists change no more, and a reader that shares them reads them before the next step
            output = GenerationOutput(seq.request_id, seq.output_prompt_ids, seq.generated_ids, seq.logprobs,
                                      seq.top_logprobs, seq.prompt_logprobs, seq.prompt_top_logprobs, seq.error,
                                      seq.status, seq.created_time, time.time() if final else None)
        else:
            output = GenerationOutput(seq.request_id, seq.output_prompt_ids, list(seq.generated_ids),
                                      list(seq.logprobs), list(seq.top_logprobs), list(seq.prompt_logprobs),
                                      list(seq.prompt_top_logprobs), seq.error, seq.status, seq.created_time, None)
        self.outbox.publish(output, final)

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
        self.broken = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="continuous-batching", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                ran = self.step()
                if self.after_step is not None:
                    self.after_step()
                if not ran:
                    time.sleep(0.002)  # idle: wait for requests without spinning a core
        except Exception as error:  # the engine itself broke: fail what is queued so that no caller waits forever
            logger.exception("the continuous batching loop stopped")
            self._in_flight = None
            message = f"engine stopped: {type(error).__name__}: {error}"
            self.broken = message  # add_request refuses from now on, until start() runs the loop again
            for seq in self.scheduler.waiting + self.scheduler.running:
                self.scheduler.cancel(seq.request_id)
                seq.error = message
                self._publish_one(seq, final=True)
            self._fail_inbox(message)
        finally:
            if self.after_step is not None:  # what the loop's end published (the failed requests)
                self.after_step()
            self.adapter_bank.uninstall()
            if self._lockstep is not None:
                from gpuformers.engine.lockstep import STOP

                self._lockstep.exchange([(STOP, None)])  # the followers' loops end with this one

    def _fail_inbox(self, message: str) -> None:
        """Fail what was sent to a loop that broke before taking it: requests, and adapter changes waiting on it."""
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                item.fail(message)
                self._publish_one(item, final=True)
            elif kind == "call":
                _, done = item
                if done.set_running_or_notify_cancel():
                    done.set_exception(RuntimeError(message))

    # --- LoRA adapters (adapter_serving.py) --------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters, which requests pass as adapter_name."""
        return self.adapter_service.names

    def load_adapter(self, peft_model_id: str | os.PathLike, adapter_name: str | None = None, **hub_kwargs) -> None:
        """Serve a LoRA adapter (a peft folder or Hub id; revision=, token=, ... for the Hub) beside the others
        under `adapter_name` (default: "default"). CUDA graphs left automatic are off while adapters are loaded."""
        self.adapter_service.load(peft_model_id, adapter_name, **hub_kwargs)

    def delete_adapter(self, adapter_name: str) -> None:
        """Stop serving an adapter; its layers' wrappers leave the model with the last adapter. Refused while a
        queued or running request uses it (cancel those, or wait for them)."""
        self.adapter_service.delete(adapter_name)

    def _between_steps(self, change):
        """Run `change` in the engine's thread between two steps (at once when no loop runs) and return what it
        returns: a step never sees the adapters change under it."""
        if not self.is_running():
            return change()
        done = concurrent.futures.Future()
        self._inbox.put(("call", (change, done)))
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self.is_running() and done.cancel():  # the loop ended without taking it
                    return change()

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
        """Stop the background loop; the LoRA adapters' wrappers leave the model (a later step puts them back)."""
        self._stop.set()
        if block and self._thread is not None:
            self._thread.join(timeout)
        if not self.is_running():  # else the loop takes them out as it ends
            self.adapter_bank.uninstall()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "ContinuousBatchingManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- requests ---------------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, adapter_name: str | None = None,
                    on_output: Callable[[GenerationOutput], None] | None = None, share_lists: bool = False,
                    **sampling) -> str:
        """Queue one prompt (a list of token ids); returns its request id. `adapter_name`: one of `adapters` (None:
        the base model). `sampling` overrides this request's temperature, top_p, top_k, min_p, do_sample, stop,
        seed, ignore_eos, repetition_penalty, frequency_penalty, presence_penalty, min_new_tokens, logit_bias,
        return_logprobs, top_logprobs, prompt_logprobs, structured_output (see SamplingParams; a prompt_logprobs
        request takes no prefix-cache hits). A bad prompt or setting raises ValueError here, before the request can
        reach a step; so does a `request_id` whose earlier request's final output has not been taken yet.
        `on_output` (not in transformers): a callback that gets every output of the request (streamed, then the final
        one) in the engine's thread, instead of get_result / request_id_iter; it must return at once (hand the output
        to another thread or event loop) and a callback that raises gets nothing more. `share_lists` (with on_output):
        its streamed outputs hold the request's own generated_tokens, logprobs and top_logprobs lists, not copies (a
        copy per output and step costs O(answer length): milliseconds per step at 256 streams of long answers), for
        a callback that reads them before the engine's next step, in the engine's thread (after_step), and keeps
        none of them: the engine core's (serving/engine_core.py), which sends each step's new tokens on. A final
        output never copies: its lists do not change any more."""
        if share_lists and on_output is None:
            raise ValueError("share_lists=True is for an on_output callback that reads each output before the "
                             "engine's next step; without on_output the outputs wait for their readers: leave it False")
        if self.broken is not None and not self.is_running():
            raise RuntimeError(f"the engine loop has stopped ({self.broken}); start() it again, or make a new manager")
        if adapter_name is not None:
            self.adapter_bank.check_name(adapter_name)
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() > 1 and input_ids.shape[0] != 1:
                raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} hold {input_ids.shape[0]} prompts; "
                                 f"add_request takes one (add_requests takes a list of them)")
            input_ids = input_ids.reshape(-1).tolist()
        input_ids = self._checked_prompt(input_ids, request_id)
        params = sampling_params_from(self.generation_config, self.config, len(input_ids),
                                      max_position_embeddings=self.model.config.max_position_embeddings,
                                      max_new_tokens=max_new_tokens, **sampling)
        check_structured_output(params.structured_output, self.model.config.vocab_size, self._lockstep is not None)
        self._check_positions(len(input_ids), params.max_new_tokens, request_id)

        def make(request_id: str) -> Sequence:  # under the outbox's lock, with the id taken
            if self._request_seeds is not None and params.seed is None and not params.greedy:
                params.seed = self._request_seeds.getrandbits(63)  # in the order requests are added
            seq = Sequence(request_id, input_ids, params, streaming=streaming, adapter_name=adapter_name)
            seq.adapter_id = self.adapter_bank.adapter_id(adapter_name) if adapter_name is not None else None
            seq.created_time = time.time()
            seq.shares_output_lists = share_lists
            return seq

        streaming = streaming or on_output is not None  # a callback is called on every update
        seq = self.outbox.admit(request_id, streaming, make, on_output)
        self._inbox.put(("add", seq))
        return seq.request_id

    def _checked_prompt(self, input_ids, request_id: str | None) -> list[int]:
        """The prompt as a list of ints, refused in the caller's thread when it would fail inside an engine step: a
        token id outside the embedding table would fail the whole step (every request in it, not this one alone).
        A prompt longer than the model's positions is refused as generate() refuses it."""
        name = f"request {request_id!r}: " if request_id is not None else ""
        vocab_size = self.model.config.vocab_size
        prompt = []
        for position, value in enumerate(input_ids):
            try:
                token = operator.index(value)  # ints, numpy ints, 0-d integer tensors; not floats
            except TypeError:
                token = None
            if token is None or not 0 <= token < vocab_size:
                raise ValueError(f"{name}prompt token {value!r} at position {position} is not a token id of this model "
                                 f"(an int in [0, {vocab_size})); check that the tokenizer matches the model")
            prompt.append(token)
        error = self.model.prompt_length_error(len(prompt))
        if error:
            raise ValueError(f"{name}{error}")
        return prompt

    def _check_positions(self, prompt_length: int, max_new_tokens: int, request_id: str | None) -> None:
        """A model with learned absolute positions (GPT-2's wpe table) has no embedding past them: a request that
        would get there is refused here, since the IndexError of its step would fail every request in that step.
        (Rotary models go on past max_position_embeddings, as generate() does.)"""
        positions = self.model.learned_positions
        needed = prompt_length + max_new_tokens - 1  # the last new token is never fed back
        if positions is not None and needed > positions:
            name = f"request {request_id!r}: " if request_id is not None else ""
            raise ValueError(f"{name}a prompt of {prompt_length} tokens with max_new_tokens={max_new_tokens} needs "
                             f"{needed} positions but {type(self.model).__name__} has learned positions for "
                             f"{positions} (max_position_embeddings); give max_new_tokens <= "
                             f"{positions - prompt_length + 1}")

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     **sampling) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming, **sampling)
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished request (any non-streaming one, or the one named); None when none finishes within
        timeout seconds, or at once when none is ready and no engine loop runs to finish one (before start(),
        after stop() or after the loop broke; as in transformers). The manager forgets a request once this returns
        it."""
        return self.outbox.take(request_id, timeout)

    def request_id_iter(self, request_id: str, timeout: float | None = None):
        """Yield a streaming request's progress after each new token, ending with its final output (after which
        the manager forgets the request). A non-streaming request yields its final output only. The iteration
        ends early, as in transformers, when no engine loop runs to finish the request (before start(), after
        stop()); `timeout`: seconds to wait for each next output, then TimeoutError (None: no limit)."""
        return self.outbox.iterate(request_id, timeout)

    @property
    def num_finished(self) -> int:
        """Requests finished so far (a count, for progress bars)."""
        return self.outbox.num_finished

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

