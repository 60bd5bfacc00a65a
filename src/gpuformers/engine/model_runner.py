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

Sampling (sample_on_device) processes each row's float32 logits in transformers' order (vLLM's for the OpenAI
penalties, which transformers lacks), all on the device:

    logit_bias (+ eos and one-token stops at -inf before min_new_tokens)    one index_put over the batch
    -> repetition_penalty (prompt + output) -> frequency / presence (output)  rows with a penalty, vectorised
    -> greedy: argmax | sampled: temperature -> top_k -> top_p -> min_p -> multinomial (per row, its generator)

A step in which no request adjusts its logits skips the first two lines entirely (host checks on the params).
The penalties count tokens in TokenCounts: a row per request on the device, to which each step adds the tokens
it sampled, so no step sends token lists or waits for the host.

Offers: ModelRunner, LaunchedStep, TokenCounts, kv_bytes_per_block, sample_on_device, PROMPT_LOGITS_ROWS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpuformers.engine.paged_attention import PagedContext, PagedKVCache, paged_context
from gpuformers.engine.scheduler import ScheduledBatch
from gpuformers.engine.sequence import Sequence
from gpuformers.generation.generate import greedy_tokens

# Prompt logits are computed this many rows at a time: (rows, vocab) in float32 is ~150 MB for a 150k vocabulary.
PROMPT_LOGITS_ROWS = 256


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


def _device_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host numbers as a tensor (int64 unless `dtype` says otherwise) on `device` without waiting for the device.
    On CUDA they are staged in pinned memory: a copy from pageable memory may wait for the stream (the step in
    flight) to drain first, and a plain list index (`tensor[list]`) copies its indices over synchronously."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block takes over all layers: K and V, block_size tokens, kv_heads x head_dim each (this process's
    share of the kv heads under tensor parallelism)."""
    element = torch.empty((), dtype=dtype).element_size()
    kv_heads = config.num_key_value_heads // tp_size
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype | None = None):
        self.model = model
        config = model.config
        self.device = model.device
        self.dtype = dtype or model.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the block manager hands out: the scratch block that CUDA-graph padding rows write to.
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        # Under tensor parallelism each process caches only the kv heads of its slice (tensor_parallel.py).
        shape = (slots, config.num_key_value_heads // getattr(model, "tp_size", 1), config.head_dim)
        # On a GPU, batched decode attention reads padding slots (masked, but 0 * NaN would still poison the sum), so
        # the cache starts zeroed. The CPU path only ever reads slots it wrote: leaving the memory untouched lets
        # the OS map pages as sequences first use them, instead of zeroing the whole cache (~1 s per 2 GB) at start.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.key_caches = [alloc(shape, dtype=self.dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self.value_caches = [alloc(shape, dtype=self.dtype, device=self.device)
                             for _ in range(config.num_hidden_layers)]
        self.decoder = model.model  # the stack without the LM head: we need logits only where we sample
        self.lm_head = model.get_output_embeddings()
        self.graphs = None  # a DecodeGraphs (cuda_graphs.py) when CUDA graphs are on
        self.token_counts = TokenCounts(self.device)  # the penalties' per-request state; empty until one asks

    # --- inputs -------------------------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedContext, list[int]]:
        """-> input_ids (1, total), position_ids (1, total), the step's PagedContext, rows of the tokens to sample."""
        bs = self.block_size
        tokens, positions, slots, query_start, context_lens, sample_rows = [], [], [], [0], [], []
        num_decodes = 0
        for index, (seq, n) in enumerate(zip(batch.sequences, batch.num_tokens)):
            start = seq.num_computed_tokens
            tokens.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
            if n == 1 and num_decodes == index:
                num_decodes += 1
            if batch.samples(index):
                sample_rows.append(query_start[-1] - 1)
        max_blocks = max(len(seq.block_table) for seq in batch.sequences)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.sequences]
        device = self.device

        def as_tensor(values):
            return _device_tensor(values, device)

        context = PagedContext(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables),
            context_lens=as_tensor(context_lens),
            query_start=query_start,
            context_lens_list=context_lens,
            num_decodes=num_decodes,
            block_size=bs,
            key_caches=self.key_caches,
            value_caches=self.value_caches,
            block_tables_list=tables,
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
            positions = seq.prompt_logprob_positions(start, n)
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
        whose tokens feed this step's placeholders."""
        input_ids, position_ids, context, sample_rows = self.prepare(batch)
        self._carry_placeholders(batch, input_ids, context.query_start, previous)
        prompt_rows = self.prompt_logprob_rows(batch)
        if self.graphs is not None and not prompt_rows and self.graphs.can_run(batch, context):
            logits = self.graphs.run(input_ids, position_ids, context)  # (len(batch), vocab): one row per sequence
            if len(sample_rows) != len(batch):  # a one-token prefill chunk that does not sample yet
                logits = logits.index_select(0, _device_tensor(sample_rows, logits.device))
        else:
            with paged_context(context):
                hidden, _ = self.decoder(input_ids=input_ids, position_ids=position_ids,
                                         past_key_values=PagedKVCache(context))
            # (1, total, hidden) -> (samples, hidden) -> (samples, vocab)
            logits = self.lm_head(hidden[0].index_select(0, _device_tensor(sample_rows, hidden.device)))
            for seq, first, rows in prompt_rows:
                self._record_prompt_logprobs(hidden[0], seq, first, rows)
        sampling = [seq for i, seq in enumerate(batch.sequences) if batch.samples(i)]
        tokens, logprob_rows, on_device = sample_on_device(logits, sampling, self.token_counts)
        event = None
        host = on_device
        if tokens.device.type == "cuda":
            # A non_blocking copy to the CPU lands in pinned memory; the event says when it has.
            host = [t.to("cpu", non_blocking=True) for t in on_device]
            event = torch.cuda.Event()
            event.record()
        return LaunchedStep(batch, sampling, tokens, host, logprob_rows, event)

    def collect(self, step: LaunchedStep) -> list[tuple[int, float | None] | None]:
        """Wait for a launched step's tokens: per sequence of its batch, what `run` returns."""
        if step.event is not None:
            step.event.synchronize()
        results = _to_host_samples(step.sampling, step.logprob_rows, step.host)
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
            rows_t, sources_t = _device_tensor(rows, device), _device_tensor(sources, device)
            input_ids[0].index_copy_(0, rows_t, previous.tokens.index_select(0, sources_t))

    def _record_prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, first: int, rows: range) -> None:
        """hidden (total, hidden): the step's final hidden states; rows give prompt tokens first, first + 1, ..."""
        k = seq.params.prompt_logprobs
        for offset in range(0, len(rows), PROMPT_LOGITS_ROWS):
            piece = rows[offset:offset + PROMPT_LOGITS_ROWS]
            # (piece, vocab) in float32, as sample_on_device computes the logprobs of generated tokens
            log_probs = torch.log_softmax(self.lm_head(hidden[piece.start:piece.stop]).float(), -1)
            targets = seq.prompt_ids[first + offset:first + offset + len(piece)]
            chosen = log_probs.gather(1, torch.tensor(targets, device=log_probs.device)[:, None])[:, 0]
            top = None
            if k:
                values, ids = log_probs.topk(k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            seq.add_prompt_logprobs(first + offset, chosen.tolist(), top)


class TokenCounts:
    """The penalties' per-request state on the device: each request with a penalty owns one row of two
    (rows, vocab) tables, how often each token occurs in its output (int32) and whether it occurs in its prompt
    (bool). The prompt row is written at the request's first sampling step (before any output), and every step
    adds the tokens it sampled on the device, so the tables never wait for the host. A request keeps its row
    through chunked prefill (only a step that samples touches it) and preemption (a recompute rebuilds the KV
    cache; the output tokens stay); the row is reused once the request has finished."""

    def __init__(self, device: torch.device):
        self.device = device
        self.output: torch.Tensor | None = None  # (capacity, vocab) int32
        self.in_prompt: torch.Tensor | None = None  # (capacity, vocab) bool
        self.rows: dict[Sequence, int] = {}  # hashed by identity
        self.free: list[int] = []

    def rows_of(self, sequences: list[Sequence], vocab_size: int) -> torch.Tensor:
        """(len(sequences),) int64 on the device: each sequence's row, giving new sequences one."""
        for seq in [s for s in self.rows if s.is_finished]:  # finished or cancelled: never sampled again
            self.free.append(self.rows.pop(seq))
        new = [seq for seq in sequences if seq not in self.rows]
        if len(new) > len(self.free):
            self._grow(len(self.rows) + len(new), vocab_size)
        for seq in new:
            self.rows[seq] = self.free.pop()
        if new:
            new_rows = _device_tensor([self.rows[seq] for seq in new], self.device)
            self.output.index_fill_(0, new_rows, 0)
            self.in_prompt.index_fill_(0, new_rows, False)
            # flat indices row * vocab + token (ids past the LM head are never sampled: left out)
            seen = [self.rows[seq] * vocab_size + t for seq in new for t in set(seq.prompt_ids) if t < vocab_size]
            self.in_prompt.view(-1).index_fill_(0, _device_tensor(seen, self.device), True)
        return _device_tensor([self.rows[seq] for seq in sequences], self.device)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per row: rows and tokens (n,) int64 on the device."""
        flat = rows * self.output.shape[1] + tokens
        self.output.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def _grow(self, needed: int, vocab_size: int) -> None:
        old = 0 if self.output is None else self.output.shape[0]
        capacity = max(needed, 2 * old, 8)
        output = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=self.device)
        if old:
            output[:old] = self.output
            in_prompt[:old] = self.in_prompt
        self.output, self.in_prompt = output, in_prompt
        self.free.extend(range(capacity - 1, old - 1, -1))  # popped from the end: lowest row first


def _adjust_logits(logits: torch.Tensor, sequences: list[Sequence], rows: list[int],
                   counts: TokenCounts) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits (len(sequences), vocab) float32 with the bias, the min_new_tokens mask and the penalties of `rows`
    (the rows whose params adjust their logits) applied, out of place. Also returns, when some rows have a
    penalty, (those rows' indices into logits, their TokenCounts rows), to count the tokens they sample."""
    vocab_size = logits.shape[-1]
    device = logits.device
    # logit_bias, then eos and the one-token stops at -inf while min_new_tokens is not reached: one index_add
    # covers both (-inf + bias is -inf, and -inf stays -inf through the penalties that come next).
    flat, values = [], []  # flat indices row * vocab + token into logits
    for i in rows:
        seq = sequences[i]
        entries = list(seq.params.logit_bias.items())
        if seq.num_output_tokens < seq.params.min_new_tokens:
            entries += [(token, float("-inf")) for token in seq.params.ending_tokens]
        for token, value in entries:
            if token < vocab_size:  # an id past the LM head is never sampled: nothing to bias or mask
                flat.append(i * vocab_size + token)
                values.append(value)
    if flat:
        added = logits.reshape(-1).index_add(0, _device_tensor(flat, device),
                                             _device_tensor(values, device, torch.float32))
        logits = added.view_as(logits)
    penalised = [i for i in rows if sequences[i].params.uses_penalties]
    if not penalised:
        return logits, None
    params = [sequences[i].params for i in penalised]
    index = _device_tensor(penalised, device)
    table_rows = counts.rows_of([sequences[i] for i in penalised], vocab_size)
    scores = logits.index_select(0, index)  # (penalised, vocab)
    output = counts.output.index_select(0, table_rows).float()  # (penalised, vocab): exact below 2**24
    present = output > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = _device_tensor([p.repetition_penalty for p in params], device, torch.float32)[:, None]
        seen = counts.in_prompt.index_select(0, table_rows) | present
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        frequency = _device_tensor([p.frequency_penalty for p in params], device, torch.float32)[:, None]
        presence = _device_tensor([p.presence_penalty for p in params], device, torch.float32)[:, None]
        scores = scores - frequency * output - presence * present
    return logits.index_copy(0, index, scores), (index, table_rows)


def _filter_row(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits (vocab,) with the tokens outside top-k, outside the top-p mass and below min_p times the top
    token's probability set to -inf, in that order (transformers')."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def sample_on_device(logits: torch.Tensor, sequences: list[Sequence], counts: TokenCounts
                     ) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Choose each sequence's token without a host sync. logits (len(sequences), vocab) ->
    (tokens (len(sequences),) int64, the rows that asked for logprobs, [tokens, and for those rows: logprobs
    (rows,), and with top_logprobs the k most likely logprobs (rows, k) and token ids (rows, k)]).
    counts: the penalties' token counts, which gain the tokens chosen for requests with a penalty."""
    logits = logits.float()
    adjusted = [i for i, seq in enumerate(sequences) if seq.params.adjusts_logits(seq.num_output_tokens)]
    penalised = None
    if adjusted:
        logits, penalised = _adjust_logits(logits, sequences, adjusted, counts)
    tokens = greedy_tokens(logits)  # greedy rows: one call for all of them
    scores = logits
    sampled = [i for i, seq in enumerate(sequences) if not seq.params.greedy]
    if sampled:
        tokens, scores = tokens.clone(), logits.clone()
        for i in sampled:
            params = sequences[i].params
            row = _filter_row(logits[i] / params.temperature, params.top_k, params.top_p, params.min_p)
            if params.seed is not None and sequences[i].generator is None:
                sequences[i].generator = torch.Generator(device=logits.device).manual_seed(params.seed)
            probs = row.softmax(-1)
            tokens[i] = torch.multinomial(probs, 1, generator=sequences[i].generator)[0]
            scores[i] = row
    if penalised is not None:
        index, table_rows = penalised
        counts.add(table_rows, tokens.index_select(0, index))
    want_logprobs = [i for i, seq in enumerate(sequences) if seq.params.return_logprobs]
    out = [tokens]
    if want_logprobs:
        rows = _device_tensor(want_logprobs, logits.device)
        log_probs = torch.log_softmax(scores[rows], -1)  # (rows, vocab)
        out.append(log_probs.gather(1, tokens[rows, None])[:, 0])
        k = max(sequences[i].params.top_logprobs for i in want_logprobs)
        if k:
            out.extend(log_probs.topk(k, dim=-1))  # values (rows, k), ids (rows, k)
    return tokens, want_logprobs, out


def _to_host_samples(sequences: list[Sequence], want_logprobs: list[int], host: list[torch.Tensor]) -> list[tuple]:
    """sample_on_device's results, on the host -> per sequence (token, logprob if it asked for logprobs), plus, for
    a sequence that asked for top_logprobs=k, its k most likely (token, logprob) pairs."""
    logprobs, top = {}, {}
    if want_logprobs:
        logprobs = dict(zip(want_logprobs, host[1].tolist()))
        if len(host) > 2:
            values, ids = host[2].tolist(), host[3].tolist()
            for row, i in enumerate(want_logprobs):
                wanted = sequences[i].params.top_logprobs
                if wanted:
                    top[i] = list(zip(ids[row][:wanted], values[row][:wanted]))
    return [(token, logprobs.get(i)) if i not in top else (token, logprobs.get(i), top[i])
            for i, token in enumerate(host[0].tolist())]
