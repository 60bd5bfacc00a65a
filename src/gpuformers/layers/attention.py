"""Attention backends and the registry that picks one by the name users type.

A backend is a function

    fn(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None, **kwargs)
        query (batch, heads, q_len, head_dim); key, value (batch, kv_heads, kv_len, head_dim)
        attention_mask: None (plain causal, or no mask at all when q_len == 1) or a boolean
                        (batch, 1, q_len, kv_len) tensor, True where a query may attend
        softcap (keyword, Gemma 2): None, or scores become softcap * tanh(scores / softcap) before masking;
                        "eager" applies it, "sdpa" hands such a call to "eager" (torch's SDPA cannot), and a model
                        that soft-caps refuses the backends that would ignore it
        sinks (keyword, gpt-oss): None, or (heads,) learned logits, one more column of each query's scores
                        before the softmax, dropped after it; "eager" applies them, "sdpa" hands such a call to
                        "eager", and a model with sinks refuses the other backends
        -> (output (batch, q_len, heads, head_dim), attention weights or None)

registered under a name: "eager" and "sdpa" here; other backends (flash_attention_2, triton, paged) register
themselves from their own files, and users add theirs with `AttentionInterface.register("mine", fn)`.

Offers: AttentionInterface, ATTENTION_FUNCTIONS, eager_attention, sdpa_attention, repeat_kv, build_attention_mask,
build_attention_mask_at.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, kv_heads * n_rep, seq, head_dim) for grouped-query attention."""
    if n_rep == 1:
        return x
    batch, kv_heads, seq, head_dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(batch, kv_heads * n_rep, seq, head_dim)


def eager_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, softcap=None, sinks=None,
                    **kwargs):
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (batch, heads, q_len, kv_len)
    if softcap is not None:  # logit soft-capping: scores squashed into (-softcap, softcap)
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        # Added, not filled in, as transformers does: the same scores (the minimum absorbs any score), and a query
        # row with nothing to attend to (a left-pad position) passes gradients through its uniform softmax to the
        # scores as there, which matters once a loss reads that row (the last pad predicts the first real token).
        scores = scores + torch.zeros((), dtype=scores.dtype, device=scores.device).masked_fill(
            ~attention_mask, torch.finfo(scores.dtype).min)
    elif query.shape[2] > 1:
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril(
            key.shape[2] - query.shape[2]
        )
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    if sinks is not None:  # attention sinks: a per-head logit column that takes its share of the softmax
        # (1, heads, 1, 1); for a call whose n_rep query heads are folded onto their kv head as n_rep query rows
        # (the engine's decodes: query (n, kv_heads, n_rep, head_dim)) the same view is (1, kv_heads, n_rep, 1),
        # head h = kv_head * n_rep + r in both
        sink = sinks.to(scores.dtype).reshape(1, scores.shape[1], -1, 1)
        sink = sink.expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)  # (batch, heads, q_len, kv_len + 1)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    if dropout and module.training:
        weights = F.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, value)  # (batch, heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), weights


def sdpa_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, softcap=None, sinks=None,
                   **kwargs):
    if softcap is not None or sinks is not None:
        # SDPA has no hook between the scores and the softmax: eager computes the soft-cap and the sinks
        return eager_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               softcap=softcap, sinks=sinks)
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    dropout_p = dropout if module.training else 0.0
    if q_len == 1 and heads != kv_heads and (attention_mask is None or attention_mask.shape[2] == 1):
        # Decode with grouped-query attention: the n_rep query heads that share a kv head become n_rep "query
        # positions" of that head, so keys and values are read once, never repeated (3-10x faster on the CPU).
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, dropout_p=dropout_p,
                                             scale=scaling)
        # (batch, kv_heads, n_rep, head_dim) lists the heads in order: (batch, 1, heads, head_dim) is a reshape
        return out.reshape(batch, 1, heads, head_dim), None
    gqa = heads != kv_heads
    if gqa and attention_mask is not None and not query.is_cpu:
        # On CUDA only the flash and math kernels take enable_gqa, and flash takes no mask: with both, torch would run
        # the math kernel, which holds every (batch, heads, q_len, kv_len) score in float32 (tens of GB for a padded
        # batch's long prefill). Repeating the keys and values keeps the memory-efficient kernel, as transformers'
        # use_gqa_in_sdpa does. The CPU path is left as it was.
        key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
        gqa = False
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout_p,
        # torch's is_causal aligns the diagonal top-left: right only when q_len == kv_len.
        is_causal=attention_mask is None and q_len > 1,
        scale=scaling,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2).contiguous(), None


class AttentionInterface:
    """The registry of attention backends, keyed by `attn_implementation` names."""

    _functions: dict[str, Callable] = {"eager": eager_attention, "sdpa": sdpa_attention}
    # Backends defined in other modules, imported the first time someone asks for them.
    _lazy: dict[str, str] = {
        name: "gpuformers.layers.flash_attention"
        for name in ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention", "triton")
    }

    @classmethod
    def register(cls, name: str, fn: Callable) -> None:
        if not callable(fn):
            raise TypeError(f"attention backend {name!r} must be a function, got {type(fn).__name__}")
        cls._functions[name] = fn

    @classmethod
    def register_lazy(cls, name: str, module: str) -> None:
        cls._lazy[name] = module

    @classmethod
    def names(cls) -> list[str]:
        return sorted(set(cls._functions) | set(cls._lazy))

    @classmethod
    def get(cls, name: str) -> Callable:
        if name not in cls._functions and name in cls._lazy:
            import importlib

            importlib.import_module(cls._lazy[name])  # registers itself
        elif name not in cls._functions and "/" in name:  # a Hub kernel, "org/repo[@rev][:function]"
            from gpuformers.layers.flash_attention import register_hub_attention

            register_hub_attention(name)
        try:
            return cls._functions[name]
        except KeyError:
            raise ValueError(
                f"attn_implementation {name!r} is not known; available: {', '.join(cls.names())} "
                f"(register your own with AttentionInterface.register(name, fn), or name a Hub kernel "
                f"'org/repo')"
            ) from None


ATTENTION_FUNCTIONS = AttentionInterface


def build_attention_mask_at(
    attention_mask: torch.Tensor | None,
    cache_position: torch.Tensor,
    kv_len: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The same mask as build_attention_mask, for queries at cache positions given as a tensor (q_len,): no host
    sync and no shape that depends on a value, so a compiled or CUDA-graph-captured decode step is built once."""
    kv_pos = torch.arange(kv_len, device=cache_position.device)[None, :]
    q_pos = cache_position[:, None]
    mask = kv_pos <= q_pos  # (q_len, kv_len)
    if sliding_window is not None:
        mask = mask & (q_pos - kv_pos < sliding_window)
    mask = mask[None, None]
    if attention_mask is not None:
        keep = attention_mask[:, :kv_len].bool()
        if keep.shape[1] < kv_len:  # a preallocated cache longer than the mask: the rest is in the future
            keep = F.pad(keep, (0, kv_len - keep.shape[1]), value=True)
        mask = mask & keep[:, None, None, :]
    return mask


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    past_len: int,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """The boolean (batch or 1, 1, q_len, kv_len) mask for one forward, or None when plain causal suffices.

    attention_mask: (batch, >= past_len + q_len) of 1 for real tokens and 0 for padding, or None.
    Query i sits at cache position past_len + i; it sees key j when j <= past_len + i, the key is not padding,
    and, with a sliding window, past_len + i - j < sliding_window. device: where the mask is built when there is
    no attention_mask to take it from.
    A query row with nothing to attend to (a left-pad position) is left fully masked: SDPA returns zeros for it and
    eager a uniform average, exactly as transformers does, so even the logits at pad positions match.
    """
    if attention_mask is not None:
        device = attention_mask.device
    # Whether any key is padding is a value, not a shape: under torch.compile assume it is (the mask is then
    # built in the graph; the same result) instead of breaking the graph to look.
    padded = attention_mask is not None and (torch.compiler.is_compiling()
                                             or not bool(attention_mask[:, :kv_len].all()))
    windowed = sliding_window is not None and past_len + q_len > sliding_window
    if not padded and not windowed and (q_len == kv_len or q_len == 1) and past_len + q_len == kv_len:
        return None
    positions = torch.arange(past_len, past_len + q_len, device=device)
    return build_attention_mask_at(attention_mask, positions, kv_len, sliding_window)
