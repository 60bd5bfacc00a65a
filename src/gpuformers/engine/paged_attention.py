"""Paged attention in torch (the CPU path and the reference for GPU kernels), and how the model reaches it.

The engine runs the model over one flattened batch: input_ids (1, total_tokens), no padding, each token with its
own position. Keys and values live in a paged cache, per layer of shape (num_blocks * block_size, kv_heads,
head_dim); `slot_mapping[t]` is where token t's key and value go and `block_tables[i]` lists sequence i's blocks.

The decoder layers are not changed: the model runner passes a `PagedKVCache` as `past_key_values` (its `update`
writes this step's keys and values into their slots and hands back the whole layer cache) and sets a
`PagedContext` for the step; the attention backends registered as "paged|sdpa" and "paged|eager" read the context
to find each sequence's queries and keys. Outside a step (plain `generate`) they behave exactly like "sdpa" and
"eager", so a model switched to a paged backend still works everywhere.

    flattened queries  [ d0 | d1 | d2 | p3 p3 p3 p3 | p4 p4 ]    d = decode (1 token), p = prefill chunk
    query_start         0    1    2    3             7      9
    context_lens       ctx0 ctx1 ctx2 ctx3          ctx4           (tokens in cache, this step's included)

"paged|flash_attention_4" (a model loaded with attn_implementation="flash_attention_4") is "paged|sdpa" whose prefill
chunks, on a Blackwell GPU with FlashAttention-4, go through its varlen entry point over the pages in place.

On a GPU the decodes (first in the batch) are attended together: by the Triton decode kernel in
paged_attention_triton.py, which reads keys in place through the block tables, or (for "paged|eager") by gathering
keys up to the longest context and masking the padding. The prefill chunks go, on a GPU with Triton, to its
prefill kernel, all in one launch per layer (each chunk after its cached keys, read in place); otherwise (the CPU,
"paged|eager", soft-capped or sink layers) each sequence is attended on its own, causally, after its cached prefix.
On the CPU the decodes of "paged|sdpa" go to the C decode kernel of paged_attention_cpu.py (all in one call, keys
read in place), or without a C compiler to torch's SDPA once per sequence.

Offers: PagedContext, PagedKVCache, paged_context, current_context, paged_attention, gathered_decode_keys,
PAGED_BACKENDS, write_kv (and the ops gpuformers::paged_kv_write, gpuformers::paged_attention).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpuformers.engine import paged_attention_cpu
from gpuformers.generation.cache import Cache
from gpuformers.layers.attention import AttentionInterface, build_attention_mask, eager_attention, sdpa_attention
from gpuformers.layers.flash_attention import fa4_pages_kv, flash_attention_4_paged_prefill


@dataclass
class PagedContext:
    """What the attention backend needs to know about one step's flattened batch."""

    slot_mapping: torch.Tensor  # (total_tokens,) int64: cache slot of each new token
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64, padded with 0
    context_lens: torch.Tensor  # (num_seqs,) int64: cached tokens after this step
    query_start: list[int]  # num_seqs + 1 offsets into the flattened tokens
    context_lens_list: list[int]  # the same as context_lens, on the host (no device sync to read)
    num_decodes: int  # the first num_decodes sequences have exactly one query token each
    block_size: int
    key_caches: list[torch.Tensor]  # per layer (num_blocks * block_size, kv_heads, head_dim)
    value_caches: list[torch.Tensor]
    max_decode_context: int | None = None  # keys gathered for the decodes; fixed when a CUDA graph replays
    # The same as block_tables, on the host, for the CPU path. The model runner gives it, so the tables are never
    # read back from the device (a sync that would wait for a step in flight); absent, they are, once per step.
    block_tables_list: list[list[int]] | None = None
    # query_start as an int32 tensor on the device, for the Triton prefill kernel; given by the model runner for a
    # step with prefill chunks (None in decode-only steps and CUDA graphs)
    cu_seqlens_q: torch.Tensor | None = None
    # Slots and masks are the same in every layer: built by the first layer of the step, reused by the others.
    memo: dict = field(default_factory=dict)


_local = threading.local()


def current_context() -> PagedContext | None:
    return getattr(_local, "context", None)


@contextlib.contextmanager
def paged_context(context: PagedContext):
    """Make `context` the one the paged backends see in this thread, for the duration of one forward."""
    previous = current_context()
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


class PagedKVCache(Cache):
    """The Cache the decoder layers talk to during an engine step: writes go to slots, reads are the whole layer."""

    def __init__(self, context: PagedContext):
        self.context = context

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Positions come from position_ids and masking from the paged backend: to the model every step looks like a
        # fresh causal pass over the flattened tokens, so it builds no mask of its own.
        return 0

    def update(self, layer_idx, key, value, cache_position=None):
        # key, value: (1, kv_heads, total_tokens, head_dim) -> slots (total_tokens, kv_heads, head_dim)
        ctx = self.context
        k_cache, v_cache = ctx.key_caches[layer_idx], ctx.value_caches[layer_idx]
        if torch.compiler.is_compiling():  # a compiled step (engine/compiled_step.py): the write as an op in place
            torch.ops.gpuformers.paged_kv_write(key, value, k_cache, v_cache, ctx.slot_mapping)
            return k_cache, v_cache
        write_kv(key, value, k_cache, v_cache, ctx.slot_mapping)
        return k_cache, v_cache


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value (1, kv_heads, total_tokens, head_dim) into the layer caches (slots, kv_heads, head_dim) at
    slot_mapping (total_tokens,)."""
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (total_tokens, kv_heads, head_dim)
    if not key.is_cuda and paged_attention_cpu.write_kv(key, value, key_cache, value_cache, slot_mapping):
        return  # float32 on the CPU, rows contiguous: one C call for both caches
    key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """(num_seqs, max_blocks) block ids -> (num_seqs, length) slots of positions 0..length-1."""
    positions = torch.arange(length, device=block_tables.device)
    blocks = block_tables.index_select(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _batch_decodes(query: torch.Tensor, ctx: PagedContext) -> bool:
    return query.is_cuda or ctx.max_decode_context is not None


def _triton_kernels_available(query: torch.Tensor) -> bool:
    """The Triton decode and prefill kernels serve "paged|sdpa" on CUDA when triton is installed ("paged|eager"
    stays torch)."""
    from gpuformers.kernels.checks import triton_importable

    return query.is_cuda and triton_importable()


def _decode_layout(ctx: PagedContext, sliding_window: int | None):
    """The decodes' key slots (nd, length) and mask (nd, 1, 1, length), True for real keys inside the window."""
    key = ("decode", sliding_window)
    if key not in ctx.memo:
        nd = ctx.num_decodes
        length = ctx.max_decode_context or max(ctx.context_lens_list[:nd])
        slots = _gather_slots(ctx.block_tables[:nd], length, ctx.block_size)
        positions = torch.arange(length, device=slots.device)
        lens = ctx.context_lens[:nd, None]
        mask = positions[None, :] < lens
        if sliding_window is not None:
            mask = mask & (positions[None, :] >= lens - sliding_window)
        ctx.memo[key] = (slots, mask[:, None, None, :])
    return ctx.memo[key]


def _prefill_layout(ctx: PagedContext, first: int) -> tuple[torch.Tensor, int]:
    """The prefill chunks of sequences first.. (after the decodes): their query offsets from the first chunk's start
    (int32, on the device) and the longest chunk. The same in every layer: made once per step."""
    key = ("prefill", first)
    if key not in ctx.memo:
        starts = ctx.query_start
        ctx.memo[key] = (ctx.cu_seqlens_q[first:] - ctx.cu_seqlens_q[first],
                         max(starts[i + 1] - starts[i] for i in range(first, len(starts) - 1)))
    return ctx.memo[key]


def gathered_decode_keys(ctx: PagedContext) -> bool:
    """Whether a forward in this context attended its decodes by gathering every row's keys up to the longest
    context (or max_decode_context), the torch path, whose cost grows with that length; the Triton decode kernel
    reads each row's own keys through the block tables instead."""
    return any(isinstance(key, tuple) and key[0] == "decode" for key in ctx.memo)


def _sequence_layout(ctx: PagedContext, i: int, sliding_window: int | None):
    """Sequence i's keys as (slots, mask): slots is a slice of the cache when its blocks are consecutive (keys are
    then read in place, a view) or else the (ctx_len,) slot indices to gather; mask (1, 1, n, ctx_len) is causal, or
    None when plain causal suffices."""
    key = ("prefill", i, sliding_window)
    if key not in ctx.memo:
        n = ctx.query_start[i + 1] - ctx.query_start[i]
        ctx_len = ctx.context_lens_list[i]
        slots = _slots(ctx, i, ctx_len)
        device = ctx.block_tables.device
        mask = build_attention_mask(None, n, ctx_len, ctx_len - n, sliding_window, device)
        if mask is None and n == 1:
            # A decode's query heads are folded into query rows (see paged_attention): say "no mask" with an
            # explicit all-True one, since backends read a missing mask with several query rows as causal.
            # Made on the device: a host-made mask copied over would wait for the step in flight.
            mask = torch.ones(1, 1, 1, ctx_len, dtype=torch.bool, device=device)
        ctx.memo[key] = (slots, mask)
    return ctx.memo[key]


def _slots(ctx: PagedContext, i: int, ctx_len: int) -> slice | torch.Tensor:
    """Sequence i's first ctx_len cache slots: a slice when its blocks are consecutive (keys read in place, a view),
    else the (ctx_len,) slot indices to gather."""
    slots = _contiguous_slots(ctx, i, ctx_len)
    return slots if slots is not None else _gather_slots(ctx.block_tables[i:i + 1], ctx_len, ctx.block_size)[0]


def _contiguous_slots(ctx: PagedContext, i: int, ctx_len: int) -> slice | None:
    """slice(first, first + ctx_len) when sequence i's first ctx_len slots are consecutive in the cache, else None.
    The block manager places sequences so that this is the common case."""
    if ctx.block_tables_list is None:
        ctx.block_tables_list = ctx.block_tables.tolist()  # once per step, shared by all layers
    blocks = ctx.block_tables_list[i][:-(-ctx_len // ctx.block_size)]
    first = blocks[0]
    if blocks != list(range(first, first + len(blocks))):
        return None
    return slice(first * ctx.block_size, first * ctx.block_size + ctx_len)


def _read_keys(cache: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
    """A sequence's keys (or values) from a layer cache (slots, kv_heads, head_dim) -> (1, kv_heads, ctx_len,
    head_dim): a view for a slice, a gathered copy for slot indices."""
    keys = cache[slots] if isinstance(slots, slice) else cache.index_select(0, slots)
    return keys.transpose(0, 1).unsqueeze(0)


def paged_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                    base=sdpa_attention, flash_prefill: bool = False, **kwargs):
    """query (1, heads, total_tokens, head_dim); key, value: the layer's paged cache from PagedKVCache.update.
    Returns (output (1, total_tokens, heads, head_dim), None)."""
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("sinks", None)  # gpt-oss's attention sinks: the same story as the soft-cap
    if torch.compiler.is_compiling() and current_context() is not None:
        # A compiled engine step: the whole function as one op that takes tensors only, so the step's Python
        # layout (PagedContext's lists and counts, read by the op from this thread's context at run time) never
        # becomes a guard or a constant of the graph.
        kind = "flash4" if flash_prefill else "eager" if base is eager_attention else "sdpa"
        out = torch.ops.gpuformers.paged_attention(query, key, value, scaling, sliding_window or 0,
                                                   0.0 if softcap is None else float(softcap), sinks, kind)
        return out, None
    if softcap is not None or sinks is not None:
        # Attention logit soft-capping (Gemma 2): SDPA, the CPU decode loop and the Triton decode kernel have no
        # place for it, so every call below goes to eager with the cap (the `base is sdpa_attention` paths skip).
        base = functools.partial(eager_attention, softcap=softcap, sinks=sinks)
    ctx = current_context()
    if ctx is None:  # not inside an engine step: an ordinary forward
        return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                    sliding_window=sliding_window, **kwargs)
    heads, total, head_dim = query.shape[1:]
    kv_heads = key.shape[1]
    out = query.new_empty(total, heads, head_dim)
    nd = ctx.num_decodes
    # On a GPU the decodes are attended in one batched call (few kernel launches; padded keys are masked). On the
    # CPU a loop over sequences is faster: it copies only each sequence's real keys and needs no mask, and its copy
    # (~270 KB) is still in cache when SDPA reads it. Measured at 1 thread, 64 decodes of 40..500 tokens, 4 kv heads
    # of 64, per layer: this loop 7-9 ms; one padded block gather + masked SDPA 40 ms (5x: twice the keys, fresh
    # pages for a 33 MB buffer); the same into a reused buffer 23 ms; groups of 2..16 by length 8-16 ms; one
    # gather of all real keys, then SDPA on slices 14-18 ms (the keys are out of cache when read); block-by-block
    # matmuls on the cache in place, no copy, 14 ms (two ops per block instead of two per sequence).
    batched = nd if _batch_decodes(query, ctx) else 0
    decode_queries = query[0, :, :nd].transpose(0, 1)  # (nd, heads, head_dim)
    if (not batched and nd and base is sdpa_attention
            and paged_attention_cpu.available(decode_queries, key, ctx.block_size)):
        # The CPU decode kernel: every decode in one call, keys read in place through the block tables
        # (engine/paged_attention_cpu.py; 2.3x the loop below at 32 decodes of <= 256 tokens, one thread)
        paged_attention_cpu.paged_decode_attention(decode_queries, key, value, ctx.block_tables, ctx.context_lens,
                                                   ctx.block_size, scaling, out[:nd], sliding_window)
        batched = nd  # the loop below does the prefill chunks only
    elif not batched and nd and base is sdpa_attention and sliding_window is None:
        out[:nd] = _cpu_decodes(ctx, query, key, value, scaling)  # no C compiler: SDPA per sequence
        batched = nd
    elif batched and base is sdpa_attention and _triton_kernels_available(query):
        from gpuformers.engine.paged_attention_triton import paged_decode_attention

        # Keys read in place through the block tables: no gathered copy. (nd, heads, head_dim)
        out[:nd] = paged_decode_attention(decode_queries, key, value, ctx.block_tables[:nd],
                                          ctx.context_lens[:nd], ctx.block_size, scaling, sliding_window)
    elif batched:
        slots, mask = _decode_layout(ctx, sliding_window)  # (nd, length), (nd, 1, 1, length)
        # (nd, length, kv_heads, head_dim) -> (nd, kv_heads, length, head_dim)
        k = key[slots].transpose(1, 2)
        v = value[slots].transpose(1, 2)
        if not query.is_cuda:  # a CPU cache starts uninitialised: padding slots may hold NaN, which 0 * NaN spreads
            padding = ~mask.transpose(-1, -2)  # (nd, 1, length, 1)
            k, v = k.masked_fill(padding, 0), v.masked_fill(padding, 0)
        # Grouped-query attention without copying keys per query head: the n_rep query heads that share a kv head
        # become n_rep query rows of that kv head (all at the same position, so one mask row serves them all).
        # Query head h = kv_head * n_rep + r, the order repeat_kv uses.
        q = decode_queries.reshape(nd, kv_heads, heads // kv_heads, head_dim)
        o, _ = base(module, q, k, v, mask, scaling=scaling)  # (nd, n_rep, kv_heads, head_dim)
        out[:nd] = o.transpose(1, 2).reshape(nd, heads, head_dim)
    num_seqs = len(ctx.query_start) - 1
    prefill_kernel = None
    if batched < num_seqs and base is sdpa_attention and ctx.cu_seqlens_q is not None:
        if flash_prefill and fa4_pages_kv(query):
            # "paged|flash_attention_4" on a GPU whose FlashAttention-4 reads paged KV: its varlen entry point
            prefill_kernel = flash_attention_4_paged_prefill
        elif _triton_kernels_available(query):
            from gpuformers.engine.paged_attention_triton import paged_prefill_attention

            prefill_kernel = paged_prefill_attention
    if prefill_kernel is not None:
        # The prefill chunks in one kernel call that reads each sequence's cached keys in place: no per-sequence
        # gathers, masks and SDPA calls (kernel launches that add up on a GPU).
        first = ctx.query_start[batched]
        cu, longest = _prefill_layout(ctx, batched)
        out[first:] = prefill_kernel(query[0, :, first:].transpose(0, 1), key, value, ctx.block_tables[batched:], cu,
                                     ctx.context_lens[batched:], ctx.block_size, scaling, longest, sliding_window)
        batched = num_seqs
    for i in range(batched, num_seqs):
        start, end = ctx.query_start[i], ctx.query_start[i + 1]
        slots, mask = _sequence_layout(ctx, i, sliding_window)
        k, v = _read_keys(key, slots), _read_keys(value, slots)  # (1, kv_heads, ctx_len, head_dim)
        if end - start == 1:  # one query token: the same GQA folding as above, (1, kv_heads, n_rep, head_dim)
            q = query[0, :, start].reshape(1, kv_heads, heads // kv_heads, head_dim)
            o, _ = base(module, q, k, v, mask, scaling=scaling)  # (1, n_rep, kv_heads, head_dim)
            out[start] = o[0].transpose(0, 1).reshape(heads, head_dim)
        else:
            o, _ = base(module, query[:, :, start:end], k, v, mask, scaling=scaling)
            out[start:end] = o[0]
    return out.unsqueeze(0), None


def _cpu_decodes(ctx: PagedContext, query, key, value, scaling: float) -> torch.Tensor:
    """The CPU decode hot path: the step's decodes (the first num_decodes sequences, one query token each) with
    torch's SDPA per sequence, over its keys read in place -> (num_decodes, heads, head_dim). Called once per layer,
    so each sequence costs one SDPA call and two slicing views, its key slots found once per step."""
    nd = ctx.num_decodes
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    slots = ctx.memo.get("cpu_decode_slots")
    if slots is None:  # a slice (consecutive blocks: the common case) or the slot indices to gather
        slots = ctx.memo["cpu_decode_slots"] = [_slots(ctx, i, ctx.context_lens_list[i]) for i in range(nd)]
    # Each decode's query heads folded onto its kv heads, as above: (nd, kv_heads, n_rep, head_dim). Inputs stay
    # 4-D (batch 1): torch's CPU flash kernel takes only those (3-D ones fall back to a slower path).
    q = query[0, :, :nd].transpose(0, 1).reshape(nd, kv_heads, heads // kv_heads, head_dim)
    keys, values = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # (1, kv_heads, slots, head_dim) views
    outs = []
    for i, where in enumerate(slots):
        if isinstance(where, slice):
            k, v = keys[:, :, where], values[:, :, where]
        else:
            k, v = keys.index_select(2, where), values.index_select(2, where)
        outs.append(F.scaled_dot_product_attention(q[i:i + 1], k, v, scale=scaling))  # every cached key is visible
    return torch.cat(outs).view(nd, heads, head_dim)


def paged_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    return paged_attention(module, query, key, value, attention_mask, base=sdpa_attention, **kwargs)


def paged_eager_attention(module, query, key, value, attention_mask, **kwargs):
    return paged_attention(module, query, key, value, attention_mask, base=eager_attention, **kwargs)


def paged_flash_attention_4(module, query, key, value, attention_mask, **kwargs):
    return paged_attention(module, query, key, value, attention_mask, base=sdpa_attention, flash_prefill=True,
                           **kwargs)


PAGED_BACKENDS = {"paged|sdpa": paged_sdpa_attention, "paged|eager": paged_eager_attention,
                  "paged|flash_attention_4": paged_flash_attention_4}
for _name, _fn in PAGED_BACKENDS.items():
    AttentionInterface.register(_name, _fn)


# --- the step as torch.library ops, for a compiled engine step (engine/compiled_step.py) ---------------------------
# Defined with torch.library.Library rather than the custom_op decorator: a compiled step calls each op once per
# layer, and the decorator's Python wrapping costs ~22 us per call against ~3 us for a plain Python kernel behind the
# dispatcher (measured on this machine, one thread), about 60 ms over 100M-parameter runs of 127 steps.

_LIBRARY = torch.library.Library("gpuformers", "FRAGMENT")
_LIBRARY.define("paged_kv_write(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                "Tensor slot_mapping) -> ()")
_LIBRARY.define("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, float scaling, "
                "int sliding_window, float softcap, Tensor? sinks, str kind) -> Tensor")


def _paged_kv_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    write_kv(key, value, key_cache, value_cache, slot_mapping)


class _Inference:
    """What the backends read of the attention module inside the op: it runs for inference only."""

    training = False


_BASES = {"sdpa": (sdpa_attention, False), "eager": (eager_attention, False), "flash4": (sdpa_attention, True)}


def _paged_attention_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scaling: float,
                        sliding_window: int, softcap: float, sinks: torch.Tensor | None, kind: str) -> torch.Tensor:
    """paged_attention over this thread's PagedContext (set by the model runner around the compiled step);
    sliding_window 0 and softcap 0.0 mean none. query (1, heads, total, head_dim) -> (1, total, heads, head_dim)."""
    base, flash_prefill = _BASES[kind]
    extra = {} if sinks is None else {"sinks": sinks}
    if softcap:
        extra["softcap"] = softcap
    out, _ = paged_attention(_Inference(), query, key_cache, value_cache, None, scaling=scaling,
                             sliding_window=sliding_window or None, base=base, flash_prefill=flash_prefill, **extra)
    return out


# CompositeExplicitAutograd: one kernel for every device (the Python bodies pick theirs); inference only
_LIBRARY.impl("paged_kv_write", _paged_kv_write, "CompositeExplicitAutograd")
_LIBRARY.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("gpuformers::paged_kv_write", lib=_LIBRARY)
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


@torch.library.register_fake("gpuformers::paged_attention", lib=_LIBRARY)
def _(query, key_cache, value_cache, scaling, sliding_window, softcap, sinks, kind):
    heads, total, head_dim = query.shape[1:]
    return query.new_empty(1, total, heads, head_dim)
