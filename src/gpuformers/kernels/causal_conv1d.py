"""The Mamba2 mixer's causal depthwise conv1d with its SiLU, as a Triton kernel: a prompt (or prefill chunk) and the
one-token decode update are the same call, with the conv state read before and written after. Its torch reference
is layers/mamba2.causal_conv1d, which defines it:

    window = [conv_state | x]                              (channels, kernel - 1 + seq)
    out[t, c] = silu(bias[c] + sum_k weight[c, k] * window[c, t + k])     (seq, channels), in x's dtype
    new conv_state = window[:, -(kernel - 1):]             the last kernel - 1 inputs, for the next call

Each program computes a (BLOCK_T tokens, BLOCK_C channels) tile of one sequence, channels innermost (the in_proj
output is token-major, so loads are coalesced without a transpose); the conv taps are a static loop over the
kernel width (4 in the released models), each tap reading the inputs it needs from the state or from x. The
programs of the first token block also write the new state of their channels. The conv is summed in float32 and
rounded to x's dtype before the SiLU, as torch's conv1d then silu round. With one token this is the decode update.

The backward is two more kernels: _conv_grad_kernel recomputes a tile's conv and writes d conv = d out * silu'(conv)
with the tile's share of d weight and d bias (added up by a torch sum over tiles, deterministic); then
_conv_input_grad_kernel gives each window column j its sum_k weight[c, k] d conv[j - k] (plus the new state's
gradient where column j was kept), x's columns to dx and the state's to d conv_state.

The decode update of the engine's batch has its own kernel, _conv_update_indexed_kernel (causal_conv1d_indexed):
one token per sequence, whose conv state is row rows[b] of the state slots' pool, shifted by one in place (window
[state | x] read into registers, a barrier, then the state's columns 1.. and x written back), so the pool's rows
are read once and written once, with no gathered copy.

causal_conv1d_train (the train() mode function) is differentiable through them (CausalConv1d); the inference
function causal_conv1d_triton hands a call back to torch (NotImplemented) when autograd would need its gradient.
While torch.compile traces both call the torch.library op gpuformers::causal_conv1d (ops.py), whose autograd formula
is the same backward.

Offers: causal_conv1d_triton, causal_conv1d_train, causal_conv1d_forward, causal_conv1d_backward, CausalConv1d,
causal_conv1d_indexed_triton, causal_conv1d_indexed_forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_rows, check_same, check_tensor, leave_to_torch, next_power_of_2


@triton.jit
def _window_tap(x_row, st_row, t, k, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, KERNEL: tl.constexpr,
                HAS_STATE: tl.constexpr):
    # window[c, t + k] for a (tokens, channels) tile, float32: the state's KERNEL - 1 columns, then x
    j = t + k
    xv = tl.load(x_row + (j - (KERNEL - 1))[:, None] * stride_x_s + c[None, :],
                 mask=(j >= KERNEL - 1)[:, None] & (t < seq)[:, None] & c_ok[None, :], other=0.0)
    value = xv.to(tl.float32)
    if HAS_STATE:
        sv = tl.load(st_row + c[None, :] * stride_st_c + j[:, None] * stride_st_k,
                     mask=(j < KERNEL - 1)[:, None] & (t < seq)[:, None] & c_ok[None, :], other=0.0)
        value += sv.to(xv.dtype).to(tl.float32)  # the state cast to x's dtype, as the layer casts it
    return value


@triton.jit
def _conv_tile(x_row, st_row, W, BIAS, t, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, stride_w_c, stride_w_k,
               KERNEL: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_C: tl.constexpr):
    # the conv (before the SiLU) of a (tokens, channels) tile, summed in float32
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(KERNEL):
        w = tl.load(W + c * stride_w_c + k * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
        acc += _window_tap(x_row, st_row, t, k, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, KERNEL,
                           HAS_STATE) * w[None, :]
    return acc


@triton.jit
def _causal_conv1d_kernel(X, STATE, W, BIAS, OUT, NEW_STATE, seq, channels, stride_x_b, stride_x_s, stride_st_b,
                          stride_st_c, stride_st_k, stride_w_c, stride_w_k, KERNEL: tl.constexpr,
                          HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    b, cb, tb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * stride may pass 2**31 in long prompts
    c_ok = c < channels
    x_row = X + b.to(tl.int64) * stride_x_b
    st_row = STATE + b.to(tl.int64) * stride_st_b
    acc = _conv_tile(x_row, st_row, W, BIAS, t, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, stride_w_c,
                     stride_w_k, KERNEL, HAS_STATE, HAS_BIAS, BLOCK_T, BLOCK_C)
    conv = acc.to(OUT.dtype.element_ty).to(tl.float32)
    out = (conv * tl.sigmoid(conv)).to(OUT.dtype.element_ty)
    tl.store(OUT + (b.to(tl.int64) * seq + t[:, None]) * channels + c[None, :], out,
             mask=(t < seq)[:, None] & c_ok[None, :])
    if KERNEL > 1:
        if tb == 0:  # the new state: window columns seq .. seq + KERNEL - 2
            col = tl.arange(0, BLOCK_K)
            pos = (seq + col).to(tl.int64)
            col_ok = col < KERNEL - 1
            tail = tl.load(x_row + (pos - (KERNEL - 1))[None, :] * stride_x_s + c[:, None],
                           mask=(pos >= KERNEL - 1)[None, :] & col_ok[None, :] & c_ok[:, None], other=0.0)
            if HAS_STATE:
                kept = tl.load(st_row + c[:, None] * stride_st_c + pos[None, :] * stride_st_k,
                               mask=(pos < KERNEL - 1)[None, :] & c_ok[:, None], other=0.0)
                tail += kept.to(tail.dtype)  # one of the two is 0 at each place
            tl.store(NEW_STATE + (b.to(tl.int64) * channels + c[:, None]) * (KERNEL - 1) + col[None, :], tail,
                     mask=col_ok[None, :] & c_ok[:, None])


@triton.jit
def _conv_update_indexed_kernel(X, STATES, ROWS, W, BIAS, OUT, channels, stride_x_b, stride_st_r, stride_st_c,
                                stride_st_k, stride_w_c, stride_w_k, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    # one token of sequence b over BLOCK_C channels; its conv state is row ROWS[b] of the pool, updated in place
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    k = tl.arange(0, BLOCK_K)
    in_state = k < KERNEL - 1
    row = STATES + tl.load(ROWS + b).to(tl.int64) * stride_st_r + c[:, None] * stride_st_c  # (C, 1) pointers
    xv = tl.load(X + b.to(tl.int64) * stride_x_b + c, mask=c_ok, other=0.0)  # (C,)
    # the window's state columns (C, K - 1), cast to x's dtype as the layer casts them, and the same shifted by one
    # (the next state's columns: state column k + 1, then x)
    kept = tl.load(row + k[None, :] * stride_st_k, mask=c_ok[:, None] & in_state[None, :], other=0.0).to(xv.dtype)
    shifted = tl.load(row + (k[None, :] + 1) * stride_st_k, mask=c_ok[:, None] & (k < KERNEL - 2)[None, :],
                      other=0.0).to(xv.dtype)
    w = tl.load(W + c[:, None] * stride_w_c + k[None, :] * stride_w_k, mask=c_ok[:, None] & in_state[None, :],
                other=0.0).to(tl.float32)
    w_last = tl.load(W + c * stride_w_c + (KERNEL - 1) * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.sum(kept.to(tl.float32) * w, axis=1) + xv.to(tl.float32) * w_last
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=c_ok, other=0.0).to(tl.float32)
    conv = acc.to(OUT.dtype.element_ty).to(tl.float32)  # rounded before the SiLU, as torch's conv1d then silu
    tl.store(OUT + b.to(tl.int64) * channels + c, (conv * tl.sigmoid(conv)).to(OUT.dtype.element_ty), mask=c_ok)
    new = tl.where((k == KERNEL - 2)[None, :], xv[:, None], shifted)
    tl.debug_barrier()  # every thread of the program has read the row before any overwrites it
    tl.store(row + k[None, :] * stride_st_k, new.to(STATES.dtype.element_ty), mask=c_ok[:, None] & in_state[None, :])


@triton.jit
def _conv_grad_kernel(X, STATE, W, BIAS, DOUT, DCONV, DW_PART, DBIAS_PART, seq, channels, stride_x_b, stride_x_s,
                      stride_st_b, stride_st_c, stride_st_k, stride_w_c, stride_w_k, KERNEL: tl.constexpr,
                      HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # d conv = d out * silu'(conv) for a tile, and the tile's share of d weight and d bias
    b, cb, tb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c_ok = c < channels
    live = (t < seq)[:, None] & c_ok[None, :]
    x_row = X + b.to(tl.int64) * stride_x_b
    st_row = STATE + b.to(tl.int64) * stride_st_b
    acc = _conv_tile(x_row, st_row, W, BIAS, t, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, stride_w_c,
                     stride_w_k, KERNEL, HAS_STATE, HAS_BIAS, BLOCK_T, BLOCK_C)
    conv = acc.to(X.dtype.element_ty).to(tl.float32)  # rounded as the forward rounds it before the SiLU
    sig = tl.sigmoid(conv)
    out_at = (b.to(tl.int64) * seq + t[:, None]) * channels + c[None, :]
    dconv = tl.load(DOUT + out_at, mask=live, other=0.0).to(tl.float32) * sig * (1.0 + conv * (1.0 - sig))
    dconv = tl.where(live, dconv, 0.0)
    tl.store(DCONV + out_at, dconv, mask=live)
    part = (b * tl.num_programs(2) + tb).to(tl.int64)
    if HAS_BIAS:
        tl.store(DBIAS_PART + part * channels + c, tl.sum(dconv, 0), mask=c_ok)
    for k in tl.static_range(KERNEL):
        tap = _window_tap(x_row, st_row, t, k, c, c_ok, seq, stride_x_s, stride_st_c, stride_st_k, KERNEL, HAS_STATE)
        tl.store(DW_PART + (part * KERNEL + k) * channels + c, tl.sum(dconv * tap, 0), mask=c_ok)


@triton.jit
def _conv_input_grad_kernel(DCONV, W, DNEW_STATE, DX, DSTATE, seq, channels, stride_w_c, stride_w_k,
                            KERNEL: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    # d window[c, j] = sum_k weight[c, k] d conv[j - k, c] (+ d new state where column j was kept), for window
    # columns j in [0, KERNEL - 1 + seq): the state's (when it was given), then x's
    b, cb, jb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    j = (jb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c_ok = c < channels
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(KERNEL):
        w = tl.load(W + c * stride_w_c + k * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
        t = j - k
        d = tl.load(DCONV + (b.to(tl.int64) * seq + t[:, None]) * channels + c[None, :],
                    mask=((t >= 0) & (t < seq))[:, None] & c_ok[None, :], other=0.0)
        acc += d * w[None, :]
    kept = j - seq  # the new state's column
    acc += tl.load(DNEW_STATE + (b.to(tl.int64) * channels + c[None, :]) * (KERNEL - 1) + kept[:, None],
                   mask=((kept >= 0) & (kept < KERNEL - 1))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    t = j - (KERNEL - 1)
    tl.store(DX + (b.to(tl.int64) * seq + t[:, None]) * channels + c[None, :], acc,
             mask=((t >= 0) & (t < seq))[:, None] & c_ok[None, :])
    if HAS_STATE:
        tl.store(DSTATE + (b.to(tl.int64) * channels + c[None, :]) * (KERNEL - 1) + j[:, None], acc,
                 mask=(j < KERNEL - 1)[:, None] & c_ok[None, :])


def causal_conv1d_forward(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher: layers/mamba2.causal_conv1d's arguments and results, checked, on the kernel. x (batch, seq,
    channels), conv_state (batch, channels, kernel - 1) or None (zeros), weight (channels, 1, kernel), bias
    (channels,) or None -> out (batch, seq, channels) contiguous in x's dtype, new state (batch, channels,
    kernel - 1) in x's dtype."""
    check_tensor("x", x, ndim=3)
    batch, seq, channels = x.shape
    check_tensor("weight", weight, ndim=3, last_dim_contiguous=False)
    if weight.shape[0] != channels or weight.shape[1] != 1:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected a depthwise (channels={channels}, 1, "
                         f"kernel) conv weight")
    kernel = weight.shape[2]
    if conv_state is not None:
        check_tensor("conv_state", conv_state, ndim=3, last_dim_contiguous=False)
        if tuple(conv_state.shape) != (batch, channels, kernel - 1):
            raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected (batch, channels, kernel - 1)"
                             f" = {(batch, channels, kernel - 1)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != channels:
            raise ValueError(f"bias has {bias.shape[0]} entries, expected one per channel ({channels})")
    check_same("device", x=x, weight=weight, **({} if bias is None else {"bias": bias}),
               **({} if conv_state is None else {"conv_state": conv_state}))
    out = torch.empty(batch, seq, channels, dtype=x.dtype, device=x.device)
    new_state = torch.empty(batch, channels, kernel - 1, dtype=x.dtype, device=x.device)
    if batch == 0 or channels == 0:
        return out, new_state
    block_t = max(16, min(64, next_power_of_2(seq)))
    block_c = 64 if channels >= 64 else max(16, next_power_of_2(channels))
    state = conv_state if conv_state is not None else x  # an unread pointer when there is no state
    grid = (batch, triton.cdiv(channels, block_c), max(1, triton.cdiv(seq, block_t)))
    _causal_conv1d_kernel[grid](
        x, state, weight, bias if bias is not None else weight, out, new_state, seq, channels,
        x.stride(0), x.stride(1), state.stride(0), state.stride(1), state.stride(2) if state.dim() == 3 else 0,
        weight.stride(0), weight.stride(2), KERNEL=kernel, HAS_STATE=conv_state is not None,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_K=max(2, next_power_of_2(kernel - 1)))
    return out, new_state


def causal_conv1d_indexed_forward(x: torch.Tensor, conv_states: torch.Tensor, rows: torch.Tensor,
                                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The launcher: layers/mamba2.causal_conv1d_indexed's arguments and result for one token per row, checked, on
    the kernel. x (n, 1, channels), conv_states (pool rows, channels, kernel - 1), rows (n,) int -> out (n, 1,
    channels) contiguous in x's dtype; rows `rows` of conv_states updated in place."""
    check_tensor("x", x, ndim=3)
    n, seq, channels = x.shape
    if seq != 1:
        raise ValueError(f"the indexed conv steps one token per row; x has {seq} (shape {tuple(x.shape)})")
    check_tensor("weight", weight, ndim=3, last_dim_contiguous=False)
    if weight.shape[0] != channels or weight.shape[1] != 1 or weight.shape[2] < 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected a depthwise (channels={channels}, 1, "
                         f"kernel >= 2) conv weight")
    kernel = weight.shape[2]
    check_tensor("conv_states", conv_states, ndim=3, last_dim_contiguous=False)
    if tuple(conv_states.shape[1:]) != (channels, kernel - 1):
        raise ValueError(f"conv_states has shape {tuple(conv_states.shape)}, expected (pool rows, channels, "
                         f"kernel - 1) = (rows, {channels}, {kernel - 1})")
    check_rows(rows, n)
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != channels:
            raise ValueError(f"bias has {bias.shape[0]} entries, expected one per channel ({channels})")
    check_same("device", x=x, conv_states=conv_states, rows=rows, weight=weight,
               **({} if bias is None else {"bias": bias}))
    out = torch.empty(n, 1, channels, dtype=x.dtype, device=x.device)
    if n and channels:
        block_c = 128 if channels >= 128 else max(16, next_power_of_2(channels))
        _conv_update_indexed_kernel[(n, triton.cdiv(channels, block_c))](
            x, conv_states, rows, weight, bias if bias is not None else weight, out, channels, x.stride(0),
            *conv_states.stride(), weight.stride(0), weight.stride(2), KERNEL=kernel, HAS_BIAS=bias is not None,
            BLOCK_C=block_c, BLOCK_K=max(2, next_power_of_2(kernel - 1)))
    return out


def causal_conv1d_backward(dout, dnew_state, x, conv_state, weight, bias):
    """Gradients of causal_conv1d_forward's (out, new state) with respect to (x, conv_state, weight, bias), each in
    its input's dtype (None for an absent state or bias). dout (batch, seq, channels); dnew_state (batch, channels,
    kernel - 1) or None (zeros). The conv is recomputed from the inputs, not kept from the forward."""
    batch, seq, channels = x.shape
    kernel = weight.shape[2]
    if tuple(dout.shape) != (batch, seq, channels):
        raise ValueError(f"dout has shape {tuple(dout.shape)}, expected x's {(batch, seq, channels)}")
    f32 = dict(dtype=torch.float32, device=x.device)
    block_t = max(16, min(64, next_power_of_2(seq)))
    block_c = 64 if channels >= 64 else max(16, next_power_of_2(channels))
    t_blocks = max(1, triton.cdiv(seq, block_t))
    dout = dout.contiguous()
    dnew_state = (torch.zeros(batch, channels, kernel - 1, **f32) if dnew_state is None
                  else dnew_state.contiguous())
    dconv = torch.empty(batch, seq, channels, **f32)
    dw_part = torch.zeros(batch, t_blocks, kernel, channels, **f32)
    dbias_part = torch.zeros(batch, t_blocks, channels, **f32)
    dx = torch.empty(batch, seq, channels, dtype=x.dtype, device=x.device)
    dstate = torch.empty(batch, channels, kernel - 1, **f32)
    if batch and channels:
        state = conv_state if conv_state is not None else x  # an unread pointer when there is no state
        st_strides = (state.stride(0), state.stride(1), state.stride(2) if state.dim() == 3 else 0)
        flags = dict(KERNEL=kernel, HAS_STATE=conv_state is not None, BLOCK_C=block_c)
        _conv_grad_kernel[(batch, triton.cdiv(channels, block_c), t_blocks)](
            x, state, weight, bias if bias is not None else weight, dout, dconv, dw_part, dbias_part, seq, channels,
            x.stride(0), x.stride(1), *st_strides, weight.stride(0), weight.stride(2), HAS_BIAS=bias is not None,
            BLOCK_T=block_t, **flags)
        # the window: kernel - 1 state columns, then seq inputs
        _conv_input_grad_kernel[(batch, triton.cdiv(channels, block_c), triton.cdiv(seq + kernel - 1, block_t))](
            dconv, weight, dnew_state, dx, dstate, seq, channels, weight.stride(0), weight.stride(2),
            BLOCK_T=block_t, **flags)
    # d weight: (kernel, channels) summed over the tiles -> (channels, 1, kernel)
    dweight = dw_part.sum((0, 1)).t().to(weight.dtype).contiguous().view(weight.shape)
    return (dx, dstate.to(conv_state.dtype) if conv_state is not None else None, dweight,
            dbias_part.sum((0, 1)).to(bias.dtype) if bias is not None else None)


class CausalConv1d(torch.autograd.Function):
    """The conv with its Triton backward (eager)."""

    @staticmethod
    def forward(ctx, x, conv_state, weight, bias):
        ctx.save_for_backward(x, conv_state, weight, bias)
        return causal_conv1d_forward(x, conv_state, weight, bias)

    @staticmethod
    def backward(ctx, dout, dnew_state):
        return causal_conv1d_backward(dout, dnew_state, *ctx.saved_tensors)


def causal_conv1d_triton(x, conv_state, weight, bias):
    """The kernel for use_kernel_function("causal_conv1d"); NotImplemented (the torch conv runs) under autograd."""
    if leave_to_torch(x, conv_state, weight, bias):
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return ops.causal_conv1d(x, conv_state, weight, bias)
    return causal_conv1d_forward(x, conv_state, weight, bias)


def causal_conv1d_train(x, conv_state, weight, bias):
    """The kernel for use_kernel_function("causal_conv1d") in train() mode: the Triton conv, differentiable."""
    if torch.compiler.is_compiling():  # the torch.library op, whose autograd formula is the backward above
        return ops.causal_conv1d(x, conv_state, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, conv_state, weight, bias)):
        return CausalConv1d.apply(x, conv_state, weight, bias)
    return causal_conv1d_forward(x, conv_state, weight, bias)


def causal_conv1d_indexed_triton(x, conv_states, rows, weight, bias):
    """The kernel for use_kernel_function("causal_conv1d_indexed"); NotImplemented (the torch gather, conv and
    scatter run) for more than one token per row and under autograd."""
    if x.shape[1] != 1 or leave_to_torch(x, conv_states, weight, bias):
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op, which mutates the pool in the graph
        return ops.causal_conv1d_indexed(x, conv_states, rows, weight, bias)
    return causal_conv1d_indexed_forward(x, conv_states, rows, weight, bias)
