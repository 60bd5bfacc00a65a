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

Forward only: causal_conv1d_triton hands the call back to torch (NotImplemented) when autograd would need its
gradient, and the mapping's training mode keeps the torch function. While torch.compile traces it calls the
torch.library op gpuformers::causal_conv1d (ops.py).

Offers: causal_conv1d_triton, causal_conv1d_forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor, leave_to_torch, next_power_of_2


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
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(KERNEL):
        w = tl.load(W + c * stride_w_c + k * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
        j = t + k  # position in the window: the state's KERNEL - 1 columns, then x
        xv = tl.load(x_row + (j - (KERNEL - 1))[:, None] * stride_x_s + c[None, :],
                     mask=(j >= KERNEL - 1)[:, None] & (t < seq)[:, None] & c_ok[None, :], other=0.0)
        value = xv.to(tl.float32)
        if HAS_STATE:
            sv = tl.load(st_row + c[None, :] * stride_st_c + j[:, None] * stride_st_k,
                         mask=(j < KERNEL - 1)[:, None] & c_ok[None, :], other=0.0)
            value += sv.to(xv.dtype).to(tl.float32)  # the state cast to x's dtype, as the layer casts it
        acc += value * w[None, :]
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


def causal_conv1d_triton(x, conv_state, weight, bias):
    """The kernel for use_kernel_function("causal_conv1d"); NotImplemented (the torch conv runs) under autograd."""
    if leave_to_torch(x, conv_state, weight, bias):
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return ops.causal_conv1d(x, conv_state, weight, bias)
    return causal_conv1d_forward(x, conv_state, weight, bias)
