"""CUDA graphs for decode steps: one graph per batch-size bucket (with the Triton decode kernel) or per (batch-size
bucket, context-length bucket) (with the torch decode attention), captured lazily.

A decode step launches hundreds of small kernels; replaying them as one CUDA graph removes the CPU launch cost,
which dominates decode for small models and batches. A graph fixes every shape and address, so a step runs in
the smallest captured bucket that holds it: its batch is padded to the bucket (padding rows write their keys and
values to a scratch block the block manager never hands out, and their logits are dropped). The Triton decode
kernel reads each row's own keys through its block table, so the table's width (the context bucket) changes
nothing it computes: one graph at the longest context serves every length. The torch path gathers keys up to the
context bucket (longer than the real contexts; the mask hides the rest), so its graphs are kept per context
bucket too. The first decode step finds out which path the model's attention takes (`gathered_decode_keys`).
Contexts are covered up to max_position_embeddings; a step past it runs eagerly.

Graphs are captured lazily, the first time a step needs a bucket, not all at start-up: capturing every bucket
takes seconds to tens of seconds (the start-up cost users complain about most in vLLM), and a workload only ever
meets a few buckets. The first step of a new bucket pays its capture once (warm-up run + capture).

A graph runs the decoder only and leaves its rows' final hidden states in one static buffer; the LM head (one
matmul, and a family's logit transform) runs after the replay. Only pure decode steps replay a graph; a step with
any prefill chunk runs eagerly. All graphs share one memory pool (they never run at the same time). Everything but
the capture itself (buckets, static buffers, padding rows) also runs on the CPU, where the tests replace `_capture`
with a stand-in that reruns the forward at each replay (tests/engine/test_cuda_graph_buffers.py).

With asynchronous batching a decode's input token may still be on the device (sampled by the step in flight): the
model runner scatters it into the step's input_ids before `run`, whose copy into the static input buffer is
ordered after it on the stream, so a graph needs nothing special and no host sync.

With ContinuousBatchingConfig(compile=True) a graph is captured over the compiled decoder (engine/compiled_step.py,
through the runner's `decode_hidden`), so a replay launches Inductor's fused kernels; buckets, lazy capture and the
decision rules are the same. The compiled graph is dynamic in the token dimension and takes the static buffers as
they are (inference tensors, contiguous (1, rows) views, as the runner's step inputs: one compiled graph for the
eager steps and every bucket); each bucket's warm-up run compiles anything missing before the recording, where a
recompilation is an error (Inductor's autotuning would wait on the device mid-capture). The paged ops inside the
graph read the graph's static PagedContext, as in the eager stack.

A model with mamba layers (engine/state_slots.py) replays its decode steps the same way: each mamba layer steps
its rows of the state pool in place through the decode rows' slot index, a static buffer of the graphs like the
block tables (padding rows point at the pool's scratch row, which no sequence owns), and the pool tensors are
captured where they lie. What must happen before a step (a restored snapshot copied into a slot, a fresh slot
zeroed: plan_step) and after it (snapshots taken) runs eagerly around the replay.

A forward that waits on the host cannot be captured: the mixture-of-experts blocks' torch forwards read which
experts got tokens (`torch.unique(...).tolist()`, as transformers' do), and a layer class says so with
`syncs_host = True`. `decide_cuda_graph` leaves graphs off for a model holding such a layer (unless a kernel replaced
its forward: use_kernels=True gives Qwen3-MoE-style blocks the fused MoE kernel, which syncs nothing), rather than
let the first capture fail; asked for explicitly, they are an error naming the layer.

Offers: DecodeGraphs, BATCH_BUCKETS, decide_cuda_graph.
"""

from __future__ import annotations

import logging

import torch

from gpuformers.engine.paged_attention import PagedContext, PagedKVCache, gathered_decode_keys, paged_context
from gpuformers.engine.state_slots import PagedStateCache, StepStates
from gpuformers.layers.moe import host_syncing_modules

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def decide_cuda_graph(asked: bool | None, model: torch.nn.Module, cuda: bool, tp_size: int) -> bool:
    """use_cuda_graph for this model: as asked, or (None) on for a model on a CUDA device in one process whose
    forward never waits on the host; asked True for a model that waits is a ValueError naming the layer."""
    if asked is False or (asked is None and (not cuda or tp_size > 1)):
        return False
    blockers = host_syncing_modules(model)
    if blockers:
        layer = type(model.get_submodule(blockers[0])).__name__
        fix = ("load the model with use_kernels=True (its fused MoE kernel syncs nothing)"
               if getattr(type(model.get_submodule(blockers[0])), "kernel_layer_name", None) else
               "no kernel replaces this layer yet")
        if asked:
            raise ValueError(f"use_cuda_graph=True: {blockers[0]} ({layer}) reads which experts got tokens on the "
                             f"host, which a CUDA graph cannot capture; {fix}, or leave use_cuda_graph None")
        logger.info("CUDA graphs off: %s (%s) waits on the host in its forward; %s", blockers[0], layer, fix)
        return False
    return True


def _bucket(value: int, buckets) -> int | None:
    for b in buckets:
        if b >= value:
            return b
    return None


class DecodeGraphs:
    # The static buffers are made as inference tensors, as the runner's step inputs are (its steps run in inference
    # mode): the compiled decoder's graph guards on that, and normal tensors here would compile it a second time.
    @torch.inference_mode()
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        bs = runner.block_size
        # Context buckets: powers of two from one block up to the model's max_position_embeddings (or the whole
        # cache, when smaller). A step with a longer context (rotary models go on past it) runs eagerly.
        longest = runner.num_blocks * bs
        positions = getattr(runner.model.config, "max_position_embeddings", None)
        if positions:
            longest = min(longest, -(-positions // bs) * bs)
        self.context_buckets, c = [], bs
        while c < longest:
            self.context_buckets.append(c)
            c *= 2
        self.context_buckets.append(longest)
        # Whether a graph must be kept per context bucket: the torch decode path gathers every row's keys up to the
        # bucket, so its cost follows the bucket; the Triton kernel reads each row's own keys through the block
        # table whatever the table's width, so one graph per batch bucket (at the longest context) serves every
        # length: fewer captures, each paid once. Found by the first decode forward (None until then).
        self.per_context: bool | None = None
        n, device = max_batch, runner.device
        # The static inputs every graph reads (graphs use their first `bucket` rows). input_ids and position_ids are
        # (n,), a graph reading (1, rows) views of them, contiguous as the runner's (1, total) step inputs: the
        # compiled decoder guards on the stride too (a (1, n)[:, :rows] slice would compile it a second time).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)
        # Block tables, one per context bucket, as wide as its contexts need and made when first used: one table as
        # wide as the whole cache would be (max_batch, num_blocks) int64, gigabytes for a small model's cache of
        # millions of blocks on a large GPU.
        self.block_tables: dict[int, torch.Tensor] = {}
        # A model with mamba layers: each decode row's state slot (the pool's scratch row for padding rows)
        states = runner.states
        self.state_rows = (torch.full((n,), states.scratch_row, dtype=torch.long, device=device)
                           if states is not None else None)
        # The static output every graph writes: the final hidden states of its rows. The LM head runs after the
        # replay, eagerly (one matmul): a (rows, vocab) logits output kept per graph would hold up to ~150 MB each.
        self.hidden = torch.zeros(n, runner.model.config.hidden_size, dtype=runner.model.dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.failed = False  # a capture failed once: stay eager rather than fail every step

    def can_run(self, batch, context: PagedContext) -> bool:
        return (not self.failed and context.num_decodes == len(batch) and len(batch) <= self.batch_buckets[-1]
                and max(context.context_lens_list) <= self.context_buckets[-1])

    def _forward(self, rows: int, length: int) -> PagedContext:
        """The decode forward over the static buffers, its rows' final hidden states written to self.hidden.
        Returns the context it ran in."""
        runner = self.runner
        context = PagedContext(
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[length][:rows],
            context_lens=self.context_lens[:rows],
            query_start=list(range(rows + 1)),
            context_lens_list=[length] * rows,  # read only through max_decode_context below
            num_decodes=rows,
            block_size=runner.block_size,
            key_caches=runner.key_caches,
            value_caches=runner.value_caches,
            max_decode_context=length,
        )
        with paged_context(context):  # the compiled decoder where the runner compiles (the module's doc)
            hidden = runner.decode_hidden(self.input_ids[:rows][None], self.position_ids[:rows][None],
                                          self._cache(context, rows))
        self.hidden[:rows].copy_(hidden[0])
        return context

    def _cache(self, context: PagedContext, rows: int) -> PagedKVCache:
        if self.state_rows is None:
            return PagedKVCache(context)
        return PagedStateCache(context, self.runner.states, StepStates(rows, self.state_rows[:rows]))

    def _capture(self, rows: int, length: int):
        """-> a graph whose replay recomputes `_forward(rows, length)`."""
        if self.runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {self.runner.device}")
        logger.info("capturing a CUDA graph for %d decode rows, context %d", rows, length)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits, cuBLAS workspaces
            self._forward(rows, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # A compiled decoder must not compile inside the capture (Inductor's autotuning waits on the device): the
        # warm-up above compiled whatever this bucket needs, so a recompilation here is an error naming the failed
        # guard (logged by `run`, which stays eager from then on) instead of a capture broken somewhere in Inductor.
        with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(graph, pool=self.pool):
            self._forward(rows, length)
        self.pool = graph.pool()
        return graph

    def _fill_table(self, length: int, block_tables: torch.Tensor, n: int, rows: int) -> None:
        """The static block table of context bucket `length`: the step's n tables, then the padding rows' (the
        scratch block). A sequence's table may list a block past its context (taken ahead for its next token): the
        bucket's width is what is read."""
        if length not in self.block_tables:
            self.block_tables[length] = torch.zeros(self.batch_buckets[-1], length // self.runner.block_size,
                                                    dtype=torch.long, device=self.runner.device)
        tables = self.block_tables[length]
        width = min(block_tables.shape[1], tables.shape[1])
        tables[:n, :width].copy_(block_tables[:, :width])
        tables[:n, width:].fill_(self.runner.scratch_block)
        tables[n:rows].fill_(self.runner.scratch_block)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, context: PagedContext,
            states: StepStates | None = None) -> torch.Tensor:
        """-> (n, vocab) logits of the step's n decodes. states: a model with mamba layers, the step's plan_step."""
        n = input_ids.shape[1]
        rows = _bucket(n, self.batch_buckets)
        length = _bucket(max(context.context_lens_list), self.context_buckets)
        scratch, bs = self.runner.scratch_block, self.runner.block_size
        # Real rows, then padding rows that write to the scratch block and attend only to it.
        self.input_ids[:n].copy_(input_ids[0])
        self.position_ids[:n].copy_(position_ids[0])
        self.slot_mapping[:n].copy_(context.slot_mapping)
        self.context_lens[:n].copy_(context.context_lens)
        if rows > n:
            self.input_ids[n:rows].fill_(0)
            self.position_ids[n:rows].fill_(0)
            self.slot_mapping[n:rows].fill_(scratch * bs)
            self.context_lens[n:rows].fill_(1)
        if self.state_rows is not None:
            # The probe and a capture's warm-up below run the forward too, and a state step is not idempotent as a
            # KV write is: they step the scratch row only (a capture records addresses, not the index's values)
            self.state_rows[:rows].fill_(self.runner.states.scratch_row)
        if self.per_context is None:  # the first decode step: does the attention's cost follow the bucket?
            self._fill_table(length, context.block_tables, n, rows)
            self.per_context = gathered_decode_keys(self._forward(rows, length))
            logger.info("CUDA graphs kept per batch bucket%s", " and context bucket (the torch decode attention "
                        "reads keys up to the bucket)" if self.per_context else " (the Triton decode kernel reads "
                        "each row's own keys)")
            if not self.per_context and length != self.context_buckets[-1]:
                del self.block_tables[length]  # the probe's: no graph reads it
        if not self.per_context:
            length = self.context_buckets[-1]
        self._fill_table(length, context.block_tables, n, rows)
        key = (rows, length)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(rows, length)
            except Exception:  # capture is fragile across torch versions: degrade to eager, loudly
                logger.exception("CUDA graph capture failed; decode runs without graphs from now on")
                self.failed = True
                cache = PagedKVCache(context) if states is None else PagedStateCache(context, self.runner.states,
                                                                                      states)
                with paged_context(context):
                    hidden = self.runner.decode_hidden(input_ids, position_ids, cache)
                return self.runner.compute_logits(hidden[0])
        if self.state_rows is not None:  # the replay steps the decodes' slots (the padding rows the scratch row)
            self.state_rows[:n].copy_(states.decode_rows)
        self.graphs[key].replay()
        return self.runner.compute_logits(self.hidden[:n])
