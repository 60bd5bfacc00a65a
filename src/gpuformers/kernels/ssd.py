"""The Mamba2 state-space (SSD) recurrence as Triton kernels: the chunked scan of a prompt and the one-token state
update of decode. Their torch reference, and the definition of every quantity below, is layers/ssd.py
(ssd_chunk_scan, ssm_state_step); the tests compare the two.

The scan runs as four kernels, the split the SSD paper's block decomposition suggests (mamba_ssm splits it the same
way): only the third walks the chunks in order, over states, never over tokens.

    1. _chunk_dt_kernel      (chunks, batch, heads)  dt = clamp(softplus(dt + dt_bias), limit) and the running sum
                             of the log-decays dt * A inside each chunk (a_cum), float32 (batch, heads, seq)
    2. _chunk_state_kernel   (batch * heads * chunks, head_dim blocks)  what each chunk adds to the state by its end:
                             sum_s exp(a_cum[end] - a_cum[s]) dt_s x_s (outer) B_s      (head_dim, state) per chunk
    3. _state_pass_kernel    (batch * heads, head_dim blocks)  the state at each chunk's start, carried chunk by
                             chunk from the initial state (written over step 2's buffer), and the final state
    4. _chunk_scan_kernel    (batch * heads * chunks, rows x head_dim blocks)  y_l = exp(a_cum[l]) C_l . start
                             + sum_{s <= l} (C_l . B_s) exp(a_cum[l] - a_cum[s]) dt_s x_s + D x_l

A prompt that chunk_size does not divide ends in a short chunk (positions past the end are masked: no input, no
decay), which is what the reference's padding computes. Everything is float32 inside; y and the states come back in
float32 like the reference's. The decode step (_state_step_kernel) gives each program one (sequence, head, head_dim
block) and its (block, state) slice of the state. Its indexed form (ssm_state_step_indexed: the engine's decode
batch, whose states are rows of the state slots' pool) reads sequence b's slice from row rows[b] of the pool and
writes the new one back there, so the pool's rows are read once and written once, with no gathered copy.

The scan's backward is kernels/ssd_backward.py (its train() mode function, ssd_chunk_scan_train, runs these
forward kernels and keeps what the backward needs). The inference functions here (ssd_chunk_scan_triton,
ssm_state_step_triton) hand a call back to torch (NotImplemented, see kernels/mapping.use_kernel_function) when
autograd would need its gradient; the decode step has no backward, and training keeps the torch step. While
torch.compile traces they call the torch.library ops gpuformers::ssd_chunk_scan / gpuformers::ssm_state_step
(ops.py) instead.

Offers: ssd_chunk_scan_triton, ssm_state_step_triton, ssm_state_step_indexed_triton, ssd_chunk_scan_forward,
ssm_state_step_forward, ssm_state_step_indexed_forward, scan_tiles, scan_states, check_scan_inputs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import (check_rows, check_same, check_tensor, dot_precision, leave_to_torch,
                                      next_power_of_2)


@triton.jit
def _softplus_like(v, like):
    # softplus(v) with v and the result rounded to like's dtype, as F.softplus(dt + dt_bias) on that dtype gives
    # them (torch's threshold 20 included); float32 out
    v = v.to(like.dtype).to(tl.float32)
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0)))).to(like.dtype).to(tl.float32)


@triton.jit
def _tile(PTR, b, t, index, cols, stride_b, stride_t, stride_index, stride_col, t_ok, col_ok):
    # a (tokens, cols) tile of a (batch, seq, heads or groups, cols) tensor at head / group `index`, float32
    return tl.load(PTR + b.to(tl.int64) * stride_b + t[:, None] * stride_t + index * stride_index
                   + cols[None, :] * stride_col, mask=t_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunk_dt_kernel(DT, DT_BIAS, A, DT_OUT, ACUM, seq, heads, chunk_size, stride_dt_b, stride_dt_s, stride_dt_h,
                     dt_min, dt_max, BLOCK_L: tl.constexpr):
    c, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # chunks on axis 0: CUDA caps axes 1-2 at 65535
    pos = (c * chunk_size + tl.arange(0, BLOCK_L)).to(tl.int64)  # pos * stride may pass 2**31
    live = (tl.arange(0, BLOCK_L) < chunk_size) & (pos < seq)
    raw = tl.load(DT + b.to(tl.int64) * stride_dt_b + pos * stride_dt_s + h * stride_dt_h, mask=live, other=0.0)
    bias = tl.load(DT_BIAS + h).to(raw.dtype).to(tl.float32)
    dt = _softplus_like(raw.to(tl.float32) + bias, raw)
    dt = tl.where(live, tl.minimum(tl.maximum(dt, dt_min), dt_max), 0.0)  # masked steps: no input, no decay
    a_cum = tl.cumsum(dt * tl.load(A + h).to(tl.float32), axis=0)
    out = (b.to(tl.int64) * heads + h) * seq + pos
    tl.store(DT_OUT + out, dt, mask=live)
    tl.store(ACUM + out, a_cum, mask=live)


@triton.jit
def _chunk_state_kernel(X, B, DT, ACUM, STATES, seq, heads, head_dim, state_size, chunk_size, heads_per_group,
                        stride_x_b, stride_x_s, stride_x_h, stride_x_p, stride_b_b, stride_b_s, stride_b_g, stride_b_n,
                        BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                        FROM_START: tl.constexpr = False):
    # FROM_START (the backward, ssd_backward.py): sum_s exp(a_cum[s]) X_s (outer) B_s, the decay from the chunk's
    # start instead of dt_s and the decay to its end
    chunks = tl.cdiv(seq, chunk_size)
    bh, c, pb = tl.program_id(0) // chunks, tl.program_id(0) % chunks, tl.program_id(1)
    b, h = bh // heads, bh % heads
    start = c * chunk_size
    end = tl.minimum(start + chunk_size, seq)  # the chunk's last position + 1
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    row = bh.to(tl.int64) * seq
    a_end = tl.load(ACUM + row + end - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        live = s < end
        x = _tile(X, b, s, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live, p < head_dim)  # (S, P)
        bs = _tile(B, b, s, h // heads_per_group, n, stride_b_b, stride_b_s, stride_b_g, stride_b_n, live,
                   n < state_size)  # (S, N)
        a_s = tl.load(ACUM + row + s, mask=live, other=0.0)
        if FROM_START:
            w = tl.where(live, tl.exp(a_s), 0.0)
        else:
            w = tl.load(DT + row + s, mask=live, other=0.0) * tl.exp(a_end - a_s)
        acc += tl.dot(tl.trans(x * w[:, None]), bs, input_precision=PRECISION)
    out = STATES + ((bh.to(tl.int64) * chunks + c) * head_dim + p[:, None]) * state_size + n[None, :]
    tl.store(out, acc, mask=(p[:, None] < head_dim) & (n[None, :] < state_size))


@triton.jit
def _state_pass_kernel(STATES, INIT, FINAL, ACUM, seq, chunks, head_dim, state_size, chunk_size,
                       HAS_INIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, pb = tl.program_id(0), tl.program_id(1)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask = (p[:, None] < head_dim) & (n[None, :] < state_size)
    inner = p[:, None] * state_size + n[None, :]
    if HAS_INIT:
        state = tl.load(INIT + bh.to(tl.int64) * head_dim * state_size + inner, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for c in range(chunks):
        slot = STATES + (bh.to(tl.int64) * chunks + c) * head_dim * state_size + inner
        added = tl.load(slot, mask=mask, other=0.0)
        tl.store(slot, state, mask=mask)  # the slot now holds the state at the chunk's start
        last = tl.minimum((c + 1) * chunk_size, seq) - 1
        state = state * tl.exp(tl.load(ACUM + bh.to(tl.int64) * seq + last)) + added
    tl.store(FINAL + bh.to(tl.int64) * head_dim * state_size + inner, state, mask=mask)


@triton.jit
def _chunk_scan_kernel(X, B, C, D, DT, ACUM, STARTS, Y, seq, heads, head_dim, state_size, chunk_size,
                       heads_per_group, stride_x_b, stride_x_s, stride_x_h, stride_x_p, stride_b_b, stride_b_s,
                       stride_b_g, stride_b_n, stride_c_b, stride_c_s, stride_c_g, stride_c_n,
                       BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    chunks = tl.cdiv(seq, chunk_size)
    bh, c, tile = tl.program_id(0) // chunks, tl.program_id(0) % chunks, tl.program_id(1)
    b, h = bh // heads, bh % heads
    g = h // heads_per_group
    p_blocks = tl.cdiv(head_dim, BLOCK_P)
    mb, pb = tile // p_blocks, tile % p_blocks
    start = c * chunk_size
    end = tl.minimum(start + chunk_size, seq)
    l0 = start + mb * BLOCK_M
    if l0 < end:
        l = (l0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # l * stride may pass 2**31 in long prompts
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        row = bh.to(tl.int64) * seq
        live_l = l < end
        p_ok = p < head_dim
        cl = _tile(C, b, l, g, n, stride_c_b, stride_c_s, stride_c_g, stride_c_n, live_l, n < state_size)  # (M, N)
        a_l = tl.load(ACUM + row + l, mask=live_l, other=0.0)
        # the start state's part: exp(a_cum[l]) C_l . start  (start: (P, N) of this chunk)
        start_state = tl.load(STARTS + ((bh.to(tl.int64) * chunks + c) * head_dim + p[None, :]) * state_size
                              + n[:, None], mask=p_ok[None, :] & (n[:, None] < state_size), other=0.0)  # (N, P)
        y = tl.dot(cl * tl.exp(a_l)[:, None], start_state, input_precision=PRECISION)  # (M, P)
        # the chunk's own inputs up to l: (C_l . B_s) exp(a_cum[l] - a_cum[s]) dt_s x_s, s <= l
        for s0 in range(start, tl.minimum(l0 + BLOCK_M, end), BLOCK_S):
            s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
            live_s = s < end
            bs = tl.load(B + b.to(tl.int64) * stride_b_b + s[None, :] * stride_b_s + g * stride_b_g
                         + n[:, None] * stride_b_n,
                         mask=live_s[None, :] & (n[:, None] < state_size), other=0.0).to(tl.float32)  # (N, S)
            scores = tl.dot(cl, bs, input_precision=PRECISION)  # (M, S)
            a_s = tl.load(ACUM + row + s, mask=live_s, other=0.0)
            causal = (s[None, :] <= l[:, None]) & live_s[None, :]
            decay = tl.exp(tl.where(causal, a_l[:, None] - a_s[None, :], float("-inf")))
            dt_s = tl.load(DT + row + s, mask=live_s, other=0.0)
            xs = _tile(X, b, s, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live_s, p_ok)  # (S, P)
            y += tl.dot(scores * decay * dt_s[None, :], xs, input_precision=PRECISION)
        xl = _tile(X, b, l, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live_l, p_ok)
        y += xl * tl.load(D + h).to(tl.float32)
        out = Y + ((b.to(tl.int64) * seq + l[:, None]) * heads + h) * head_dim + p[None, :]
        tl.store(out, y, mask=live_l[:, None] & p_ok[None, :])


@triton.jit
def _state_step_kernel(STATE, ROWS, X, DT, A, B, C, D, DT_BIAS, NEW_STATE, Y, heads, head_dim, state_size,
                       heads_per_group, stride_s_b, stride_s_h, stride_s_p, stride_x_b, stride_x_h, stride_x_p,
                       stride_dt_b, stride_dt_h, stride_b_b, stride_b_g, stride_b_n, stride_c_b, stride_c_g, stride_c_n,
                       INDEXED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # INDEXED: STATE is a pool whose row ROWS[b] is sequence b's state, written back in place (NEW_STATE unused)
    bh, pb = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    g = h // heads_per_group
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < state_size
    mask = p_ok[:, None] & n_ok[None, :]
    raw = tl.load(DT + b.to(tl.int64) * stride_dt_b + h * stride_dt_h)
    dt = _softplus_like(raw.to(tl.float32) + tl.load(DT_BIAS + h).to(raw.dtype).to(tl.float32), raw)
    x = tl.load(X + b.to(tl.int64) * stride_x_b + h * stride_x_h + p * stride_x_p, mask=p_ok, other=0.0).to(tl.float32)
    bn = tl.load(B + b.to(tl.int64) * stride_b_b + g * stride_b_g + n * stride_b_n, mask=n_ok, other=0.0)
    cn = tl.load(C + b.to(tl.int64) * stride_c_b + g * stride_c_g + n * stride_c_n, mask=n_ok, other=0.0)
    if INDEXED:
        row = tl.load(ROWS + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    at = STATE + row * stride_s_b + h * stride_s_h + p[:, None] * stride_s_p + n[None, :]
    state = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    state = state * tl.exp(dt * tl.load(A + h).to(tl.float32)) + (dt * x)[:, None] * bn.to(tl.float32)[None, :]
    if INDEXED:
        tl.debug_barrier()  # every thread of the program has read the tile before any overwrites it
        tl.store(at, state, mask=mask)
    else:
        tl.store(NEW_STATE + ((b.to(tl.int64) * heads + h) * head_dim + p[:, None]) * state_size + n[None, :], state,
                 mask=mask)
    y = tl.sum(state * cn.to(tl.float32)[None, :], axis=1) + x * tl.load(D + h).to(tl.float32)
    tl.store(Y + (b.to(tl.int64) * heads + h) * head_dim + p, y, mask=p_ok)


def _check_heads(heads: int, groups: int, **per_head: torch.Tensor) -> None:
    if groups < 1 or heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of the groups of B and C ({groups})")
    for name, t in per_head.items():
        check_tensor(name, t, ndim=1)
        if t.shape[0] != heads:
            raise ValueError(f"{name} has {t.shape[0]} entries, expected one per head ({heads})")


def scan_tiles(head_dim: int, state_size: int, chunk_size: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M rows of a chunk, BLOCK_S source steps, BLOCK_P of head_dim, BLOCK_N = the whole state, warps, stages)
    of the chunk-state and chunk-scan kernels. The state dimension is never split (each program holds whole rows
    of the (head_dim, state) matrix); a state of 256 halves the step tiles to stay within shared memory (checked for
    sm_90 by tests/kernels/test_compile_for_gpu.py). 16 is tl.dot's smallest side."""
    block_n = max(16, next_power_of_2(state_size))
    block_p = max(16, min(64, next_power_of_2(head_dim)))
    block_m = max(16, min(64, next_power_of_2(chunk_size)))
    block_s = 32 if block_n <= 128 else 16
    return block_m, block_s, block_p, block_n, 4 if block_n <= 64 else 8, 2


def check_scan_inputs(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state):
    """layers/ssd.ssd_chunk_scan's arguments (shapes there), checked; returns initial_state contiguous (or None)."""
    # Any strides: the mixer's x, B, C are views of its conv output, token-major from the kernel and channel-major
    # from the torch conv.
    check_tensor("x", x, ndim=4, last_dim_contiguous=False)
    batch, seq, heads, head_dim = x.shape
    check_tensor("dt", dt, ndim=3, last_dim_contiguous=False)
    check_tensor("B", B, ndim=4, last_dim_contiguous=False)
    check_tensor("C", C, ndim=4, last_dim_contiguous=False)
    groups, state_size = B.shape[2], B.shape[3]
    if tuple(dt.shape) != (batch, seq, heads):
        raise ValueError(f"dt has shape {tuple(dt.shape)}, expected (batch, seq, heads) = {(batch, seq, heads)}")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (batch, seq, groups, state_size):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected (batch, seq, groups, state) = "
                             f"{(batch, seq, groups, state_size)}")
    _check_heads(heads, groups, A=A, D=D, dt_bias=dt_bias)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=4)
        if tuple(initial_state.shape) != (batch, heads, head_dim, state_size):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected (batch, heads, "
                             f"head_dim, state) = {(batch, heads, head_dim, state_size)}")
        initial_state = initial_state.contiguous()
    check_same("device", x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    check_same("dtype", x=x, B=B, C=C)
    return initial_state


def scan_states(x, dt, A, B, dt_bias, chunk_size, dt_limit, initial_state):
    """Kernels 1-3 on checked inputs with seq > 0: (dt (batch, heads, seq) after softplus and clamp, a_cum (batch,
    heads, seq), the state at each chunk's start (batch, heads, chunks, head_dim, state), the final state), float32.
    The backward (ssd_backward.py) reruns this rather than keep the forward's copies when the forward was an op."""
    batch, seq, heads, head_dim = x.shape
    state_size = B.shape[3]
    f32 = dict(dtype=torch.float32, device=x.device)
    chunks = math.ceil(seq / chunk_size)
    dt_out = torch.empty(batch, heads, seq, **f32)
    a_cum = torch.empty(batch, heads, seq, **f32)
    states = torch.empty(batch, heads, chunks, head_dim, state_size, **f32)
    final = torch.empty(batch, heads, head_dim, state_size, **f32)
    _, block_s, block_p, block_n, warps, stages = scan_tiles(head_dim, state_size, chunk_size)
    p_blocks = triton.cdiv(head_dim, block_p)
    _chunk_dt_kernel[(chunks, batch, heads)](
        dt, dt_bias, A, dt_out, a_cum, seq, heads, chunk_size, dt.stride(0), dt.stride(1), dt.stride(2),
        float(dt_limit[0]), float(dt_limit[1]), BLOCK_L=max(16, next_power_of_2(chunk_size)))
    _chunk_state_kernel[(batch * heads * chunks, p_blocks)](
        x, B, dt_out, a_cum, states, seq, heads, head_dim, state_size, chunk_size, heads // B.shape[2], *x.stride(),
        *B.stride(), BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_N=block_n, PRECISION=dot_precision(x.dtype),
        num_warps=warps, num_stages=stages)
    _state_pass_kernel[(batch * heads, p_blocks)](
        states, initial_state if initial_state is not None else final, final, a_cum, seq, chunks, head_dim,
        state_size, chunk_size, HAS_INIT=initial_state is not None, BLOCK_P=block_p, BLOCK_N=block_n)
    return dt_out, a_cum, states, final


def ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state=None, saved=None):
    """The launcher: layers/ssd.ssd_chunk_scan's arguments and results (shapes there), checked, on the kernels.
    A list passed as `saved` receives scan_states' dt, a_cum and chunk-start states, for the backward."""
    initial_state = check_scan_inputs(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state)
    batch, seq, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    y = torch.empty(batch, seq, heads, head_dim, dtype=torch.float32, device=x.device)
    if seq == 0:
        final = torch.zeros(batch, heads, head_dim, state_size, dtype=torch.float32, device=x.device)
        return y, final.copy_(initial_state) if initial_state is not None else final
    dt_out, a_cum, states, final = scan_states(x, dt, A, B, dt_bias, chunk_size, dt_limit, initial_state)
    if saved is not None:
        saved.extend((dt_out, a_cum, states))
    chunks = states.shape[2]
    block_m, block_s, block_p, block_n, warps, stages = scan_tiles(head_dim, state_size, chunk_size)
    _chunk_scan_kernel[(batch * heads * chunks, triton.cdiv(chunk_size, block_m) * triton.cdiv(head_dim, block_p))](
        x, B, C, D, dt_out, a_cum, states, y, seq, heads, head_dim, state_size, chunk_size, heads // groups,
        *x.stride(), *B.stride(), *C.stride(),
        BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_N=block_n, PRECISION=dot_precision(x.dtype),
        num_warps=warps, num_stages=stages)
    return y, final


def _check_step_inputs(state, x, dt, B, C, A, D, dt_bias, rows=None) -> None:
    """layers/ssd.ssm_state_step's arguments (ssm_state_step_indexed's with rows), checked."""
    check_tensor("x", x, ndim=3, last_dim_contiguous=False)
    batch, heads, head_dim = x.shape
    check_tensor("state", state, ndim=4)
    check_tensor("dt", dt, ndim=2, last_dim_contiguous=False)
    check_tensor("B", B, ndim=3, last_dim_contiguous=False)
    check_tensor("C", C, ndim=3, last_dim_contiguous=False)
    groups, state_size = B.shape[1], B.shape[2]
    # the indexed step's states are a pool: any number of rows
    expected = {"state": (state.shape[0] if rows is not None else batch, heads, head_dim, state_size),
                "dt": (batch, heads), "B": (batch, groups, state_size), "C": (batch, groups, state_size)}
    for name, t in (("state", state), ("dt", dt), ("B", B), ("C", C)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected[name]}")
    _check_heads(heads, groups, A=A, D=D, dt_bias=dt_bias)
    tensors = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    if rows is not None:
        check_rows(rows, batch)
        tensors["rows"] = rows
        if state.dtype != torch.float32:
            raise ValueError(f"the state pool must be float32 (it is updated in place), got {state.dtype}")
    check_same("device", **tensors)


def _launch_step(state, rows, x, dt, A, B, C, D, dt_bias, new_state, y) -> None:
    batch, heads, head_dim = x.shape
    if batch:
        block_p = max(16, min(64, next_power_of_2(head_dim)))
        _state_step_kernel[(batch * heads, triton.cdiv(head_dim, block_p))](
            state, rows if rows is not None else state, x, dt, A, B, C, D, dt_bias,
            new_state if new_state is not None else state, y, heads, head_dim,
            B.shape[2], heads // B.shape[1], state.stride(0), state.stride(1), state.stride(2), *x.stride(),
            *dt.stride(), *B.stride(), *C.stride(), INDEXED=rows is not None, BLOCK_P=block_p,
            BLOCK_N=max(16, next_power_of_2(B.shape[2])))


def ssm_state_step_forward(state, x, dt, A, B, C, D, dt_bias):
    """The launcher: layers/ssd.ssm_state_step's arguments and results (shapes there), checked, on the kernel. The
    new state is a new tensor (the cache may hold the old one elsewhere)."""
    _check_step_inputs(state, x, dt, B, C, A, D, dt_bias)
    batch, heads, head_dim = x.shape
    new_state = torch.empty(batch, heads, head_dim, B.shape[2], dtype=torch.float32, device=x.device)
    y = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=x.device)
    _launch_step(state, None, x, dt, A, B, C, D, dt_bias, new_state, y)
    return y, new_state


def ssm_state_step_indexed_forward(states, rows, x, dt, A, B, C, D, dt_bias):
    """The launcher: layers/ssd.ssm_state_step_indexed's arguments and result (shapes there), checked, on the
    kernel: rows `rows` of the pool `states` are read and written in place, with no copy of them."""
    _check_step_inputs(states, x, dt, B, C, A, D, dt_bias, rows)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _launch_step(states, rows, x, dt, A, B, C, D, dt_bias, None, y)
    return y


def ssd_chunk_scan_triton(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state=None):
    """The kernel for use_kernel_function("ssd_chunk_scan"); NotImplemented (the torch scan runs) under autograd."""
    if leave_to_torch(x, dt, A, B, C, D, dt_bias, initial_state):
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return ops.ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk_size, float(dt_limit[0]), float(dt_limit[1]),
                                  initial_state)
    return ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state)


def ssm_state_step_triton(state, x, dt, A, B, C, D, dt_bias):
    """The kernel for use_kernel_function("ssm_state_step"); NotImplemented (the torch step runs) under autograd."""
    if leave_to_torch(state, x, dt, A, B, C, D, dt_bias):
        return NotImplemented
    if torch.compiler.is_compiling():
        return ops.ssm_state_step(state, x, dt, A, B, C, D, dt_bias)
    return ssm_state_step_forward(state, x, dt, A, B, C, D, dt_bias)


def ssm_state_step_indexed_triton(states, rows, x, dt, A, B, C, D, dt_bias):
    """The kernel for use_kernel_function("ssm_state_step_indexed"); NotImplemented (the torch gather, step and
    scatter run) under autograd."""
    if leave_to_torch(states, x, dt, A, B, C, D, dt_bias):
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op, which mutates the pool in the graph
        return ops.ssm_state_step_indexed(states, rows, x, dt, A, B, C, D, dt_bias)
    return ssm_state_step_indexed_forward(states, rows, x, dt, A, B, C, D, dt_bias)
