"""The logits-processor interface: the base class, the list that applies processors in order, and the helpers the
processors of generation/logits.py (penalties and constraints) and generation/warpers.py (sampling warpers) share.

A processor is a callable `(input_ids (batch, seq) LongTensor, scores (batch, vocab) float) -> scores`. It lives in
its own module so that logits.py can re-export the warpers while warpers.py subclasses LogitsProcessor, without the
two importing each other.

Offers: LogitsProcessor, LogitsProcessorList, NEG_INF, and for the processor modules TokenMask and token_id_list.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

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


class TokenMask:
    """A fixed set of token ids as a (vocab,) bool mask, built once per vocab size and device, so each step costs one
    `torch.where` instead of a `torch.isin`."""

    def __init__(self, token_ids: Sequence[int] | int | torch.Tensor):
        self.token_ids = token_id_list(token_ids)  # a tensor is read once, before decoding starts
        self._mask: torch.Tensor | None = None

    def mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.shape[0] != vocab_size or self._mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [t for t in self.token_ids if 0 <= t < vocab_size]  # ids past the lm head can never be produced
            mask[ids] = True
            self._mask = mask.to(device)
        return self._mask


def token_id_list(token_ids: int | Sequence[int] | torch.Tensor | None) -> list[int]:
    """Token ids given as an int, a sequence or a tensor, as a list of ints (empty for None)."""
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor):
        return token_ids.reshape(-1).tolist()
    return [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
