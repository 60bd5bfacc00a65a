"""Transition scores: the score each generated token had when it was chosen, read back from generate()'s outputs.

The same numbers as transformers' `compute_transition_scores`. generate(return_dict_in_generate=True) keeps one
(rows, vocab) tensor per step (`scores`, processed, with output_scores=True; or `logits`, raw, with
output_logits=True); the token chosen at step t of output row r sits in `sequences[r, prompt + t]`, and its
scores in the row the step ran on: row r itself in greedy search and sampling, `beam_indices[r, t]` in beam
search (beams are reordered every step, so a returned sequence passes through different rows).

    scores[t]      (rows, vocab)        one per step
    beam_indices   (out_rows, steps)    row of scores[t] that produced token t; -1 once the sequence had ended
    result[r, t] = scores[t][beam_indices[r, t], sequences[r, prompt + t]], or 0 where beam_indices is -1

Beam search's `scores` are the log-probabilities it sums, so with length_penalty=0 a row's transition scores
(normalize_logits=False) add up to its `sequences_scores`.

Offers: compute_transition_scores(sequences, scores, beam_indices=None, normalize_logits=False), also reachable
as `model.compute_transition_scores(...)` (GenerationMixin).
"""

from __future__ import annotations

import torch


def compute_transition_scores(
    sequences: torch.Tensor,
    scores: tuple[torch.Tensor, ...] | list[torch.Tensor],
    beam_indices: torch.Tensor | None = None,
    normalize_logits: bool = False,
) -> torch.Tensor:
    """(out_rows, generated) scores of the generated tokens in `sequences` (out_rows, prompt + generated).

    scores: generate()'s `scores` or `logits`, one (rows, vocab) tensor per step. beam_indices: the output's
    `beam_indices`, needed after beam search (without it, output row r is taken to come from row r of every step,
    as in greedy search and sampling). normalize_logits: log_softmax each step's scores first, which turns raw
    logits or temperature-scaled scores into log-probabilities. Steps after a beam ended score 0.
    """
    if not scores:
        raise ValueError("scores is empty; pass generate()'s output.scores (output_scores=True) or output.logits "
                         "(output_logits=True) from a call with return_dict_in_generate=True")
    rows, steps = scores[0].shape[0], len(scores)
    if beam_indices is None:
        if sequences.shape[0] != rows:
            raise ValueError(
                f"sequences has {sequences.shape[0]} rows but each step of scores has {rows}; after beam search "
                f"pass beam_indices=output.beam_indices"
            )
        beam_indices = torch.arange(rows, device=sequences.device)[:, None].expand(rows, steps)
    elif beam_indices.shape[0] != sequences.shape[0]:
        raise ValueError(
            f"beam_indices has {beam_indices.shape[0]} rows but sequences has {sequences.shape[0]}; pass both from "
            f"the same generate() output"
        )
    ended = beam_indices < 0  # (out_rows, steps): the sequence had already ended at this step
    steps = int((~ended).sum(-1).max())  # the longest returned sequence's generated tokens
    if steps > len(scores) or steps > sequences.shape[1]:
        raise ValueError(
            f"beam_indices covers {steps} generated tokens but scores has {len(scores)} steps and sequences "
            f"{sequences.shape[1]} tokens; pass sequences, scores and beam_indices from the same generate() output"
        )
    ended = ended[:, :steps]
    source = beam_indices[:, :steps].masked_fill(ended, 0)
    # an ended row's slot holds padding, which may be -1 (no eos); any valid id does, its score is zeroed below
    tokens = sequences[:, sequences.shape[1] - steps:].masked_fill(ended, 0)
    stacked = torch.stack(list(scores[:steps]), dim=1)  # (rows, steps, vocab)
    if normalize_logits:
        stacked = stacked.log_softmax(dim=-1)
    device = stacked.device
    step = torch.arange(steps, device=device)[None, :]  # (1, steps)
    picked = stacked[source.to(device), step, tokens.to(device)]  # (out_rows, steps)
    return picked.masked_fill(ended.to(device), 0.0)
