"""FlashAttention-style attention as Triton kernels: forward and backward, causal, grouped-query (GQA), sliding
window, an optional boolean mask (padding), and variable-length packed sequences (cu_seqlens).

Forward (one program = BLOCK_M queries of one (sequence, head)): stream the keys in BLOCK_N tiles and keep a
running max m, sum l and output accumulator, so the (q_len, kv_len) score matrix never exists in memory:

    s = q k^T * scale * log2(e)              (BLOCK_M, BLOCK_N), in base 2 so exp2 is one instruction
    m' = max(m, rowmax(s)); p = 2^(s - m'); l = l * 2^(m - m') + rowsum(p); acc = acc * 2^(m - m') + p v
    out = acc / l;  lse = m + log2(l)        (kept for the backward)

Backward: delta = rowsum(dout * out) (torch), then one kernel per key tile for dk, dv (looping over the query
tiles of every query head of its group) and one per query tile for dq. No atomics, so results are deterministic.

Positions are aligned bottom-right like a KV cache: query i of a q_len chunk sits at key position
i + kv_len - q_len; causal lets it see keys j <= that, a sliding window W keeps (position - j) < W. Rows that see
no key (left padding) give zeros.

Layouts: padded q (batch, heads, q_len, head_dim), k and v (batch, kv_heads, kv_len, head_dim) (any strides with
a contiguous last dimension); packed q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim) with
cu_seqlens_q / cu_seqlens_k (num_seqs + 1,) int32 offsets.

Under torch.compile, flash_attention calls the torch.library op gpuformers::flash_attention (ops.py) instead of
FlashAttentionFunction; packed sequences then need max_seqlen_q / max_seqlen_k (no host sync in a graph).

Offers: flash_attention, attention_reference, FlashAttentionFunction, tile_sizes (the kernels' tiles, which the
engine's paged prefill kernel shares), LOG2E, and for ops.py's torch.library op AttentionProblem (one call's checked
shapes), attention_forward and attention_backward (the kernel launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor, dot_precision, next_power_of_2

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
_MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2 (axis 0 takes 2**31 - 1)


@triton.jit
def _visible(rows, cols, q_len, k_len, diag, window, b, MASK, stride_mb, stride_mq, stride_mk,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):
    # (BLOCK_M, BLOCK_N) booleans: may query row attend to key col.
    ok = (rows < q_len)[:, None] & (cols < k_len)[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + diag)
    if HAS_WINDOW:
        ok = ok & (rows[:, None] + diag - cols[None, :] < window)
    if HAS_MASK:
        # int64 rows: q_len * kv_len passes 2**31 at 46k tokens
        mask_ptr = MASK + b * stride_mb + rows.to(tl.int64)[:, None] * stride_mq + cols[None, :] * stride_mk
        allowed = tl.load(mask_ptr, mask=ok, other=0)
        ok = ok & (allowed != 0)
    return ok


@triton.jit
def _head_and_batch():
    # Grid (tiles, heads, batch): CUDA caps grid axes 1 and 2 at 65535 each, which batch * heads on one axis
    # passes (1,024 packed sequences of 64 heads). int64, since b * stride_qb passes 2**31 once q, k or the mask
    # holds 2**31 elements (q of 16 x 16k tokens x 64 heads x 128; an (8, 1, 16k, 16k) padding mask).
    return tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)


@triton.jit
def _seq_bounds(b, CU_Q, CU_K, Q_LEN, K_LEN, VARLEN: tl.constexpr):
    # Starts are int64 (they scale row strides of packed tensors); lengths stay int32 so tile loops use int32 math.
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        q_len = (tl.load(CU_Q + b + 1) - tl.load(CU_Q + b)).to(tl.int32)
        k_start = tl.load(CU_K + b).to(tl.int64)
        k_len = (tl.load(CU_K + b + 1) - tl.load(CU_K + b)).to(tl.int32)
    else:
        q_start = (b * 0).to(tl.int64)
        q_len = (b * 0 + Q_LEN).to(tl.int32)
        k_start = (b * 0).to(tl.int64)
        k_len = (b * 0 + K_LEN).to(tl.int32)
    return q_start, q_len, k_start, k_len


@triton.jit
def _key_range(pid_m, q_len, k_len, diag, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys query tile pid_m can see, lo a multiple of BLOCK_N (the forward and dq kernels' loop)."""
    lo = k_len * 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M + diag)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pid_m * BLOCK_M + diag - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(pid_m * BLOCK_M < q_len, hi, lo)  # programs past a short packed sequence do nothing
    return lo, hi


@triton.jit
def _load_tile(ptr, b, h, stride_b, stride_h, stride_s, positions, offs_d, mask):
    """(len(positions), BLOCK_D): rows of head h of sequence b (b = 0 for packed tensors, positions absolute)."""
    return tl.load(ptr + b * stride_b + h * stride_h + positions[:, None] * stride_s + offs_d[None, :], mask=mask,
                   other=0.0)


# Lengths and the window vary call to call; specialising on them (== 1, multiple of 16) would compile a kernel
# per shape. Strides keep their specialisation (it enables vector loads).
_DYNAMIC = ["Q_LEN", "K_LEN", "window"]


@triton.jit(do_not_specialize=_DYNAMIC)
def _attn_fwd_kernel(Q, K, V, O, LSE, MASK, CU_Q, CU_K,
                     stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                     stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                     stride_lb, stride_lh, stride_mb, stride_mq, stride_mk,
                     Q_LEN, K_LEN, head_dim, window, qk_scale,
                     GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                     VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    h, b = _head_and_batch()
    kvh = h // GROUP
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Q_LEN, K_LEN, VARLEN)
    diag = k_len - q_len
    b_dense = b * (1 - VARLEN)  # packed sequences address rows through q_start / k_start instead
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    q = tl.load(Q + b_dense * stride_qb + h * stride_qh + (q_start + rows)[:, None] * stride_qs + offs_d[None, :],
                mask=(rows < q_len)[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(pid_m, q_len, k_len, diag, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    k_base = K + b_dense * stride_kb + kvh * stride_kh
    v_base = V + b_dense * stride_vb + kvh * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kmask = (cols < k_len)[None, :] & dmask[:, None]
        k_t = tl.load(k_base + (k_start + cols)[None, :] * stride_ks + offs_d[:, None], mask=kmask, other=0.0)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        # Interior tiles, where every row of the block sees every key of the tile, skip building the mask: they
        # are most tiles of a long causal prefill.
        needs_mask = start_n + BLOCK_N > k_len
        if CAUSAL:
            needs_mask = needs_mask | (start_n + BLOCK_N - 1 > pid_m * BLOCK_M + diag)
        if HAS_WINDOW:
            needs_mask = needs_mask | ((pid_m + 1) * BLOCK_M - 1 + diag - start_n >= window)
        if HAS_MASK:
            needs_mask = needs_mask | True
        if needs_mask:
            ok = _visible(rows, cols, q_len, k_len, diag, window, b, MASK, stride_mb, stride_mq, stride_mk,
                          CAUSAL, HAS_WINDOW, HAS_MASK)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + (k_start + cols)[:, None] * stride_vs + offs_d[None, :],
                    mask=(cols < k_len)[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(O + b_dense * stride_ob + h * stride_oh + (q_start + rows)[:, None] * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=(rows < q_len)[:, None] & dmask[None, :])
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(LSE + b * stride_lb + h * stride_lh + q_start + rows, lse, mask=rows < q_len)


@triton.jit(do_not_specialize=_DYNAMIC)
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, MASK, CU_Q, CU_K,
                          stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                          stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
                          stride_lb, stride_lh, stride_mb, stride_mq, stride_mk,
                          Q_LEN, K_LEN, head_dim, window, qk_scale, sm_scale,
                          GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                          VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    kvh, b = _head_and_batch()
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Q_LEN, K_LEN, VARLEN)
    diag = k_len - q_len
    b_dense = b * (1 - VARLEN)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    kv_mask = (cols < k_len)[:, None] & dmask[None, :]
    k = _load_tile(K, b_dense, kvh, stride_kb, stride_kh, stride_ks, k_start + cols, offs_d, kv_mask)
    v = _load_tile(V, b_dense, kvh, stride_vb, stride_vh, stride_vs, k_start + cols, offs_d, kv_mask)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo = q_len * 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(lo, pid_n * BLOCK_N - diag)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(hi, (pid_n + 1) * BLOCK_N - 1 - diag + window)
    hi = tl.where(pid_n * BLOCK_N < k_len, hi, lo)
    for g in range(GROUP):
        h = kvh * GROUP + g
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_mask = (rows < q_len)[:, None] & dmask[None, :]
            q = _load_tile(Q, b_dense, h, stride_qb, stride_qh, stride_qs, q_start + rows, offs_d, row_mask)
            do = _load_tile(DO, b_dense, h, stride_dob, stride_doh, stride_dos, q_start + rows, offs_d, row_mask)
            lse = tl.load(LSE + b * stride_lb + h * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
            delta = tl.load(DELTA + b * stride_lb + h * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
            ok = _visible(rows, cols, q_len, k_len, diag, window, b, MASK, stride_mb, stride_mq, stride_mk,
                          CAUSAL, HAS_WINDOW, HAS_MASK)
            p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(DO.dtype.element_ty)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(Q.dtype.element_ty)), q, input_precision=PRECISION)
    tl.store(DK + b_dense * stride_dkb + kvh * stride_dkh + (k_start + cols)[:, None] * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b_dense * stride_dvb + kvh * stride_dvh + (k_start + cols)[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=_DYNAMIC)
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, MASK, CU_Q, CU_K,
                        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                        stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                        stride_dqb, stride_dqh, stride_dqs,
                        stride_lb, stride_lh, stride_mb, stride_mq, stride_mk,
                        Q_LEN, K_LEN, head_dim, window, qk_scale, sm_scale,
                        GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                        VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    h, b = _head_and_batch()
    kvh = h // GROUP
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Q_LEN, K_LEN, VARLEN)
    diag = k_len - q_len
    b_dense = b * (1 - VARLEN)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    row_mask = (rows < q_len)[:, None] & dmask[None, :]
    q = _load_tile(Q, b_dense, h, stride_qb, stride_qh, stride_qs, q_start + rows, offs_d, row_mask)
    do = _load_tile(DO, b_dense, h, stride_dob, stride_doh, stride_dos, q_start + rows, offs_d, row_mask)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(pid_m, q_len, k_len, diag, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < k_len)[:, None] & dmask[None, :]
        k = _load_tile(K, b_dense, kvh, stride_kb, stride_kh, stride_ks, k_start + cols, offs_d, kv_mask)
        v = _load_tile(V, b_dense, kvh, stride_vb, stride_vh, stride_vs, k_start + cols, offs_d, kv_mask)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        ok = _visible(rows, cols, q_len, k_len, diag, window, b, MASK, stride_mb, stride_mq, stride_mk,
                      CAUSAL, HAS_WINDOW, HAS_MASK)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(K.dtype.element_ty), k, input_precision=PRECISION)
    tl.store(DQ + b_dense * stride_dqb + h * stride_dqh + (q_start + rows)[:, None] * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


# --- launchers ----------------------------------------------------------------------------------------------

def tile_sizes(device: torch.device, head_dim: int, kind: str, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dkdv or dq kernel."""
    if device.type != "cuda":
        return 16, 16, 1, 1  # the interpreter: small tiles so short test sequences still cross tile edges
    if dtype == torch.float32:  # twice the bytes per tile: the half-precision tiles would overflow shared memory
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 16, 4, 1)
    if kind == "fwd":
        return (128, 64, 8, 3) if head_dim <= 128 else (64, 32, 8, 2)
    if kind == "dkdv":
        return (32, 64, 4, 2) if head_dim <= 128 else (16, 32, 8, 1)
    return (64, 32, 4, 2) if head_dim <= 128 else (32, 16, 8, 1)


def _strides3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    # (batch, head, position) strides; packed tensors (total, heads, dim) have no batch stride.
    return (0, t.stride(1), t.stride(0)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


class AttentionProblem:
    """The checked shapes of one attention call."""

    def __init__(self, q, k, v, causal, sliding_window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k):
        self.varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        rank = 3 if self.varlen else 4
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=rank)
        check_same("dtype", q=q, k=k, v=v)
        check_same("device", q=q, k=k, v=v)
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        self.head_dim = q.shape[-1]
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"q has head_dim {self.head_dim} but k has {k.shape[-1]}")
        if self.head_dim > 256:
            raise ValueError(f"head_dim {self.head_dim} is larger than the 256 this kernel supports")
        if self.varlen:
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ValueError("pass both cu_seqlens_q and cu_seqlens_k for packed sequences")
            if mask is not None:
                raise ValueError("mask= is not supported with packed sequences; packing already separates them")
            for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
                    raise ValueError(f"{name} must be a 1-D int32 tensor on {q.device}, got {cu.dtype} "
                                     f"{tuple(cu.shape)} on {cu.device}")
            if cu_seqlens_q.shape != cu_seqlens_k.shape:
                raise ValueError("cu_seqlens_q and cu_seqlens_k must list the same number of sequences")
            self.batch = cu_seqlens_q.shape[0] - 1
            self.heads, self.kv_heads = q.shape[1], k.shape[1]
            # The grid is sized by the longest sequence; computing it costs one host sync when not given.
            self.q_len = int(max_seqlen_q) if max_seqlen_q else int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
            self.k_len = int(max_seqlen_k) if max_seqlen_k else int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
            self.total_q = q.shape[0]
        else:
            self.batch, self.heads, self.q_len = q.shape[0], q.shape[1], q.shape[2]
            self.kv_heads, self.k_len = k.shape[1], k.shape[2]
            if k.shape[0] != self.batch:
                raise ValueError(f"q has batch {self.batch} but k has {k.shape[0]}")
        if self.batch > _MAX_GRID_YZ or self.heads > _MAX_GRID_YZ:
            raise ValueError(f"{self.batch} sequences of {self.heads} heads: the kernel's grid takes at most "
                             f"{_MAX_GRID_YZ} of each; split the batch")
        if self.heads % self.kv_heads:
            raise ValueError(f"query heads ({self.heads}) must be a multiple of key/value heads ({self.kv_heads})")
        self.group = self.heads // self.kv_heads
        self.causal = bool(causal)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        self.window = int(sliding_window or 0)
        self.mask = None
        if mask is not None:
            expected = (self.q_len, self.k_len)
            if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
                    or mask.shape[0] not in (1, self.batch) or tuple(mask.shape[2:]) != expected:
                raise ValueError(f"mask must be a bool (batch or 1, 1, {self.q_len}, {self.k_len}) tensor, got "
                                 f"{mask.dtype} {tuple(mask.shape)}")
            self.mask = mask.view(torch.uint8)
        self.cu_q, self.cu_k = cu_seqlens_q, cu_seqlens_k

    def mask_args(self, fallback):
        if self.mask is None:
            return fallback, 0, 0, 0
        m = self.mask
        return m, (m.stride(0) if m.shape[0] > 1 else 0), m.stride(2), m.stride(3)

    def lse_shape_strides(self):
        # LSE and delta: (batch, heads, q_len) dense, or (heads, total_q) packed.
        if self.varlen:
            return (self.heads, self.total_q), (0, self.total_q)
        return (self.batch, self.heads, self.q_len), (self.heads * self.q_len, self.q_len)

    def flags(self, dtype):
        return dict(GROUP=self.group, CAUSAL=self.causal, HAS_WINDOW=self.window > 0, HAS_MASK=self.mask is not None,
                    VARLEN=self.varlen, PRECISION=dot_precision(dtype), BLOCK_D=max(16, next_power_of_2(self.head_dim)))


def attention_forward(p: AttentionProblem, q, k, v, scale):
    if p.varlen:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        # (batch, q_len, heads, dim) memory seen as (batch, heads, q_len, dim): the model reshapes it for free.
        out = torch.empty(p.batch, p.q_len, p.heads, p.head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse_shape, (slb, slh) = p.lse_shape_strides()
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = tile_sizes(q.device, p.head_dim, "fwd", q.dtype)
    mask, smb, smq, smk = p.mask_args(lse)
    cu_q = p.cu_q if p.varlen else lse
    cu_k = p.cu_k if p.varlen else lse
    if q.numel() and p.k_len:
        grid = (triton.cdiv(p.q_len, block_m), p.heads, p.batch)
        _attn_fwd_kernel[grid](
            q, k, v, out, lse, mask, cu_q, cu_k,
            *_strides3(q, p.varlen), *_strides3(k, p.varlen), *_strides3(v, p.varlen), *_strides3(out, p.varlen),
            slb, slh, smb, smq, smk,
            p.q_len, p.k_len, p.head_dim, p.window, scale * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **p.flags(q.dtype),
        )
    elif q.numel():
        out.zero_()
        lse.fill_(float("inf"))
    return out, lse


def attention_backward(p: AttentionProblem, q, k, v, out, lse, dout, scale):
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # delta = rowsum(dout * out): (batch, heads, q_len) or (heads, total_q), laid out like lse.
    delta = (dout.float() * out.float()).sum(-1)
    delta = delta.t().contiguous() if p.varlen else delta.contiguous()
    _, (slb, slh) = p.lse_shape_strides()
    mask, smb, smq, smk = p.mask_args(lse)
    cu_q = p.cu_q if p.varlen else lse
    cu_k = p.cu_k if p.varlen else lse
    flags = p.flags(q.dtype)
    if not q.numel() or not p.k_len:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_m, block_n, warps, stages = tile_sizes(q.device, p.head_dim, "dkdv", q.dtype)
    _attn_bwd_dkdv_kernel[(triton.cdiv(p.k_len, block_n), p.kv_heads, p.batch)](
        q, k, v, dout, lse, delta, dk, dv, mask, cu_q, cu_k,
        *_strides3(q, p.varlen), *_strides3(k, p.varlen), *_strides3(v, p.varlen), *_strides3(dout, p.varlen),
        *_strides3(dk, p.varlen), *_strides3(dv, p.varlen), slb, slh, smb, smq, smk,
        p.q_len, p.k_len, p.head_dim, p.window, scale * LOG2E, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
    )
    block_m, block_n, warps, stages = tile_sizes(q.device, p.head_dim, "dq", q.dtype)
    _attn_bwd_dq_kernel[(triton.cdiv(p.q_len, block_m), p.heads, p.batch)](
        q, k, v, dout, lse, delta, dq, mask, cu_q, cu_k,
        *_strides3(q, p.varlen), *_strides3(k, p.varlen), *_strides3(v, p.varlen), *_strides3(dout, p.varlen),
        *_strides3(dq, p.varlen), slb, slh, smb, smq, smk,
        p.q_len, p.k_len, p.head_dim, p.window, scale * LOG2E, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem, scale):
        out, lse = attention_forward(problem, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem, ctx.scale = problem, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(ctx.problem, q, k, v, out, lse, dout, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None, sliding_window: int | None = None,
                    mask: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None) -> torch.Tensor:
    """Attention output shaped like q: (batch, heads, q_len, head_dim), or (total_q, heads, head_dim) packed.

    mask: optional bool (batch or 1, 1, q_len, kv_len), True where a query may attend (combined with causal and
    sliding_window). scale defaults to head_dim ** -0.5. Differentiable in q, k and v.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        if (cu_seqlens_q is not None or cu_seqlens_k is not None) and not (max_seqlen_q and max_seqlen_k):
            raise ValueError("under torch.compile pass max_seqlen_q and max_seqlen_k with packed sequences "
                             "(computing them from cu_seqlens needs a host sync)")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        return ops.flash_attention(q, k, v, bool(causal), scale, int(sliding_window or 0), mask, cu_seqlens_q,
                                   cu_seqlens_k, int(max_seqlen_q or 0), int(max_seqlen_k or 0))[0]
    problem = AttentionProblem(q, k, v, causal, sliding_window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttentionFunction.apply(q, k, v, problem, scale)
    return attention_forward(problem, q, k, v, scale)[0]


def attention_reference(q, k, v, *, causal=True, scale=None, sliding_window=None, mask=None):
    """Plain torch attention with the same conventions (dense layout), for tests: rows that see nothing give 0."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (batch, heads, q_len, kv_len)
    q_len, k_len = q.shape[2], k.shape[2]
    pos = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    cols = torch.arange(k_len, device=q.device)[None, :]
    ok = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    if causal:
        ok &= cols <= pos
    if sliding_window:
        ok &= pos - cols < sliding_window
    ok = ok[None, None]
    if mask is not None:
        ok = ok & mask
    scores = scores.masked_fill(~ok, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype)

