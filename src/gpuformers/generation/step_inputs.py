"""StepInputs: what each forward of `generate()` gets besides the model itself (the prefill's and every decode step's
input ids, position ids, attention mask, cache position), built once per call into buffers sized to the final length.

Left padding: the attention mask covers prompt and generated tokens; positions count real tokens only
(`mask.cumsum(-1) - 1`), so a padded row continues from where its text ends (transformers' rule: new tokens follow
the prompt's last position). A decode step only slices the buffers.

Cache rebuild: before each forward the model is asked `cache_must_be_rebuilt(past_length, length)` (Python ints, no
host sync); where it says so (Phi-3's longrope passing original_max_position_embeddings, as transformers' Phi-3
decides by the padded length) the cache is emptied and the whole sequence recomputed once, as prefill.

Chunked prefill: with `prefill_chunk_size=n` the prompt goes through the model n tokens per forward (the last
chunk's logits start decoding), so activation memory is bounded by n instead of the prompt length; the cache ends
up holding the same keys, so the tokens are those of an unchunked prefill. As in transformers it needs a cache
(use_cache=False is refused) and assisted generation prefills in one piece.

Offers: StepInputs (prefill, step, forward_step; positions, mask, full_mask, cache), used by the decode loops of
generate.py, beam_search.py and assisted.py.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuformers.generation.cache import Cache, StaticCache


class StepInputs:
    """Everything a forward needs besides the tokens: positions, attention mask and cache, kept in buffers sized
    to the final length so that a decode step only slices them.

    positions: (rows, max_length); a left-padded row counts only its real tokens; padding slots hold 0.
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
            # transformers' rule: the prompt's positions count its real tokens (padding at 0), and each new token
            # comes one after the prompt's last position. With left padding that continues the count; after a
            # right-padded prompt (last slot masked, position 0) it restarts at 1, as in transformers.
            prompt_positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 0)
            self.positions = torch.empty(rows, max_length, dtype=torch.long, device=device)
            self.positions[:, :prompt_length] = prompt_positions  # (rows, prompt_length)
            steps = torch.arange(1, max_length - prompt_length + 1, device=device)
            self.positions[:, prompt_length:] = prompt_positions[:, -1:] + steps  # (rows, new tokens)

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

    def forward_step(self, model, forward, sequences: torch.Tensor, length: int, **extra):
        """One decode step's outputs, `length` tokens existing so far: `forward` (the model, or its compiled decode
        step) on the newest token over the cache; or, where the model says its cache must be rebuilt at this length
        (Phi-3's longrope once the sequence passes original_max_position_embeddings), the model on the whole
        sequence over the emptied cache, as transformers does (logits of the last position only, as in prefill).

            cache: length - 1 tokens --(crop to 0)--> prefill(sequences[:, :length]) --> cache: length tokens

        `extra`: more arguments for the forward (output_hidden_states=True).
        """
        cache = self.cache
        if cache is not None and self.cache_must_be_rebuilt(length - 1, length):
            cache.crop(0)
            return model(**self.prefill(sequences[:, :length]), past_key_values=cache, use_cache=True,
                         logits_to_keep=1, **extra)
        return forward(**self.step(sequences, length), past_key_values=cache, use_cache=cache is not None, **extra)
