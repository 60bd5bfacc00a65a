"""Sampling in the engine: each sequence's next token from its logits row, with its own parameters, on the device.

Each row's float32 logits are processed in transformers' order (vLLM's for the OpenAI penalties, which
transformers lacks), all on the device:

    logit_bias -> eos and one-token stops at -inf before min_new_tokens     one index_add, one mask over the batch
    -> repetition_penalty (prompt + output) -> frequency / presence (output)  rows with a penalty, vectorised
    -> tokens the request's grammar does not allow at -inf                  rows with structured_output
    -> greedy: argmax | sampled: temperature -> top_k -> top_p -> min_p -> multinomial
       (on a GPU the sampled rows all at once, each with its own params and generator; on the CPU row by row)

The min_new_tokens mask, the penalties, the grammar mask, the temperature and the filters are
generation/sampling_ops.py's functions, the ones generate()'s logits processors call, given a tensor of each row's
values: the same numbers as generate() for the same logits. Which tokens the min_new_tokens mask holds back, and
until when, is the request's StopRules (generation/stop_rules.py).

A step in which no request adjusts its logits skips the first two lines entirely (host checks on the params).
Logprobs, greedy or sampled, are those of the adjusted logits (before temperature and the filters).
The penalties count tokens in TokenCounts: a row per request on the device, to which each step adds the tokens
it sampled, so no step sends token lists or waits for the host.

Offers: sample_on_device, to_host_samples, TokenCounts, host_tensor, device_tensor, device_scope.
"""

from __future__ import annotations

import array
import contextlib

import torch

from gpuformers.engine.sequence import SamplingParams, Sequence
from gpuformers.engine.structured import mask_logits
from gpuformers.generation import sampling_ops
from gpuformers.generation.generate import greedy_tokens


_ARRAY_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def host_tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A flat list of numbers as a CPU tensor. Through array.array: for the few hundred ints of an engine step this
    is ~7x faster than torch.tensor, which inspects every element (94 vs 13 us for 256; benchmarks/
    bench_engine_host.py). Anything else (nested lists, tensors, an empty list) goes to torch.tensor."""
    code = _ARRAY_TYPECODES.get(dtype)
    if code is not None and values:
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)  # the tensor keeps the array alive
        except (TypeError, OverflowError):
            pass
    return torch.tensor(values, dtype=dtype)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host numbers as a tensor (int64 unless `dtype` says otherwise) on `device` without waiting for the device.
    On CUDA they are staged in pinned memory: a copy from pageable memory may wait for the stream (the step in
    flight) to drain first, and a plain list index (`tensor[list]`) copies its indices over synchronously."""
    if device.type != "cuda":
        return host_tensor(values, dtype)
    return host_tensor(values, dtype).pin_memory().to(device, non_blocking=True)


def device_scope(device: torch.device):
    """A context in which `device` is this thread's current CUDA device (nothing off CUDA). Torch ops follow their
    tensors' device, but what names no device uses the current one: Triton kernel launches, streams, events, CUDA
    graph captures. A thread starts on cuda:0, so an engine loop thread (or a server's worker thread) driving a
    model on cuda:1 would launch those on the wrong GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
            new_rows = device_tensor([self.rows[seq] for seq in new], self.device)
            self.output.index_fill_(0, new_rows, 0)
            self.in_prompt.index_fill_(0, new_rows, False)
            # flat indices row * vocab + token (ids past the LM head are never sampled: left out)
            seen = [self.rows[seq] * vocab_size + t for seq in new for t in set(seq.prompt_ids) if t < vocab_size]
            self.in_prompt.view(-1).index_fill_(0, device_tensor(seen, self.device), True)
        return device_tensor([self.rows[seq] for seq in sequences], self.device)

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
    # flat indices row * vocab + token into logits (an id past the LM head is never sampled: nothing to bias or mask)
    flat, values = [], []  # logit_bias
    ending = []  # the tokens that would end a row still short of min_new_tokens (its StopRules)
    for i in rows:
        seq = sequences[i]
        for token, value in seq.params.logit_bias.items():
            if token < vocab_size:
                flat.append(i * vocab_size + token)
                values.append(value)
        rules = seq.params.stop_rules
        if rules.suppresses_endings(seq.num_output_tokens):
            ending += [i * vocab_size + token for token in rules.ending_tokens if token < vocab_size]
    if flat:
        added = logits.reshape(-1).index_add(0, device_tensor(flat, device),
                                             device_tensor(values, device, torch.float32))
        logits = added.view_as(logits)
    if ending:
        # (rows, vocab) bool, set only in the short rows; -inf stays -inf through the penalties that come next
        mask = torch.zeros(logits.numel(), dtype=torch.bool, device=device)
        mask.index_fill_(0, device_tensor(ending, device), True)
        logits = sampling_ops.suppress_before_min_tokens(logits, mask.view_as(logits))
    penalised = [i for i in rows if sequences[i].params.uses_penalties]
    if not penalised:
        return logits, None
    params = [sequences[i].params for i in penalised]
    index = device_tensor(penalised, device)
    table_rows = counts.rows_of([sequences[i] for i in penalised], vocab_size)
    repetition = any(p.repetition_penalty != 1.0 for p in params)
    # (penalised, 1) each: 1 and 0 in the rows that do not use them change nothing
    penalty = device_tensor([p.repetition_penalty for p in params], device, torch.float32)[:, None]
    frequency = device_tensor([p.frequency_penalty for p in params], device, torch.float32)[:, None]
    presence = device_tensor([p.presence_penalty for p in params], device, torch.float32)[:, None]
    output = counts.output.index_select(0, table_rows)  # (penalised, vocab) int32
    in_prompt = counts.in_prompt.index_select(0, table_rows) if repetition else None
    penalise = _penalise_sparse if device.type == "cpu" else _penalise_dense
    return penalise(logits, index, output, in_prompt, penalty, frequency, presence), (index, table_rows)


def _penalise_dense(logits, index, output, in_prompt, penalty, frequency, presence) -> torch.Tensor:
    """The penalties over whole rows: logits (n, vocab); index (rows,) the penalised rows; output (rows, vocab) their
    output token counts; in_prompt (rows, vocab) or None (no repetition penalty); penalty, frequency, presence
    (rows, 1). On a GPU: no nonzero(), which would wait for the device."""
    scores = logits.index_select(0, index)  # (rows, vocab)
    if in_prompt is not None:
        scores = sampling_ops.penalize_repetition(scores, in_prompt | (output > 0), penalty)
    scores = sampling_ops.penalize_frequency_presence(scores, output, frequency, presence)
    return logits.index_copy(0, index, scores)


def _penalise_sparse(logits, index, output, in_prompt, penalty, frequency, presence) -> torch.Tensor:
    """_penalise_dense's numbers, changing only the tokens seen (a few hundred per row of a vocabulary of 10^5): one
    pass over the tables instead of a dozen dense (rows, vocab) temporaries. On the CPU, where nonzero() waits for
    nothing: 64 rows of 152k tokens, ~50 ms instead of ~320 (benchmarks/bench_sampler.py)."""
    seen = output > 0
    if in_prompt is not None:
        seen |= in_prompt
    row, token = seen.nonzero(as_tuple=True)
    values = logits[index[row], token]  # (seen,): one entry per (row, token) seen
    if in_prompt is not None:
        values = sampling_ops.repetition_penalty_rule(values, penalty[row, 0])
    values = sampling_ops.penalize_frequency_presence(values, output[row, token], frequency[row, 0],
                                                      presence[row, 0])
    logits = logits.clone()
    logits[index[row], token] = values
    return logits


def _filter_row(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits (vocab,) through transformers' TopK -> TopP -> MinP warpers as generate() builds them (each only when
    set), called with this row's numbers as generate() calls them. The one-row reference of _filter_rows, which the
    engine runs and the tests compare with this."""
    row = logits[None]  # (1, vocab)
    if top_k and top_k < logits.shape[-1]:
        row = sampling_ops.top_k_filter(row, top_k)
    if top_p < 1.0:
        row = sampling_ops.top_p_filter(row, top_p)
    if min_p:
        row = sampling_ops.min_p_filter(row, min_p)
    return row[0]


def _filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """_filter_row for every row at once, each with its own params: logits (rows, vocab) -> the same with the
    filtered tokens at -inf. The rows with a top_k share one topk (to their largest k), those with a top_p one
    sort, those with a min_p one softmax; a row skips the filters it does not use, as generate() leaves out a warper
    it does not use (a neutral value is not always neutral: top_p=1 would still drop the tokens whose probability
    rounds to 0)."""
    vocab_size = logits.shape[-1]
    device = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # 0: off (k >= vocab keeps everything)
    k_rows = [r for r in range(len(params)) if top_k[r]]
    if k_rows:
        k = device_tensor([top_k[r] for r in k_rows], device)
        logits = _on_rows(logits, k_rows, lambda rows: sampling_ops.top_k_filter(
            rows, k, max_top_k=max(top_k[r] for r in k_rows)))
    p_rows = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        # float64: the threshold 1 - top_p is taken in double, as from generate()'s Python number
        top_p = device_tensor([params[r].top_p for r in p_rows], device, torch.float64)
        logits = _on_rows(logits, p_rows, lambda rows: sampling_ops.top_p_filter(rows, top_p))
    floor = [r for r, p in enumerate(params) if p.min_p]
    if floor:
        min_p = device_tensor([params[r].min_p for r in floor], device, torch.float32)
        logits = _on_rows(logits, floor, lambda rows: sampling_ops.min_p_filter(rows, min_p))
    return logits


def _on_rows(logits: torch.Tensor, picked: list[int], apply) -> torch.Tensor:
    """logits (rows, vocab) with the rows `picked` replaced by apply(those rows); out of place."""
    if len(picked) == logits.shape[0]:
        return apply(logits)
    index = device_tensor(picked, logits.device)
    return logits.index_copy(0, index, apply(logits.index_select(0, index)))


def _warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What generate()'s sampling warpers make of each row's logits, each row with its own params: logits
    (rows, vocab) -> temperature, then top_k -> top_p -> min_p (filtered tokens at -inf), before the softmax."""
    temperature = device_tensor([p.temperature for p in params], logits.device, torch.float32)
    return _filter_rows(sampling_ops.scale_by_temperature(logits, temperature), params)


def _sample_rows(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """The sampled rows' tokens: logits (rows, vocab) of sequences that all sample -> (rows,) int64, each row
    through its temperature, filters and draw (its own generator when it has a seed), in a fixed number of kernels
    whatever the number of rows (a few more per seeded row: its noise)."""
    generators = _generators(sequences, logits.device)
    probs = _warp_rows(logits, [seq.params for seq in sequences]).softmax(-1)
    return _draw_rows(probs, generators)


def _sample_each_row(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """_sample_rows one row at a time (the CPU's way): the same tokens, each row through _filter_row and
    torch.multinomial with its own generator."""
    tokens = []
    for row, seq, generator in zip(logits, sequences, _generators(sequences, logits.device)):
        params = seq.params
        scaled = sampling_ops.scale_by_temperature(row, params.temperature)
        probs = _filter_row(scaled, params.top_k, params.top_p, params.min_p).softmax(-1)
        tokens.append(torch.multinomial(probs, 1, generator=generator))
    return torch.cat(tokens)


def _generators(sequences: list[Sequence], device: torch.device) -> list[torch.Generator | None]:
    """Each sequence's own generator (made from its seed at its first sample, then kept on it), or None: the
    device's default one."""
    for seq in sequences:
        if seq.params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return [seq.generator for seq in sequences]


def _draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of probs (rows, vocab) -> (rows,) int64, row i drawn with generators[i] (None: the
    device's default generator). On the CPU torch.multinomial, one row at a time (the random stream of generate()
    and transformers). On a GPU the race torch.multinomial runs inside (_exponential_rows) without the checks before
    it that read the probabilities back with .item() in torch releases before pytorch#134818 (2024): two host syncs
    per sampled row, each making `launch` wait for the step in flight (generate() samples the same way,
    generation/generate.py)."""
    if probs.device.type != "cuda":
        return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
    return _exponential_rows(probs, generators)


def _exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) from `generator`: the token torch.multinomial(probs, 1) draws, probs (vocab,)."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax()


def _exponential_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """_exponential_race over every row at once: probs (rows, vocab) -> (rows,) int64. The rows without a generator
    share one draw of noise from the default generator; a row with one draws its own row of noise from it, as
    _exponential_race would (the same numbers: one call of the same size), so a seeded request's token does not
    depend on the rows beside it."""
    noise = torch.empty_like(probs)  # (rows, vocab)
    if any(g is None for g in generators):
        noise.exponential_(1)  # the seeded rows' share is overwritten below
    for row, g in enumerate(generators):
        if g is not None:
            noise[row].exponential_(1, generator=g)
    return (probs / noise).argmax(-1)


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
    constrained = [i for i, seq in enumerate(sequences) if seq.grammar_matcher is not None]
    if constrained:
        logits = mask_logits(logits, [sequences[i].grammar_matcher for i in constrained], constrained)
    sampled = [i for i, seq in enumerate(sequences) if not seq.params.greedy]
    # On a GPU the sampled rows go all together: 256 of them cost the kernels of one (and a noise draw per seeded
    # row). On the CPU one row at a time is faster (each row's temporaries stay in cache: 173 vs 206 ms for 64 rows
    # of 32k, benchmarks/bench_sampler.py) and there are no launches to save.
    sample = _sample_rows if logits.device.type == "cuda" else _sample_each_row
    if sampled and len(sampled) == len(sequences):
        tokens = sample(logits, sequences)
    else:
        tokens = greedy_tokens(logits)  # greedy rows: one call for all of them
        if sampled:
            index = device_tensor(sampled, logits.device)
            tokens = tokens.index_copy(0, index, sample(logits.index_select(0, index),
                                                        [sequences[i] for i in sampled]))
    if penalised is not None:
        index, table_rows = penalised
        counts.add(table_rows, tokens.index_select(0, index))
    want_logprobs = [i for i, seq in enumerate(sequences) if seq.params.return_logprobs]
    out = [tokens]
    if want_logprobs:
        rows = device_tensor(want_logprobs, logits.device)
        # From the adjusted logits, before temperature and the top-k / top-p / min_p filters: those change which token
        # is drawn, not the distribution reported (OpenAI's and vLLM's logprobs; filtered ones would be -inf, with
        # arbitrary ids among the top alternatives).
        log_probs = torch.log_softmax(logits[rows], -1)  # (rows, vocab)
        out.append(log_probs.gather(1, tokens[rows, None])[:, 0])
        k = max(sequences[i].params.top_logprobs for i in want_logprobs)
        if k:
            out.extend(log_probs.topk(k, dim=-1))  # values (rows, k), ids (rows, k)
    return tokens, want_logprobs, out


def to_host_samples(sequences: list[Sequence], want_logprobs: list[int], host: list[torch.Tensor]) -> list[tuple]:
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
