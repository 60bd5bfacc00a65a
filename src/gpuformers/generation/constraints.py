"""Logits processors that follow the length and the position in the sequence: minimum lengths, forced bos / eos,
suppressed tokens, the exponential eos decay, inf/nan removal and the final renormalisation, with transformers' names
and numbers (generation/logits.py builds the list generate() applies and re-exports these). The minimum lengths
follow the min-tokens rule of generation/stop_rules.py and mask with generation/sampling_ops.py's
suppress_before_min_tokens, as the engine's min_new_tokens does; the suppressed tokens go through its ban_tokens.

Offers: MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, ForcedBOSTokenLogitsProcessor,
ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, ExponentialDecayLengthPenalty,
SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, LogitNormalization.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gpuformers.generation import sampling_ops
from gpuformers.generation.logits_processor import NEG_INF, LogitsProcessor, token_id_list, TokenMask
from gpuformers.generation.stop_rules import before_min_tokens


class MinLengthLogitsProcessor(LogitsProcessor):
    """Forbid eos while the sequence (prompt included) is shorter than `min_length`."""

    def __init__(self, min_length: int, eos_token_id: int | list[int] | torch.Tensor):
        if not isinstance(min_length, int) or min_length < 0:
            raise ValueError(f"min_length must be an integer >= 0, got {min_length!r}")
        self.min_length = min_length
        self.eos = TokenMask(eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if not before_min_tokens(input_ids.shape[-1], self.min_length):
            return scores
        return sampling_ops.suppress_before_min_tokens(scores, self.eos.mask(scores.shape[-1], scores.device))


class MinNewTokensLengthLogitsProcessor(LogitsProcessor):
    """Forbid eos until `min_new_tokens` tokens have been generated after a prompt of `prompt_length_to_skip`."""

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id: int | list[int] | torch.Tensor):
        if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")
        self.prompt_length_to_skip = prompt_length_to_skip
        self.min_new_tokens = min_new_tokens
        self.eos = TokenMask(eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if not before_min_tokens(input_ids.shape[-1] - self.prompt_length_to_skip, self.min_new_tokens):
            return scores
        return sampling_ops.suppress_before_min_tokens(scores, self.eos.mask(scores.shape[-1], scores.device))


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
        self.eos = TokenMask(eos_token_id)

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
        eos = token_id_list(eos_token_id)
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
        self.tokens = TokenMask(list(suppress_tokens))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return sampling_ops.ban_tokens(scores, self.tokens.mask(scores.shape[-1], scores.device))


class SuppressTokensAtBeginLogitsProcessor(LogitsProcessor):
    """Never produce the given tokens as the first generated token (when the sequence is `begin_index` long)."""

    def __init__(self, begin_suppress_tokens: Sequence[int], begin_index: int):
        self.tokens = TokenMask(list(begin_suppress_tokens))
        self.begin_index = begin_index

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.begin_index:
            return scores
        return sampling_ops.ban_tokens(scores, self.tokens.mask(scores.shape[-1], scores.device))


class LogitNormalization(LogitsProcessor):
    """Turn scores into log-probabilities (renormalize_logits=True); beam search relies on it after warpers."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.log_softmax(dim=-1)
