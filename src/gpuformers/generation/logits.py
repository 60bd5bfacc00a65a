"""Logits processors: the steps between the model's next-token logits and the choice of a token.

Each processor is a callable `(input_ids (batch, seq) LongTensor, scores (batch, vocab) float) -> scores` with the
name and behaviour of the transformers class of the same name, so processed scores match transformers' on the same
input. Every decision that depends on data stays on the device (masks, `torch.where`, scatter); only shapes, which
the host already knows, choose a branch, so no processor waits on the GPU.

`build_logits_processors(generation_config, prompt_length)` builds the list generate() applies, in transformers'
order: penalties and constraints first, then (only with do_sample=True) the sampling warpers
temperature -> top_k -> top_p -> min_p -> typical_p -> epsilon -> eta, then renormalisation.

PrefixConstrainedLogitsProcessor (generate(prefix_allowed_tokens_fn=...)) lives in generation/prefix_constrained.py;
it calls the user's Python function per row, so it is the one processor that waits for the device.

Offers: LogitsProcessor, LogitsProcessorList, build_logits_processors, and the processors:
RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor, MinLengthLogitsProcessor,
MinNewTokensLengthLogitsProcessor, ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor,
InfNanRemoveLogitsProcessor, SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, LogitNormalization,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
EpsilonLogitsWarper, EtaLogitsWarper.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from gpuformers.generation.config import GenerationConfig

NEG_INF = -math.inf


class LogitsProcessor:
    """Base class: subclasses implement `__call__(input_ids, scores) -> scores` and never modify `scores` in place
    (generate() may keep the raw scores for `output_logits`)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(input_ids, scores)")


class LogitsProcessorList(list):
    """A list of processors that is itself a processor: applies each in order."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class _TokenMask:
    """A fixed set of token ids as a (vocab,) bool mask, built once per vocab size and device, so each step costs one
    `torch.where` instead of a `torch.isin`."""

    def __init__(self, token_ids: Sequence[int] | int | torch.Tensor):
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.reshape(-1).tolist()  # built once, before decoding starts
        self.token_ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        self._mask: torch.Tensor | None = None

    def mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.shape[0] != vocab_size or self._mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [t for t in self.token_ids if 0 <= t < vocab_size]  # ids past the lm head can never be produced
            mask[ids] = True
            self._mask = mask.to(device)
        return self._mask


def _keep_top_tokens(scores: torch.Tensor, remove: torch.Tensor, min_tokens_to_keep: int) -> torch.Tensor:
    """Clear `remove` for each row's `min_tokens_to_keep` highest scores. remove: (batch, vocab) bool."""
    k = min(min_tokens_to_keep, scores.shape[-1])
    kth_best = torch.topk(scores, k).values[..., -1:]  # (batch, 1)
    return remove & (scores < kth_best)


# --- penalties and constraints --------------------------------------------------------------------------------------


class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Make every token already in the sequence less likely: its score is divided by `penalty` when positive and
    multiplied by it when negative (CTRL, arXiv:1909.05858). `prompt_ignore_length` leaves out the first positions
    of each row: an int for all rows, or a (batch,) tensor, e.g. the left-padding length of each row."""

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None):
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r}; 1.0 means no penalty")
        self.penalty = float(penalty)
        self.prompt_ignore_length = prompt_ignore_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        vocab_size = scores.shape[-1]
        ignore = self.prompt_ignore_length
        if isinstance(ignore, int):
            input_ids = input_ids[:, ignore:]
        elif isinstance(ignore, torch.Tensor):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            # ignored positions point at a spare column past the vocab, dropped at the end
            input_ids = input_ids.masked_fill(positions[None, :] < ignore.to(input_ids.device)[:, None], vocab_size)
        # ids beyond the lm head (embedding larger than the head) also land in the spare column
        ids = input_ids.clamp(max=vocab_size)  # (batch, seq)
        padded = torch.nn.functional.pad(scores, (0, 1))  # (batch, vocab + 1)
        seen = padded.gather(1, ids)
        penalised = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return padded.scatter(1, ids, penalised)[:, :vocab_size]


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Forbid any n-gram of `ngram_size` tokens from occurring twice in a row's sequence.

    The next token t would repeat an n-gram when the last n-1 tokens followed by t already occur. So every earlier
    window of n tokens whose first n-1 tokens equal the current suffix bans its last token.
    """

    def __init__(self, ngram_size: int):
        if not isinstance(ngram_size, int) or isinstance(ngram_size, bool) or ngram_size <= 0:
            raise ValueError(f"no_repeat_ngram_size must be a positive integer, got {ngram_size!r}")
        self.ngram_size = ngram_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        n = self.ngram_size
        batch, seq = input_ids.shape
        if seq < n:  # no complete n-gram yet
            return scores
        vocab_size = scores.shape[-1]
        windows = input_ids.unfold(1, n, 1)  # (batch, seq - n + 1, n)
        suffix = input_ids[:, seq - (n - 1):]  # (batch, n - 1)
        hits = (windows[:, :, : n - 1] == suffix[:, None, :]).all(-1)  # (batch, seq - n + 1)
        # windows that do not match (and ids past the head) add their hit to a spare column, dropped below
        targets = torch.where(hits, windows[:, :, -1].clamp(max=vocab_size), vocab_size)
        banned = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=scores.device)
        banned.scatter_(1, targets, True)
        return scores.masked_fill(banned[:, :vocab_size], NEG_INF)


class NoBadWordsLogitsProcessor(LogitsProcessor):
    """Never produce the token sequences in `bad_words_ids`. A one-token entry is banned everywhere; for a longer
    one, its last token is banned in rows whose sequence ends with the rest of it. An entry that is just an eos
    token is dropped, as in transformers (stopping must stay possible)."""

    def __init__(self, bad_words_ids: list[list[int]], eos_token_id: int | list[int] | None = None):
        if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids or not all(
            isinstance(seq, (list, tuple)) and seq for seq in bad_words_ids
        ):
            raise ValueError(f"bad_words_ids must be a non-empty list of non-empty lists of token ids, "
                             f"got {bad_words_ids!r}")
        eos = set(_as_list(eos_token_id))
        sequences = [list(seq) for seq in bad_words_ids if not (len(seq) == 1 and seq[0] in eos)]
        self.single = _TokenMask([seq[0] for seq in sequences if len(seq) == 1])
        # longer entries grouped by prefix length: (prefixes (k, prefix_len), last tokens (k,)), moved on first use
        by_length: dict[int, list[list[int]]] = {}
        for seq in sequences:
            if len(seq) > 1:
                by_length.setdefault(len(seq) - 1, []).append(seq)
        self._groups = [(torch.tensor([s[:-1] for s in group]), torch.tensor([s[-1] for s in group]))
                        for group in by_length.values()]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        batch, vocab_size = scores.shape
        banned = self.single.mask(vocab_size, scores.device).expand(batch, vocab_size)
        if self._groups:
            banned = torch.cat([banned, banned.new_zeros(batch, 1)], dim=1)  # spare column for ids past the head
            if self._groups[0][0].device != scores.device:
                self._groups = [(p.to(scores.device), t.to(scores.device)) for p, t in self._groups]
            for prefixes, last in self._groups:
                k = prefixes.shape[1]
                if k > input_ids.shape[1]:
                    continue
                ends_with = (input_ids[:, None, -k:] == prefixes[None]).all(-1)  # (batch, entries)
                targets = torch.where(ends_with, last.clamp(max=vocab_size)[None, :], vocab_size)
                banned = banned.scatter(1, targets, True)
            banned = banned[:, :vocab_size]
        return scores.masked_fill(banned, NEG_INF)


class MinLengthLogitsProcessor(LogitsProcessor):
    """Forbid eos while the sequence (prompt included) is shorter than `min_length`."""

    def __init__(self, min_length: int, eos_token_id: int | list[int] | torch.Tensor):
        if not isinstance(min_length, int) or min_length < 0:
            raise ValueError(f"min_length must be an integer >= 0, got {min_length!r}")
        self.min_length = min_length
        self.eos = _TokenMask(eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.min_length:
            return scores
        return scores.masked_fill(self.eos.mask(scores.shape[-1], scores.device), NEG_INF)


class MinNewTokensLengthLogitsProcessor(LogitsProcessor):
    """Forbid eos until `min_new_tokens` tokens have been generated after a prompt of `prompt_length_to_skip`."""

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id: int | list[int] | torch.Tensor):
        if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")
        self.prompt_length_to_skip = prompt_length_to_skip
        self.min_new_tokens = min_new_tokens
        self.eos = _TokenMask(eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip >= self.min_new_tokens:
            return scores
        return scores.masked_fill(self.eos.mask(scores.shape[-1], scores.device), NEG_INF)


class ForcedBOSTokenLogitsProcessor(LogitsProcessor):
    """Force `bos_token_id` as the first generated token when the input is one token long."""

    def __init__(self, bos_token_id: int):
        self.bos_token_id = bos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != 1:
            return scores
        forced = torch.full_like(scores, NEG_INF)
        forced[:, self.bos_token_id] = 0
        return forced


class ForcedEOSTokenLogitsProcessor(LogitsProcessor):
    """Force an eos token as the last token when the sequence is one short of `max_length`."""

    def __init__(self, max_length: int, eos_token_id: int | list[int]):
        self.max_length = max_length
        self.eos = _TokenMask(eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.max_length - 1:
            return scores
        eos = self.eos.mask(scores.shape[-1], scores.device)
        return torch.where(eos, 0.0, NEG_INF).to(scores.dtype).expand_as(scores).clone()


class InfNanRemoveLogitsProcessor(LogitsProcessor):
    """Replace nan by 0 and +-inf by the dtype's largest finite values, so sampling cannot fail on them."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        finfo = torch.finfo(scores.dtype)
        return torch.nan_to_num(scores, nan=0.0, posinf=finfo.max, neginf=finfo.min)


class SuppressTokensLogitsProcessor(LogitsProcessor):
    """Never produce the given tokens."""

    def __init__(self, suppress_tokens: Sequence[int]):
        self.tokens = _TokenMask(list(suppress_tokens))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.tokens.mask(scores.shape[-1], scores.device), NEG_INF)


class SuppressTokensAtBeginLogitsProcessor(LogitsProcessor):
    """Never produce the given tokens as the first generated token (when the sequence is `begin_index` long)."""

    def __init__(self, begin_suppress_tokens: Sequence[int], begin_index: int):
        self.tokens = _TokenMask(list(begin_suppress_tokens))
        self.begin_index = begin_index

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.begin_index:
            return scores
        return scores.masked_fill(self.tokens.mask(scores.shape[-1], scores.device), NEG_INF)


class LogitNormalization(LogitsProcessor):
    """Turn scores into log-probabilities (renormalize_logits=True); beam search relies on it after warpers."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.log_softmax(dim=-1)


# --- sampling warpers (only with do_sample=True) ---------------------------------------------------------------------


class TemperatureLogitsWarper(LogitsProcessor):
    """Divide the scores by `temperature`: below 1 sharpens the distribution, above 1 flattens it."""

    def __init__(self, temperature: float):
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}; "
                             f"for deterministic output use do_sample=False")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopKLogitsWarper(LogitsProcessor):
    """Keep the `top_k` highest-scoring tokens (ties with the k-th included), remove the rest."""

    def __init__(self, top_k: int, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}; generate() treats 0 as 'off'")
        self.top_k = max(top_k, min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth_best = torch.topk(scores, k).values[..., -1:]  # (batch, 1)
        return scores.masked_fill(scores < kth_best, self.filter_value)


class TopPLogitsWarper(LogitsProcessor):
    """Nucleus sampling (arXiv:1904.09751): keep the smallest set of most likely tokens whose probabilities add up
    to at least `top_p`."""

    def __init__(self, top_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        top_p = float(top_p)
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be between 0 and 1, got {top_p!r}")
        _check_min_tokens(min_tokens_to_keep)
        self.top_p = top_p
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        # Ascending order: the mass of the least likely tokens accumulates first, and a token is dropped while
        # everything up to and including it stays within the 1 - top_p tail.
        ascending, order = torch.sort(scores, dim=-1)  # (batch, vocab)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = tail_mass <= 1.0 - self.top_p
        drop_sorted[:, -self.min_tokens_to_keep:] = False  # the most likely tokens sit at the end
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, self.filter_value)


class MinPLogitsWarper(LogitsProcessor):
    """Keep tokens whose probability is at least `min_p` times the most likely token's (arXiv:2407.01082)."""

    def __init__(self, min_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, got {min_p!r}")
        _check_min_tokens(min_tokens_to_keep)
        self.min_p = min_p
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)  # (batch, 1)
        drop = probs < threshold
        k = min(self.min_tokens_to_keep, probs.shape[-1])
        drop = drop.scatter(1, torch.topk(probs, k).indices, False)
        return scores.masked_fill(drop, self.filter_value)


class TypicalLogitsWarper(LogitsProcessor):
    """Locally typical sampling (arXiv:2202.00666): rank tokens by how far their surprisal is from the
    distribution's entropy, keep the closest ones until their mass reaches `mass`."""

    def __init__(self, mass: float = 0.9, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        mass = float(mass)
        if not 0.0 < mass < 1.0:
            raise ValueError(f"typical_p must be between 0 and 1 (exclusive), got {mass!r}")
        _check_min_tokens(min_tokens_to_keep)
        self.mass = mass
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        log_probs = scores.log_softmax(dim=-1)
        entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)  # (batch, 1)
        distance = (-log_probs - entropy).abs()
        distance_sorted, order = torch.sort(distance, dim=-1)
        mass_so_far = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        # index of the last token needed to reach the mass
        last = (mass_so_far < self.mass).sum(dim=1).clamp(max=scores.shape[-1] - 1)  # (batch,)
        drop_sorted = distance_sorted > distance_sorted.gather(1, last[:, None])
        drop_sorted[:, : self.min_tokens_to_keep] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, self.filter_value)


class EpsilonLogitsWarper(LogitsProcessor):
    """Epsilon sampling (arXiv:2210.15191): drop tokens with probability below `epsilon`."""

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        epsilon = float(epsilon)
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon_cutoff must be between 0 and 1 (exclusive), got {epsilon!r}")
        _check_min_tokens(min_tokens_to_keep)
        self.epsilon = epsilon
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        drop = scores.softmax(dim=-1) < self.epsilon
        drop = _keep_top_tokens(scores, drop, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)


class EtaLogitsWarper(LogitsProcessor):
    """Eta sampling (arXiv:2210.15191): drop tokens with probability below min(eta, sqrt(eta) * exp(-entropy))."""

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        epsilon = float(epsilon)
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"eta_cutoff must be between 0 and 1 (exclusive), got {epsilon!r}")
        _check_min_tokens(min_tokens_to_keep)
        self.epsilon = epsilon
        # sqrt taken in float32, as the reference does; a host float, so no tensor is copied to the device per step
        self._sqrt_epsilon = torch.tensor(epsilon, dtype=torch.float32).sqrt().item()
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        log_probs = scores.log_softmax(dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs).nansum(dim=-1, keepdim=True)  # (batch, 1)
        eta = (self._sqrt_epsilon * torch.exp(-entropy)).clamp(max=self.epsilon)
        drop = _keep_top_tokens(scores, probs < eta, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)


# --- the list generate() uses ----------------------------------------------------------------------------------------


def build_logits_processors(
    generation_config: GenerationConfig,
    prompt_length: int,
    device: torch.device | str | None = None,
    attention_mask: torch.Tensor | None = None,
    prefix_allowed_tokens_fn=None,
) -> LogitsProcessorList:
    """The processors `generation_config` asks for, in transformers' order.

    prompt_length: tokens per row before generation (padding included). attention_mask: the prompt's (batch, seq)
    mask; with left padding it keeps the pad tokens out of the repetition penalty, as transformers does. device is
    accepted for symmetry with transformers; the processors follow the device of the scores they get.
    prefix_allowed_tokens_fn: generate()'s `fn(batch_id, input_ids) -> allowed token ids`, which adds a
    PrefixConstrainedLogitsProcessor (generation/prefix_constrained.py).
    """
    gc = generation_config
    eos = gc.eos_token_ids
    processors = LogitsProcessorList()
    if gc.repetition_penalty != 1.0:
        padding = None
        if attention_mask is not None:
            # index of each row's first real token == its left-padding length; stays a device tensor
            padding = (attention_mask != 0).int().argmax(dim=1)
        processors.append(RepetitionPenaltyLogitsProcessor(gc.repetition_penalty, prompt_ignore_length=padding))
    if gc.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
    if gc.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(gc.bad_words_ids, eos))
    min_length = gc.min_length_for(prompt_length)
    if eos and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos))
    if eos and gc.min_new_tokens is not None and gc.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, gc.min_new_tokens, eos))
    if prefix_allowed_tokens_fn is not None:
        # imported here: that module imports LogitsProcessor from this one
        from gpuformers.generation.prefix_constrained import PrefixConstrainedLogitsProcessor

        rows_per_prompt = max(gc.num_beams, gc.num_return_sequences)
        processors.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, rows_per_prompt))
    if gc.forced_bos_token_id is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(gc.forced_bos_token_id))
    if gc.forced_eos_token_id is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(gc.max_length_for(prompt_length), gc.forced_eos_token_id))
    if gc.remove_invalid_values:
        processors.append(InfNanRemoveLogitsProcessor())
    if gc.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(gc.suppress_tokens))
    if gc.begin_suppress_tokens is not None:
        # with a one-token prompt and a forced bos, the first free choice comes one step later
        begin = prompt_length if prompt_length > 1 or gc.forced_bos_token_id is None else prompt_length + 1
        processors.append(SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, begin))
    if gc.do_sample:
        # beam sampling keeps one token more than there are eos tokens, so every beam can continue
        keep = len(eos) + 1 if gc.num_beams > 1 and eos else 2 if gc.num_beams > 1 else 1
        if gc.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(gc.temperature))
        if gc.top_k != 0:
            processors.append(TopKLogitsWarper(gc.top_k, min_tokens_to_keep=keep))
        if gc.top_p < 1.0:
            processors.append(TopPLogitsWarper(gc.top_p, min_tokens_to_keep=keep))
        if gc.min_p is not None:
            processors.append(MinPLogitsWarper(gc.min_p, min_tokens_to_keep=keep))
        if gc.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(gc.typical_p, min_tokens_to_keep=keep))
        if 0.0 < gc.epsilon_cutoff < 1.0:
            processors.append(EpsilonLogitsWarper(gc.epsilon_cutoff, min_tokens_to_keep=keep))
        if 0.0 < gc.eta_cutoff < 1.0:
            processors.append(EtaLogitsWarper(gc.eta_cutoff, min_tokens_to_keep=keep))
    if gc.renormalize_logits:
        processors.append(LogitNormalization())
    return processors


def _as_list(token_ids: int | list[int] | torch.Tensor | None) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor):
        return token_ids.reshape(-1).tolist()
    return [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]


def _check_min_tokens(min_tokens_to_keep: int) -> None:
    if not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be a positive integer, got {min_tokens_to_keep!r}")
