"""The attention backends beyond eager and sdpa: "triton" (our FlashAttention-style kernel, kernels/attention.py),
"flash_attention_2" / "flash_attention_3" (the flash-attn package, when installed and the GPU supports it) and
"flex_attention" (torch's, when this torch has it). Importing this file registers them with AttentionInterface.

Asking for flash_attention_2/3 without the package (or on a GPU it does not support) falls back to "triton" with one
warning; asking for them on the CPU is an error. flash-attn has no boolean-mask input, so a forward with a padding
mask goes to the triton kernel too (same numbers, no fallback warning needed).

Offers: triton_attention, flash_attention_2, flash_attention_3, flex_attention, check_backend_device.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from gpuformers.layers.attention import AttentionInterface

logger = logging.getLogger(__name__)

_INSTALL = "pip install flash-attn --no-build-isolation"
_MIN_CAPABILITY = {"flash_attention_2": (8, 0), "flash_attention_3": (9, 0)}  # Ampere / Hopper
_PACKAGE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
_warned: set[str] = set()
# (name, device) -> _flash_attn_usable's answer, asked once: every layer of every step calls the backend, and the
# question (a search of sys.path for the package, a query of the GPU) would cost more than a decode step's attention
# and break a compiled decode step's graph at every layer.
_usable: dict[tuple[str, torch.device], str] = {}


def triton_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                     **kwargs):
    """The AttentionInterface backend on kernels/attention.py: same inputs and outputs as sdpa_attention."""
    from gpuformers.kernels.attention import flash_attention

    if dropout and module is not None and module.training:
        raise NotImplementedError(
            f"attention dropout ({dropout}) is not implemented in the triton attention backend; set "
            f"config.attention_dropout=0 or use attn_implementation='sdpa'"
        )
    # A mask from build_attention_mask already holds causality and the window; without one, both are plain.
    out = flash_attention(query, key, value, causal=attention_mask is None, scale=scaling,
                          sliding_window=sliding_window if attention_mask is None else None, mask=attention_mask)
    return out.transpose(1, 2), None  # (batch, q_len, heads, head_dim)


def check_backend_device(name: str, device: torch.device | str) -> None:
    """Raise a clear error when `name` cannot run on `device` at all (flash-attn on the CPU)."""
    if name in _MIN_CAPABILITY and torch.device(device).type != "cuda":
        raise ValueError(
            f"attn_implementation={name!r} needs an NVIDIA GPU but the model is on {torch.device(device)}; "
            f"use attn_implementation='sdpa' (or 'triton' with TRITON_INTERPRET=1 for tests)"
        )


def _flash_attn_usable(name: str, device: torch.device) -> str:
    """'' when the flash-attn package for `name` can run on `device`, else why not (in words)."""
    if importlib.util.find_spec(_PACKAGE[name]) is None:
        return f"the {_PACKAGE[name]} package is not installed ({_INSTALL})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < _MIN_CAPABILITY[name]:
        need = ".".join(map(str, _MIN_CAPABILITY[name]))
        return f"{name} needs a GPU of compute capability {need} or newer, this one is {major}.{minor}"
    return ""


def _flash_backend(name: str):
    def backend(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None, **kwargs):
        check_backend_device(name, query.device)
        why = _usable.get((name, query.device))
        if why is None:
            why = _usable[(name, query.device)] = _flash_attn_usable(name, query.device)
        if why:
            if name not in _warned:
                _warned.add(name)
                logger.warning("attn_implementation=%r falls back to 'triton': %s", name, why)
            return triton_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    sliding_window=sliding_window)
        if attention_mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
            # Padding masks and float32 are outside flash-attn's interface; the triton kernel gives the same result.
            return triton_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    sliding_window=sliding_window)
        # flash-attn takes (batch, seq, heads, head_dim); window_size=(left, right) keys around each query.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        if name == "flash_attention_2":
            from flash_attn import flash_attn_func

            out = flash_attn_func(q, k, v, dropout_p=dropout if module.training else 0.0, softmax_scale=scaling,
                                  causal=query.shape[2] > 1, window_size=window)
        else:
            from flash_attn_interface import flash_attn_func

            out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=query.shape[2] > 1, window_size=window)
            out = out[0] if isinstance(out, tuple) else out
        return out, None

    backend.__name__ = name
    return backend


flash_attention_2 = _flash_backend("flash_attention_2")
flash_attention_3 = _flash_backend("flash_attention_3")


def flex_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                   **kwargs):
    """torch's flex_attention with a block mask built from the same rules (bottom-right causal, window, padding)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    if dropout and module.training:
        raise NotImplementedError("attention dropout is not implemented in the flex_attention backend")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    offset = kv_len - q_len
    if attention_mask is not None:
        mask = attention_mask.expand(batch, 1, q_len, kv_len)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx + offset
            if sliding_window:
                visible = visible & (q_idx + offset - kv_idx < sliding_window)
            return visible

    block_mask = create_block_mask(mask_mod, batch, None, q_len, kv_len, device=query.device)
    out = torch_flex_attention(query, key, value, block_mask=block_mask, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("triton", triton_attention)
AttentionInterface.register("flash_attention_2", flash_attention_2)
AttentionInterface.register("flash_attention_3", flash_attention_3)
if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
    AttentionInterface.register("flex_attention", flex_attention)
