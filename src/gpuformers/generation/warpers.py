"""Sampling warpers: the logits processors generate() applies only with do_sample=True, after the penalties and
constraints of generation/logits.py, in transformers' order:

    temperature -> top_h -> top_k -> top_p -> min_p -> typical_p -> epsilon -> eta

Each has the name and behaviour of the transformers class of the same name, so the warped scores match
transformers' on the same input. Temperature, top-k, top-p and min-p are thin wrappers over the batched functions
of generation/sampling_ops.py, which the engine's sampler calls too (one implementation for both). A removed token
gets `filter_value` (-inf); every choice that depends on data stays on the device (sort, topk, scatter, masks), so
no warper waits on the GPU. generation/logits.py re-exports them all and builds the list (build_logits_processors).

Offers: TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper.
"""

from __future__ import annotations

import torch

from gpuformers.generation import sampling_ops
from gpuformers.generation.logits_processor import NEG_INF, LogitsProcessor


class TemperatureLogitsWarper(LogitsProcessor):
    """Divide the scores by `temperature`: below 1 sharpens the distribution, above 1 flattens it."""

    def __init__(self, temperature: float):
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}; "
                             f"for deterministic output use do_sample=False")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return sampling_ops.scale_by_temperature(scores, self.temperature)


class TopHLogitsWarper(LogitsProcessor):
    """Top-H sampling (arXiv:2509.02510): keep the most likely tokens while the entropy they contribute stays within
    `top_h` times the entropy of the distribution.

    Only the `top_n` (100) most likely tokens take part: their probabilities p are renormalised over those 100,
    tokens are added from the most likely down while the running sum of -p log p is <= top_h * H(p), and the most
    likely token is always kept. Tokens outside the 100 are removed. There is no min_tokens_to_keep (transformers
    has none either).
    """

    top_n = 100  # transformers' cap on the candidates, which bounds the sort

    def __init__(self, top_h: float, filter_value: float = NEG_INF):
        if not isinstance(top_h, (int, float)) or isinstance(top_h, bool) or not 0.0 < top_h <= 1.0:
            raise ValueError(f"top_h must be a number in (0, 1], got {top_h!r}; typical values are 0.3-0.6")
        self.top_h = float(top_h)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        n = min(self.top_n, scores.shape[-1])
        top, order = torch.topk(scores, n, dim=-1)  # (batch, n), most likely first
        log_probs = top - top.logsumexp(dim=-1, keepdim=True)
        probs = log_probs.softmax(dim=-1)
        # H(p) with -inf log-probs clamped, so that a token of probability 0 adds 0 (not nan)
        entropy = -(log_probs.clamp(min=torch.finfo(log_probs.dtype).min) * probs).sum(-1, keepdim=True)  # (batch, 1)
        # a p that underflows to 0 gives nan here, which keeps it and every less likely token out
        running_entropy = (-probs * probs.log()).cumsum(dim=-1)
        keep_top = running_entropy <= entropy * self.top_h
        keep_top[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(1, order, keep_top)
        return scores.masked_fill(~keep, self.filter_value)


class TopKLogitsWarper(LogitsProcessor):
    """Keep the `top_k` highest-scoring tokens (ties with the k-th included), remove the rest."""

    def __init__(self, top_k: int, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}; generate() treats 0 as 'off'")
        self.top_k = max(top_k, min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return sampling_ops.top_k_filter(scores, self.top_k, filter_value=self.filter_value)


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
        return sampling_ops.top_p_filter(scores, self.top_p, self.min_tokens_to_keep, self.filter_value)


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
        return sampling_ops.min_p_filter(scores, self.min_p, self.min_tokens_to_keep, self.filter_value)


class TypicalLogitsWarper(LogitsProcessor):
    """Locally typical sampling (arXiv:2202.00666): rank tokens by how far their surprisal is from the
    distribution's entropy, keep the closest ones until their mass reaches `mass`."""

    def __init__(self, mass: float = 0.9, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        self.mass = _check_open_unit_interval("typical_p", mass)
        _check_min_tokens(min_tokens_to_keep)
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
        self.epsilon = _check_open_unit_interval("epsilon_cutoff", epsilon)
        _check_min_tokens(min_tokens_to_keep)
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        drop = scores.softmax(dim=-1) < self.epsilon
        drop = _keep_top_tokens(scores, drop, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)


class EtaLogitsWarper(LogitsProcessor):
    """Eta sampling (arXiv:2210.15191): drop tokens with probability below min(eta, sqrt(eta) * exp(-entropy))."""

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        self.epsilon = _check_open_unit_interval("eta_cutoff", epsilon)
        _check_min_tokens(min_tokens_to_keep)
        # sqrt taken in float32, as the reference does; a host float, so no tensor is copied to the device per step
        self._sqrt_epsilon = torch.tensor(self.epsilon, dtype=torch.float32).sqrt().item()
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        log_probs = scores.log_softmax(dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs).nansum(dim=-1, keepdim=True)  # (batch, 1)
        eta = (self._sqrt_epsilon * torch.exp(-entropy)).clamp(max=self.epsilon)
        drop = _keep_top_tokens(scores, probs < eta, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)


def _keep_top_tokens(scores: torch.Tensor, remove: torch.Tensor, min_tokens_to_keep: int) -> torch.Tensor:
    """Clear `remove` for each row's `min_tokens_to_keep` highest scores. remove: (batch, vocab) bool."""
    k = min(min_tokens_to_keep, scores.shape[-1])
    kth_best = torch.topk(scores, k).values[..., -1:]  # (batch, 1)
    return remove & (scores < kth_best)


def _check_open_unit_interval(name: str, value: float) -> float:
    """`value` as a float, checked to lie strictly between 0 and 1 (`name`: the generation config field)."""
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be between 0 and 1 (exclusive), got {value!r}")
    return value


def _check_min_tokens(min_tokens_to_keep: int) -> None:
    if not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be a positive integer, got {min_tokens_to_keep!r}")
