"""The list of logits processors generate() applies between the model's next-token logits and the choice of a
token, and the one import path of every processor.

Each processor is a callable `(input_ids (batch, seq) LongTensor, scores (batch, vocab) float) -> scores` with the
name and behaviour of the transformers class of the same name, so processed scores match transformers' on the same
input. Every decision that depends on data stays on the device (masks, `torch.where`, scatter); only shapes, which
the host already knows, choose a branch, so no processor waits on the GPU.

`build_logits_processors(generation_config, prompt_length)` builds the list generate() applies, in transformers'
order: penalties and constraints first (sequence_bias first of all), then the caller's logits_processor, then (only
with do_sample=True) the sampling warpers, temperature -> top_h -> top_k -> top_p -> min_p -> typical_p -> epsilon
-> eta, then renormalisation.
The processors live by kind: generation/penalties.py (what the sequence already holds), generation/constraints.py
(lengths, forced and suppressed tokens), generation/warpers.py (sampling), on the base classes of
generation/logits_processor.py; all are re-exported here, so every processor can be imported from this module.

PrefixConstrainedLogitsProcessor (generate(prefix_allowed_tokens_fn=...)) lives in generation/prefix_constrained.py;
it calls the user's Python function per row, so it is the one processor that waits for the device.

Offers: LogitsProcessor, LogitsProcessorList, build_logits_processors, merge_processors, and the processors:
SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor,
NoBadWordsLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, ForcedBOSTokenLogitsProcessor,
ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, ExponentialDecayLengthPenalty,
SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, LogitNormalization; and, from warpers.py,
TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
EpsilonLogitsWarper, EtaLogitsWarper.
"""

from __future__ import annotations

import torch

from gpuformers.generation.config import GenerationConfig
# re-exported: every processor has always been importable from this module
from gpuformers.generation.constraints import (  # noqa: F401
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from gpuformers.generation.logits_processor import LogitsProcessor, LogitsProcessorList  # noqa: F401
from gpuformers.generation.penalties import (  # noqa: F401
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
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
# --- the list generate() uses ----------------------------------------------------------------------------------------


def build_logits_processors(
    generation_config: GenerationConfig,
    prompt_length: int,
    device: torch.device | str | None = None,
    attention_mask: torch.Tensor | None = None,
    prefix_allowed_tokens_fn=None,
    logits_processor=None,
) -> LogitsProcessorList:
    """The processors `generation_config` asks for, in transformers' order.

    prompt_length: tokens per row before generation (padding included). attention_mask: the prompt's (batch, seq)
    mask; with left padding it keeps the pad tokens out of the repetition penalty, as transformers does. device is
    accepted for symmetry with transformers; the processors follow the device of the scores they get.
    prefix_allowed_tokens_fn: generate()'s `fn(batch_id, input_ids) -> allowed token ids`, which adds a
    PrefixConstrainedLogitsProcessor (generation/prefix_constrained.py).
    logits_processor: generate()'s own processors, placed as transformers places them: after the penalties and
    constraints, before the sampling warpers and the renormalisation; one of the same class as a built one
    replaces it in its place (merge_processors).
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
    processors = merge_processors(processors, logits_processor or [])
    if gc.do_sample:
        # beam sampling keeps one token more than there are eos tokens, so every beam can continue; as in
        # transformers, an explicit empty eos list counts (1 token kept) and only None falls back to 2
        keep = 1 if gc.num_beams == 1 else 2 if gc.eos_token_id is None else len(eos) + 1
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


def merge_processors(built: list, custom: list) -> list:
    """transformers' merge of the processors (or stopping criteria) generate() built with the caller's: a caller's
    one of the same class as a built one takes its place, the others follow the built ones. Returns a list of the
    type of `built`."""
    if not custom:
        return built
    merged = type(built)()
    for default in built:
        merged.append(next((c for c in custom if type(c) is type(default)), default))
    merged.extend(c for c in custom if not any(c is m for m in merged))
    return merged
