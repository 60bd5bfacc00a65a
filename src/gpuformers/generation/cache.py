"""KV caches for incremental decoding with `forward(..., past_key_values=cache, use_cache=True)`.

A cache holds, per layer, keys and values of shape (batch, kv_heads, tokens, head_dim). The model asks it three
things: `get_seq_length()` (tokens already stored: the next token's cache position), `kv_length(new_tokens)`
(the key length attention will see after this step, to size the mask) and `update(layer_idx, k, v)`
(store this step's keys and values, return everything attention should see).

Offers: Cache (the interface), DynamicCache (grows as needed, written in place), StaticCache (preallocated, written in place,
fixed shapes for CUDA graphs).
"""

from __future__ import annotations

import torch


class Cache:
    """The interface between a decoder and its KV storage."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError

    def kv_length(self, new_tokens: int) -> int:
        return self.get_seq_length() + new_tokens

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
               cache_position: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (batch, kv_heads, new, head_dim) keys and values; with cache_position (new,), at those slots."""
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search keeps the beams it extends)."""
        raise NotImplementedError(f"{type(self).__name__} does not support reorder_cache")


class DynamicCache(Cache):
    """The default for `generate` and `use_cache=True`: per layer, keys and values in a buffer that grows by half
    again (in steps of 256 tokens) when full. Each step writes its tokens in place and attention reads a view of the
    first `length` tokens, so a step costs its own tokens, where growing by concatenation copies the whole cache every
    step (quadratic in the generated length). Under autograd (a cache whose keys need gradients) it concatenates,
    since writing in place would change tensors an earlier step saved for its backward."""

    _GROW_TOKENS = 256

    def __init__(self):
        self._keys: list[torch.Tensor] = []  # (batch, kv_heads, capacity, head_dim)
        self._values: list[torch.Tensor] = []
        self._lengths: list[int] = []

    @property
    def key_cache(self) -> list[torch.Tensor]:
        """Per layer, the stored keys (batch, kv_heads, tokens, head_dim): views of the buffers."""
        return [k[:, :, :n] for k, n in zip(self._keys, self._lengths)]

    @property
    def value_cache(self) -> list[torch.Tensor]:
        return [v[:, :, :n] for v, n in zip(self._values, self._lengths)]

    def __len__(self) -> int:
        return len(self._keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self._keys):
            return 0
        return self._lengths[layer_idx]

    def update(self, layer_idx, key, value, cache_position=None):
        # cache_position is implied: new tokens always follow the stored ones.
        new = key.shape[2]
        if layer_idx == len(self._keys):
            self._keys.append(key)
            self._values.append(value)
            self._lengths.append(new)
            return key, value
        length = self._lengths[layer_idx]
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if torch.is_grad_enabled() and (key.requires_grad or keys.requires_grad):
            keys = torch.cat([keys[:, :, :length], key], dim=2)
            values = torch.cat([values[:, :, :length], value], dim=2)
        else:
            if length + new > keys.shape[2]:  # full: move to a buffer half as large again
                step = self._GROW_TOKENS
                capacity = -(-max(length + new, length * 3 // 2) // step) * step
                keys, values = self._grow(keys, length, capacity), self._grow(values, length, capacity)
            keys[:, :, length:length + new] = key
            values[:, :, length:length + new] = value
        self._keys[layer_idx], self._values[layer_idx] = keys, values
        self._lengths[layer_idx] = length + new
        return keys[:, :, :length + new], values[:, :, :length + new]

    @staticmethod
    def _grow(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        batch, heads, _, head_dim = buffer.shape
        grown = buffer.new_empty(batch, heads, capacity, head_dim)
        grown[:, :, :length] = buffer[:, :, :length]
        return grown

    def reorder_cache(self, beam_idx):
        for i in range(len(self._keys)):
            device = self._keys[i].device
            self._keys[i] = self._keys[i].index_select(0, beam_idx.to(device))
            self._values[i] = self._values[i].index_select(0, beam_idx.to(device))

    def crop(self, max_length: int) -> None:
        """Keep only the first max_length tokens (used to roll back speculative or rejected tokens)."""
        self._lengths = [min(n, max_length) for n in self._lengths]

    def to_legacy_cache(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return tuple(zip(self.key_cache, self.value_cache))


class StaticCache(Cache):
    """Keys and values preallocated to `max_cache_len` tokens and written in place, so every decode step sees
    tensors of the same shape at the same addresses (what CUDA graphs and torch.compile need).

    Per layer: key and value of shape (batch, kv_heads, max_cache_len, head_dim), allocated on the first update
    (batch, device and dtype come from that step's keys unless given here). `update` writes the new tokens at
    their cache positions with index_copy_ and returns the whole buffers; the slots not written yet hold zeros and
    the attention mask hides them, because `kv_length` reports max_cache_len and query i sits at cache position
    past_len + i. The count of tokens written is a Python int per layer, so reading it never waits on the device.

    fixed_shape=False returns the written prefix instead (views of the same buffers, kv_length = tokens after this
    step): the shapes then grow, which a compiled or captured step cannot take, but an eager step attends over
    fewer slots and needs no mask. generate() uses it when the decode step is not compiled (on the CPU), so the
    static cache there is never slower than the dynamic one, which copies the whole cache at every step.
    """

    def __init__(self, config, max_cache_len: int, max_batch_size: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 fixed_shape: bool = True):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.fixed_shape = fixed_shape
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.key_cache: list[torch.Tensor | None] = [None] * self.num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * self.num_layers
        self._written = [0] * self.num_layers  # tokens stored per layer (Python ints: no device sync to read)

    def __len__(self) -> int:
        return self.num_layers

    def _allocate(self, layer_idx: int, key: torch.Tensor) -> None:
        batch = self.max_batch_size or key.shape[0]
        device = self.device or key.device
        dtype = self.dtype or key.dtype
        shape = (batch, self.num_kv_heads, self.max_cache_len, self.head_dim)
        self.key_cache[layer_idx] = torch.zeros(shape, device=device, dtype=dtype)
        self.value_cache[layer_idx] = torch.zeros(shape, device=device, dtype=dtype)
        if torch.device(device).type == "cuda":
            # Written in place by a captured decode step: tell torch.compile the buffers never move, or CUDA graphs
            # are skipped for mutating their inputs (or copy them in at every replay).
            torch._dynamo.mark_static_address(self.key_cache[layer_idx])
            torch._dynamo.mark_static_address(self.value_cache[layer_idx])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._written[layer_idx]

    def kv_length(self, new_tokens: int) -> int:
        return self.max_cache_len if self.fixed_shape else self._written[0] + new_tokens

    def update(self, layer_idx, key, value, cache_position=None):
        # key, value: (batch, kv_heads, new_tokens, head_dim)
        if self.key_cache[layer_idx] is None:
            self._allocate(layer_idx, key)
        if cache_position is not None:
            # The compiled step: write at the given slots, read no Python count (the caller calls mark_written).
            keys, values = self.key_cache[layer_idx], self.value_cache[layer_idx]
            keys.index_copy_(2, cache_position, key.to(keys.dtype))
            values.index_copy_(2, cache_position, value.to(values.dtype))
            return keys, values
        start, new = self._written[layer_idx], key.shape[2]
        if start + new > self.max_cache_len:
            raise ValueError(
                f"StaticCache holds at most {self.max_cache_len} tokens but {start} are stored and {new} more came; "
                f"build it with a larger max_cache_len (prompt length + max_new_tokens)"
            )
        keys, values = self.key_cache[layer_idx], self.value_cache[layer_idx]
        if key.shape[0] != keys.shape[0]:
            raise ValueError(
                f"StaticCache was allocated for batch {keys.shape[0]} but got keys for batch {key.shape[0]}; "
                f"build a new cache (or call reset()) for a different batch size"
            )
        # Slots start..start+new-1 are consecutive: a copy into a narrowed view (half the time of index_copy_ with a
        # positions tensor at batch 1: ~5 instead of ~10 us per layer on the CPU; copy_ casts the dtype too)
        keys.narrow(2, start, new).copy_(key)
        values.narrow(2, start, new).copy_(value)
        self._written[layer_idx] = start + new
        if not self.fixed_shape:
            return keys.narrow(2, 0, start + new), values.narrow(2, 0, start + new)
        return keys, values

    def reorder_cache(self, beam_idx):
        # In place, so the buffers keep their addresses (a captured graph reads them there).
        for keys, values in zip(self.key_cache, self.value_cache):
            if keys is not None:
                index = beam_idx.to(keys.device)
                keys.copy_(keys.index_select(0, index))
                values.copy_(values.index_select(0, index))

    def mark_written(self, length: int) -> None:
        """Record that every layer now holds `length` tokens (after updates made with cache_position)."""
        self._written = [length] * self.num_layers

    def crop(self, max_length: int) -> None:
        """Forget the tokens from position max_length on (the slots are overwritten by the next update)."""
        self._written = [min(n, max_length) for n in self._written]

    def reset(self) -> None:
        """Empty the cache for a new prompt of the same batch size, keeping the buffers (and their addresses)."""
        for keys, values in zip(self.key_cache, self.value_cache):
            if keys is not None:
                keys.zero_()
                values.zero_()
        self._written = [0] * self.num_layers
