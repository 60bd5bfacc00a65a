"""When a sequence is finished, and why: the stop rules, written once for generate() (its stopping criteria,
generation/stopping.py, and its min-length processors, generation/constraints.py) and for the engine (the finish
check of engine/sequence.py, the min_new_tokens mask of engine/sampler.py).

After each new token a sequence is finished by the first rule that holds; the engine records which (FinishReason):

    EOS            the newest token is one of the eos tokens (an engine request with ignore_eos has none)
    STOP_SEQUENCE  the new tokens end with one of the stop token sequences (the engine's SamplingParams.stop), once
                   there are at least min_new_tokens of them
    LENGTH         the sequence holds max_length tokens, prompt included (generate()), or max_new_tokens new ones
                   (the engine); one limit, as both take it from GenerationConfig.max_length_for
    GRAMMAR        the request's structured-output grammar is complete (the engine only: engine/structured.py)

generate() also stops on stop strings, matched on the text's bytes inside the device loop (stopping.py's
StopStringCriteria); the engine has no text (its server cuts stop strings from the decoded text).

Before the minimum length (before_min_tokens), the tokens that would end a sequence by themselves (eos, and the
engine's one-token stop sequences: StopRules.ending_tokens) score -inf (sampling_ops.suppress_before_min_tokens), so
neither EOS nor a one-token STOP_SEQUENCE can come early.

The two callers hold their tokens differently, so a rule that reads tokens has one form per holder, side by side
here: generate() holds every row in one (rows, seq) tensor on the device and must not wait for it, so
newest_token_in is a batched tensor op giving a (rows,) bool; the engine holds each sequence's tokens in host lists
(its scheduler moves lists, never tensors), so StopRules.finish_reason reads a list. The length rules are host
facts in both (reached_length, before_min_tokens). tests/test_sampling_rules_both_paths.py runs each rule through
generate() and through the engine.

Offers: FinishReason, StopRules, reached_length, before_min_tokens, newest_token_in.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch


class FinishReason(str, enum.Enum):
    """Which stop rule ended a sequence."""

    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    LENGTH = "length"
    GRAMMAR = "grammar"


def reached_length(length: int, max_length: int) -> bool:
    """The length rule: a sequence of `length` tokens is done at `max_length` (both counted the same way: with the
    prompt in generate(), new tokens only in the engine)."""
    return length >= max_length


def before_min_tokens(length: int, min_length: int) -> bool:
    """The min-tokens rule: a sequence of `length` tokens may not end yet while it is shorter than `min_length`
    (counted as reached_length counts)."""
    return length < min_length


def newest_token_in(input_ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The eos rule for a batch on the device: input_ids (rows, seq), token_ids (n,) on the same device -> (rows,)
    bool, True where the row's newest token is one of token_ids."""
    return (input_ids[:, -1:] == token_ids).any(dim=-1)  # (rows, 1) == (n,) -> (rows, n)


class StopRules:
    """The stop rules of one request, asked on the host after each of its new tokens (the engine's finish check).

    max_new_tokens: the length limit (new tokens). eos_token_ids: the tokens that end it (empty: eos is ignored).
    stop_sequences: token-id sequences that end it once its new tokens end with one. min_new_tokens: before this many
    new tokens no stop sequence ends it, and its ending_tokens are held back from sampling."""

    __slots__ = ("max_new_tokens", "eos_token_ids", "stop_sequences", "min_new_tokens", "ending_tokens")

    def __init__(self, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
                 stop_sequences: Sequence[Sequence[int]] = (), min_new_tokens: int = 0):
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_sequences = [list(s) for s in stop_sequences]  # lists: compared with slices of the token list
        self.min_new_tokens = min_new_tokens
        # the tokens that end the request by themselves: what min_new_tokens holds back
        self.ending_tokens = tuple(self.eos_token_ids) + tuple(s[0] for s in self.stop_sequences if len(s) == 1)

    def suppresses_endings(self, num_new_tokens: int) -> bool:
        """Whether the next token, after `num_new_tokens` new ones, must not be one of the ending_tokens."""
        return before_min_tokens(num_new_tokens, self.min_new_tokens) and bool(self.ending_tokens)

    def finish_reason(self, new_tokens: list[int]) -> FinishReason | None:
        """Why the request is finished after its newest token new_tokens[-1] (new_tokens: every token generated so
        far, a host list), or None while it goes on."""
        if new_tokens[-1] in self.eos_token_ids:
            return FinishReason.EOS
        if self.stop_sequences and not before_min_tokens(len(new_tokens), self.min_new_tokens) and any(
                new_tokens[-len(s):] == s for s in self.stop_sequences):
            return FinishReason.STOP_SEQUENCE
        if reached_length(len(new_tokens), self.max_new_tokens):
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"StopRules(max_new_tokens={self.max_new_tokens}, eos_token_ids={self.eos_token_ids}, "
                f"stop_sequences={self.stop_sequences}, min_new_tokens={self.min_new_tokens})")
