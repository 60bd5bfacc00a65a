"""`model.generate()` as transformers': GenerationMixin (the entry point and its dispatch) and the greedy and sampling
decode loop over a KV cache.

Beam search (num_beams > 1) lives in generation/beam_search.py, assisted generation (assistant_model=,
prompt_lookup_num_tokens=) in generation/assisted.py; generate() prepares their inputs and calls them. What runs once
before decoding (config merging, prompt checks, length, cache and compiled decode step) is in
generation/preparation.py; what each forward gets (positions, attention mask, cache position, chunked prefill,
cache rebuild) in generation/step_inputs.py.

    prompt -> prefill (logits for the last position only) -> decode loop:
        logits (rows, vocab) -> logits processors -> argmax | sample | beam top-k -> stop checks -> streamer
        -> the next token goes in as a (rows, 1) step, at position (last prompt position + steps) per row

Host syncs. A CUDA decode loop never waits on the GPU for token selection (argmax, or sampling by the exponential
race below instead of torch.multinomial, which synchronises). The one question that needs the host, "have all rows
finished?", is asked only when something other than the length limit can finish a row (eos, stop strings,
max_time, user criteria), and on an accelerator only every `STOP_CHECK_INTERVAL` steps; the extra steps cost
padding tokens that are cut off at the end, so the output equals checking every step. A streamer needs the tokens
on the host anyway, so with one the check runs every step.

Offers: GenerationMixin (generate, compute_transition_scores; the hooks supports_compiled_decode, is_stateful,
make_cache, position_limit, cache_must_be_rebuilt), GenerateDecoderOnlyOutput, STOP_CHECK_INTERVAL,
step_logits, greedy_tokens (and, from beam_search.py, GenerateBeamDecoderOnlyOutput).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# GenerateBeamDecoderOnlyOutput is re-exported: both output types of generate() can be imported from here
from gpuformers.generation.beam_search import GenerateBeamDecoderOnlyOutput, beam_search  # noqa: F401
from gpuformers.generation.cache import Cache, DynamicCache
from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.preparation import GenerationPreparation
from gpuformers.generation.step_inputs import StepInputs
from gpuformers.generation.transition_scores import compute_transition_scores
from gpuformers.outputs import ModelOutput
from gpuformers.kernels import cpu_c

# On an accelerator, ask "have all rows finished?" (a host sync) once per this many decode steps.
STOP_CHECK_INTERVAL = 8


@dataclass
class GenerateDecoderOnlyOutput(ModelOutput):
    """generate(..., return_dict_in_generate=True) for greedy search and sampling."""

    sequences: torch.LongTensor | None = None  # (rows, prompt + new tokens)
    scores: tuple[torch.Tensor, ...] | None = None  # processed scores, one (rows, vocab) per new token
    logits: tuple[torch.Tensor, ...] | None = None  # raw logits, one (rows, vocab) per new token
    # with output_hidden_states: per new token, the forward that chose it: the embeddings' and every layer's output
    # (the last one after the final norm), each (rows, prompt length) at the first token, (rows, 1) after
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    past_key_values: Cache | None = None

    @property
    def cache(self) -> Cache | None:  # transformers 5's name for the field
        return self.past_key_values


class GenerationMixin(GenerationPreparation):
    """`generate()` for causal LMs; mixed into PreTrainedModel. The model provides forward(), config,
    generation_config and get_input_embeddings(). The preparation steps generate() runs once come from
    GenerationPreparation (generation/preparation.py)."""

    # True in a model whose forward can be captured once for every decode step: what changes from step to step
    # (cache position, mask) reaches it as tensors, never as Python ints, and it never waits on the device. Until
    # a model says so, generate() runs its static-cache decode step eagerly: a forward that reads the cache length
    # as an int is recompiled at every new length (torch.compile guards on the int), which costs far more than
    # CUDA graphs save.
    supports_compiled_decode: bool = False
    # True in a model whose cache carries recurrent state (Mamba2's conv and SSM states, make_cache): such a state
    # cannot be rolled back, so assisted decoding refuses the model, and the continuous-batching engine, which keeps
    # only paged keys and values, refuses it too.
    is_stateful: bool = False

    def make_cache(self) -> Cache:
        """The cache generate() (cache_implementation "dynamic", the default) and a forward with use_cache=True fill
        when none is passed: keys and values in a DynamicCache; a state-space model returns its RecurrentCache."""
        return DynamicCache()

    @property
    def position_limit(self) -> int | None:
        """How many positions the model handles (max_position_embeddings), which caps generate()'s default length;
        None for a model without positions (a state-space model)."""
        return self.config.max_position_embeddings

    def cache_must_be_rebuilt(self, past_length: int, length: int) -> bool:
        """True when a forward that takes the cache from `past_length` tokens to `length` tokens (padded lengths)
        must instead recompute all `length` tokens over an emptied cache, because the keys cached so far were
        computed differently from how the model computes them at `length` (Phi-3's longrope switches to its long
        factors past original_max_position_embeddings). Asked with Python ints before every forward of the decode
        loop, so it must not touch tensors. No by default."""
        return False

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        attention_mask: torch.Tensor | None = None,
        tokenizer=None,
        assistant_model=None,
        prefix_allowed_tokens_fn=None,
        **kwargs,
    ):
        """Continue each prompt row of `inputs` (batch, seq); returns (rows, seq + new) token ids, or a
        GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput with return_dict_in_generate=True.

        kwargs are GenerationConfig fields (max_new_tokens=, do_sample=, temperature=, num_beams=, ...) that
        override model.generation_config for this call, plus `input_ids=` and `past_key_values=` (a Cache).
        `tokenizer=` is needed for stop_strings. Pass the attention_mask of left-padded batches.
        `assistant_model=` (a smaller model with the same tokenizer) or `prompt_lookup_num_tokens=` turns on
        assisted generation (speculative decoding, one prompt at a time; generation/assisted.py).
        `prefix_allowed_tokens_fn(batch_id, input_ids) -> allowed token ids` constrains each next token
        (generation/prefix_constrained.py).
        """
        from gpuformers.generation.logits import build_logits_processors, merge_processors
        from gpuformers.generation.stopping import build_stopping_criteria

        input_ids = kwargs.pop("input_ids", None)
        cache = kwargs.pop("past_key_values", None)
        cache = kwargs.pop("cache", cache)
        config = self._prepare_generation_config(generation_config, kwargs)
        input_ids, attention_mask = self._prepare_prompt(inputs, input_ids, attention_mask, config)
        batch, prompt_length = input_ids.shape
        assisted = assistant_model is not None or config.prompt_lookup_num_tokens is not None
        if assisted:
            from gpuformers.generation.assisted import assisted_decoding, check_assisted_generation
            check_assisted_generation(self, assistant_model, config, batch)
        eos = config.eos_token_ids
        if config.pad_token_id is None and eos:
            config.pad_token_id = eos[0]  # transformers' fallback: finished rows are padded with eos
        if attention_mask is None:
            attention_mask = self._infer_attention_mask(input_ids, config)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # nothing padded: the model needs no mask (one check, before the loop)

        max_length = self._prepare_max_length(config, prompt_length)

        beams = config.num_beams
        self._refuse_unmade_outputs(config, beams, assisted)
        if beams > 1 and streamer is not None:
            raise ValueError("streamer cannot be used with beam search (num_beams > 1); use num_beams=1")
        expand = beams if beams > 1 else config.num_return_sequences
        if expand > 1:
            input_ids = input_ids.repeat_interleave(expand, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(expand, dim=0)
        rows = input_ids.shape[0]

        # the caller's processors and criteria join the built ones as in transformers (merge_processors)
        processors = build_logits_processors(config, prompt_length, device=input_ids.device,
                                             attention_mask=attention_mask,
                                             prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                             logits_processor=logits_processor)
        criteria = build_stopping_criteria(config, prompt_length, tokenizer=tokenizer)
        criteria = merge_processors(criteria, list(stopping_criteria or []))
        if criteria.max_length is not None and criteria.max_length != max_length:
            # A caller's MaxLengthCriteria replaced the built one, so it decides where generation ends, shorter or
            # longer, as in transformers (which still checks it after the first new token); the buffers and the
            # cache below are sized to it. The processors keep the config's length (forced eos), as there.
            max_length = config.max_length = max(criteria.max_length, prompt_length + 1)
        if assisted:
            self._refuse_cache_rebuild(assistant_model, prompt_length, max_length)

        # When nothing the loop makes can leave this call but the token ids (no cache passed in, no dict of scores
        # and cache returned), the loop runs in inference mode: no autograd bookkeeping on each of the ~700 ops of a
        # step (8-13% faster decode at batch 1 on the CPU, tiny model). The ids are then cloned out of it, so that
        # callers may still edit them in place or train on them, as after transformers' no_grad generate.
        private = cache is None and not config.return_dict_in_generate
        # (not inference_mode(False) otherwise: that would switch off a caller's own inference mode)
        with torch.inference_mode() if private else contextlib.nullcontext():
            cache = self._prepare_cache(cache, config, rows, max_length)
            step_inputs = StepInputs(attention_mask, rows, prompt_length, max_length, cache, input_ids.device,
                                     self, config.prefill_chunk_size)
            # (hidden states come from the eager forward: a compiled step returns only what it was compiled for)
            forward = self if _wants_hidden_states(config) else self._decode_forward(config, cache)
            from gpuformers.kernels.cpu_linear import cpu_matmuls

            # (an assisted step verifies several tokens per row: the main model's copies are for many rows)
            with self._cpu_matmuls(forward, None if assisted else rows), (
                    cpu_matmuls(assistant_model, rows) if assistant_model is not None
                    else contextlib.nullcontext()):
                if assisted:
                    out = assisted_decoding(self, assistant_model, input_ids, step_inputs, config, processors,
                                            criteria, streamer)
                elif beams > 1:
                    out = beam_search(self, input_ids, step_inputs, forward, config, processors, criteria, batch)
                else:
                    out = self._sample(input_ids, step_inputs, forward, config, processors, criteria, streamer)
        return out.clone() if private else out

    @staticmethod
    def _refuse_unmade_outputs(config, beams: int, assisted: bool) -> None:
        """An output generate() was asked for but does not make is an error, not a silent None."""
        if not config.return_dict_in_generate:
            return  # transformers returns the token ids alone then, whatever else was asked
        if config.output_attentions:
            raise NotImplementedError(
                "generate(output_attentions=True) is not implemented in gpuformers: its attention backends return no "
                "attention weights; leave output_attentions False (output_hidden_states, output_scores and "
                "output_logits are available)")
        if config.output_hidden_states and (beams > 1 or assisted):
            raise NotImplementedError(
                f"generate(output_hidden_states=True) is implemented for greedy search and sampling, not for "
                f"{'beam search (num_beams > 1)' if beams > 1 else 'assisted generation'}; use num_beams=1 without "
                f"an assistant, or leave output_hidden_states False")

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        """(rows, new tokens) score of each generated token, from generate(return_dict_in_generate=True)'s
        sequences, scores (or logits) and, after beam search, beam_indices; see generation/transition_scores.py."""
        return compute_transition_scores(sequences, scores, beam_indices=beam_indices,
                                         normalize_logits=normalize_logits)

    # --- greedy search and sampling ---------------------------------------------------------------------------

    def _sample(self, input_ids, step_inputs: StepInputs, forward, config, processors, criteria, streamer):
        rows, prompt_length = input_ids.shape
        max_length = config.max_length
        device = input_ids.device
        sequences = torch.empty(rows, max_length, dtype=torch.long, device=device)
        sequences[:, :prompt_length] = input_ids
        # Only eos pads finished rows (transformers' rule); rows stopped by other criteria keep their tokens.
        pad = config.pad_token_id if config.eos_token_ids else None
        can_stop_early = bool(config.eos_token_ids or config.stop_strings or config.max_time is not None
                              or len(criteria) > count_length_criteria(criteria))
        interval = _stop_check_interval(device, streamer)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        any_unfinished = []  # per step, a 0-d bool tensor (read once at the end when checks were spaced out)
        scores_out = [] if config.return_dict_in_generate and config.output_scores else None
        logits_out = [] if config.return_dict_in_generate and config.output_logits else None
        hidden_out = [] if _wants_hidden_states(config) else None
        extra = {"output_hidden_states": True} if hidden_out is not None else {}
        if streamer is not None:
            streamer.put(input_ids.cpu())

        outputs = self(**step_inputs.prefill(input_ids), past_key_values=step_inputs.cache,
                       use_cache=step_inputs.cache is not None, logits_to_keep=1, **extra)
        length = prompt_length
        while True:
            logits = step_logits(outputs, compiled=forward is not self)  # (rows, vocab)
            if hidden_out is not None:
                hidden_out.append(outputs.hidden_states)
            del outputs
            if logits_out is not None:
                logits_out.append(logits.clone() if processors else logits)  # a processor may work in place
            scores = processors(sequences[:, :length], logits) if processors else logits
            if scores_out is not None:
                scores_out.append(scores)
            tokens = _select_tokens(scores) if config.do_sample else greedy_tokens(scores)
            if pad is not None:
                tokens = torch.where(unfinished, tokens, pad)
            sequences[:, length] = tokens
            length += 1
            if streamer is not None:
                streamer.put(tokens.cpu())
            if can_stop_early:
                unfinished &= ~criteria(sequences[:, :length], scores)
                if interval > 1:
                    any_unfinished.append(unfinished.any())
                if (length - prompt_length) % interval == 0 and not bool(unfinished.any()):
                    break
            if length >= max_length:
                break
            outputs = step_inputs.forward_step(self, forward, sequences, length, **extra)

        if interval > 1 and any_unfinished:
            # Steps run after every row had finished (between two checks) are cut off here.
            alive = torch.stack(any_unfinished).cpu()
            done = (~alive).nonzero()
            if len(done):
                length = prompt_length + int(done[0]) + 1
        if streamer is not None:
            streamer.end()
        sequences = sequences[:, :length]
        if not config.return_dict_in_generate:
            return sequences
        steps = length - prompt_length
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(scores_out[:steps]) if scores_out is not None else None,
            logits=tuple(logits_out[:steps]) if logits_out is not None else None,
            hidden_states=tuple(hidden_out[:steps]) if hidden_out is not None else None,
            past_key_values=step_inputs.cache,
        )


def _wants_hidden_states(config) -> bool:
    """Whether generate() returns each step's hidden states (transformers' rule: only in a returned dict)."""
    return bool(config.return_dict_in_generate and config.output_hidden_states)


def _stop_check_interval(device: torch.device, streamer) -> int:
    """Decode steps between two "have all rows finished?" checks: every step where a check costs nothing (the
    CPU) or the tokens go to the host anyway (a streamer), else STOP_CHECK_INTERVAL."""
    return 1 if device.type == "cpu" or streamer is not None else STOP_CHECK_INTERVAL


def step_logits(outputs, compiled: bool) -> torch.Tensor:
    """The last position's logits (rows, vocab) in float32, as sampling reads them. From a compiled step (CUDA graphs,
    mode="reduce-overhead") always a copy, as transformers takes one: the step's output lives in the graph's memory,
    which its next replay overwrites, so a float32 model's view of it would change under the scores and logits kept
    for the caller (and under processors that edit in place)."""
    return outputs.logits[:, -1].to(dtype=torch.float32, copy=compiled)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,): each row's highest score, the first one on ties, as argmax. On the CPU (float32)
    through kernels/cpu_c.py's vectorized argmax, else max(-1): the same index, where torch's CPU argmax reduction
    is slower (48 x 32k rows on one thread, a loaded machine: max(-1) 2.0 ms, the C kernel 0.5 ms)."""
    if scores.device.type != "cpu":
        return scores.argmax(-1)
    tokens = cpu_c.first_argmax(scores)
    return tokens if tokens is not None else scores.max(-1).indices


def _select_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from softmax(scores) (rows, vocab) -> (rows,).

    On the CPU torch.multinomial (the same random stream as transformers under torch.manual_seed). On an
    accelerator the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i, and
    unlike torch.multinomial it never makes the host wait for the device.
    """
    probs = F.softmax(scores, dim=-1)
    if probs.device.type == "cpu":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return probs.div_(torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def count_length_criteria(criteria) -> int:
    """How many of the stopping criteria only enforce the length limit (which the loop bound already does)."""
    return sum(1 for c in criteria if type(c).__name__ in ("MaxLengthCriteria", "MaxNewTokensCriteria"))
