"""Paged decode attention as a Triton kernel: each decode query reads its keys and values in place, through its
block table, instead of gathering them into a padded copy first (what the torch path in paged_attention.py does).

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

Offers: paged_decode_attention, paged_decode_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels.checks import check_same, check_tensor, dot_precision, next_power_of_2


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
        block = tl.load(BLOCK_TABLES + seq * stride_bs + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_N, D_P2)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0)
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


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence against its paged keys: query (num_seqs, heads, head_dim) ->
    (num_seqs, heads, head_dim)."""
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=3)
    check_tensor("value_cache", value_cache, ndim=3)
    check_same("device", query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
               context_lens=context_lens)
    check_same("dtype", query=query, key_cache=key_cache, value_cache=value_cache)
    num_seqs, heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    if heads % kv_heads or key_cache.shape[2] != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} and caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} do not fit: heads must be a multiple of kv_heads and "
                         f"head_dim must match")
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
