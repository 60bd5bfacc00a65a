"""RMSNorm and fused residual-add + RMSNorm as Triton kernels, forward and backward, beside their torch reference.

    y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)          (rms_norm)
    s = x + residual;  y = rms_norm(s)  ->  (y, s)                  (rms_norm with residual=)

The statistics are computed in float32 and the normalised row is rounded to the input dtype before the weight
multiplies it, exactly as the torch layer (layers/norm.py) does, so float16 results match it bit for bit or
within one rounding. One program normalises one row; the backward gives each program a run of rows so that the
weight gradient is summed in registers and only (programs, hidden) partial sums reach memory. Under torch.compile,
rms_norm calls the torch.library ops gpuformers::rms_norm / gpuformers::add_rms_norm (ops.py) instead of
RMSNormFunction.

Offers: rms_norm, rms_norm_reference, rms_norm_forward, rms_norm_backward, RMSNormFunction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor, next_power_of_2


@triton.jit
def _rms_norm_fwd_kernel(X, RES, W, Y, RES_OUT, RSTD, stride_x, stride_res, stride_y, stride_res_out, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first: the torch layers add in that dtype.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES_OUT + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DRES_OUT, DX, DW_PARTIAL, stride_dy, stride_x, stride_dres, stride_dx,
                         n_rows, n_cols, rows_per_program, HAS_DRES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        row64 = tl.cast(row, tl.int64)  # row * stride passes 2**31 past ~400k rows of hidden 5120
        x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64)
        normed = x * rstd
        dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        dnormed = dy * w
        # d/dx of x * rsqrt(mean(x^2)): rstd * (dn - n * mean(dn * n))
        dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / n_cols))
        if HAS_DRES:
            dx += tl.load(DRES_OUT + row64 * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def rms_norm_reference(x, weight, eps=1e-6, residual=None):
    """The torch computation the kernel must reproduce (same as layers/norm.py, plus the residual add)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * normed.to(x.dtype)
    return (y, x) if residual is not None else y


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    # (..., hidden) -> (rows, hidden) without copying when the leading dims are viewable.
    check_tensor(name, t)
    return t.reshape(-1, t.shape[-1])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (..., hidden), weight (hidden,), residual like x or None -> (y, residual_out or None, rstd (rows,))."""
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements but x has hidden size {hidden}")
    check_same("device", x=x, weight=weight)
    x2 = _rows("x", x)
    res2 = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
        res2 = _rows("residual", residual)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    # Contiguous, not empty_like: a permuted x would give a permuted res_out that .view(-1, hidden) rejects.
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        y2 = y.view(-1, hidden)
        ro2 = res_out.view(-1, hidden) if res_out is not None else y2
        _rms_norm_fwd_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight, y2, ro2, rstd,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, y2.stride(0), ro2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden), num_warps=_num_warps(hidden),
        )
    return y, res_out, rstd


def rms_norm_backward(dy, x, weight, rstd, dres_out=None):
    """Gradients of rms_norm_forward: (dx, dweight); x is the normalised input (residual_out when fused)."""
    hidden = x.shape[-1]
    dy2, x2 = _rows("dy", dy.contiguous()), x.reshape(-1, hidden)
    rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as res_out above
    dres2 = dres_out.contiguous().view(-1, hidden) if dres_out is not None else None
    programs = max(1, min(rows, _programs_for(x.device)))
    rows_per_program = triton.cdiv(rows, programs) if rows else 0
    dw_partial = torch.zeros(programs, hidden, dtype=torch.float32, device=x.device)
    if rows:
        dx2 = dx.view(-1, hidden)
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight, rstd, dres2 if dres2 is not None else dy2, dx2, dw_partial,
            dy2.stride(0), x2.stride(0), dres2.stride(0) if dres2 is not None else 0, dx2.stride(0),
            rows, hidden, rows_per_program,
            HAS_DRES=dres_out is not None, BLOCK=next_power_of_2(hidden), num_warps=_num_warps(hidden),
        )
    return dx, dw_partial.sum(0).to(weight.dtype)


def _num_warps(hidden: int) -> int:
    return min(16, max(1, next_power_of_2(hidden) // 256))


def _programs_for(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs, each a Python loop


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, res_out, rstd = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(res_out if residual is not None else x, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is not None:
            return y, res_out
        return y

    @staticmethod
    def backward(ctx, dy, dres_out=None):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy, x, weight, rstd, dres_out if ctx.has_residual else None)
        return dx, dweight, None, (dx if ctx.has_residual else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """Triton RMSNorm of x (..., hidden); with `residual`, returns (rms_norm(x + residual), x + residual)."""
    if torch.compiler.is_compiling():  # the torch.library ops: torch.compile keeps them in its graph
        if residual is None:
            return ops.rms_norm(x, weight, eps)[0]
        y, summed, _ = ops.add_rms_norm(x, residual, weight, eps)
        return y, summed
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
    )
    if needs_grad:
        return RMSNormFunction.apply(x, weight, eps, residual)
    y, res_out, _ = rms_norm_forward(x, weight, eps, residual)
    return (y, res_out) if residual is not None else y
