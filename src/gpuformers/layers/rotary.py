"""Rotary position embeddings: the inverse frequencies of every rope type, and applying them to q and k.

Rope types (config.rope_parameters["rope_type"]): default, linear, dynamic (NTK, recomputed as the sequence
grows past max_position_embeddings), yarn, llama3, longrope (long or short factors by sequence length). The
formulas are the published ones, written to give the same numbers as transformers.

Offers: RotaryEmbedding, rope_inv_freq, rotary_dim, apply_rotary_pos_emb, rotate_half.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpuformers.kernels.mapping import use_kernel_function

if TYPE_CHECKING:  # read for its fields only: the layers sit below the models
    from gpuformers.models.config import ModelConfig


def _base_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    # (dim/2,) float32: theta^(-2i/dim)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rotary_dim(config: ModelConfig) -> int:
    """How many dims of each head rotary turns: int(head_dim * partial_rotary_factor), as transformers rounds (all of
    them but in Phi-3-style partial rotary)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def rope_inv_freq(config: ModelConfig, device=None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq of shape (rotary_dim/2,), attention_scaling applied to cos and sin)."""
    rope = config.rope_parameters
    rope_type, base, dim = rope["rope_type"], rope["rope_theta"], rotary_dim(config)
    if rope_type == "default":
        return _base_inv_freq(base, dim, device), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim, device) / rope["factor"], 1.0
    if rope_type == "dynamic":
        # NTK-aware: stretch the base once the sequence outgrows the trained length.
        max_pos = config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = rope["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim, device), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(rope, dim, device), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, device)
    if rope_type == "longrope":
        return _longrope_inv_freq(config, device, seq_len)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(rope: dict, dim: int, device) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope["rope_theta"], dim, device)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are scaled down by factor, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig, device) -> tuple[torch.Tensor, float]:
    rope, dim = config.rope_parameters, rotary_dim(config)
    base = rope["rope_theta"]
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept (high frequencies)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope_inv_freq(config: ModelConfig, device, seq_len: int | None) -> tuple[torch.Tensor, float]:
    rope, dim = config.rope_parameters, rotary_dim(config)
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = bool(seq_len) and seq_len > original
    ext = torch.tensor(rope["long_factor" if use_long else "short_factor"], dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * rope["rope_theta"] ** shape), attention_factor


class RotaryEmbedding(nn.Module):
    """position_ids (batch, seq) -> cos, sin (batch, seq, rotary_dim: head_dim but in partial rotary), shared by all
    layers of a model."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_type
        self.original_max_seq_len = config.max_position_embeddings
        self.reset_buffers(device)

    def reset_buffers(self, device=None):
        """(Re)compute inv_freq; called after a model built on the meta device is loaded."""
        # Never on the meta device: the frequencies are tiny, and torch's meta kernels for them import the
        # compiler stack (about a second).
        if device is None or torch.device(device).type == "meta":
            device = "cpu"
        inv_freq, self.attention_scaling = rope_inv_freq(self.config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.max_seq_len_cached = self.original_max_seq_len
        self.long_inv_freq = None

    def _update_frequencies(self, position_ids: torch.Tensor, device):
        # Only dynamic and longrope depend on the sequence length; this costs a host sync, so skip it otherwise.
        seq_len = int(position_ids.max()) + 1
        if self.rope_type == "dynamic":
            if seq_len > self.max_seq_len_cached:  # grow
                self.inv_freq, self.attention_scaling = rope_inv_freq(self.config, device, seq_len)
                self.max_seq_len_cached = seq_len
            if seq_len < self.original_max_seq_len < self.max_seq_len_cached:  # back to the trained scale
                self.inv_freq = self.original_inv_freq.to(device)
                self.max_seq_len_cached = self.original_max_seq_len
        else:  # longrope
            original = self.config.rope_parameters["original_max_position_embeddings"]
            if self.long_inv_freq is None:
                self.long_inv_freq, _ = rope_inv_freq(self.config, device, original + 1)
            self.inv_freq = self.long_inv_freq if seq_len > original else self.original_inv_freq

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_type in ("dynamic", "longrope"):
            self._update_frequencies(position_ids, x.device)
        # (batch, seq, head_dim/2) in float32 whatever the model dtype, then cast once.
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # (multiplying by 1 changes no number, and costs two ops per step)
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension (x1 its first dim // 2 entries), as a new tensor."""
    second = x.shape[-1] - x.shape[-1] // 2
    # roll gives (x2, x1) in one op; negating x2 in place is exact (two ops fewer than slicing twice and
    # concatenating: a quarter of rotary's time at batch 1).
    rotated = x.roll(second, -1)
    rotated.narrow(-1, 0, second).neg_()
    return rotated


@use_kernel_function("rotary_pos_emb")  # use_kernels=True may route this to kernels/rotary.py
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """q (batch, heads, seq, head_dim), k (batch, kv_heads, seq, head_dim); cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return (x * cos) + (rotate_half(x) * sin)
    # The same sum (addition commutes exactly) with the second product and the sum in place: fewer allocations.
    return (x * cos).add_(rotate_half(x).mul_(sin))
