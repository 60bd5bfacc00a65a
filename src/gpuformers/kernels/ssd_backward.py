"""The backward of the Mamba2 chunked scan (kernels/ssd.py) as Triton kernels, and the autograd function that
`use_kernels=True` runs in train() mode. Every quantity is defined in layers/ssd.py; per chunk c and head h, with
a_cum the running log-decay inside the chunk, S_c the state at the chunk's start and dS_c' the gradient of the
state at its end (the next chunk's start, or the final state):

    dS_c        = exp(a_cum[end]) dS_c' + sum_l exp(a_cum[l]) dy_l (outer) C_l     (head_dim, state), walked backwards
    dxdt_s      = sum_{l >= s} (C_l . B_s) exp(a_cum[l] - a_cum[s]) dy_l + exp(a_cum[end] - a_cum[s]) dS_c' B_s
    dx_s        = dt_s dxdt_s + D dy_s                 d(dt_s) directly = x_s . dxdt_s
    dB_s (head) = dt_s [sum_{l >= s} exp(a_cum[l] - a_cum[s]) (dy_l . x_s) C_l + exp(a_cum[end] - a_cum[s]) dS_c'^T x_s]
    dC_l (head) = sum_{s <= l} exp(a_cum[l] - a_cum[s]) dt_s (dy_l . x_s) B_s + exp(a_cum[l]) S_c^T dy_l
    d a_cum[l]  = C_l . dC_l - B_l . dB_l (+ sum(dS_c' * S_c') at the chunk's last step)

The last line holds because every term of y_l (without D) carries exp(+a_cum[l]) and every input term of the state
exp(-a_cum[s]); so no kernel needs the decays' derivatives one by one. Then the log-decays a = dt * A get
d a = the reverse running sum of d a_cum inside each chunk, and dt goes back through dt * A, the time_step_limit clamp
(gradient only where the value is inside the limits, ends included, as torch.clamp's), softplus and dt_bias.

    1. _chunk_state_kernel (ssd.py, FROM_START)  sum_l exp(a_cum[l]) dy_l (outer) C_l per chunk
    2. _dstate_pass_kernel   (batch * heads, head_dim blocks)  dS walked from the last chunk to the first: each chunk's
                             dS_c' over step 1's buffer, the initial state's gradient, sum(dS_c' * S_c') per chunk
    3. _dx_db_kernel         (batch * heads * chunks, row blocks)  dx, d(dt) directly, dB per head, B . dB (two
                             launches, one for dx and one for dB, when (head_dim, state) is large)
    4. _dc_kernel            (batch * heads * chunks, row blocks)  dC per head, C . dC, dy . x (for D)
    5. _dt_backward_kernel   (chunks, batch, heads)  d a_cum -> d(dt) before its bias; dA and d dt_bias per program

Kernels 3 and 4 hold whole (head_dim, state) rows. The heads of a group add their dB and dC, and the per-program
dA, dD and dt_bias pieces are added, by torch sums of those small buffers (no atomics: the result is deterministic).
The forward's dt, a_cum and chunk-start states are kept for the backward by the eager autograd function; the
torch.library op (ops.py) recomputes them (kernels 1-3 of ssd.py) instead of returning them.

Offers: ssd_chunk_scan_backward, SSDChunkScan, ssd_chunk_scan_train.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import dot_precision, next_power_of_2
from gpuformers.kernels.ssd import (_chunk_state_kernel, _softplus_like, _tile, check_scan_inputs, scan_states,
                                    scan_tiles, ssd_chunk_scan_forward)


@triton.jit
def _dstate_pass_kernel(DSTATES, STATES, FINAL, DFINAL, DINIT, ACUM, END_DOT, seq, chunks, head_dim, state_size,
                        chunk_size, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, pb = tl.program_id(0), tl.program_id(1)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask = (p[:, None] < head_dim) & (n[None, :] < state_size)
    inner = p[:, None] * state_size + n[None, :]
    one = bh.to(tl.int64) * head_dim * state_size + inner
    grad = tl.load(DFINAL + one, mask=mask, other=0.0)  # d final state: the last chunk's end
    for i in range(chunks):
        c = chunks - 1 - i
        slot = DSTATES + (bh.to(tl.int64) * chunks + c) * head_dim * state_size + inner
        from_y = tl.load(slot, mask=mask, other=0.0)  # step 1: sum_l exp(a_cum[l]) dy_l (outer) C_l
        tl.store(slot, grad, mask=mask)  # the slot now holds the gradient of the chunk's end state
        # the chunk's end state: the next chunk's start, or the final state
        after = tl.load(STATES + (bh.to(tl.int64) * chunks + c + 1) * head_dim * state_size + inner,
                        mask=mask & (c + 1 < chunks), other=0.0)
        after += tl.load(FINAL + one, mask=mask & (c + 1 == chunks), other=0.0)
        tl.store(END_DOT + (bh.to(tl.int64) * tl.num_programs(1) + pb) * chunks + c, tl.sum(tl.sum(grad * after, 1), 0))
        last = tl.minimum((c + 1) * chunk_size, seq) - 1
        grad = grad * tl.exp(tl.load(ACUM + bh.to(tl.int64) * seq + last)) + from_y
    tl.store(DINIT + one, grad, mask=mask)


@triton.jit
def _chunk_rows(seq, heads, chunk_size, heads_per_group, BLOCK: tl.constexpr):
    # this program's (batch * heads, batch, head, group, chunk, chunks, chunk start, chunk end, first row): grid
    # (batch * heads * chunks, row blocks of the chunk)
    chunks = tl.cdiv(seq, chunk_size)
    bh, c = tl.program_id(0) // chunks, tl.program_id(0) % chunks
    h = bh % heads
    start = c * chunk_size
    return bh, bh // heads, h, h // heads_per_group, c, chunks, start, tl.minimum(start + chunk_size, seq), \
        start + tl.program_id(1) * BLOCK


@triton.jit
def _dx_db_kernel(X, B, C, D, DY, DT, ACUM, DSTATES, DX, DDT, DB, DA_NEG, seq, heads, head_dim, state_size,
                  chunk_size, heads_per_group, stride_x_b, stride_x_s, stride_x_h, stride_x_p, stride_b_b, stride_b_s,
                  stride_b_g, stride_b_n, stride_c_b, stride_c_s, stride_c_g, stride_c_n, stride_dy_b, stride_dy_s,
                  stride_dy_h, stride_dy_p, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WITH_DX: tl.constexpr, WITH_DB: tl.constexpr):
    # WITH_DX: dx and dt's direct gradient; WITH_DB: dB and B . dB. The two share only their loads: a large
    # (head_dim, state) launches them apart, each holding the end state's gradient in one layout in shared memory.
    bh, b, h, g, c, chunks, start, end, s0 = _chunk_rows(seq, heads, chunk_size, heads_per_group, BLOCK_S)
    if s0 < end:
        s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        p = tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        row = bh.to(tl.int64) * seq
        live_s, p_ok, n_ok = s < end, p < head_dim, n < state_size
        xs = _tile(X, b, s, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live_s, p_ok)  # (S, P)
        bs = _tile(B, b, s, g, n, stride_b_b, stride_b_s, stride_b_g, stride_b_n, live_s, n_ok)  # (S, N)
        a_s = tl.load(ACUM + row + s, mask=live_s, other=0.0)
        dt_s = tl.load(DT + row + s, mask=live_s, other=0.0)
        # the end state's gradient dS_c' (P, N), reached from s with decay exp(a_cum[end] - a_cum[s])
        d_end = tl.load(DSTATES + ((bh.to(tl.int64) * chunks + c) * head_dim + p[:, None]) * state_size + n[None, :],
                        mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        to_end = tl.where(live_s, tl.exp(tl.load(ACUM + row + end - 1) - a_s), 0.0)
        dxdt = tl.zeros((BLOCK_S, BLOCK_P), dtype=tl.float32)
        db = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        if WITH_DX:
            dxdt = tl.dot(bs, tl.trans(d_end), input_precision=PRECISION) * to_end[:, None]  # (S, P)
        if WITH_DB:
            db = tl.dot(xs, d_end, input_precision=PRECISION) * to_end[:, None]  # (S, N), times dt_s below
        # the outputs l >= s of this chunk
        for l0 in range(s0, end, BLOCK_L):
            l = (l0 + tl.arange(0, BLOCK_L)).to(tl.int64)
            live_l = l < end
            cl = _tile(C, b, l, g, n, stride_c_b, stride_c_s, stride_c_g, stride_c_n, live_l, n_ok)  # (L, N)
            dyl = _tile(DY, b, l, h, p, stride_dy_b, stride_dy_s, stride_dy_h, stride_dy_p, live_l, p_ok)
            a_l = tl.load(ACUM + row + l, mask=live_l, other=0.0)
            causal = (l[None, :] >= s[:, None]) & live_l[None, :]
            decay = tl.exp(tl.where(causal, a_l[None, :] - a_s[:, None], float("-inf")))  # (S, L)
            if WITH_DX:
                scores = tl.dot(bs, tl.trans(cl), input_precision=PRECISION) * decay  # (C_l . B_s) decayed
                dxdt += tl.dot(scores, dyl, input_precision=PRECISION)
            if WITH_DB:
                dyx = tl.dot(xs, tl.trans(dyl), input_precision=PRECISION) * decay  # (dy_l . x_s) decayed
                db += tl.dot(dyx, cl, input_precision=PRECISION)
        if WITH_DX:
            dys = _tile(DY, b, s, h, p, stride_dy_b, stride_dy_s, stride_dy_h, stride_dy_p, live_s, p_ok)
            dx = dxdt * dt_s[:, None] + dys * tl.load(D + h).to(tl.float32)
            tl.store(DX + ((b.to(tl.int64) * seq + s[:, None]) * heads + h) * head_dim + p[None, :], dx,
                     mask=live_s[:, None] & p_ok[None, :])
            tl.store(DDT + row + s, tl.sum(xs * dxdt, 1), mask=live_s)
        if WITH_DB:
            db = db * dt_s[:, None]
            tl.store(DB + ((b.to(tl.int64) * seq + s[:, None]) * heads + h) * state_size + n[None, :], db,
                     mask=live_s[:, None] & n_ok[None, :])
            tl.store(DA_NEG + row + s, tl.sum(bs * db, 1), mask=live_s)


@triton.jit
def _dc_kernel(X, B, C, DY, DT, ACUM, STARTS, DC, DA_POS, DSKIP, seq, heads, head_dim, state_size, chunk_size,
               heads_per_group, stride_x_b, stride_x_s, stride_x_h, stride_x_p, stride_b_b, stride_b_s, stride_b_g,
               stride_b_n, stride_c_b, stride_c_s, stride_c_g, stride_c_n, stride_dy_b, stride_dy_s, stride_dy_h,
               stride_dy_p, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    bh, b, h, g, c, chunks, start, end, l0 = _chunk_rows(seq, heads, chunk_size, heads_per_group, BLOCK_L)
    if l0 < end:
        l = (l0 + tl.arange(0, BLOCK_L)).to(tl.int64)
        p = tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        row = bh.to(tl.int64) * seq
        live_l, p_ok, n_ok = l < end, p < head_dim, n < state_size
        cl = _tile(C, b, l, g, n, stride_c_b, stride_c_s, stride_c_g, stride_c_n, live_l, n_ok)  # (L, N)
        dyl = _tile(DY, b, l, h, p, stride_dy_b, stride_dy_s, stride_dy_h, stride_dy_p, live_l, p_ok)  # (L, P)
        a_l = tl.load(ACUM + row + l, mask=live_l, other=0.0)
        # the start state's part: exp(a_cum[l]) S_c^T dy_l
        start_state = tl.load(STARTS + ((bh.to(tl.int64) * chunks + c) * head_dim + p[:, None]) * state_size
                              + n[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)  # (P, N)
        dc = tl.dot(dyl, start_state, input_precision=PRECISION) * tl.where(live_l, tl.exp(a_l), 0.0)[:, None]
        for s0 in range(start, tl.minimum(l0 + BLOCK_L, end), BLOCK_S):
            s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
            live_s = s < end
            xs = _tile(X, b, s, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live_s, p_ok)  # (S, P)
            bs = _tile(B, b, s, g, n, stride_b_b, stride_b_s, stride_b_g, stride_b_n, live_s, n_ok)  # (S, N)
            a_s = tl.load(ACUM + row + s, mask=live_s, other=0.0)
            dt_s = tl.load(DT + row + s, mask=live_s, other=0.0)
            causal = (s[None, :] <= l[:, None]) & live_s[None, :]
            decay = tl.exp(tl.where(causal, a_l[:, None] - a_s[None, :], float("-inf")))  # (L, S)
            dyx = tl.dot(dyl, tl.trans(xs), input_precision=PRECISION) * decay * dt_s[None, :]
            dc += tl.dot(dyx, bs, input_precision=PRECISION)
        xl = _tile(X, b, l, h, p, stride_x_b, stride_x_s, stride_x_h, stride_x_p, live_l, p_ok)
        tl.store(DC + ((b.to(tl.int64) * seq + l[:, None]) * heads + h) * state_size + n[None, :], dc,
                 mask=live_l[:, None] & n_ok[None, :])
        tl.store(DA_POS + row + l, tl.sum(cl * dc, 1), mask=live_l)
        tl.store(DSKIP + row + l, tl.sum(dyl * xl, 1), mask=live_l)


@triton.jit
def _dt_backward_kernel(DT_RAW, DT_BIAS, A, DT, DDT_DIRECT, DA_POS, DA_NEG, END_DOT, DDT_RAW, DA_PART, DBIAS_PART,
                        seq, batch, heads, chunk_size, stride_dt_b, stride_dt_s, stride_dt_h, dt_min, dt_max,
                        BLOCK_L: tl.constexpr):
    c, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunks = tl.cdiv(seq, chunk_size)
    pos = (c * chunk_size + tl.arange(0, BLOCK_L)).to(tl.int64)
    live = (tl.arange(0, BLOCK_L) < chunk_size) & (pos < seq)
    row = (b.to(tl.int64) * heads + h) * seq
    last = tl.minimum((c + 1) * chunk_size, seq) - 1
    d_acum = tl.load(DA_POS + row + pos, mask=live, other=0.0) - tl.load(DA_NEG + row + pos, mask=live, other=0.0)
    d_acum += tl.where(pos == last, tl.load(END_DOT + (b * heads + h) * chunks + c), 0.0)
    d_a = tl.cumsum(d_acum, 0, reverse=True)  # a_cum[l] sums a_k for k <= l in the chunk
    a_h = tl.load(A + h).to(tl.float32)
    dt = tl.load(DT + row + pos, mask=live, other=0.0)  # after softplus and clamp
    d_dt = tl.load(DDT_DIRECT + row + pos, mask=live, other=0.0) + a_h * d_a
    # back through the clamp and softplus(raw + bias), recomputed as the forward rounded them
    raw = tl.load(DT_RAW + b.to(tl.int64) * stride_dt_b + pos * stride_dt_s + h * stride_dt_h, mask=live, other=0.0)
    v = (raw.to(tl.float32) + tl.load(DT_BIAS + h).to(raw.dtype).to(tl.float32)).to(raw.dtype).to(tl.float32)
    soft = _softplus_like(v, raw)
    d_soft = tl.where((soft >= dt_min) & (soft <= dt_max), d_dt, 0.0)
    d_v = tl.where(live, d_soft * tl.where(v > 20.0, 1.0, tl.sigmoid(v)), 0.0)
    tl.store(DDT_RAW + row + pos, d_v, mask=live)  # (batch, heads, seq); the launcher transposes
    part = (c * batch + b) * heads + h
    tl.store(DA_PART + part, tl.sum(tl.where(live, dt * d_a, 0.0), 0))
    tl.store(DBIAS_PART + part, tl.sum(d_v, 0))


def ssd_chunk_scan_backward(dy, dfinal, x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state, final,
                            saved=None):
    """Gradients of ssd_chunk_scan_forward's (y, final state) with respect to (x, dt, A, B, C, D, dt_bias,
    initial_state), each in its input's dtype (None for an absent initial state). dy (batch, seq, heads, head_dim) and
    dfinal (batch, heads, head_dim, state) are float32 (None: zeros); `final` is the forward's final state; `saved`
    the forward's (dt, a_cum, states) list, or None to recompute them."""
    initial_state = check_scan_inputs(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state)
    batch, seq, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    f32 = dict(dtype=torch.float32, device=x.device)
    dfinal = (torch.zeros(batch, heads, head_dim, state_size, **f32) if dfinal is None
              else dfinal.float().contiguous())
    if seq == 0:
        zeros = [torch.zeros_like(t) for t in (x, dt, A, B, C, D, dt_bias)]
        return (*zeros, dfinal.to(initial_state.dtype) if initial_state is not None else None)
    dy = torch.zeros(batch, seq, heads, head_dim, **f32) if dy is None else dy.float().contiguous()
    if saved:
        dt_out, a_cum, states = saved
    else:
        dt_out, a_cum, states, final = scan_states(x, dt, A, B, dt_bias, chunk_size, dt_limit, initial_state)
    chunks = states.shape[2]
    _, block_s, block_p, block_n, warps, stages = scan_tiles(head_dim, state_size, chunk_size)
    precision = dot_precision(x.dtype)
    per_group = heads // groups
    p_blocks = triton.cdiv(head_dim, block_p)

    # 1-2: the gradient of each chunk's end state, walked back from the final state's
    d_states = torch.empty(batch, heads, chunks, head_dim, state_size, **f32)
    _chunk_state_kernel[(batch * heads * chunks, p_blocks)](
        dy, C, dt_out, a_cum, d_states, seq, heads, head_dim, state_size, chunk_size, per_group, *dy.stride(),
        *C.stride(), BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_N=block_n, PRECISION=precision, num_warps=warps,
        num_stages=stages, FROM_START=True)
    d_init = torch.empty(batch, heads, head_dim, state_size, **f32)
    end_dot = torch.empty(batch * heads, p_blocks, chunks, **f32)
    _dstate_pass_kernel[(batch * heads, p_blocks)](
        d_states, states, final.contiguous(), dfinal, d_init, a_cum, end_dot, seq, chunks, head_dim, state_size,
        chunk_size, BLOCK_P=block_p, BLOCK_N=block_n)

    # 3-4: the chunks' own gradients; whole head_dim rows (the dot products over it are summed in one program)
    full_p = max(16, next_power_of_2(head_dim))
    rows = 32 if full_p * block_n <= 64 * 64 else 16
    grid = (batch * heads * chunks, triton.cdiv(chunk_size, rows))
    dx = torch.empty(batch, seq, heads, head_dim, dtype=x.dtype, device=x.device)
    ddt_direct, da_neg, da_pos, dskip = (torch.empty(batch, heads, seq, **f32) for _ in range(4))
    db_heads = torch.empty(batch, seq, heads, state_size, **f32)
    dc_heads = torch.empty(batch, seq, heads, state_size, **f32)
    strides = (*x.stride(), *B.stride(), *C.stride(), *dy.stride())
    # together, or apart where (head_dim, state) is large (two copies of it overflow shared memory on sm_90)
    for parts in ([(True, True)] if full_p * block_n <= 64 * 256 else [(True, False), (False, True)]):
        _dx_db_kernel[grid](
            x, B, C, D, dy, dt_out, a_cum, d_states, dx, ddt_direct, db_heads, da_neg, seq, heads, head_dim,
            state_size, chunk_size, per_group, *strides, BLOCK_S=rows, BLOCK_L=rows, BLOCK_P=full_p,
            BLOCK_N=block_n, PRECISION=precision, WITH_DX=parts[0], WITH_DB=parts[1], num_warps=warps,
            num_stages=stages)
    _dc_kernel[grid](
        x, B, C, dy, dt_out, a_cum, states, dc_heads, da_pos, dskip, seq, heads, head_dim, state_size, chunk_size,
        per_group, *strides, BLOCK_L=rows, BLOCK_S=rows, BLOCK_P=full_p, BLOCK_N=block_n, PRECISION=precision,
        num_warps=warps, num_stages=stages)

    # 5: the log-decays' gradient back to dt, A and dt_bias
    ddt = torch.empty(batch, heads, seq, dtype=dt.dtype, device=x.device)
    da_part, dbias_part = (torch.empty(chunks, batch, heads, **f32) for _ in range(2))
    _dt_backward_kernel[(chunks, batch, heads)](
        dt, dt_bias, A, dt_out, ddt_direct, da_pos, da_neg, end_dot.sum(1), ddt, da_part, dbias_part, seq, batch,
        heads, chunk_size, *dt.stride(), float(dt_limit[0]), float(dt_limit[1]),
        BLOCK_L=max(16, next_power_of_2(chunk_size)))

    def per_group_sum(t, like):  # (batch, seq, heads, state) -> the group's (batch, seq, groups, state)
        return t.view(batch, seq, groups, per_group, state_size).sum(3).to(like.dtype)

    return (dx, ddt.transpose(1, 2).contiguous(), da_part.sum((0, 1)).to(A.dtype), per_group_sum(db_heads, B),
            per_group_sum(dc_heads, C), dskip.sum((0, 2)).to(D.dtype), dbias_part.sum((0, 1)).to(dt_bias.dtype),
            d_init.to(initial_state.dtype) if initial_state is not None else None)


class SSDChunkScan(torch.autograd.Function):
    """The scan with its Triton backward (eager): keeps the forward's dt, a_cum and chunk-start states."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state):
        saved = []
        y, final = ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state, saved)
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_state, final, *saved)
        ctx.chunk_size, ctx.dt_limit = chunk_size, dt_limit
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, dt_bias, initial_state, final, *saved = ctx.saved_tensors
        grads = ssd_chunk_scan_backward(dy, dfinal, x, dt, A, B, C, D, dt_bias, ctx.chunk_size, ctx.dt_limit,
                                        initial_state, final, saved)
        return (*grads[:7], None, None, grads[7])


def ssd_chunk_scan_train(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state=None):
    """The kernel for use_kernel_function("ssd_chunk_scan") in train() mode: the Triton scan, differentiable."""
    if torch.compiler.is_compiling():  # the torch.library op, whose autograd formula is the backward above
        return ops.ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk_size, float(dt_limit[0]), float(dt_limit[1]),
                                  initial_state)
    inputs = (x, dt, A, B, C, D, dt_bias, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return SSDChunkScan.apply(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state)
    return ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk_size, dt_limit, initial_state)
