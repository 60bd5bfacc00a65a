"""RecurrentCache: the cache of a model with state-space (mamba) layers, for `generate()` and `use_cache=True`.

A mamba layer's memory of the past does not grow with it: per layer and sequence, a conv state (the last
conv_kernel - 1 inputs of its causal conv, (batch, conv_dim, conv_kernel - 1)) and an SSM state (batch, heads,
head_dim, state_size), float32. The layer's sequence mixing runs through `mix_states`, which gives it both (None
before its first token) and keeps the new ones with the count of tokens they took in. A hybrid model's attention
layers keep keys and values here too, through the usual `update` (a DynamicCache inside, its layers numbered in the order they
first store), so one cache object serves the whole stack.

What a state cannot do: go back. `crop(n)` below the tokens seen would need the states as they were n tokens ago,
which are not kept, so it raises (assisted decoding, which rolls back rejected drafts, refuses such models before it
starts); `crop` to the current length or more changes nothing, `crop(0)` and `reset()` empty the cache.
`reorder_cache` (beam search) selects batch rows of every state and of the keys and values.

Offers: RecurrentCache.
"""

from __future__ import annotations

import torch

from gpuformers.generation.cache import Cache, DynamicCache


class RecurrentCache(Cache):
    """Module doc."""

    def __init__(self):
        self._conv: dict[int, torch.Tensor] = {}  # layer -> (batch, conv_dim, conv_kernel - 1)
        self._ssm: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, head_dim, state_size), float32
        self._lengths: dict[int, int] = {}  # layer -> tokens it has taken in (mamba and attention layers)
        self._attention = DynamicCache()  # the attention layers' keys and values (a hybrid model)
        self._kv_slot: dict[int, int] = {}  # attention layer -> its layer number in _attention

    # --- what a mamba layer asks -----------------------------------------------------------------------------

    def conv_state(self, layer_idx: int) -> torch.Tensor | None:
        return self._conv.get(layer_idx)

    def ssm_state(self, layer_idx: int) -> torch.Tensor | None:
        return self._ssm.get(layer_idx)

    def update_state(self, layer_idx: int, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     new_tokens: int) -> None:
        """Keep the layer's states after `new_tokens` more tokens."""
        self._conv[layer_idx], self._ssm[layer_idx] = conv_state, ssm_state
        self._lengths[layer_idx] = self._lengths.get(layer_idx, 0) + new_tokens

    def mix_states(self, layer_idx: int, mix, xbc: torch.Tensor, dt: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Run the layer's sequence mixing (Mamba2Mixer.mix) over the batch from its cached states and keep the new
        ones. xbc (batch, seq, conv_dim), dt (batch, seq, heads) -> y (batch, seq, heads, head_dim)."""
        y, conv, ssm = mix(xbc, dt, self.conv_state(layer_idx), self.ssm_state(layer_idx), attention_mask)
        self.update_state(layer_idx, conv, ssm, xbc.shape[1])
        return y

    # --- what an attention layer asks (hybrid models) --------------------------------------------------------

    def update(self, layer_idx, key, value, cache_position=None):
        slot = self._kv_slot.setdefault(layer_idx, len(self._kv_slot))
        keys, values = self._attention.update(slot, key, value)
        self._lengths[layer_idx] = self._attention.get_seq_length(slot)
        return keys, values

    # --- the Cache interface ---------------------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens the layer has taken in (layer 0: what a forward starting now continues from)."""
        return self._lengths.get(layer_idx, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for states in (self._conv, self._ssm):
            for layer, state in states.items():
                states[layer] = state.index_select(0, beam_idx.to(state.device))
        if self._kv_slot:
            self._attention.reorder_cache(beam_idx)

    def crop(self, max_length: int) -> None:
        """Forget the tokens from max_length on: only all of them (max_length 0) or none (module doc)."""
        seen = self.get_seq_length()
        if max_length <= 0:
            self.reset()
        elif max_length < seen:
            raise NotImplementedError(
                f"a recurrent (state-space) cache cannot be cropped from {seen} to {max_length} tokens: its conv and "
                f"SSM states hold no earlier step to roll back to (state rollback is not implemented); recompute "
                f"from the first {max_length} tokens with a new cache instead")

    def reset(self) -> None:
        """Empty the cache for a new prompt."""
        self._conv.clear()
        self._ssm.clear()
        self._lengths.clear()
        self._attention = DynamicCache()
        self._kv_slot.clear()

    def __len__(self) -> int:
        return len(self._lengths)
