"""Stopping criteria: per row of the batch, is this sequence finished?

Each criterion is a callable `(input_ids (batch, seq), scores) -> BoolTensor (batch,)`, True for rows that are done,
with the names of transformers' classes. The checks run on the device (stop strings included), so the decode loop
can keep going without asking the GPU anything; generate() decides when to look at the flags. The length and eos
criteria are thin wrappers over the rules of generation/stop_rules.py, which the engine's finish check follows too;
stop strings are generate()'s alone (the engine has no text).

Stop strings are matched on bytes, so a string that spans several tokens, or starts or ends inside a token, is
found. A row stops when a stop string ends inside its newest token, exactly as transformers' StopStringCriteria:

    tokens:  ... | "Par" | "is" | ".\n" |        stop string "is."
    text:    ...  P a r   i s    . \n
                          ^^^^^^^ ends inside the newest token -> stop

How it stays on the device: every vocab token's bytes sit in one flat uint8 tensor with offsets, and a table says
which tokens hold a whole stop string (both built once per tokenizer). A match in the newest token either lies
inside it (one table lookup) or crosses its start; for that case each step gathers the L - 1 bytes on each side of
the boundary (L = longest stop string; a cumsum and a searchsorted over the last tokens' lengths) and compares
every stop string at every start before the boundary.

Offers: StoppingCriteria, StoppingCriteriaList, MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria,
StopStringCriteria, build_stopping_criteria, token_bytes.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import Any, Sequence

import torch

from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.stop_rules import newest_token_in, reached_length
from gpuformers.tokenizer import byte_level_alphabet


class StoppingCriteria:
    """Base class: `__call__(input_ids, scores) -> BoolTensor (batch,)`, True where the row is done."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(input_ids, scores)")


class StoppingCriteriaList(list):
    """A list of criteria that is itself one: a row is done when any criterion says so."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            done = done | criterion(input_ids, scores, **kwargs)
        return done

    @property
    def max_length(self) -> int | None:
        for criterion in self:
            if isinstance(criterion, MaxLengthCriteria):
                return criterion.max_length
        return None


class MaxLengthCriteria(StoppingCriteria):
    """Done once the sequence (prompt included) holds `max_length` tokens."""

    def __init__(self, max_length: int):
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        self.max_length = max_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        # a host fact: the length is the same for every row
        done = reached_length(input_ids.shape[1], self.max_length)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class MaxTimeCriteria(StoppingCriteria):
    """Done once `max_time` seconds have passed since `initial_timestamp` (default: when the criterion was built)."""

    def __init__(self, max_time: float, initial_timestamp: float | None = None):
        if not isinstance(max_time, (int, float)) or not max_time > 0:
            raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}")
        self.max_time = float(max_time)
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        done = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class EosTokenCriteria(StoppingCriteria):
    """Done for the rows whose newest token is one of the eos tokens."""

    def __init__(self, eos_token_id: int | Sequence[int] | torch.Tensor):
        if isinstance(eos_token_id, torch.Tensor):
            ids = eos_token_id.reshape(-1).tolist()
        else:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not ids:
            raise ValueError("EosTokenCriteria needs at least one eos token id, got an empty list")
        self.eos_token_id = torch.tensor(ids, dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        if self.eos_token_id.device != input_ids.device:
            self.eos_token_id = self.eos_token_id.to(input_ids.device)
        return newest_token_in(input_ids, self.eos_token_id)


class StopStringCriteria(StoppingCriteria):
    """Done for the rows whose text has a stop string ending inside the newest token (see the module docstring)."""

    def __init__(self, tokenizer: Any, stop_strings: str | Sequence[str]):
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}")
        self.stop_strings = strings
        encoded = [s.encode("utf-8") for s in strings]
        flat, offsets = token_bytes(tokenizer)
        lengths = offsets[1:] - offsets[:-1]
        # ids past the vocab (an lm head wider than the tokenizer) read as an empty token
        self._offsets = torch.cat([offsets[:-1], offsets[-1:]])  # (vocab + 1,) start of each token, then the end
        self._lengths = torch.cat([lengths, lengths.new_zeros(1)])  # (vocab + 1,)
        self._flat = torch.cat([flat, flat.new_zeros(1)])  # one spare byte so clamped indices stay in range
        # (vocab + 1,) True where a token holds a whole stop string by itself
        raw = bytes(flat.tolist()) if flat.numel() else b""
        bounds = offsets.tolist()
        inside = [any(b in raw[bounds[t]:bounds[t + 1]] for b in encoded) for t in range(len(bounds) - 1)]
        self._holds_stop = torch.tensor(inside + [False], dtype=torch.bool)
        # A stop string that crosses the newest token's start uses at most L - 1 bytes on each side of it.
        self._side = max(max(len(b) for b in encoded) - 1, 1)
        self._window_tokens = 2 * self._side + 1  # earlier tokens to read (>= 1 byte each; margin for empty ones)
        longest = self._side + 1
        self._stops = torch.full((len(encoded), longest), -1, dtype=torch.int16)  # (n, L), -1 past each string
        for i, b in enumerate(encoded):
            self._stops[i, : len(b)] = torch.tensor(list(b), dtype=torch.int16)
        self._stop_lengths = torch.tensor([len(b) for b in encoded])

    def _to(self, device: torch.device) -> None:
        if self._flat.device != device:
            for name in ("_flat", "_offsets", "_lengths", "_holds_stop", "_stops", "_stop_lengths"):
                setattr(self, name, getattr(self, name).to(device))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None = None, **kwargs) -> torch.BoolTensor:
        device = input_ids.device
        self._to(device)
        vocab = self._lengths.shape[0] - 1
        side = self._side
        newest = input_ids[:, -1].clamp(max=vocab)  # (batch,)
        # Case 1: the newest token holds a whole stop string.
        done = self._holds_stop[newest]
        # Case 2: a stop string crosses the start of the newest token. Build, per row, the `side` bytes before the
        # newest token followed by its first `side` bytes (-1 where there are none) and look for strings that
        # start before the boundary and end after it.
        j = torch.arange(side, device=device)
        head_index = self._offsets[newest][:, None] + j  # (batch, side)
        head = torch.where(j < self._lengths[newest][:, None], self._flat[head_index.clamp(max=self._flat.shape[0] - 1)]
                           .to(torch.int16), -1)
        earlier = input_ids[:, :-1][:, -self._window_tokens:].flip(1).clamp(max=vocab)  # (batch, K), newest first
        if earlier.shape[1] == 0:
            tail = torch.full((input_ids.shape[0], side), -1, dtype=torch.int16, device=device)
        else:
            lengths = self._lengths[earlier]  # (batch, K)
            ends = lengths.cumsum(dim=1)  # bytes covered by the newest k + 1 earlier tokens
            # byte r before the boundary (r = 0 is the closest) lies in earlier token k = #tokens ending at or before r
            k = torch.searchsorted(ends, j.expand(earlier.shape[0], -1).contiguous(), right=True)  # (batch, side)
            present = k < earlier.shape[1]
            k = k.clamp(max=earlier.shape[1] - 1)
            token = earlier.gather(1, k)
            from_token_end = j - (ends.gather(1, k) - lengths.gather(1, k))
            index = self._offsets[token] + lengths.gather(1, k) - 1 - from_token_end
            index = index.clamp(0, self._flat.shape[0] - 1)
            tail = torch.where(present, self._flat[index].to(torch.int16), -1).flip(1)  # (batch, side), in text order
        text = torch.cat([tail, head], dim=1)  # (batch, 2 * side); the newest token starts at index `side`
        windows = torch.nn.functional.pad(text, (0, side), value=-1).unfold(1, side + 1, 1)  # (batch, 2*side, L)
        positions = torch.arange(side + 1, device=device)
        beyond = positions[None, :] >= self._stop_lengths[:, None]  # (n, L): past the end of each string
        hit = ((windows[:, :, None, :] == self._stops[None, None]) | beyond[None, None]).all(dim=-1)  # (batch, 2s, n)
        start = torch.arange(2 * side, device=device)[:, None]  # (2s, 1)
        crosses = (start < side) & (start + self._stop_lengths[None, :] > side)  # (2s, n)
        return done | (hit & crosses[None]).flatten(1).any(dim=1)


def build_stopping_criteria(
    generation_config: GenerationConfig,
    prompt_length: int,
    tokenizer: Any = None,
    max_position_embeddings: int | None = None,
) -> StoppingCriteriaList:
    """The criteria `generation_config` asks for, in transformers' order: max length, max time, stop strings, eos.

    prompt_length: tokens per row before generation (padding included), for max_new_tokens. tokenizer: needed for
    stop_strings. max_position_embeddings: caps the default length (20 new tokens) as transformers does.
    """
    gc = generation_config
    criteria = StoppingCriteriaList()
    criteria.append(MaxLengthCriteria(gc.max_length_for(prompt_length, max_position_embeddings)))
    if gc.max_time is not None:
        criteria.append(MaxTimeCriteria(gc.max_time))
    if gc.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={gc.stop_strings!r} needs the tokenizer to find the strings in the tokens; pass it "
                f"with generate(..., tokenizer=tokenizer)"
            )
        criteria.append(StopStringCriteria(tokenizer, gc.stop_strings))
    if gc.eos_token_ids:
        criteria.append(EosTokenCriteria(gc.eos_token_ids))
    return criteria


# --- the bytes each token stands for ---------------------------------------------------------------------------------

_TOKEN_BYTES_CACHE: "weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes each token id adds to decoded text, packed as (flat uint8 bytes, (vocab + 1,) offsets).

    Works for a gpuformers or transformers fast tokenizer, or a bare tokenizers.Tokenizer: byte-level BPE (GPT-2,
    Llama 3, Qwen) maps token characters back to bytes; byte fallback (`<0x0A>`) gives its byte; a sentencepiece
    "\u2581" becomes a space; other tokens use the tokenizer's own convert_tokens_to_string. Cached per tokenizer.
    """
    try:
        cached = _TOKEN_BYTES_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None:
        return cached
    vocab: dict[str, int] = tokenizer.get_vocab()
    decoder_types = _decoder_types(tokenizer)
    byte_level = "ByteLevel" in decoder_types
    byte_fallback = "ByteFallback" in decoder_types
    metaspace = "Metaspace" in decoder_types or "Replace" in decoder_types
    char_to_byte = {c: b for b, c in byte_level_alphabet().items()} if byte_level else {}
    size = max(vocab.values()) + 1 if vocab else 0
    pieces = [b""] * size
    for token, index in vocab.items():
        pieces[index] = _one_token_bytes(tokenizer, token, byte_level, byte_fallback, metaspace, char_to_byte)
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.long)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    flat = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8) if offsets[-1] > 0 else \
        torch.zeros(0, dtype=torch.uint8)
    result = (flat, offsets)
    try:
        _TOKEN_BYTES_CACHE[tokenizer] = result
    except TypeError:
        pass
    return result


def _one_token_bytes(tokenizer: Any, token: str, byte_level: bool, byte_fallback: bool, metaspace: bool,
                     char_to_byte: dict[str, int]) -> bytes:
    if byte_level and all(c in char_to_byte for c in token):
        return bytes(char_to_byte[c] for c in token)
    if byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    if metaspace:
        return token.replace("\u2581", " ").encode("utf-8")
    if byte_level:  # an added token written in plain text (e.g. "<|im_end|>" or one with spaces)
        return token.encode("utf-8")
    convert = getattr(tokenizer, "convert_tokens_to_string", None)
    return (convert([token]) if convert is not None else token).encode("utf-8")


def _decoder_types(tokenizer: Any) -> set[str]:
    """Types named in the backend tokenizer's decoder config, e.g. {"ByteLevel"} or {"Sequence", "Replace", ...}."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # or a bare tokenizers.Tokenizer
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    state = decoder.__getstate__()
    try:
        config = json.loads(state.decode() if isinstance(state, bytes) else state)
    except (TypeError, ValueError):
        return {type(decoder).__name__}
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found
