"""Prefix-constrained decoding: `generate(prefix_allowed_tokens_fn=fn)` lets only the tokens `fn` names be chosen.

`fn(batch_id, input_ids)` gets the index of the prompt a row belongs to and that row's tokens so far (seq,), and
returns the token ids allowed next (constrained decoding as in arXiv:2010.00904, e.g. forcing a whole entity once its
first token appears). It is a Python function called once per row and step, so the constraint is built on the host
and sent to the device as one (rows, vocab) mask per step, applied by generation/sampling_ops.py's mask_to_allowed:
the masking the engine's structured-output grammars use too (engine/structured.py).

Offers: PrefixConstrainedLogitsProcessor (transformers' class of the same name; build_logits_processors in
generation/logits.py adds it when generate() gets prefix_allowed_tokens_fn).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from gpuformers.generation import sampling_ops
from gpuformers.generation.logits import LogitsProcessor

PrefixAllowedTokensFn = Callable[[int, torch.Tensor], "Sequence[int] | torch.Tensor"]


class PrefixConstrainedLogitsProcessor(LogitsProcessor):
    """Set the score of every token that `prefix_allowed_tokens_fn(batch_id, row_ids)` does not allow to -inf.

    num_beams: rows per prompt (num_beams, or num_return_sequences when sampling several per prompt); row i belongs
    to prompt i // num_beams. When no row of a prompt has an allowed token with a finite score (e.g. another
    processor banned them all), the prompt's rows get 0 on the allowed tokens, so the constraint still holds.
    """

    def __init__(self, prefix_allowed_tokens_fn: PrefixAllowedTokensFn, num_beams: int):
        if not callable(prefix_allowed_tokens_fn):
            raise TypeError(f"prefix_allowed_tokens_fn must be a function (batch_id, input_ids) -> allowed token ids, "
                            f"got {type(prefix_allowed_tokens_fn).__name__}")
        if not isinstance(num_beams, int) or num_beams < 1:
            raise ValueError(f"num_beams must be a positive integer (rows per prompt), got {num_beams!r}")
        self.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
        self.num_beams = num_beams

    def allowed_mask(self, input_ids: torch.LongTensor, vocab_size: int) -> torch.Tensor:
        """(rows, vocab) bool on the host: True where fn allows the token."""
        rows = input_ids.shape[0]
        if rows % self.num_beams:
            raise ValueError(f"input_ids has {rows} rows, not a multiple of num_beams={self.num_beams} "
                             f"(rows per prompt)")
        allowed = torch.zeros(rows, vocab_size, dtype=torch.bool)
        for row in range(rows):
            batch_id = row // self.num_beams
            tokens = self.prefix_allowed_tokens_fn(batch_id, input_ids[row])
            ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
            if ids.numel() == 0:
                raise ValueError(f"prefix_allowed_tokens_fn returned no tokens for batch_id {batch_id}, so no token "
                                 f"can follow {input_ids[row].tolist()}; return at least one id, e.g. an eos token")
            if bool((ids < 0).any() or (ids >= vocab_size).any()):
                raise ValueError(f"prefix_allowed_tokens_fn returned token ids outside 0..{vocab_size - 1} for "
                                 f"batch_id {batch_id}: {ids[(ids < 0) | (ids >= vocab_size)].tolist()}")
            allowed[row, ids] = True
        return allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed_mask(input_ids, scores.shape[-1]).to(scores.device)
        constrained = sampling_ops.mask_to_allowed(scores, allowed)
        forced = sampling_ops.mask_to_allowed(torch.zeros_like(scores), allowed)  # the constraint alone
        # (prompts, 1): no row of the prompt has a finite allowed score left
        stuck = constrained.amax(dim=-1).isneginf().view(-1, self.num_beams).all(dim=-1, keepdim=True)
        return torch.where(stuck.repeat_interleave(self.num_beams, dim=0), forced, constrained)
