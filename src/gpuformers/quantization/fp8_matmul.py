"""y = x @ W^T + b for a fine-grained FP8 weight (float8_e4m3fn, one float32 scale per bm x bn block) as a Triton
kernel that reads the FP8 bytes and scales each tile in registers, so the weight stays in FP8 in memory.

The layout is the checkpoint's (quantization/fp8.py); with K = in_features, N = out_features:

    weight            float8_e4m3fn (N, K)
    weight_scale_inv  float32       (ceil(N / bm), ceil(K / bn))      w[n, k] = weight[n, k] * s[n // bm, k // bn]

One program computes a (BLOCK_M, BLOCK_N) tile of y, walking K in BLOCK_K steps; BLOCK_K divides bn, so each step
reads one scale per output channel (that of its block row). The tile of W is converted to float32, scaled, rounded
to x's dtype (as dequantize_fp8_weight rounds it) and multiplied with float32 accumulation:

        x (M, K) ──► x tile (BLOCK_M, BLOCK_K) ─────┐
                                                     ├─ tl.dot ─► acc (BLOCK_M, BLOCK_N) float32 ─► y (M, N)
        weight ──► fp8 tile ─► float32 * s[n // bm] ─┘

Activations are not quantized: the matmul runs in x's dtype, not on FP8 tensor cores, so the saving is memory (half
of bfloat16's weight bytes), not FLOPs. Converting float8_e4m3fn in Triton needs compute capability 8.9 (H100, L4,
4090) or the interpreter. Tile sizes and split-K come from the weight-only kernel's choose_config (with group size
bn), the split-K partial tiles summed afterwards; unmeasured on a GPU so far.

The backward is grad_x = grad_y @ dequantize(W) and grad_bias = grad_y summed over rows; the FP8 weights get none.
Under torch.compile fp8_matmul calls the torch.library op gpuformers::fp8_matmul (registered on import).

Offers: fp8_matmul, fp8_matmul_forward, fp8_matmul_reference, kernel_fits, FP8MatmulFunction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op

from gpuformers.kernels.checks import check_bias_and_devices, check_tensor, dot_precision
from gpuformers.kernels.ops import NAMESPACE
from gpuformers.kernels.weight_only_matmul import MatmulConfig, choose_config, store_output_tile, sum_split_k
from gpuformers.kernels.weight_only_matmul import kernel_fits as _block_k_fits
from gpuformers.quantization.fp8 import dequantize_fp8_weight, scale_grid


@triton.jit
def _fp8_matmul_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys, block_rows,
                       block_cols, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < M, offs_n < N
    scale_rows = S + (offs_n // block_rows) * stride_sn  # each output channel's row of block scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):  # split-K: steps pid_k, pid_k + SPLIT_K, ...
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = W + offs_n[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # (BLOCK_N, BLOCK_K) float8
        else:
            in_k = (offs_k < K)[None, :]
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k, other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k, other=0.0)
        scale = tl.load(scale_rows + k0 // block_cols, mask=mask_n, other=0.0)  # (BLOCK_N,) float32
        w = (w.to(tl.float32) * scale[:, None]).to(X.dtype.element_ty)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    store_output_tile(Y, B, acc, pid_k, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ys, HAS_BIAS, SPLIT_K)


def kernel_fits(in_features: int, block_size: tuple[int, int] | None) -> bool:
    """Whether the kernel takes this layer: blocks of scales (not one per tensor) whose column count has a
    power-of-two factor of at least 16, which the K step must divide. FP8Linear dequantizes per call otherwise."""
    return block_size is not None and _block_k_fits(in_features, block_size[1])


def _check(x, weight, scale_inv, block_size, bias):
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float8_e4m3fn,))
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, but x has {k} features: it must be "
                         f"(out_features, {k})")
    if not kernel_fits(k, block_size):
        raise ValueError(f"block_size={block_size}: the kernel needs [rows, columns] blocks whose column count has a "
                         f"power-of-two factor >= 16 (e.g. [128, 128]); dequantize the weight for this layer")
    check_tensor("weight_scale_inv", scale_inv, ndim=2, dtypes=(torch.float32,))
    expected = scale_grid(n, k, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a "
                         f"{(n, k)} weight in blocks of {list(block_size)}")
    tensors = dict(x=x, weight=weight, weight_scale_inv=scale_inv)
    check_bias_and_devices(bias, n, **tensors)


def fp8_matmul_forward(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                       bias: torch.Tensor | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x (..., K) -> x @ W^T + bias (..., N) in x's dtype, W read as FP8 blocks (no autograd)."""
    _check(x, weight, scale_inv, block_size, bias)
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    config = config or choose_config(m, n, k, block_size[1], x.device)
    if block_size[1] % config.block_k:
        raise ValueError(f"config.block_k={config.block_k} does not divide the block's {block_size[1]} columns")
    y2 = y.view(m, n)
    out = y2 if config.split_k == 1 else torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    _fp8_matmul_kernel[grid](
        x2, weight, scale_inv, bias if bias is not None else scale_inv, out, m, n, k, x2.stride(0), weight.stride(0),
        scale_inv.stride(0), out.stride(-2), out.stride(0) if config.split_k > 1 else 0, block_size[0],
        block_size[1], HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, SPLIT_K=config.split_k,
        PRECISION=dot_precision(x.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if config.split_k > 1:
        sum_split_k(out, y2, bias)
    return y


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in torch: F.linear(x, the dequantized weight in x's dtype, bias)."""
    w = dequantize_fp8_weight(weight, scale_inv, block_size, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def _save(ctx, weight, scale_inv, block_size, bias):
    ctx.save_for_backward(weight, scale_inv)
    ctx.block_size = tuple(block_size)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gradients(ctx, grad_y):
    """Gradients for (x, weight, scale_inv, block_size, bias): only x and bias get one."""
    weight, scale_inv = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_y @ dequantize_fp8_weight(weight, scale_inv, ctx.block_size, grad_y.dtype)  # (..., N) @ (N, K)
    if ctx.needs_input_grad[4]:
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, grad_bias


class FP8MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale_inv, block_size, bias):
        _save(ctx, weight, scale_inv, block_size, bias)
        return fp8_matmul_forward(x, weight, scale_inv, block_size, bias)

    @staticmethod
    def backward(ctx, grad_y):
        return _gradients(ctx, grad_y)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W^T + bias -> (..., out) in x's dtype, W an FP8 weight with block scales; differentiable in x
    and bias."""
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return torch.ops.gpuformers.fp8_matmul(x, weight, scale_inv, list(block_size), bias)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return FP8MatmulFunction.apply(x, weight, scale_inv, tuple(block_size), bias)
    return fp8_matmul_forward(x, weight, scale_inv, tuple(block_size), bias)


# --- the torch.library op (for torch.compile) -------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::fp8_matmul", mutates_args=())
def _op(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int],
        bias: torch.Tensor | None) -> torch.Tensor:
    return fp8_matmul_forward(x, weight, scale_inv, tuple(block_size), bias)


@_op.register_fake
def _(x, weight, scale_inv, block_size, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _op_setup(ctx, inputs, output):
    _, weight, scale_inv, block_size, bias = inputs
    _save(ctx, weight, scale_inv, block_size, bias)


_op.register_autograd(_gradients, setup_context=_op_setup)
