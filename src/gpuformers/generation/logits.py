"""Logits processors: the penalties and constraints between the model's next-token logits and the choice of a
token, and the list generate() applies.

Each processor is a callable `(input_ids (batch, seq) LongTensor, scores (batch, vocab) float) -> scores` with the
name and behaviour of the transformers class of the same name, so processed scores match transformers' on the same
input. Every decision that depends on data stays on the device (masks, `torch.where`, scatter); only shapes, which
the host already knows, choose a branch, so no processor waits on the GPU.

`build_logits_processors(generation_config, prompt_length)` builds the list generate() applies, in transformers'
order: penalties and constraints first (sequence_bias first of all), then (only with do_sample=True) the sampling
warpers of generation/warpers.py, temperature -> top_h -> top_k -> top_p -> min_p -> typical_p -> epsilon -> eta,
then renormalisation. The base classes live in generation/logits_processor.py; both they and the warpers are
re-exported here, so every processor can be imported from this module.

PrefixConstrainedLogitsProcessor (generate(prefix_allowed_tokens_fn=...)) lives in generation/prefix_constrained.py;
it calls the user's Python function per row, so it is the one processor that waits for the device.

Offers: LogitsProcessor, LogitsProcessorList, build_logits_processors, and the processors:
SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor,
NoBadWordsLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, ForcedBOSTokenLogitsProcessor,
ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, ExponentialDecayLengthPenalty,
SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, LogitNormalization; and, from warpers.py,
TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
EpsilonLogitsWarper, EtaLogitsWarper.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gpuformers.generation.config import GenerationConfig, sequence_bias_as_dict
# re-exported: the base classes and the warpers have always been importable from this module
from gpuformers.generation.logits_processor import (  # noqa: F401
    NEG_INF,
    LogitsProcessor,
    LogitsProcessorList,
    _as_list,
    _TokenMask,
)
from gpuformers.generation.warpers import (  # noqa: F401
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

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


class SequenceBiasLogitsProcessor(LogitsProcessor):
    """Add a bias to the score of a sequence's last token wherever the next token would complete the sequence: a
    one-token sequence is biased in every row, a longer one in the rows that end with the rest of it. Biases of
    sequences that end in the same token add up.

    sequence_bias: transformers' list of [token ids, bias] pairs, `[[[10, 45], -2.0], [[64], 7.5]]`, or its dict
    form `{(10, 45): -2.0, (64,): 7.5}`. A token id the scores have no column for raises ValueError on the first
    call, as in transformers (the vocabulary size is only known then).
    """

    def __init__(self, sequence_bias: list | dict):
        self.sequence_bias = sequence_bias_as_dict(sequence_bias)
        self._single = {ids[0]: bias for ids, bias in self.sequence_bias.items() if len(ids) == 1}
        by_prefix_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, bias in self.sequence_bias.items():
            if len(ids) > 1:
                by_prefix_length.setdefault(len(ids) - 1, []).append((ids, bias))
        # per prefix length: (prefixes (k, prefix_len), last tokens (k,), biases (k,)), moved on first use
        self._groups = [
            (torch.tensor([ids[:-1] for ids, _ in group]), torch.tensor([ids[-1] for ids, _ in group]),
             torch.tensor([bias for _, bias in group], dtype=torch.float32))
            for group in by_prefix_length.values()
        ]
        self._single_bias: torch.Tensor | None = None  # (vocab,) float32, built on the first call
        self._built_for: tuple[int, torch.device] | None = None  # (vocab size, device) of _single_bias

    def _prepare(self, vocab_size: int, device: torch.device) -> None:
        too_large = sorted({t for ids in self.sequence_bias for t in ids if t >= vocab_size})
        if too_large:
            raise ValueError(f"sequence_bias biases token ids {too_large}, but the scores have {vocab_size} columns "
                             f"(ids 0-{vocab_size - 1}); drop those entries")
        single_bias = torch.zeros(vocab_size, dtype=torch.float32)
        single_bias[list(self._single)] = torch.tensor(list(self._single.values()), dtype=torch.float32)
        self._single_bias = single_bias.to(device)
        self._groups = [tuple(t.to(device) for t in group) for group in self._groups]
        self._built_for = (vocab_size, device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        batch, vocab_size = scores.shape
        if self._built_for != (vocab_size, scores.device):
            self._prepare(vocab_size, scores.device)
        bias = self._single_bias.to(scores.dtype).expand(batch, vocab_size)
        for prefixes, last, biases in self._groups:
            k = prefixes.shape[1]
            if k > input_ids.shape[1]:
                continue
            ends_with = (input_ids[:, None, -k:] == prefixes[None]).all(-1)  # (batch, entries)
            bias = bias.index_add(1, last, torch.where(ends_with, biases, 0.0).to(scores.dtype))
        return scores + bias


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


class ExponentialDecayLengthPenalty(LogitsProcessor):
    """Make eos more and more likely once `start_index` tokens have been generated, so that generation tends to end
    soon after, without a hard cut: at length prompt + start_index + i (i >= 1), each finite eos score s becomes
    s + |s| * (decay_factor ** i - 1); |s| makes a negative score rise too.

    exponential_decay_length_penalty: (start_index, decay_factor). input_ids_seq_length: the prompt length.
    """

    def __init__(self, exponential_decay_length_penalty: tuple[int, float],
                 eos_token_id: int | list[int] | torch.Tensor, input_ids_seq_length: int):
        pair = exponential_decay_length_penalty
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                and isinstance(pair[1], (int, float))):
            raise ValueError(f"exponential_decay_length_penalty must be a pair (start_index, decay_factor), e.g. "
                             f"(15, 1.6), got {pair!r}")
        eos = _as_list(eos_token_id)
        if not eos or any(t < 0 for t in eos):
            raise ValueError(f"exponential_decay_length_penalty raises the eos scores, so it needs eos token ids >= 0, "
                             f"got {eos_token_id!r}; set eos_token_id")
        self.regulation_start = pair[0] + input_ids_seq_length
        self.regulation_factor = float(pair[1])
        self.eos_token_ids = list(dict.fromkeys(eos))  # a repeated id is raised once
        self._eos: torch.Tensor | None = None  # the ids below the vocab size, on the scores' device
        self._eos_built_for: tuple[int, torch.device] | None = None  # (vocab size, device) of _eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        steps_past_start = input_ids.shape[-1] - self.regulation_start
        if steps_past_start <= 0:
            return scores
        vocab_size = scores.shape[-1]
        if self._eos_built_for != (vocab_size, scores.device):
            # ids past the lm head can never be produced
            ids = [t for t in self.eos_token_ids if t < vocab_size]
            self._eos = torch.tensor(ids, dtype=torch.long, device=scores.device)
            self._eos_built_for = (vocab_size, scores.device)
        eos_scores = scores[:, self._eos]  # (batch, n_eos)
        rise = eos_scores.abs() * (self.regulation_factor ** steps_past_start - 1)
        rise = rise.masked_fill(~torch.isfinite(eos_scores), 0.0)
        return scores.index_add(1, self._eos, rise)


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
    if gc.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(gc.sequence_bias))
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
    if gc.exponential_decay_length_penalty is not None:
        if not eos:
            raise ValueError(f"generation config field exponential_decay_length_penalty="
                             f"{gc.exponential_decay_length_penalty!r} raises the eos scores, but there is no "
                             f"eos_token_id; set one or drop the penalty")
        processors.append(ExponentialDecayLengthPenalty(gc.exponential_decay_length_penalty, eos, prompt_length))
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
        if gc.top_h is not None:
            processors.append(TopHLogitsWarper(gc.top_h))
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
