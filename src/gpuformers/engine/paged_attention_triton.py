"""Paged attention as Triton kernels: each query reads its keys and values in place, through its sequence's block
table, instead of gathering them into a padded copy first (what the torch path in paged_attention.py does). Two
kernels: decode (one query token per sequence) and prefill (a chunk of query tokens per sequence, packed, after the
sequence's cached keys).

One program = one (sequence, kv head): the n_rep query heads that share the kv head are the rows of one tile
(padded to 16 rows so tl.dot applies), and the context is streamed in BLOCK_N-token tiles with an online softmax:

    slot(pos) = block_table[pos // block_size] * block_size + pos % block_size
    s = q k^T * scale                       (rows, BLOCK_N), -inf outside [window start, context_len)
    m' = max(m, rowmax(s)); p = exp(s - m'); l = l * exp(m - m') + rowsum(p); acc = acc * exp(m - m') + p v
    out = acc / l

Layouts: query (num_seqs, heads, head_dim); key_cache, value_cache (num_slots, kv_heads, head_dim) with a
contiguous last dimension; block_tables (num_seqs, max_blocks) int; context_lens (num_seqs,) int (keys in the
cache, this step's included). The torch reference is `paged_decode_reference`; tests compare the two under the
Triton interpreter on the CPU.

Prefill: one program = BLOCK_M query tokens of one sequence's chunk and one query head, the same online softmax
over key tiles, in base 2 (exp2, the scale times log2 e). The chunk's queries are the last q_len positions of the
context (bottom-right aligned, as the chunk's keys were written to their slots before attention): query i sits at
position context_len - q_len + i and sees the keys at positions <= its own (and inside the sliding window). Key
tiles start at the first one the program's first query may see and stop after its last query's position, so a
chunk after a long cached prefix reads each prefix key once per query tile. Layouts: query (total_q, heads,
head_dim) packed by cu_seqlens_q (num_seqs + 1,) int32; block_tables, context_lens as for decode. Its reference is
`paged_prefill_reference`.

Offers: paged_decode_attention, paged_decode_reference, paged_prefill_attention, paged_prefill_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels.attention import LOG2E, tile_sizes
from gpuformers.kernels.checks import check_same, check_tensor, dot_precision, next_power_of_2


@triton.jit
def _load_keys(K, V, table, positions, ok, kv_head, dims, dim_ok, stride_ks, stride_kh, stride_vs, stride_vh,
               BLOCK_SIZE: tl.constexpr):
    """One sequence's keys and values at `positions` (where `ok`; zeros elsewhere), read in place through its block
    table: slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE."""
    block = tl.load(table + positions // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + positions % BLOCK_SIZE
    mask = ok[:, None] & dim_ok[None, :]
    k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _paged_decode_kernel(Q, K, V, OUT, BLOCK_TABLES, CONTEXT_LENS,
                         stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_oh,
                         stride_bs, scale, window,
                         N_REP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    context_len = tl.load(CONTEXT_LENS + seq).to(tl.int32)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D_P2)
    row_ok = rows < N_REP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * N_REP + rows
    q = tl.load(Q + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (ROWS, D_P2)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_P2), tl.float32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    # Start at the tile holding `first`, so the first tile always has a visible key (m is finite after it).
    for tile in range((first // BLOCK_N) * BLOCK_N, context_len, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        visible = (pos < context_len) & (pos >= first)
        k, v = _load_keys(K, V, BLOCK_TABLES + seq * stride_bs, pos, visible, kv_head, dims, dim_ok,
                          stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_SIZE)  # (BLOCK_N, D_P2) each
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # (ROWS, BLOCK_N)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty context (no keys) gives 0, as the reference does
    tl.store(OUT + seq * stride_os + heads[:, None] * stride_oh + dims[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def _check_paged(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, **indices: torch.Tensor):
    """query (tokens, heads, head_dim) and the caches (slots, kv_heads, head_dim) fit together; every tensor on one
    device."""
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=3)
    check_tensor("value_cache", value_cache, ndim=3)
    check_same("device", query=query, key_cache=key_cache, value_cache=value_cache, **indices)
    check_same("dtype", query=query, key_cache=key_cache, value_cache=value_cache)
    heads, head_dim = query.shape[1:]
    if heads % key_cache.shape[1] or key_cache.shape[2] != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} and caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} do not fit: heads must be a multiple of kv_heads and "
                         f"head_dim must match")


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence against its paged keys: query (num_seqs, heads, head_dim) ->
    (num_seqs, heads, head_dim)."""
    _check_paged(query, key_cache, value_cache, block_tables=block_tables, context_lens=context_lens)
    num_seqs, heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must be (num_seqs, max_blocks) and (num_seqs,) with num_seqs = {num_seqs}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two (the kernel tiles keys by it)")
    block_tables = block_tables.contiguous()
    n_rep = heads // kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, kv_heads)](
        query, key_cache, value_cache, out, block_tables, context_lens.contiguous(),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, sliding_window or 0,
        N_REP=n_rep, ROWS=max(16, next_power_of_2(n_rep)), HEAD_DIM=head_dim, D_P2=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=min(64, max(16, block_size)), HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(query.dtype),
    )
    return out


def paged_decode_reference(query, key_cache, value_cache, block_tables, context_lens, block_size, scale,
                           sliding_window=None) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time (float32 math)."""
    out = torch.empty_like(query)
    n_rep = query.shape[1] // key_cache.shape[1]
    for i, length in enumerate(context_lens.tolist()):
        positions = torch.arange(length, device=query.device)
        if sliding_window is not None:
            positions = positions[max(0, length - sliding_window):]
        slots = block_tables[i, positions // block_size] * block_size + positions % block_size
        k = key_cache[slots].float().repeat_interleave(n_rep, dim=1)  # (keys, heads, head_dim)
        v = value_cache[slots].float().repeat_interleave(n_rep, dim=1)
        weights = torch.einsum("hd,khd->hk", query[i].float(), k).mul(scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", weights, v).to(out.dtype)
    return out


@triton.jit
def _paged_prefill_kernel(Q, K, V, OUT, BLOCK_TABLES, CU_Q, CONTEXT_LENS,
                          stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                          stride_bs, qk_scale, window,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    q_start = tl.load(CU_Q + seq).to(tl.int64)
    q_len = (tl.load(CU_Q + seq + 1) - tl.load(CU_Q + seq)).to(tl.int32)
    context_len = tl.load(CONTEXT_LENS + seq).to(tl.int32)
    first_position = context_len - q_len  # the chunk's first query's position
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    row_ok = rows < q_len
    positions = first_position + rows
    dims = tl.arange(0, D_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_M, D_P2)
    hi = tl.minimum(context_len, first_position + (tile + 1) * BLOCK_M)  # past the tile's last query: unseen
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_position + tile * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(tile * BLOCK_M < q_len, hi, lo)  # programs past a short chunk do nothing
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_P2), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < context_len
        k, v = _load_keys(K, V, BLOCK_TABLES + seq * stride_bs, keys, key_ok, kv_head, dims, dim_ok,
                          stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_SIZE)  # (BLOCK_N, D_P2) each
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale  # (BLOCK_M, BLOCK_N)
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        if HAS_WINDOW:
            visible = visible & (positions[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(OUT + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float, max_seqlen_q: int,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Each sequence's chunk of query tokens against its paged keys, causally after its cached prefix: query
    (total_q, heads, head_dim) packed by cu_seqlens_q (num_seqs + 1,) int32 -> (total_q, heads, head_dim).
    context_lens: keys in the cache per sequence, this chunk's included; max_seqlen_q: the longest chunk (sizes the
    grid without a host sync)."""
    _check_paged(query, key_cache, value_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                 context_lens=context_lens)
    total_q, heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    num_seqs = block_tables.shape[0]
    if block_tables.dim() != 2 or cu_seqlens_q.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)} and "
                         f"context_lens {tuple(context_lens.shape)} must be (num_seqs, max_blocks), (num_seqs + 1,) "
                         f"and (num_seqs,)")
    if cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two")
    out = torch.empty_like(query)
    if total_q == 0 or num_seqs == 0:
        return out
    block_m, block_n, warps, stages = tile_sizes(query.device, head_dim, "fwd", query.dtype)  # the flash forward's
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, num_seqs)
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables.contiguous(), cu_seqlens_q, context_lens.contiguous(),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale * LOG2E, sliding_window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, D_P2=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(query.dtype), num_warps=warps, num_stages=stages,
    )
    return out


def paged_prefill_reference(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, block_size,
                            scale, sliding_window=None) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time (float32 math)."""
    out = torch.empty_like(query)
    n_rep = query.shape[1] // key_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    for i, length in enumerate(context_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        positions = torch.arange(length, device=query.device)
        slots = block_tables[i, positions // block_size] * block_size + positions % block_size
        k = key_cache[slots].float().repeat_interleave(n_rep, dim=1)  # (keys, heads, head_dim)
        v = value_cache[slots].float().repeat_interleave(n_rep, dim=1)
        query_positions = torch.arange(length - (last - first), length, device=query.device)
        visible = positions[None, :] <= query_positions[:, None]  # (queries, keys)
        if sliding_window is not None:
            visible &= query_positions[:, None] - positions[None, :] < sliding_window
        scores = torch.einsum("qhd,khd->hqk", query[first:last].float(), k).mul(scale)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", weights, v).to(out.dtype)
    return out
