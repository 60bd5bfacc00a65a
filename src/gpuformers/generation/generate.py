"""`model.generate()` as transformers': input preparation, greedy and sampling decode over a KV cache, dispatch.

Beam search (num_beams > 1) lives in generation/beam_search.py, assisted generation (assistant_model=,
prompt_lookup_num_tokens=) in generation/assisted.py; generate() prepares their inputs and calls them.

    prompt -> prefill (logits for the last position only) -> decode loop:
        logits (rows, vocab) -> logits processors -> argmax | sample | beam top-k -> stop checks -> streamer
        -> the next token goes in as a (rows, 1) step, at position (last prompt position + steps) per row

Left padding: the attention mask covers prompt and generated tokens; positions count real tokens only
(`mask.cumsum(-1) - 1`), so a padded row continues from where its text ends. Positions and the mask live in
buffers sized to the final length, built once; a decode step only slices them.

Host syncs. A CUDA decode loop never waits on the GPU for token selection (argmax, or sampling by the exponential
race below instead of torch.multinomial, which synchronises). The one question that needs the host, "have all rows
finished?", is asked only when something other than the length limit can finish a row (eos, stop strings,
max_time, user criteria), and on an accelerator only every `STOP_CHECK_INTERVAL` steps; the extra steps cost
padding tokens that are cut off at the end, so the output equals checking every step. A streamer needs the tokens
on the host anyway, so with one the check runs every step.

Cache rebuild: before each forward the loop asks the model `cache_must_be_rebuilt(past_length, length)` (Python
ints, no host sync); where it says so (Phi-3's longrope passing original_max_position_embeddings, as transformers'
Phi-3 decides by the padded length) the cache is emptied and the whole sequence recomputed once, as prefill.

Chunked prefill: with `prefill_chunk_size=n` the prompt goes through the model n tokens per forward (the last
chunk's logits start decoding), so activation memory is bounded by n instead of the prompt length; the cache ends
up holding the same keys, so the tokens are those of an unchunked prefill. As in transformers it needs a cache
(use_cache=False is refused) and assisted generation prefills in one piece.

Static cache: `cache_implementation="static"` preallocates keys and values for prompt + new tokens (StaticCache).
On CUDA, for a model with `supports_compiled_decode`, the decode step gets fixed shapes and is compiled with
`torch.compile(mode="reduce-overhead")` (CUDA graphs) unless `disable_compile=True`, as transformers does.
Elsewhere it runs eagerly and attends over the written slots only, which makes it no slower than the dynamic cache.

Offers: GenerationMixin (generate, compute_transition_scores), GenerateDecoderOnlyOutput, STOP_CHECK_INTERVAL,
greedy_tokens (and, from beam_search.py, GenerateBeamDecoderOnlyOutput).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# GenerateBeamDecoderOnlyOutput is re-exported: both output types of generate() can be imported from here
from gpuformers.generation.beam_search import GenerateBeamDecoderOnlyOutput, beam_search  # noqa: F401
from gpuformers.generation.cache import Cache, DynamicCache, StaticCache
from gpuformers.generation.config import CompileConfig, GenerationConfig
from gpuformers.generation.transition_scores import compute_transition_scores
from gpuformers.models.outputs import ModelOutput

# On an accelerator, ask "have all rows finished?" (a host sync) once per this many decode steps.
STOP_CHECK_INTERVAL = 8
# The cache implementations generate() builds itself.
_CACHES = {"dynamic": DynamicCache, "static": StaticCache}


@dataclass
class GenerateDecoderOnlyOutput(ModelOutput):
    """generate(..., return_dict_in_generate=True) for greedy search and sampling."""

    sequences: torch.LongTensor | None = None  # (rows, prompt + new tokens)
    scores: tuple[torch.Tensor, ...] | None = None  # processed scores, one (rows, vocab) per new token
    logits: tuple[torch.Tensor, ...] | None = None  # raw logits, one (rows, vocab) per new token
    past_key_values: Cache | None = None

    @property
    def cache(self) -> Cache | None:  # transformers 5's name for the field
        return self.past_key_values


class _StepInputs:
    """Everything a forward needs besides the tokens: positions, attention mask and cache, kept in buffers sized
    to the final length so that a decode step only slices them.

    positions: (rows, max_length); a left-padded row counts only its real tokens; padding slots hold 1.
    mask: (rows, max_length) of 1 for real tokens, or None when nothing is padded (the model then needs no mask).
    """

    def __init__(self, attention_mask: torch.Tensor | None, rows: int, prompt_length: int, max_length: int,
                 cache: Cache | None, device: torch.device, model, prefill_chunk_size: int | None = None):
        if prefill_chunk_size is not None and cache is None:
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size} prefills the prompt into the cache chunk by "
                             f"chunk, so it needs a cache; drop use_cache=False or prefill_chunk_size")
        self.cache = cache
        self.model = model  # runs the prefill chunks before the last one
        self.prefill_chunk_size = prefill_chunk_size
        # the model's GenerationMixin.cache_must_be_rebuilt, asked with Python ints before each forward
        self.cache_must_be_rebuilt = model.cache_must_be_rebuilt
        # a fixed-shape static cache attends over all its slots
        self.full_mask = isinstance(cache, StaticCache) and cache.fixed_shape
        self.slots: torch.Tensor | None = None  # arange(max_cache_len): cache positions for fixed-shape steps
        if attention_mask is None:
            self.positions = torch.arange(max_length, device=device).expand(rows, max_length)
            self.mask = None
        else:
            self.mask = torch.ones(rows, max_length, dtype=attention_mask.dtype, device=device)
            self.mask[:, :prompt_length] = attention_mask
            self.positions = (self.mask.cumsum(-1) - 1).masked_fill_(self.mask == 0, 1)

    def _mask_until(self, length: int) -> torch.Tensor | None:
        if self.mask is None or self.full_mask:
            return self.mask
        return self.mask[:, :length]

    def prefill(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """The inputs of the forward that ends the prompt: the whole prompt, minus what a cache passed in by the
        user already holds (all of it when the model says that cache must be rebuilt at this length).

        With prefill_chunk_size=n the rest is cut into n-token chunks from the first uncached token, as
        transformers' torch.split does; the chunks before the last run here, into the cache, and the inputs
        returned are the last chunk's. A chunk the model says needs a rebuilt cache recomputes from token 0.
        """
        done = self.cache.get_seq_length() if self.cache is not None else 0
        length = input_ids.shape[1]
        while True:
            end = length if self.prefill_chunk_size is None else min(length, done + self.prefill_chunk_size)
            if done and self.cache_must_be_rebuilt(done, end):
                self.cache.crop(0)
                done = 0
            inputs = dict(input_ids=input_ids[:, done:end], position_ids=self.positions[:, done:end],
                          attention_mask=self._mask_until(end))
            if end == length:
                return inputs
            # only the cache is wanted from this chunk: keep one position of logits, then drop them
            self.model(**inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            done = end

    def step(self, sequences: torch.Tensor, length: int) -> dict[str, Any]:
        """The newest token (the whole sequence without a cache); `length` tokens exist so far."""
        if self.cache is None:
            return dict(input_ids=sequences[:, :length], position_ids=self.positions[:, :length],
                        attention_mask=self._mask_until(length))
        inputs = dict(input_ids=sequences[:, length - 1:length], position_ids=self.positions[:, length - 1:length],
                      attention_mask=self._mask_until(length))
        if self.full_mask:
            # A fixed-shape step: the cache slot arrives as a tensor, so one compiled graph serves every step.
            if self.slots is None:
                self.slots = torch.arange(self.cache.max_cache_len, device=sequences.device)
            inputs["cache_position"] = self.slots[length - 1:length]
            self.cache.mark_written(length)
        return inputs

    def forward_step(self, model, forward, sequences: torch.Tensor, length: int):
        """One decode step's outputs, `length` tokens existing so far: `forward` (the model, or its compiled decode
        step) on the newest token over the cache; or, where the model says its cache must be rebuilt at this length
        (Phi-3's longrope once the sequence passes original_max_position_embeddings), the model on the whole
        sequence over the emptied cache, as transformers does (logits of the last position only, as in prefill).

            cache: length - 1 tokens --(crop to 0)--> prefill(sequences[:, :length]) --> cache: length tokens
        """
        cache = self.cache
        if cache is not None and self.cache_must_be_rebuilt(length - 1, length):
            cache.crop(0)
            return model(**self.prefill(sequences[:, :length]), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return forward(**self.step(sequences, length), past_key_values=cache, use_cache=cache is not None)


class GenerationMixin:
    """`generate()` for causal LMs; mixed into PreTrainedModel. The model provides forward(), config,
    generation_config and get_input_embeddings()."""

    # True in a model whose forward can be captured once for every decode step: what changes from step to step
    # (cache position, mask) reaches it as tensors, never as Python ints, and it never waits on the device. Until
    # a model says so, generate() runs its static-cache decode step eagerly: a forward that reads the cache length
    # as an int is recompiled at every new length (torch.compile guards on the int), which costs far more than
    # CUDA graphs save.
    supports_compiled_decode: bool = False

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
        from gpuformers.generation.logits import LogitsProcessorList, build_logits_processors
        from gpuformers.generation.stopping import StoppingCriteriaList, build_stopping_criteria

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

        # Lengths are fixed here, once: the stop criteria and the loop bounds read them from the config.
        max_length = config.max_length_for(prompt_length, self.config.max_position_embeddings)
        if max_length <= prompt_length:
            raise ValueError(
                f"max_length={max_length} leaves no room for new tokens after a prompt of {prompt_length} tokens; "
                f"set max_new_tokens instead"
            )
        config.max_new_tokens = None
        config.max_length = max_length
        if assisted:
            _refuse_cache_rebuild(self, assistant_model, prompt_length, max_length)

        beams = config.num_beams
        if beams > 1 and streamer is not None:
            raise ValueError("streamer cannot be used with beam search (num_beams > 1); use num_beams=1")
        expand = beams if beams > 1 else config.num_return_sequences
        if expand > 1:
            input_ids = input_ids.repeat_interleave(expand, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(expand, dim=0)
        rows = input_ids.shape[0]

        processors = build_logits_processors(config, prompt_length, device=input_ids.device,
                                             attention_mask=attention_mask,
                                             prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        processors = LogitsProcessorList([*processors, *(logits_processor or [])])
        criteria = build_stopping_criteria(config, prompt_length, tokenizer=tokenizer)
        criteria = StoppingCriteriaList([*criteria, *(stopping_criteria or [])])

        # When nothing the loop makes can leave this call but the token ids (no cache passed in, no dict of scores
        # and cache returned), the loop runs in inference mode: no autograd bookkeeping on each of the ~700 ops of a
        # step (8-13% faster decode at batch 1 on the CPU, tiny model). The ids are then cloned out of it, so that
        # callers may still edit them in place or train on them, as after transformers' no_grad generate.
        private = cache is None and not config.return_dict_in_generate
        # (not inference_mode(False) otherwise: that would switch off a caller's own inference mode)
        with torch.inference_mode() if private else contextlib.nullcontext():
            cache = self._prepare_cache(cache, config, rows, max_length)
            step_inputs = _StepInputs(attention_mask, rows, prompt_length, max_length, cache, input_ids.device,
                                      self, config.prefill_chunk_size)
            forward = self._decode_forward(config, cache)
            if assisted:
                out = assisted_decoding(self, assistant_model, input_ids, step_inputs, config, processors, criteria,
                                        streamer)
            elif beams > 1:
                out = beam_search(self, input_ids, step_inputs, forward, config, processors, criteria, batch)
            else:
                out = self._sample(input_ids, step_inputs, forward, config, processors, criteria, streamer)
        return out.clone() if private else out

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        """(rows, new tokens) score of each generated token, from generate(return_dict_in_generate=True)'s
        sequences, scores (or logits) and, after beam search, beam_indices; see generation/transition_scores.py."""
        return compute_transition_scores(sequences, scores, beam_indices=beam_indices,
                                         normalize_logits=normalize_logits)

    # --- preparation ------------------------------------------------------------------------------------------

    def _prepare_generation_config(self, generation_config, kwargs: dict) -> GenerationConfig:
        """model.generation_config (or defaults from the model config) < generation_config < kwargs."""
        base = getattr(self, "generation_config", None)
        if base is None:
            base = GenerationConfig.from_model_config(self.config)
        config = generation_config.merged_with(base) if generation_config is not None else base.copy()
        if generation_config is None and config.cache_implementation == "hybrid":
            # Checkpoints with sliding-window layers (Gemma 2 / 3) ship "hybrid", which transformers now reads, from
            # the model's own defaults, as the default dynamic cache (it handles the windows); so do we.
            config.cache_implementation = None
        unknown = config.update(**kwargs)
        if unknown:
            hints = []
            for name in sorted(unknown):
                close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(GenerationConfig)], n=1)
                hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
            raise TypeError(
                f"generate() got arguments that are neither GenerationConfig fields nor inputs: {', '.join(hints)}; "
                f"inputs are inputs/input_ids, attention_mask, past_key_values, streamer, tokenizer, "
                f"logits_processor, stopping_criteria, prefix_allowed_tokens_fn"
            )
        return config

    def _prepare_prompt(self, inputs, input_ids, attention_mask, config: GenerationConfig):
        if inputs is not None and input_ids is not None:
            raise ValueError("pass the prompt once: either as the first argument (inputs) or as input_ids=, not both")
        ids = inputs if inputs is not None else input_ids
        device = self.get_input_embeddings().weight.device
        if ids is None:
            if config.bos_token_id is None:
                raise ValueError("generate() needs a prompt (input_ids) or a bos_token_id to start from")
            ids = torch.full((1, 1), config.bos_token_id, dtype=torch.long, device=device)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(
                f"input_ids must be a (batch, seq) tensor of token ids, got {shape}; "
                f"use tokenizer(text, return_tensors='pt').input_ids (add [None] to a 1-D tensor)"
            )
        if ids.shape[1] == 0:
            raise ValueError("input_ids is empty (no prompt tokens); give at least one token, e.g. the bos token")
        for name, tensor in (("input_ids", ids), ("attention_mask", attention_mask)):
            if tensor is not None and tensor.device != device:
                raise ValueError(
                    f"{name} is on {tensor.device} but the model's embeddings are on {device}; "
                    f"move it with {name}.to(model.device)"
                )
        if attention_mask is not None and attention_mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(ids.shape)}; "
                f"they must match (pass the mask the tokenizer returned with these ids)"
            )
        limit = self.config.max_position_embeddings
        if ids.shape[1] > limit and self.config.rope_type != "dynamic":
            raise ValueError(
                f"the prompt has {ids.shape[1]} tokens but the model handles at most max_position_embeddings="
                f"{limit} positions (rope_type {self.config.rope_type!r} does not extend beyond them); "
                f"shorten the prompt, e.g. tokenizer(..., truncation=True, max_length={limit})"
            )
        return ids.long(), attention_mask

    @staticmethod
    def _infer_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor | None:
        """transformers' rule without a mask: pad tokens in the prompt are padding, unless pad is also eos."""
        pad = config.pad_token_id
        if pad is None or pad in config.eos_token_ids:
            return None
        return (input_ids != pad).long()

    def _prepare_cache(self, cache, config: GenerationConfig, rows: int, max_length: int) -> Cache | None:
        if cache is not None:
            if not isinstance(cache, Cache):
                raise TypeError(f"past_key_values must be a gpuformers Cache, got {type(cache).__name__}")
            return cache
        if not config.use_cache:
            return None
        name = config.cache_implementation or "dynamic"
        if name not in _CACHES:
            raise ValueError(
                f"cache_implementation {name!r} is not supported by generate(); supported: {', '.join(_CACHES)}"
            )
        if name == "dynamic":
            return DynamicCache()
        size = config.max_cache_len or max_length
        if size < max_length:
            raise ValueError(
                f"max_cache_len={size} is smaller than the {max_length} tokens this call can reach; "
                f"raise max_cache_len or lower max_new_tokens"
            )
        # Fixed shapes only pay off when the step is compiled; eagerly, reading the written prefix is cheaper.
        return StaticCache(self.config, max_cache_len=size, max_batch_size=rows,
                           fixed_shape=self._compiles_decode(config))

    def _compiles_decode(self, config: GenerationConfig) -> bool:
        """transformers' auto-compile rule, less the cache: on CUDA unless disable_compile=True, for a model that
        supports it (the step is then compiled when its cache is a fixed-shape StaticCache). On other devices only
        when the caller passes a compile_config: compiling costs about a minute there, worth it for long runs."""
        device = self.get_input_embeddings().weight.device
        if config.disable_compile or (device.type != "cuda" and config.compile_config is None):
            return False
        if not self.supports_compiled_decode:
            warnings.warn(
                f"{type(self).__name__} does not support a compiled decode step yet (supports_compiled_decode is "
                f"False): the static cache runs without CUDA graphs; pass disable_compile=True to silence this",
                UserWarning, stacklevel=4)
            return False
        return True

    def _decode_forward(self, config: GenerationConfig, cache: Cache | None):
        """The function a decode step calls: the model itself, or the model compiled for CUDA graphs when
        _compiles_decode says so and the cache has fixed shapes. The compiled function is kept on the model so a
        second generate() call reuses it."""
        if not (isinstance(cache, StaticCache) and cache.fixed_shape and self._compiles_decode(config)):
            return self
        options = config.compile_config or CompileConfig()
        key = tuple(sorted(options.to_dict().items(), key=str))
        compiled = getattr(self, "_compiled_decode", None)
        if compiled is None or compiled[0] != key:
            kwargs = dict(fullgraph=options.fullgraph, dynamic=options.dynamic, backend=options.backend)
            # torch.compile accepts a mode or options, not both.
            kwargs.update(options=options.options) if options.options else kwargs.update(mode=options.mode)
            compiled = (key, torch.compile(self.forward, **kwargs))
            self._compiled_decode = compiled
        return compiled[1]

    # --- greedy search and sampling ---------------------------------------------------------------------------

    def _sample(self, input_ids, step_inputs: _StepInputs, forward, config, processors, criteria, streamer):
        rows, prompt_length = input_ids.shape
        max_length = config.max_length
        device = input_ids.device
        sequences = torch.empty(rows, max_length, dtype=torch.long, device=device)
        sequences[:, :prompt_length] = input_ids
        # Only eos pads finished rows (transformers' rule); rows stopped by other criteria keep their tokens.
        pad = config.pad_token_id if config.eos_token_ids else None
        can_stop_early = bool(config.eos_token_ids or config.stop_strings or config.max_time is not None
                              or len(criteria) > _length_criteria(criteria))
        interval = _stop_check_interval(device, streamer)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        any_unfinished = []  # per step, a 0-d bool tensor (read once at the end when checks were spaced out)
        scores_out = [] if config.return_dict_in_generate and config.output_scores else None
        logits_out = [] if config.return_dict_in_generate and config.output_logits else None
        if streamer is not None:
            streamer.put(input_ids.cpu())

        outputs = self(**step_inputs.prefill(input_ids), past_key_values=step_inputs.cache,
                       use_cache=step_inputs.cache is not None, logits_to_keep=1)
        length = prompt_length
        while True:
            logits = outputs.logits[:, -1].float()  # (rows, vocab)
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
            outputs = step_inputs.forward_step(self, forward, sequences, length)

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
            past_key_values=step_inputs.cache,
        )


def _refuse_cache_rebuild(model, assistant_model, prompt_length: int, max_length: int) -> None:
    """Assisted generation does not rebuild a cache (cache_must_be_rebuilt): refuse a call that would need it."""
    for role, m in (("model", model), ("assistant_model", assistant_model)):
        if m is not None and m.cache_must_be_rebuilt(prompt_length, max_length):
            raise NotImplementedError(
                f"assisted generation cannot take {role} {type(m).__name__} from {prompt_length} to {max_length} "
                f"tokens: on the way its cache must be recomputed (cache_must_be_rebuilt; Phi-3's longrope past "
                f"original_max_position_embeddings), which assisted generation does not do; generate without "
                f"assistant_model / prompt_lookup_num_tokens, or keep max_length at or below that length"
            )


def _stop_check_interval(device: torch.device, streamer) -> int:
    """Decode steps between two "have all rows finished?" checks: every step where a check costs nothing (the
    CPU) or the tokens go to the host anyway (a streamer), else STOP_CHECK_INTERVAL."""
    return 1 if device.type == "cpu" or streamer is not None else STOP_CHECK_INTERVAL


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,): each row's highest score, the first one on ties, as argmax. On the CPU through
    max(-1), the same index at half the time (argmax's CPU reduction is slower: 1.2 vs 2.6 ms for 35 x 32k rows)."""
    return scores.max(-1).indices if scores.device.type == "cpu" else scores.argmax(-1)


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


def _length_criteria(criteria) -> int:
    """How many of the stopping criteria only enforce the length limit (which the loop bound already does)."""
    return sum(1 for c in criteria if type(c).__name__ in ("MaxLengthCriteria", "MaxNewTokensCriteria"))
