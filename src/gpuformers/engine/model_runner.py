"""The model runner: one scheduled step in, one sampled token per finishing sequence out.

It owns the paged KV cache tensors (per layer K and V of shape (num_blocks * block_size, kv_heads, head_dim)),
flattens a ScheduledBatch into one row of tokens with positions, slot mappings and block tables, runs the model's
decoder over it with the paged attention backend, computes logits only at the rows that sample, and samples with
each request's own parameters (greedy rows in one argmax; sampled rows with their own seeded generator).

Prompt logprobs (SamplingParams.prompt_logprobs): a request that asked for them also gets logits at the rows of
its prefill chunk, and the runner records them on the Sequence as each chunk runs (position q's logits give
token q + 1's logprob). Requests that did not ask keep paying for one row of logits only.

    chunk rows:     p3  p4  p5  p6        (positions of the flattened step that belong to this sequence)
    logits give:    t4  t5  t6  t7        (prompt token logprobs; the last prompt position's logits sample instead)

A step is `launch` then `collect` (`run` does both). `launch` prepares the inputs, runs the model and chooses the
tokens on the device (argmax, or multinomial with each request's generator; logprobs too) without waiting for the
device, then starts copying what the host needs into pinned memory behind an event. `collect` waits for that
event and turns the results into one (token, logprob[, top]) or None per sequence. Asynchronous batching launches
step N+1 before collecting step N: a sequence whose last token is still a placeholder (sequence.py) takes it from
step N's token tensor on the device (scattered into N+1's input_ids, so a CUDA graph's static input buffer gets it
too). The one host wait left in `launch` is a step that records prompt logprobs (they are read on the host there).

    launch N ──> launch N+1 (inputs: N's tokens, on the device) ──> collect N ──> launch N+2 ──> collect N+1 ...

Sampling, with each request's own parameters and logit adjustments, is sampler.py's. With LoRA adapters loaded
(lora.py) the runner gives the step each adapter's rows of the flattened batch (`adapter_rows`), as it gives the
attention its PagedContext.

Offers: ModelRunner, LaunchedStep, kv_bytes_per_block, step_workspace_bytes, PROMPT_LOGITS_ROWS.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch

from gpuformers.kernels.cpu_linear import packed_linears
from gpuformers.engine.compiled_step import CompiledDecoder, head_plan
from gpuformers.engine.lora import adapter_rows
from gpuformers.engine.paged_attention import PagedContext, PagedKVCache, paged_context
from gpuformers.engine.sampler import TokenCounts, device_scope, device_tensor, sample_on_device, to_host_samples
from gpuformers.engine.scheduler import ScheduledBatch
from gpuformers.engine.sequence import Sequence
from gpuformers.engine.state_slots import PagedStateCache, StatePool, attention_layer_indices, plan_step, take_snapshots

# Prompt logits are computed this many rows at a time: (rows, vocab) in float32 is ~150 MB for a 150k vocabulary.
PROMPT_LOGITS_ROWS = 256
# (rows, vocab) float32 tensors a step's sampling holds at once at most: the logits, their adjusted copy, the dense
# penalties' temporaries (counts as float, the penalised rows, two torch.where results) and the log-softmax.
_LOGITS_COPIES = 6
# (tokens, hidden) tensors a decoder layer holds at once: the residual stream, the normed input, q / attention
# output, the sum; and the MLP's gate, up and product rows of (tokens, intermediate).
_HIDDEN_COPIES, _INTERMEDIATE_COPIES = 4, 3


@dataclass
class LaunchedStep:
    """A step whose tokens are chosen (or being chosen) on the device and not yet read by the host."""

    batch: ScheduledBatch
    sampling: list[Sequence]  # the sequences that sample, in the row order of `tokens`
    tokens: torch.Tensor  # (len(sampling),) int64 on the device: what the next step feeds the placeholders
    host: list[torch.Tensor]  # tokens, then logprobs and top-k values / ids when asked for: on the host (pinned)
    logprob_rows: list[int]  # rows of `sampling` that asked for logprobs, in the row order of host[1]
    event: torch.cuda.Event | None  # recorded after the copies to the host; None on the CPU (already there)
    rows: dict[Sequence, int] = field(init=False)  # each sampling sequence's row of `tokens` (hashed by identity)

    def __post_init__(self):
        self.rows = {seq: row for row, seq in enumerate(self.sampling)}


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       num_layers: int | None = None) -> int:
    """Bytes one block takes over all layers (num_layers: those that keep keys and values, when not every layer
    does, as in a hybrid model): K and V, block_size tokens, kv_heads x head_dim each (this process's share of the kv
    heads under tensor parallelism)."""
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    if not num_layers:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    kv_heads = config.num_key_value_heads // tp_size
    return 2 * num_layers * block_size * kv_heads * config.head_dim * element


def step_workspace_bytes(config, max_batch_tokens: int, max_requests: int, dtype: torch.dtype,
                         tp_size: int = 1) -> int:
    """An estimate of the device memory one step takes beyond the weights and the KV cache, which sizing the cache
    must leave free: the decoder's activations over max_batch_tokens tokens (this process's share of the MLP under
    tensor parallelism) and the float32 logits, (rows, vocab) for every sampling row (or a chunk of prompt
    logprobs, computed before them) with the copies the logit adjustments and logprobs make. (Attention that
    materialises its scores, "paged|eager" over long prefills, can take more.)"""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = _HIDDEN_COPIES * config.hidden_size + _INTERMEDIATE_COPIES * config.intermediate_size // tp_size
    rows = max(min(max_requests, max_batch_tokens), PROMPT_LOGITS_ROWS)
    return max_batch_tokens * per_token * element + rows * config.vocab_size * 4 * _LOGITS_COPIES


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                 prepack_weights: bool = False, states: StatePool | None = None, compile: bool = False):
        self.model = model
        config = model.config
        self.device = model.device
        self.dtype = dtype or model.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the block manager hands out: the scratch block that CUDA-graph padding rows write to.
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        # On a GPU, batched decode attention reads padding slots (masked, but 0 * NaN would still poison the sum), so
        # the cache starts zeroed. The CPU path only ever reads slots it wrote: leaving the memory untouched lets
        # the OS map pages as sequences first use them, instead of zeroing the whole cache (~1 s per 2 GB) at start.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        # Indexed by layer; None at a layer that keeps no keys and values (a hybrid model's mamba and MLP layers)
        cached = set(attention_layer_indices(model))
        if cached:  # under tensor parallelism each process caches only the kv heads of its slice (tensor_parallel.py)
            shape = (slots, config.num_key_value_heads // getattr(model, "tp_size", 1), config.head_dim)
        self.key_caches = [alloc(shape, dtype=self.dtype, device=self.device) if i in cached else None
                           for i in range(config.num_hidden_layers)]
        self.value_caches = [alloc(shape, dtype=self.dtype, device=self.device) if i in cached else None
                             for i in range(config.num_hidden_layers)]
        self.states = states  # a model with mamba layers: their per-sequence states (state_slots.py)
        self.decoder = model.model  # the stack without the LM head: we need logits only where we sample
        self.compute_logits = model.compute_logits  # the LM head (and a family's logit transform)
        self.graphs = None  # a DecodeGraphs (cuda_graphs.py) when CUDA graphs are on
        self.adapter_bank = None  # the manager's AdapterBank (lora.py): LoRA adapters of the step's sequences
        self.token_counts = TokenCounts(self.device)  # the penalties' per-request state; empty until one asks
        # CPU: oneDNN-packed copies of the linear weights, in use during each eager step (kernels/cpu_linear.py),
        # the same ones generate() uses on this model
        # ContinuousBatchingConfig.compile: the decoder compiled (engine/compiled_step.py), for steps without prompt
        # logprobs or LoRA rows; on the CPU it freezes its own packed weights, so only the LM head gets a copy here
        self.compiled = CompiledDecoder(self.decoder, self.scratch_block * block_size) if compile else None
        plan = head_plan(model) if compile else None
        self.packed = packed_linears(model, plan=plan) if prepack_weights and plan != [] else None

    # --- inputs -------------------------------------------------------------------------------------------------

    def reserve_cache(self) -> None:
        """Write every page of the KV cache once, so that its memory is taken now rather than page by page as
        sequences first reach it (on the CPU the cache starts unwritten, see __init__). A long-running server calls
        this at start: its memory then stays flat under traffic, and a machine without room for the cache fails at
        start-up instead of at the busiest moment. A no-op on a GPU, where the cache starts zeroed."""
        if self.device.type != "cuda":
            for cache in self.kv_tensors():
                cache.zero_()
            if self.states is not None:  # the mamba layers' state slots, left unwritten the same way
                self.states.conv.zero_()
                self.states.ssm.zero_()

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every layer's key and value cache tensors (the layers that keep them)."""
        return [t for t in (*self.key_caches, *self.value_caches) if t is not None]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedContext, list[int]]:
        """-> input_ids (1, total), position_ids (1, total), the step's PagedContext, rows of the tokens to sample."""
        bs = self.block_size
        tokens, positions, slots, query_start, context_lens, sample_rows = [], [], [], [0], [], []
        num_decodes = 0
        sampling = batch.sampling()  # asked before the scheduler advances the sequences
        for index, (seq, n) in enumerate(zip(batch.sequences, batch.num_tokens)):
            start = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:  # a decode (or a one-token chunk): the common case, without ranges
                tokens.append(seq.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                if num_decodes == index:
                    num_decodes += 1
            else:
                tokens += seq.tokens(start, start + n)
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
            if sampling[index]:
                sample_rows.append(query_start[-1] - 1)
        width = max(len(seq.block_table) for seq in batch.sequences)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.sequences]
        device = self.device

        def as_tensor(values):
            return device_tensor(values, device)

        context = PagedContext(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(list(itertools.chain.from_iterable(tables))).view(len(batch), width),
            context_lens=as_tensor(context_lens),
            query_start=query_start,
            context_lens_list=context_lens,
            num_decodes=num_decodes,
            block_size=bs,
            key_caches=self.key_caches,
            value_caches=self.value_caches,
            block_tables_list=tables,
            # for the Triton prefill kernel (paged_attention.py): a step with prefill chunks only
            cu_seqlens_q=device_tensor(query_start, device, torch.int32) if num_decodes < len(batch) else None,
        )
        return as_tensor(tokens)[None], as_tensor(positions)[None], context, sample_rows

    # --- the step -----------------------------------------------------------------------------------------------

    @staticmethod
    def prompt_logprob_rows(batch: ScheduledBatch) -> list[tuple[Sequence, int, range]]:
        """Per sequence that wants prompt logprobs from this step: (sequence, its first prompt token to record,
        the rows of the flattened step whose logits give them)."""
        found, row = [], 0
        for seq, n in zip(batch.sequences, batch.num_tokens):
            start = seq.num_computed_tokens
            wants = seq.params.prompt_logprobs is not None  # most requests do not: no lookup for them
            positions = seq.prompt_logprob_positions(start, n) if wants else None
            if positions:
                found.append((seq, positions.start + 1,
                              range(row + positions.start - start, row + positions.stop - start)))
            row += n
        return found

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[tuple[int, float | None] | None]:
        """Compute the batch; per sequence, (token, logprob or None) when it sampled, else None. Prompt logprobs
        are recorded on their sequences (Sequence.add_prompt_logprobs) as a side effect."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Start the step on the device and return without waiting for it. `previous`: the step still in flight,
        whose tokens feed this step's placeholders. Runs with the model's GPU as the thread's current device,
        whichever thread calls it (the engine loop's starts on cuda:0)."""
        with device_scope(self.device):
            return self._launch(batch, previous)

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep:
        input_ids, position_ids, context, sample_rows = self.prepare(batch)
        self._carry_placeholders(batch, input_ids, context.query_start, previous)
        prompt_rows = self.prompt_logprob_rows(batch)
        lora_rows = self.adapter_bank.rows(batch.sequences, batch.num_tokens) if self.adapter_bank else None
        plan = None
        if self.states is not None:  # the mamba layers' states: restored, zeroed, where each run finds them
            plan = plan_step(self.states, batch.sequences, batch.num_tokens, context)
        if self.graphs is not None and not prompt_rows and not lora_rows and self.graphs.can_run(batch, context):
            # (len(batch), vocab): one row per sequence
            logits = self.graphs.run(input_ids, position_ids, context, plan)
            if len(sample_rows) != len(batch):  # a one-token prefill chunk that does not sample yet
                logits = logits.index_select(0, device_tensor(sample_rows, logits.device))
        else:
            cache = PagedKVCache(context) if plan is None else PagedStateCache(context, self.states, plan)
            with self.packed.active() if self.packed else contextlib.nullcontext():
                with paged_context(context), adapter_rows(lora_rows):
                    hidden = self.decode_hidden(input_ids, position_ids, cache, eager=bool(prompt_rows or lora_rows))
                # (1, total, hidden) -> (samples, hidden) -> (samples, vocab)
                logits = self.compute_logits(hidden[0].index_select(0, device_tensor(sample_rows, hidden.device)))
                for seq, first, rows in prompt_rows:
                    self._record_prompt_logprobs(hidden[0], seq, first, rows)
        if plan is not None:  # the states at snapshot boundaries this step reached (after a replay too)
            take_snapshots(self.states, plan)
        sampling = [seq for seq, samples in zip(batch.sequences, batch.sampling()) if samples]
        tokens, logprob_rows, on_device = sample_on_device(logits, sampling, self.token_counts)
        event = None
        host = on_device
        if tokens.device.type == "cuda":
            # A non_blocking copy to the CPU lands in pinned memory; the event says when it has.
            host = [t.to("cpu", non_blocking=True) for t in on_device]
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tokens.device))  # the copies' stream, not the current device's
        return LaunchedStep(batch, sampling, tokens, host, logprob_rows, event)

    def decode_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedKVCache,
                      eager: bool = False) -> torch.Tensor:
        """The decoder stack over one step, inside its paged_context: input_ids, position_ids (1, total) -> the final
        hidden states (1, total, hidden). Compiled (compiled_step.py) where the runner compiles, unless `eager`: a
        step with prompt logprobs or LoRA rows, which the compiled graph does not take (nor a model with mamba
        states). A CUDA graph's capture (cuda_graphs.py) calls this too, so it records the compiled kernels."""
        if self.compiled is not None and not eager and self.states is None:
            return self.compiled(input_ids, position_ids, cache)
        hidden, _ = self.decoder(input_ids=input_ids, position_ids=position_ids, past_key_values=cache)
        return hidden

    def collect(self, step: LaunchedStep) -> list[tuple[int, float | None] | None]:
        """Wait for a launched step's tokens: per sequence of its batch, what `run` returns."""
        if step.event is not None:
            step.event.synchronize()
        results = to_host_samples(step.sampling, step.logprob_rows, step.host)
        # (not batch.samples: the scheduler has advanced the sequences since the launch)
        return [results[step.rows[seq]] if seq in step.rows else None for seq in step.batch.sequences]

    @staticmethod
    def _carry_placeholders(batch: ScheduledBatch, input_ids: torch.Tensor, query_start: list[int],
                            previous: LaunchedStep | None) -> None:
        """Scatter the previous step's sampled tokens (on the device) into this step's input_ids (1, total) at
        the rows whose token is still a placeholder."""
        rows, sources = [], []
        for index, seq in enumerate(batch.sequences):
            if not seq.num_pending_tokens:
                continue
            row = previous.rows.get(seq) if previous is not None else None
            if seq.num_pending_tokens != 1 or row is None:
                raise RuntimeError(f"request {seq.request_id!r} was scheduled with {seq.num_pending_tokens} tokens "
                                   f"of unknown value that the step in flight did not sample")
            # The placeholder is the sequence's last token, so the last row of its chunk.
            rows.append(query_start[index + 1] - 1)
            sources.append(row)
        if rows:
            device = input_ids.device
            rows_t, sources_t = device_tensor(rows, device), device_tensor(sources, device)
            input_ids[0].index_copy_(0, rows_t, previous.tokens.index_select(0, sources_t))

    def _record_prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, first: int, rows: range) -> None:
        """hidden (total, hidden): the step's final hidden states; rows give prompt tokens first, first + 1, ..."""
        k = seq.params.prompt_logprobs
        for offset in range(0, len(rows), PROMPT_LOGITS_ROWS):
            piece = rows[offset:offset + PROMPT_LOGITS_ROWS]
            # (piece, vocab) in float32, as sample_on_device computes the logprobs of generated tokens
            log_probs = torch.log_softmax(self.compute_logits(hidden[piece.start:piece.stop]).float(), -1)
            targets = seq.prompt_ids[first + offset:first + offset + len(piece)]
            chosen = log_probs.gather(1, torch.tensor(targets, device=log_probs.device)[:, None])[:, 0]
            top = None
            if k:
                values, ids = log_probs.topk(k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            seq.add_prompt_logprobs(first + offset, chosen.tolist(), top)
