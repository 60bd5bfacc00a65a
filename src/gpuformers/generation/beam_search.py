"""Beam search for `model.generate(num_beams>1)`: the same candidates, length penalty and scores as transformers'.

It runs on the prompt, step inputs and KV cache that generation/generate.py prepares.

    per prompt, each step: (beams, vocab) log-probs + beam scores -> top `keep` candidates -> those that end join
    the `beams` best finished sequences, the best `beams` that do not end keep running -> cache reordered to them

Everything is a tensor of shape (batch, beams, ...) and stays on the device; the one host question, "is every prompt
done?", is asked every step.

Offers: `beam_search(model, input_ids, step_inputs, forward, config, processors, criteria, batch)`, called by
GenerationMixin.generate; `GenerateBeamDecoderOnlyOutput`, what it returns with return_dict_in_generate=True.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpuformers.generation.cache import Cache
from gpuformers.outputs import ModelOutput

if TYPE_CHECKING:
    from gpuformers.generation.step_inputs import StepInputs

# Beam search marks impossible candidates with this score (transformers' value, kept for equal scores).
_NEG = -1.0e9


@dataclass
class GenerateBeamDecoderOnlyOutput(ModelOutput):
    """generate(..., num_beams>1, return_dict_in_generate=True)."""

    sequences: torch.LongTensor | None = None  # (batch * num_return_sequences, length)
    sequences_scores: torch.Tensor | None = None  # (batch * num_return_sequences,) length-penalised log-probs
    scores: tuple[torch.Tensor, ...] | None = None  # processed log-probs, one (batch * num_beams, vocab) per step
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.LongTensor | None = None  # (batch * num_return_sequences, new tokens): source row per step
    past_key_values: Cache | None = None

    @property
    def cache(self) -> Cache | None:
        return self.past_key_values


def beam_search(model, input_ids, step_inputs: StepInputs, forward, config, processors, criteria, batch):
    """Beam search as transformers' (same candidates, length penalty, early stopping and scores).

    Each step keeps `keep` = max(2, 1 + #eos) * beams candidates per prompt so that beams survive when the
    best candidates end; candidates that end go to a per-prompt list of the best `beams` finished sequences,
    scored by sum of log-probs / new_length ** length_penalty.
    """
    from gpuformers.generation.generate import step_logits  # (generate.py imports this module)

    beams, max_length = config.num_beams, config.max_length
    rows, prompt_length = input_ids.shape
    device = input_ids.device
    length_penalty, early_stopping = config.length_penalty, config.early_stopping
    keep = max(2, 1 + len(config.eos_token_ids)) * beams
    is_top = torch.arange(keep, device=device) < beams  # candidates that may enter the finished list
    # transformers' fill value for unused slots: pad (unless it is 0) else eos[0], or -1 without eos
    eos = config.eos_token_ids
    fill = (config.pad_token_id or eos[0]) if eos else -1

    # running: the beams still growing; finished: the best ended sequences. (batch, beams, ...)
    running = torch.full((batch, beams, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :prompt_length] = input_ids.view(batch, beams, prompt_length)
    finished = running.clone()
    running_scores = torch.zeros(batch, beams, device=device)
    running_scores[:, 1:] = _NEG  # all beams start equal: only the first one may expand at step one
    finished_scores = torch.full((batch, beams), _NEG, device=device)
    running_origin = torch.full((batch, beams, max_length - prompt_length), -1, dtype=torch.long, device=device)
    finished_origin = running_origin.clone()
    finished_done = torch.zeros(batch, beams, dtype=torch.bool, device=device)
    can_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)
    row_offset = torch.arange(batch, device=device)[:, None] * beams  # (batch, 1): beam -> flat row
    scores_out = [] if config.return_dict_in_generate and config.output_scores else None
    logits_out = [] if config.return_dict_in_generate and config.output_logits else None

    outputs = model(**step_inputs.prefill(input_ids), past_key_values=step_inputs.cache,
                   use_cache=step_inputs.cache is not None, logits_to_keep=1)
    length = prompt_length
    while True:
        logits = step_logits(outputs, compiled=forward is not model)  # (batch * beams, vocab)
        del outputs
        vocab = logits.shape[-1]
        log_probs = processors(running[:, :, :length].reshape(rows, length), F.log_softmax(logits, dim=-1))
        if scores_out is not None:
            scores_out.append(log_probs)
        if logits_out is not None:
            logits_out.append(logits)
        total = (log_probs.view(batch, beams, vocab) + running_scores[:, :, None]).view(batch, beams * vocab)

        # (batch, keep) candidate continuations, best first
        if config.do_sample:
            picked = torch.multinomial(F.softmax(total, dim=-1), num_samples=keep)
            cand_scores, order = total.gather(1, picked).sort(dim=-1, descending=True)
            picked = picked.gather(1, order)
        else:
            cand_scores, picked = total.topk(keep, dim=-1)
        source, token = picked // vocab, picked % vocab
        cand = _gather(running, source)
        cand[:, :, length] = token
        cand_origin = _gather(running_origin, source)
        cand_origin[:, :, length - prompt_length] = source + row_offset
        ends = criteria(cand[:, :, :length + 1].reshape(batch * keep, length + 1), None).view(batch, keep)

        # The best `beams` candidates that did not end keep running.
        alive_scores = cand_scores + ends.float() * _NEG
        best = alive_scores.topk(beams, dim=-1).indices
        running, running_scores = _gather(cand, best), _gather(alive_scores, best)
        running_origin = _gather(cand_origin, best)

        # Ended candidates among the top `beams` join the finished list if they beat its members.
        just_ended = ends & is_top
        final_scores = cand_scores / ((length + 1 - prompt_length) ** length_penalty)
        if early_stopping is True:
            final_scores = final_scores + finished_done.all(-1, keepdim=True).float() * _NEG
        final_scores = final_scores + (~can_improve).float() * _NEG + (~just_ended).float() * _NEG
        merged_scores = torch.cat((finished_scores, final_scores), dim=1)
        best = merged_scores.topk(beams, dim=-1).indices
        finished = _gather(torch.cat((finished, cand), dim=1), best)
        finished_scores = _gather(merged_scores, best)
        finished_origin = _gather(torch.cat((finished_origin, cand_origin), dim=1), best)
        finished_done = _gather(torch.cat((finished_done, just_ended), dim=1), best)

        if step_inputs.cache is not None:
            step_inputs.cache.reorder_cache(running_origin[:, :, length - prompt_length].reshape(rows))
        length += 1
        can_improve = can_improve & _can_improve(
            running_scores, finished_scores, finished_done, length, prompt_length, max_length,
            length_penalty, early_stopping)
        all_full = bool(finished_done.all()) and early_stopping is True
        if length >= max_length or not bool(can_improve.any()) or all_full or bool(ends.all()):
            break
        flat = running.view(rows, max_length)
        outputs = step_inputs.forward_step(model, forward, flat, length)

    returned = config.num_return_sequences
    sequences = finished[:, :returned].reshape(batch * returned, max_length)
    sequence_scores = finished_scores[:, :returned].reshape(batch * returned)
    origin = finished_origin[:, :returned].reshape(batch * returned, -1)
    new_tokens = int((origin >= 0).sum(dim=1).max())
    sequences, origin = sequences[:, :prompt_length + new_tokens], origin[:, :new_tokens]
    if not config.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=sequence_scores if config.output_scores else None,
        scores=tuple(scores_out) if scores_out is not None else None,
        logits=tuple(logits_out) if logits_out is not None else None,
        beam_indices=origin,
        past_key_values=step_inputs.cache,
    )


def _can_improve(running_scores, finished_scores, finished_done, length, prompt_length, max_length,
                 length_penalty, early_stopping) -> torch.Tensor:
    """(batch, 1): may a running beam still beat the worst finished one? transformers' heuristic: the best
    running score is judged at the current length, or at max_length with early_stopping="never" and a
    positive length penalty (longer can only be better then)."""
    if early_stopping == "never" and length_penalty > 0.0:
        best_length = max_length - prompt_length
    else:
        best_length = length - prompt_length
    best_running = running_scores[:, :1] / (best_length ** length_penalty)
    worst_finished = torch.where(finished_done, finished_scores.min(dim=1, keepdim=True).values, _NEG)
    return (best_running > worst_finished).any(dim=-1, keepdim=True)


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pick along dim 1 (the beam dim): tensor (batch, n, ...), index (batch, k) -> (batch, k, ...)."""
    index = index.view(*index.shape, *([1] * (tensor.dim() - 2)))
    return tensor.take_along_dim(index, dim=1)
