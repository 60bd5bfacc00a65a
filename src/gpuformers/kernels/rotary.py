"""Rotary position embedding applied to q and k by a Triton kernel, in place (inference) or out of place with a
backward (training), beside the torch reference in layers/rotary.py.

    x1, x2 = x[..., :half], x[..., half:]          cos, sin: (batch, seq, head_dim), batch may be 1 (broadcast)
    y1 = x1 * cos[:half] - x2 * sin[:half]
    y2 = x2 * cos[half:] + x1 * sin[half:]

The backward is the transposed rotation (dy rotated by -sin). One program handles one (batch, position) and a
block of heads, so cos and sin are read once per token. Under torch.compile both functions call the
torch.library op gpuformers::rotary (ops.py), out of place.

Offers: apply_rotary, apply_rotary_inplace, rotary_forward, RotaryFunction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor, next_power_of_2


@triton.jit
def _rotary_kernel(X, Y, COS, SIN, stride_xb, stride_xh, stride_xs, stride_yb, stride_yh, stride_ys,
                   stride_cb, stride_cs, seq_len, n_heads, half,
                   BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # h * seq * dim: 2**31 at 256k tokens
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    mask = (heads < n_heads)[:, None] & dmask[None, :]
    cs = b * stride_cb + s * stride_cs
    cos1 = tl.load(COS + cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + cs + half + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + cs + half + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    x_ptr = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    y_ptr = Y + b * stride_yb + s * stride_ys + heads[:, None] * stride_yh + d[None, :]
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, y2.to(Y.dtype.element_ty), mask=mask)


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
                   unsqueeze_dim: int = 1, backward: bool = False) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) when unsqueeze_dim == 1, or (batch, seq, heads, head_dim) when it is 2;
    cos, sin (batch or 1, seq, head_dim). Writes into `out` (x itself for in place) and returns it."""
    check_tensor("x", x, ndim=4)
    check_tensor("cos", cos, ndim=3)
    check_tensor("sin", sin, ndim=3)
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (x is batch, heads, seq, dim) or 2 (batch, seq, heads, dim), "
                         f"got {unsqueeze_dim}")
    check_same("device", x=x, cos=cos, sin=sin)
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape and strides")
    view = x if unsqueeze_dim == 1 else x.transpose(1, 2)  # (batch, heads, seq, head_dim)
    batch, heads, seq, head_dim = view.shape
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if cos.shape[1] != seq or cos.shape[2] != head_dim or cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match x (batch={batch}, seq={seq}, head_dim={head_dim})")
    out = torch.empty_like(x) if out is None else out
    out_view = out if unsqueeze_dim == 1 else out.transpose(1, 2)
    if x.numel():
        block_h = min(next_power_of_2(heads), 16)
        grid = (batch * seq, triton.cdiv(heads, block_h))
        _rotary_kernel[grid](
            view, out_view, cos, sin, view.stride(0), view.stride(1), view.stride(2),
            out_view.stride(0), out_view.stride(1), out_view.stride(2),
            cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), seq, heads, head_dim // 2,
            BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=next_power_of_2(head_dim // 2), num_warps=1,
        )
    return out


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return rotary_forward(q, cos, sin, unsqueeze_dim=unsqueeze_dim), rotary_forward(k, cos, sin,
                                                                                         unsqueeze_dim=unsqueeze_dim)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dim = ctx.unsqueeze_dim
        dq = rotary_forward(dq.contiguous(), cos, sin, unsqueeze_dim=dim, backward=True) if dq is not None else None
        dk = rotary_forward(dk.contiguous(), cos, sin, unsqueeze_dim=dim, backward=True) if dk is not None else None
        return dq, dk, None, None, None


def apply_rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Triton rotary of q and k (new tensors, differentiable w.r.t. q and k); same signature as the torch one."""
    if cos.requires_grad or sin.requires_grad:
        # Learned rotary tables are not a thing in this library: decline, so that the torch function runs and their
        # gradient is right (kernels/mapping.py use_kernel_function).
        return NotImplemented
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return ops.rotary(q, cos, sin, unsqueeze_dim, False), ops.rotary(k, cos, sin, unsqueeze_dim, False)
    return RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim)


def apply_rotary_inplace(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotates q and k in place when no gradient is needed (inference), else falls back to apply_rotary."""
    if torch.compiler.is_compiling():  # out of place: the compiler plans the buffers (an in-place op would be
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)  # turned into a copy anyway)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)
    return rotary_forward(q, cos, sin, q, unsqueeze_dim), rotary_forward(k, cos, sin, k, unsqueeze_dim)
