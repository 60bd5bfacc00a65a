"""The sampling operations, written once for generate() and the engine: temperature, top-k, top-p, min-p, the
repetition / frequency / presence penalties, and the masks (banned tokens, the allowed tokens of a constraint, the
tokens that would end a sequence before its minimum length) over (rows, vocab) scores, each with transformers'
numbers.

A parameter is either a Python number, the same for every row (what the logits processors of generation/warpers.py,
generation/penalties.py, generation/constraints.py and generation/prefix_constrained.py pass), or a tensor with one
value per row (what engine/sampler.py and engine/structured.py pass for a step's rows, each request with its own
settings). Either way the result equals transformers' processor bit for bit: a per-row tensor is rounded and combined
the way torch treats the Python number it stands for (see _divide and top_p_filter), so a request gets the same
tokens from the engine as from generate() for the same logits.

Everything runs on the device: no function reads a value back to the host (the engine's step must not wait on the
GPU); only shapes and host numbers choose a branch. When a sequence is finished (eos, stop sequences, lengths) is
generation/stop_rules.py's question; the masks here are how the scores keep to its min-tokens rule.

Offers: scale_by_temperature, top_k_filter, top_p_filter, min_p_filter, penalize_repetition,
repetition_penalty_rule, penalize_frequency_presence, ban_tokens, mask_to_allowed, suppress_before_min_tokens.
"""

from __future__ import annotations

import math

import torch

NEG_INF = -math.inf

PerRow = float | torch.Tensor  # a number for every row, or a (rows,) tensor with one value per row


def _column(param: PerRow, dtype: torch.dtype | None = None) -> PerRow:
    """A per-row (rows,) tensor as a (rows, 1) column that broadcasts over the vocabulary; a number unchanged."""
    if not isinstance(param, torch.Tensor):
        return param
    param = param.reshape(-1, 1)
    return param if dtype is None else param.to(dtype)


def _divide(values: torch.Tensor, divisor: PerRow) -> torch.Tensor:
    """values / divisor, with a tensor divisor giving what `values / number` gives for each of its numbers. torch
    does not divide by a host number everywhere: on CUDA (and for float16 / bfloat16 on the CPU) it multiplies by
    the number's reciprocal, rounded to the op's compute precision, which can differ from a true division in the
    last bit; a greedy near-tie would then pick another token than generate()'s. divisor: a number or a tensor
    that broadcasts against values (already float of the right precision: the numbers as the user gave them)."""
    if not isinstance(divisor, torch.Tensor):
        return values / divisor
    reduced = values.dtype in (torch.float16, torch.bfloat16)
    if values.is_cuda or reduced:
        compute = torch.float32 if reduced else values.dtype  # torch's "opmath" type for the dtype
        inverse = divisor.to(compute).reciprocal()
        return (values.to(compute) * inverse).to(values.dtype)
    return values / divisor.to(values.dtype)


def scale_by_temperature(scores: torch.Tensor, temperature: PerRow) -> torch.Tensor:
    """scores (rows, vocab) / temperature (a number > 0, or (rows,) float32): transformers' TemperatureLogitsWarper."""
    return _divide(scores, _column(temperature))


def top_k_filter(scores: torch.Tensor, top_k: int | torch.Tensor, min_tokens_to_keep: int = 1,
                 filter_value: float = NEG_INF, max_top_k: int | None = None) -> torch.Tensor:
    """scores (rows, vocab) with every token below the k-th highest score of its row set to filter_value (ties
    with the k-th stay): transformers' TopKLogitsWarper, k = max(top_k, min_tokens_to_keep) capped at the vocab.

    top_k: an int >= 1, or (rows,) int64 with each row's k >= 1. max_top_k: with a tensor, a host bound on its
    values (the engine knows it from the requests' settings), so that one topk to that bound finds every row's
    k-th score instead of a full sort of the vocabulary."""
    vocab_size = scores.shape[-1]
    if not isinstance(top_k, torch.Tensor):
        k = min(max(top_k, min_tokens_to_keep), vocab_size)
        kth = torch.topk(scores, k).values[..., -1:]  # (rows, 1)
    else:
        bound = vocab_size if max_top_k is None else min(max(max_top_k, min_tokens_to_keep), vocab_size)
        k = top_k.clamp(min=min_tokens_to_keep, max=bound).reshape(-1, 1)  # (rows, 1)
        # the k-th largest value is the same number whichever way it is found: the same cut as topk(k)
        kth = torch.topk(scores, bound).values.gather(1, k - 1)
    return scores.masked_fill(scores < kth, filter_value)


def top_p_filter(scores: torch.Tensor, top_p: PerRow, min_tokens_to_keep: int = 1,
                 filter_value: float = NEG_INF) -> torch.Tensor:
    """Nucleus filtering, transformers' TopPLogitsWarper exactly: scores (rows, vocab) sorted ascending, and a token
    removed while the probability mass up to and including it is <= 1 - top_p; a row's min_tokens_to_keep most
    likely tokens always stay.

    top_p: a number in [0, 1], or (rows,) float64. The threshold is 1 - top_p computed in double and compared in the
    scores' dtype, as torch compares with transformers' Python number (a float32 top_p would round first: 1 - 0.9 in
    float32 is not the float32 of 0.1). Tied scores are ordered by torch.sort's own (unstable) order, the one
    transformers sees on the same device: which of two tied tokens at the cut stays is that order's choice."""
    ascending, order = torch.sort(scores, descending=False)  # (rows, vocab), most likely last
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    if isinstance(top_p, torch.Tensor):
        threshold = (1.0 - top_p.to(torch.float64)).to(tail_mass.dtype).reshape(-1, 1)  # (rows, 1)
    else:
        threshold = 1.0 - top_p
    drop_sorted = tail_mass <= threshold
    drop_sorted[..., -min_tokens_to_keep:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, filter_value)


def min_p_filter(scores: torch.Tensor, min_p: PerRow, min_tokens_to_keep: int = 1,
                 filter_value: float = NEG_INF) -> torch.Tensor:
    """scores (rows, vocab) with every token whose probability is below min_p times its row's top probability set
    to filter_value, a row's min_tokens_to_keep most likely tokens kept: transformers' MinPLogitsWarper.
    min_p: a number in [0, 1], or (rows,) float32 (0 leaves a row as it is)."""
    probs = scores.softmax(dim=-1)
    drop = probs < _column(min_p, probs.dtype) * probs.amax(dim=-1, keepdim=True)
    if min_tokens_to_keep > 1:
        # with one token to keep this changes nothing: the top token is never below min_p (<= 1) times itself
        k = min(min_tokens_to_keep, probs.shape[-1])
        drop = drop.scatter(-1, torch.topk(probs, k, dim=-1).indices, False)
    return scores.masked_fill(drop, filter_value)


def repetition_penalty_rule(values: torch.Tensor, penalty: PerRow) -> torch.Tensor:
    """The CTRL penalty (arXiv:1909.05858) on the scores of tokens already seen: a negative score is multiplied by
    penalty, any other divided by it (transformers' RepetitionPenaltyLogitsProcessor). penalty: a number, or a
    float32 tensor that broadcasts against values."""
    return torch.where(values < 0, values * penalty, _divide(values, penalty))


def penalize_repetition(scores: torch.Tensor, seen: torch.Tensor, penalty: PerRow) -> torch.Tensor:
    """scores (rows, vocab) with repetition_penalty_rule applied where seen (rows, vocab) bool is True. penalty: a
    number or (rows,) float32."""
    return torch.where(seen, repetition_penalty_rule(scores, _column(penalty)), scores)


def penalize_frequency_presence(scores: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                                presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties (vLLM's numbers; transformers has none): score - frequency * count - presence * (count > 0).
    counts: how often each token occurs in the output, broadcastable against scores, int or float (exact below
    2**24); frequency, presence: broadcastable float32 ((rows, 1) for a row each)."""
    count = counts.float()
    return scores - frequency * count - presence * (count > 0)


def ban_tokens(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """scores (rows, vocab) with the banned tokens at -inf, out of place (a caller may keep the raw scores, or they
    may be a CUDA graph's output buffer). banned: bool, (vocab,) the same tokens for every row, or (rows, vocab) each
    row's own: transformers' SuppressTokens, NoBadWords and NoRepeatNGram processors all end this way."""
    return scores.masked_fill(banned, NEG_INF)


def mask_to_allowed(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """scores (rows, vocab) with every token that `allowed` (rows, vocab) bool does not allow at -inf, out of place:
    constrained decoding, for generate()'s prefix_allowed_tokens_fn (PrefixConstrainedLogitsProcessor) and the
    engine's structured-output grammars (structured.mask_logits) alike. What a row whose allowed tokens are all
    -inf gets instead is the caller's rule (transformers' processor gives the constraint alone)."""
    return ban_tokens(scores, ~allowed)


def suppress_before_min_tokens(scores: torch.Tensor, ending: torch.Tensor,
                               too_short: bool | torch.Tensor = True) -> torch.Tensor:
    """The min-tokens rule on the scores: scores (rows, vocab) with the tokens that would end a sequence at -inf in
    the rows still short of their minimum length, so that none of them can be chosen yet (transformers'
    MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor; the engine's min_new_tokens, which also holds
    back one-token stop sequences: stop_rules.StopRules.ending_tokens).

    ending: bool, (vocab,) the same tokens for every row, or (rows, vocab) each row's own (the engine sets only the
    rows that are short). too_short: a host bool for every row (generate(): the rows share their length; see
    stop_rules.before_min_tokens), or (rows,) bool, one per row."""
    if isinstance(too_short, torch.Tensor):
        return ban_tokens(scores, ending & too_short.reshape(-1, 1))
    return ban_tokens(scores, ending) if too_short else scores
