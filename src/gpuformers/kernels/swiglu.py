"""SiLU and SiLU-and-mul (the SwiGLU gate of llama-family MLPs) as Triton kernels, forward and backward.

    silu_and_mul(gate, up) = silu(gate).to(dtype) * up        gate, up: (..., intermediate)
    silu(x)                = x * sigmoid(x)

The torch MLP computes silu in float32 and rounds it before the product; the kernel rounds at the same place, so
float16 results match it. Elementwise and memory-bound: each program handles BLOCK elements of one row.
Under torch.compile, silu_and_mul and silu call the torch.library ops gpuformers::silu_and_mul / gpuformers::silu
(ops.py) instead of their autograd.Functions.

Offers: silu_and_mul, silu, swiglu_reference, silu_and_mul_forward, silu_and_mul_backward, SiluAndMulFunction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor

_BLOCK = 1024


@triton.jit
def _silu_mul_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols, GATED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Y.dtype.element_ty)
    if GATED:
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        act = (act.to(tl.float32) * u).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, act, mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
                         GATED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    dact = dy
    if GATED:
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        # The forward rounded silu(g) before the product; du sees that rounded value.
        tl.store(DU + row * stride_du + cols, (dy * act.to(DU.dtype.element_ty).to(tl.float32)).to(DU.dtype.element_ty),
                 mask=mask)
        dact = (dy * u).to(DG.dtype.element_ty).to(tl.float32)
    # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    tl.store(DG + row * stride_dg + cols, (dact * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up as the torch MLP computes it (silu(gate) alone when up is None)."""
    return F.silu(gate) if up is None else F.silu(gate) * up


def _check(gate, up):
    check_tensor("gate", gate)
    if up is not None:
        check_tensor("up", up)
        if up.shape != gate.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
        check_same("dtype", gate=gate, up=up)
        check_same("device", gate=gate, up=up)


def silu_and_mul_forward(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """gate, up (..., n) -> silu(gate) * up (..., n); up=None gives silu(gate)."""
    _check(gate, up)
    n = gate.shape[-1]
    g2 = gate.reshape(-1, n)
    u2 = up.reshape(-1, n) if up is not None else g2
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    y2 = y.view(-1, n)
    if g2.shape[0] and n:
        grid = (g2.shape[0], triton.cdiv(n, _BLOCK))
        _silu_mul_fwd_kernel[grid](g2, u2, y2, g2.stride(0), u2.stride(0), y2.stride(0), n,
                                   GATED=up is not None, BLOCK=_BLOCK, num_warps=4)
    return y


def silu_and_mul_backward(dy, gate, up):
    """Gradients of silu_and_mul_forward: (dgate, dup or None)."""
    n = gate.shape[-1]
    dy2, g2 = dy.contiguous().view(-1, n), gate.reshape(-1, n)
    u2 = up.reshape(-1, n) if up is not None else g2
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if up is not None else None
    dg2 = dgate.view(-1, n)
    du2 = dup.view(-1, n) if dup is not None else dg2
    if g2.shape[0] and n:
        grid = (g2.shape[0], triton.cdiv(n, _BLOCK))
        _silu_mul_bwd_kernel[grid](dy2, g2, u2, dg2, du2, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0),
                                   du2.stride(0), n, GATED=up is not None, BLOCK=_BLOCK, num_warps=4)
    return dgate, dup


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_and_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return silu_and_mul_backward(dy, gate, up)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton silu(gate) * up, differentiable."""
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return ops.silu_and_mul(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SiluAndMulFunction.apply(gate, up)
    return silu_and_mul_forward(gate, up)


class _SiluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_and_mul_forward(x, None)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return silu_and_mul_backward(dy, x, None)[0]


def silu(x: torch.Tensor) -> torch.Tensor:
    """Triton silu(x), differentiable."""
    if torch.compiler.is_compiling():
        return ops.silu(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SiluFunction.apply(x)
    return silu_and_mul_forward(x, None)
