"""The attention backends beyond eager and sdpa: "triton" (our FlashAttention-style kernel, kernels/attention.py),
"flash_attention_2" / "flash_attention_3" (the flash-attn package, when installed and the GPU supports it),
"flash_attention_4" (FlashAttention CuTe, `flash_attn.cute`, on Hopper and Blackwell) and "flex_attention" (torch's,
when this torch has it: compiled once per process on CUDA, with one block mask per forward shared by the layers).
Importing this file registers them with AttentionInterface.

Asking for flash_attention_2/3/4 without the package (or on a GPU it does not support) falls back to "triton" with one
warning naming why; asking for them on the CPU is an error. flash-attn has no boolean-mask input, so a forward with a
padding mask goes to the triton kernel too (same numbers, no fallback warning needed); so does float32.

Offers: triton_attention, flash_attention_2, flash_attention_3, flash_attention_4, flex_attention,
check_backend_device, flash_attn_usable (why a flash backend cannot run on a device, or ''),
register_hub_attention (attn_implementation="org/repo": a Hub attention kernel through the `kernels` package),
fa4_pages_kv, flash_attention_4_paged_prefill (the engine's prefill chunks through FlashAttention-4's varlen entry).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import weakref
from collections import OrderedDict

import torch

from gpuformers.layers.attention import AttentionInterface, build_attention_mask, eager_attention

logger = logging.getLogger(__name__)

_INSTALL = {
    "flash_attention_2": "pip install flash-attn --no-build-isolation",
    "flash_attention_3": "build the hopper/ folder of the flash-attention repository: it has no PyPI package",
    # PyPI's flash-attn-cute 0.0.1 is an empty placeholder: the CuTe build comes from the repository's sources
    "flash_attention_4": "pip install the flash_attn/cute folder of the flash-attention repository (FlashAttention-4)",
}
# (oldest, first unsupported) compute capability: Ampere+ / Hopper / Hopper and Blackwell (sm_90 to sm_11x)
_CAPABILITY = {"flash_attention_2": ((8, 0), None), "flash_attention_3": ((9, 0), (10, 0)),
               "flash_attention_4": ((9, 0), (12, 0))}
_PACKAGE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface",
            "flash_attention_4": "flash_attn.cute"}
_GPU_WORDS = {"flash_attention_2": "an Ampere or newer GPU", "flash_attention_3": "a Hopper GPU",
              "flash_attention_4": "a Hopper or Blackwell GPU"}
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
    if name in _CAPABILITY and torch.device(device).type != "cuda":
        raise ValueError(
            f"attn_implementation={name!r} needs an NVIDIA GPU but the model is on {torch.device(device)}; "
            f"use attn_implementation='sdpa' (or 'triton' with TRITON_INTERPRET=1 for tests)"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # "flash_attn.cute" without flash_attn, or a module with no spec
        return False


def flash_attn_usable(name: str, capability: tuple[int, int] | None) -> str:
    """'' when the package behind flash backend `name` is installed and a GPU of `capability` (None: no GPU)
    supports it, else why not, in words that name the fix."""
    if not _installed(_PACKAGE[name]):
        return f"the {_PACKAGE[name]} package is not installed ({_INSTALL[name]})"
    if capability is None:
        return f"{name} needs {_GPU_WORDS[name]} and there is none"
    oldest, too_new = _CAPABILITY[name]
    if tuple(capability) < oldest or (too_new is not None and tuple(capability) >= too_new):
        return (f"{name} needs {_GPU_WORDS[name]} (compute capability {'.'.join(map(str, oldest))}"
                f"{'' if too_new is None else ' up to ' + str(too_new[0] - 1) + '.x'}), this one is "
                f"{'.'.join(map(str, capability))}")
    return ""


def _flash_attn_usable(name: str, device: torch.device) -> str:
    """'' when the flash-attn package for `name` can run on `device`, else why not (in words)."""
    return flash_attn_usable(name, torch.cuda.get_device_capability(device))


def _fallback(module, query, key, value, attention_mask, scaling, dropout, sliding_window, kwargs):
    """The triton kernel for a call flash-attn cannot take; "eager" for a soft-capped call (Gemma 2's softcap
    reaches flash_attention_4 only, and the triton kernel has no soft-cap), which applies the cap and the window."""
    if kwargs.get("softcap") is not None:
        mask = attention_mask
        if mask is None and (sliding_window or query.shape[2] > 1):
            mask = build_attention_mask(None, query.shape[2], key.shape[2], key.shape[2] - query.shape[2],
                                        sliding_window, device=query.device)
        return eager_attention(module, query, key, value, mask, scaling=scaling, dropout=dropout,
                               softcap=kwargs["softcap"])
    return triton_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                            sliding_window=sliding_window)


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
            return _fallback(module, query, key, value, attention_mask, scaling, dropout, sliding_window, kwargs)
        if attention_mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
            # Padding masks and float32 are outside flash-attn's interface; the triton kernel gives the same result.
            return _fallback(module, query, key, value, attention_mask, scaling, dropout, sliding_window, kwargs)
        # flash-attn takes (batch, seq, heads, head_dim); window_size=(left, right) keys around each query.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        causal = query.shape[2] > 1  # flash-attn aligns the diagonal bottom-right, as the KV cache needs
        if name == "flash_attention_2":
            from flash_attn import flash_attn_func

            window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
            out = flash_attn_func(q, k, v, dropout_p=dropout if module.training else 0.0, softmax_scale=scaling,
                                  causal=causal, window_size=window)
        elif name == "flash_attention_3":
            from flash_attn_interface import flash_attn_func

            window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
            out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, window_size=window)
        else:
            out = _flash_attention_4(module, q, k, v, scaling=scaling, dropout=dropout, causal=causal,
                                     sliding_window=sliding_window, softcap=kwargs.get("softcap"))
        return (out[0] if isinstance(out, tuple) else out), None

    backend.__name__ = name
    return backend


def _flash_attention_4(module, q, k, v, *, scaling, dropout, causal, sliding_window, softcap):
    """FlashAttention CuTe's flash_attn_func on (batch, seq, heads, head_dim) inputs: grouped-query attention as is
    (kv_heads divides heads), None for an unbounded side of the window, softcap 0.0 for none."""
    from flash_attn.cute import flash_attn_func  # optional: FlashAttention-4, found by flash_attn_usable

    if dropout and module is not None and module.training:
        raise NotImplementedError(f"attention dropout ({dropout}) is not implemented by flash_attention_4; set "
                                  f"config.attention_dropout=0 or use attn_implementation='flash_attention_2'")
    window = (sliding_window - 1, 0) if sliding_window else (None, None)
    return flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, window_size=window,
                           softcap=float(softcap or 0.0))


def fa4_pages_kv(query: torch.Tensor) -> bool:
    """Whether FlashAttention-4 can attend `query` over the engine's paged KV cache: its paged-KV kernels are
    Blackwell's (sm_100 to sm_11x; this release refuses a page table on Hopper), in float16 / bfloat16."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    why = _usable.get(("flash_attention_4", query.device))
    if why is None:
        why = _usable[("flash_attention_4", query.device)] = _flash_attn_usable("flash_attention_4", query.device)
    return not why and torch.cuda.get_device_capability(query.device)[0] >= 10


def flash_attention_4_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens,
                                    block_size: int, scaling: float, max_seqlen_q: int,
                                    sliding_window: int | None = None) -> torch.Tensor:
    """FlashAttention-4's varlen entry point over the engine's paged cache: query (total_q, heads, head_dim) packed by
    cu_seqlens_q (num_seqs + 1,) int32, each chunk after its sequence's cached keys; caches (num_blocks * block_size,
    kv_heads, head_dim) read as pages (num_blocks, block_size, kv_heads, head_dim) through block_tables (num_seqs,
    max_blocks); context_lens (num_seqs,) keys of each sequence, this step's included. Causal from the end of each
    sequence's keys, as flash-attn aligns it -> (total_q, heads, head_dim)."""
    from flash_attn.cute import flash_attn_varlen_func  # optional: FlashAttention-4, checked by fa4_pages_kv

    pages = (key_cache.view(-1, block_size, *key_cache.shape[1:]), value_cache.view(-1, block_size,
                                                                                     *value_cache.shape[1:]))
    window = (sliding_window - 1, 0) if sliding_window else (None, None)
    out = flash_attn_varlen_func(query, *pages, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                 seqused_k=context_lens.to(torch.int32), page_table=block_tables.to(torch.int32),
                                 softmax_scale=scaling, causal=True, window_size=window)
    return out[0] if isinstance(out, tuple) else out


flash_attention_2 = _flash_backend("flash_attention_2")
flash_attention_3 = _flash_backend("flash_attention_3")
flash_attention_4 = _flash_backend("flash_attention_4")


def register_hub_attention(name: str, *, allow_all_kernels: bool = False):
    """attn_implementation="org/repo" (or "org/repo@rev", "org/repo:function"): an attention kernel from the Hub
    through the `kernels` package (kernels/hub_kernels.py, trust rule included), registered under `name`.

    A kernel with flash-attn 2's `flash_attn_func` is called as flash_attention_2 calls it ((batch, seq, heads,
    head_dim), causal bottom-right, window (left, 0)); a named function is used as an AttentionInterface backend
    itself. Calls with a padding mask (flash-attn has no mask input), attention sinks or a soft-cap go to "sdpa"
    ("eager" for the last two), which the kernel could not compute."""
    from gpuformers.kernels.hub_kernels import load_kernel_module, parse_kernel

    spec = parse_kernel(name, need_name=False)
    kernel = load_kernel_module(spec, allow_all_kernels=allow_all_kernels)
    if spec.name is not None:
        backend = getattr(kernel, spec.name, None)
        if not callable(backend):
            raise ValueError(f"attention kernel {name!r} has no function {spec.name!r}")
    elif callable(getattr(kernel, "flash_attn_func", None)):
        backend = _flash_attn_func_backend(name, kernel.flash_attn_func)
    else:
        raise ValueError(f"attention kernel {name!r} has no flash_attn_func; name the backend function in it as "
                         f"'{spec.source}:function'")
    AttentionInterface.register(name, backend)
    return backend


def _flash_attn_func_backend(name: str, flash_attn_func):
    def backend(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None, **kwargs):
        if attention_mask is not None or kwargs.get("softcap") is not None or kwargs.get("sinks") is not None:
            from gpuformers.layers.attention import sdpa_attention

            return sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  softcap=kwargs.get("softcap"), sinks=kwargs.get("sinks"))
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seq, heads, head_dim)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        out = flash_attn_func(q, k, v, dropout_p=dropout if module is not None and module.training else 0.0,
                              softmax_scale=scaling, causal=query.shape[2] > 1, window_size=window)
        return (out[0] if isinstance(out, tuple) else out), None

    backend.__name__ = name
    return backend


# torch.compile'd flex_attention and create_block_mask, made on the first CUDA call (making them imports torch's
# compiler stack) and shared by every layer and model of the process. Uncompiled, flex_attention runs torch's reference
# path, which holds every (batch, heads, q_len, kv_len) score; compiled, it is one fused kernel that skips masked
# blocks. Default dynamic, as transformers: the first shapes compile static, the first change of a length compiles
# one graph with symbolic lengths that serves the rest (dynamic=False would compile again at every decode step).
_compiled_flex_attention = None
_compiled_create_block_mask = None

# Block masks already built, so that the layers of one forward share one instead of each building it again:
# key -> (weak reference to the mask tensor, or None for plain causal; the BlockMask). Every layer of a forward gets
# the same mask tensor for its sliding window (build_attention_mask's, one per window), so a mask's entry is keyed by
# that tensor (identity and version) and lives as long as it does: its BlockMask is kept without the mask_mod that
# reads the tensor (given again at each call), so the cache never keeps a forward's mask alive, and the weak
# reference drops the entry with the mask. A plain-causal BlockMask depends on its key alone and is reused across
# forwards; the oldest entries go past _MAX_BLOCK_MASKS (decode steps add one per kv_len).
_block_masks: OrderedDict[tuple, tuple[weakref.ref | None, object]] = OrderedDict()
_MAX_BLOCK_MASKS = 16


def _flex_functions(device: torch.device):
    """(flex_attention, create_block_mask) for tensors on `device`: the compiled pair on CUDA, torch's own on the CPU
    (compiling there takes tens of seconds per shape) and inside a graph being compiled (that compile takes them in)."""
    global _compiled_flex_attention, _compiled_create_block_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return torch_flex_attention, create_block_mask
    if _compiled_flex_attention is None:
        # torch.compile(create_block_mask) is what create_block_mask(..., _compile=True) runs (and what torch now
        # recommends instead of that flag): the mask is evaluated block by block, never as a (q_len, kv_len) tensor.
        _compiled_flex_attention = torch.compile(torch_flex_attention)
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_flex_attention, _compiled_create_block_mask


def _flex_block_mask(create_block_mask, attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                     sliding_window: int | None, device: torch.device):
    """The BlockMask for a call with this mask (boolean (batch or 1, 1, q_len, kv_len), True where a query may
    attend) or, with None, bottom-right causal within `sliding_window`; built once for all the layers that share it."""
    if attention_mask is not None:
        mask = attention_mask.expand(batch, 1, q_len, kv_len)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]

        # An inference tensor keeps no version counter (and cannot be changed outside inference mode anyway).
        version = None if attention_mask.is_inference() else attention_mask._version
        key = (batch, q_len, kv_len, None, device, id(attention_mask), version)
    else:
        offset = kv_len - q_len

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx + offset
            if sliding_window:
                visible = visible & (q_idx + offset - kv_idx < sliding_window)
            return visible

        key = (batch, q_len, kv_len, sliding_window, device, None, None)
    if torch.compiler.is_compiling():  # the graph being compiled holds the block mask; no Python cache in it
        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    entry = _block_masks.get(key)
    if entry is not None and (entry[0] is None or entry[0]() is attention_mask):
        _block_masks.move_to_end(key)
        block_mask = entry[1]
    else:
        block_mask = create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
        if attention_mask is None:
            _block_masks[key] = (None, block_mask)
        else:
            from torch.nn.attention.flex_attention import noop_mask

            kept = copy.copy(block_mask)
            kept.mask_mod = noop_mask  # no reference to the mask tensor from the cache
            _block_masks[key] = (weakref.ref(attention_mask, lambda _, key=key: _block_masks.pop(key, None)), kept)
        while len(_block_masks) > _MAX_BLOCK_MASKS:
            _block_masks.popitem(last=False)
    if attention_mask is not None:
        block_mask = copy.copy(block_mask)
        block_mask.mask_mod = mask_mod
    return block_mask


def flex_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                   **kwargs):
    """torch's flex_attention with a block mask built from the same rules (bottom-right causal, window, padding):
    compiled on CUDA, and one block mask per forward (not per layer)."""
    if dropout and module.training:
        raise NotImplementedError("attention dropout is not implemented in the flex_attention backend")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    torch_flex_attention, create_block_mask = _flex_functions(query.device)
    block_mask = _flex_block_mask(create_block_mask, attention_mask, batch, q_len, kv_len, sliding_window,
                                  query.device)
    out = torch_flex_attention(query, key, value, block_mask=block_mask, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("triton", triton_attention)
AttentionInterface.register("flash_attention_2", flash_attention_2)
AttentionInterface.register("flash_attention_3", flash_attention_3)
AttentionInterface.register("flash_attention_4", flash_attention_4)
if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
    AttentionInterface.register("flex_attention", flex_attention)
