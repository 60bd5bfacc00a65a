"""Logits processors that penalise or bias tokens by what the sequence already holds: the repetition penalty, the
n-gram ban, bad words and sequence_bias, with transformers' names and numbers (generation/logits.py builds the list
generate() applies and re-exports these). The repetition penalty and the bans are generation/sampling_ops.py's
repetition_penalty_rule and ban_tokens, the functions the engine's sampler calls too.

Offers: RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
SequenceBiasLogitsProcessor.
"""

from __future__ import annotations

import torch

from gpuformers.generation.config import sequence_bias_as_dict
from gpuformers.generation.logits_processor import LogitsProcessor, token_id_list, TokenMask
from gpuformers.generation.sampling_ops import ban_tokens, repetition_penalty_rule


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
        # only the seen tokens' scores, through the rule the engine's penalties use too (generation/sampling_ops.py)
        penalised = repetition_penalty_rule(padded.gather(1, ids), self.penalty)
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
        return ban_tokens(scores, banned[:, :vocab_size])


class NoBadWordsLogitsProcessor(LogitsProcessor):
    """Never produce the token sequences in `bad_words_ids`. A one-token entry is banned everywhere; for a longer
    one, its last token is banned in rows whose sequence ends with the rest of it. An entry that is just an eos
    token is dropped, as in transformers (stopping must stay possible). A token id the scores have no column for
    raises ValueError on the first call, as in transformers (the vocabulary size is only known then)."""

    def __init__(self, bad_words_ids: list[list[int]], eos_token_id: int | list[int] | None = None):
        if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids or not all(
            isinstance(seq, (list, tuple)) and seq for seq in bad_words_ids
        ):
            raise ValueError(f"bad_words_ids must be a non-empty list of non-empty lists of token ids, "
                             f"got {bad_words_ids!r}")
        eos = set(token_id_list(eos_token_id))
        sequences = [list(seq) for seq in bad_words_ids if not (len(seq) == 1 and seq[0] in eos)]
        self._ids = sorted({t for seq in sequences for t in seq})
        self.single = TokenMask([seq[0] for seq in sequences if len(seq) == 1])
        # longer entries grouped by prefix length: (prefixes (k, prefix_len), last tokens (k,)), moved on first use
        by_length: dict[int, list[list[int]]] = {}
        for seq in sequences:
            if len(seq) > 1:
                by_length.setdefault(len(seq) - 1, []).append(seq)
        self._groups = [(torch.tensor([s[:-1] for s in group]), torch.tensor([s[-1] for s in group]))
                        for group in by_length.values()]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        batch, vocab_size = scores.shape
        if self._ids and self._ids[-1] >= vocab_size:
            _refuse_ids_past_the_scores("bad_words_ids bans", self._ids, vocab_size)
        banned = self.single.mask(vocab_size, scores.device).expand(batch, vocab_size)
        if self._groups:
            banned = torch.cat([banned, banned.new_zeros(batch, 1)], dim=1)  # spare column: rows without a match
            if self._groups[0][0].device != scores.device:
                self._groups = [(p.to(scores.device), t.to(scores.device)) for p, t in self._groups]
            for prefixes, last in self._groups:
                k = prefixes.shape[1]
                if k > input_ids.shape[1]:
                    continue
                ends_with = (input_ids[:, None, -k:] == prefixes[None]).all(-1)  # (batch, entries)
                targets = torch.where(ends_with, last[None, :], vocab_size)
                banned = banned.scatter(1, targets, True)
            banned = banned[:, :vocab_size]
        return ban_tokens(scores, banned)


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
        _refuse_ids_past_the_scores("sequence_bias biases", (t for ids in self.sequence_bias for t in ids), vocab_size)
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


def _refuse_ids_past_the_scores(what: str, token_ids, vocab_size: int) -> None:
    """ValueError naming the token ids that the scores have no column for, as transformers refuses them."""
    too_large = sorted({t for t in token_ids if t >= vocab_size})
    if too_large:
        raise ValueError(f"{what} token ids {too_large}, but the scores have {vocab_size} columns "
                         f"(ids 0-{vocab_size - 1}); drop those entries")
