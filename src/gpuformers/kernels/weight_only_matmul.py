"""y = x @ W^T + b for weight-only quantized W (int8, or int4 packed two per byte) as a Triton kernel that reads the
packed integers and dequantizes each weight tile in registers, so the float weight is never written to memory.

The layout is WeightOnlyLinear's (quantization/weight_only.py); with K = in_features, N = out_features, G groups:

    bits 8  qweight int8  (N, K)       w = q * scale[n, k // group]                  G = 1: scale the output instead
    bits 4  qweight uint8 (N, K // 2)  w = (q - 8) * scale[n, g] + zero[n, g]        byte j = column 2j (low nibble)
                                                                                     | column 2j + 1 (high nibble)
    MXFP4   qweight uint8 (N, K // 2)  w = E2M1(q) * 2^(scale[n, k // 32] - 127)   the same nibble order; uint8
                                                                                     scales (kernels/mxfp4_matmul.py)

One program computes a (BLOCK_M, BLOCK_N) tile of y, walking K in BLOCK_K steps; BLOCK_K divides the group size, so
each step reads one scale (and zero) per output channel. The tile of W is dequantized in float32, rounded to x's
dtype as dequantize() rounds it, and multiplied on the tensor cores with float32 accumulation:

        x (M, K) ──► x tile (BLOCK_M, BLOCK_K) ─┐
                                                ├─ tl.dot ─► acc (BLOCK_M, BLOCK_N) float32 ─► y (M, N), x's dtype
        qweight ──► q tile ─► (q*s [+ z']) ─────┘

Decode (a few rows) reads the weight once and is memory-bound, so it needs many programs: split-K gives each of
SPLIT_K programs a share of K and sums their float32 partial tiles afterwards. Block sizes come from choose_config
by M (decode / small batch / prefill); they are reasoned, not tuned: no GPU has run this kernel yet.

The backward is grad_x = grad_y @ dequantize(W) (torch) and grad_bias = grad_y summed over rows; the integer weights
get no gradient (QLoRA trains adapters beside the layer). Under torch.compile weight_only_matmul calls the
torch.library op gpuformers::weight_only_matmul (registered on import of this file) instead of its autograd.Function.

Offers: weight_only_matmul, weight_only_matmul_forward, weight_only_matmul_reference, MatmulConfig, choose_config,
kernel_fits, launch, store_output_tile, sum_split_k, WeightOnlyMatmulFunction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op

from gpuformers.kernels.checks import check_bias_and_devices, check_tensor, dot_precision, next_power_of_2
from gpuformers.kernels.ops import NAMESPACE
from gpuformers.kernels.packed_formats import INT4_MID, dequantize_weight

MIN_BLOCK_K = 16  # tl.dot's smallest inner dimension
_INT4_MID = tl.constexpr(INT4_MID)


@triton.jit
def _weight_only_matmul_kernel(X, Q, S, Z, B, Y, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
                               group_size, BITS: tl.constexpr, MXFP4: tl.constexpr, SCALE_OUTPUT: tl.constexpr,
                               HAS_BIAS: tl.constexpr,
                               EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Split-K: this program takes the K steps pid_k, pid_k + SPLIT_K, ...
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # bits 4: the bytes holding columns offs_k
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        q_ptrs = Q + offs_n[:, None] * stride_qn + (offs_k if BITS == 8 else offs_byte)[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
            q = tl.load(q_ptrs, mask=mask_n[:, None], other=0)  # (BLOCK_N, BLOCK_K) int8 or (BLOCK_N, BLOCK_K / 2)
        else:
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
            q_in_k = offs_k < K if BITS == 8 else offs_byte < K // 2
            q = tl.load(q_ptrs, mask=mask_n[:, None] & q_in_k[None, :], other=0)
        if BITS == 8:
            w = q.to(tl.float32)
            if not SCALE_OUTPUT:
                scale = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=mask_n, other=0.0).to(tl.float32)
                w = w * scale[:, None]
        elif MXFP4:  # E2M1 codes and one E8M0 scale per 32 columns (kernels/mxfp4_matmul.py)
            c = tl.join(q & 15, q >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.int32)  # codes, column order as below
            e, m = (c >> 1) & 3, c & 1
            # the float32 bit pattern of each magnitude: (1 + m/2) * 2^(e - 1) for e > 0, m / 2 for e == 0 (0x3F000000
            # is 0.5); built from bits, so it is exact on any GPU (no exp2 approximation)
            bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
            w = bits.to(tl.float32, bitcast=True)
            w = tl.where(c >= 8, -w, w)
            s = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=mask_n, other=127).to(tl.int32)
            w = w * (s << 23).to(tl.float32, bitcast=True)[:, None]  # * 2^(s - 127); s = 0 reads as 0 (2^-127)
        else:
            # Contiguous bytes (vector loads); joining (low, high) on a last axis of 2 and flattening it puts column
            # 2j's nibble before column 2j + 1's.
            w = tl.join(q & 15, q >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)  # (BLOCK_N, BLOCK_K)
            scale = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=mask_n, other=0.0).to(tl.float32)
            zero = tl.load(Z + offs_n * stride_sn + k0 // group_size, mask=mask_n, other=0.0).to(tl.float32)
            # q * scale + (zero - 8 * scale): dequantize()'s float32 formula, so both round to the same weight
            w = w * scale[:, None] + (zero - _INT4_MID * scale)[:, None]
        acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), input_precision=PRECISION)
    if SCALE_OUTPUT:  # int8 with one scale per output channel: x @ (q * s)^T = (x @ q^T) * s
        acc *= tl.load(S + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    store_output_tile(Y, B, acc, pid_k, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ys, HAS_BIAS, SPLIT_K)


@triton.jit
def store_output_tile(Y, B, acc, pid_k, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ys, HAS_BIAS: tl.constexpr,
                      SPLIT_K: tl.constexpr):
    """Store a program's float32 (BLOCK_M, BLOCK_N) tile of y (this kernel's and fp8_matmul's): plus the bias in y's
    dtype, or under split-K as one float32 partial tile of (SPLIT_K, M, N) for sum_split_k."""
    # int64: a config with split-K at large M puts split_k * m * n past 2**31
    y_ptrs = Y + pid_k.to(tl.int64) * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:  # a float32 partial tile; the launcher sums the SPLIT_K of them and adds the bias
        tl.store(y_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


# --- launch configuration --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatmulConfig:
    """Tile sizes and launch options of one weight_only_matmul call (split_k > 1: K shared by that many programs)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name}={value} must be a power of two >= 16 (tl.dot's smallest tile)")
        if self.split_k < 1:
            raise ValueError(f"MatmulConfig.split_k={self.split_k} must be >= 1 (1: no split)")


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _largest_block_k(k: int, group_size: int | None) -> int:
    """The largest BLOCK_K that fits: a power of two dividing the group size (one scale per step), at most K's."""
    limit = max(MIN_BLOCK_K, next_power_of_2(k))
    return min(limit, group_size & -group_size) if group_size else limit


def kernel_fits(k: int, group_size: int | None) -> bool:
    """Whether the kernel takes this layer: a group size must have a power-of-two factor of at least 16 (BLOCK_K
    has to divide it). WeightOnlyLinear dequantizes per call for the others (e.g. group_size=24)."""
    return _largest_block_k(k, group_size) >= MIN_BLOCK_K


def choose_config(m: int, n: int, k: int, group_size: int | None, device: torch.device) -> MatmulConfig:
    """A fixed config by the number of rows M (not autotuned; unmeasured on a GPU so far):

        M <= 16  decode      16 x 64 tiles, BLOCK_K 128, split-K until ~2 programs per SM: memory-bound, reads W once
        M <= 64  small batch 32/64 x 64 tiles, BLOCK_K 64, split-K as above
        M > 64   prefill     128 x 128 tiles, BLOCK_K 64, 8 warps: compute-bound, no split
    """
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = (32 if m <= 32 else 64), 64, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    block_k = min(block_k, _largest_block_k(k, group_size))
    split_k = 1
    if m <= 64:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        wanted = max(1, 2 * _multiprocessors(device) // tiles)
        split_k = min(next_power_of_2(wanted + 1) // 2, triton.cdiv(k, block_k), 16)  # a power of two, <= wanted
    return MatmulConfig(block_m, block_n, block_k, split_k, warps, stages)


_config_for = functools.lru_cache(maxsize=1024)(choose_config)  # the launcher's: no Python work per decode step


# --- launcher --------------------------------------------------------------------------------------------------

def _check(x, qweight, scales, zeros, bits, group_size, bias):
    check_tensor("x", x)
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r} is not supported: the weight-only matmul reads 8-bit or 4-bit weights")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.uint8 if bits == 4 else torch.int8,))
    k, n = x.shape[-1], qweight.shape[0]
    packed_k = k // 2 if bits == 4 else k
    if bits == 4 and k % 2:
        raise ValueError(f"x has {k} features, an odd number, but 4-bit weights pack two columns per byte")
    if qweight.shape[1] != packed_k:
        raise ValueError(f"qweight has shape {tuple(qweight.shape)}, but x has {k} features: {bits}-bit qweight "
                         f"must be (out_features, {packed_k})")
    groups = k // group_size if group_size else 1
    if group_size is not None and (group_size <= 0 or k % group_size):
        raise ValueError(f"group_size={group_size} does not divide in_features={k}; pass the layer's group size, "
                         "or None for one scale per output channel")
    if not kernel_fits(k, group_size):
        raise ValueError(f"group_size={group_size} has no power-of-two factor >= {MIN_BLOCK_K}, which the kernel's "
                         "K step must divide; use a group size such as 32, 64 or 128, or dequantize-then-matmul")
    check_tensor("scales", scales, ndim=2)
    if tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {(n, groups)} (out_features, groups) "
                         f"for in_features={k} and group_size={group_size}")
    tensors = dict(x=x, qweight=qweight, scales=scales)
    if bits == 4:
        if zeros is None:
            raise ValueError("4-bit weights need zeros (out_features, groups); got zeros=None")
        check_tensor("zeros", zeros, ndim=2)
        if zeros.shape != scales.shape or zeros.stride() != scales.stride():
            raise ValueError(f"zeros (shape {tuple(zeros.shape)}, strides {zeros.stride()}) must be laid out as "
                             f"scales (shape {tuple(scales.shape)}, strides {scales.stride()}); pass .contiguous() "
                             "copies of both")
        tensors["zeros"] = zeros
    check_bias_and_devices(bias, n, **tensors)


def weight_only_matmul_forward(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               zeros: torch.Tensor | None, bits: int, group_size: int | None,
                               bias: torch.Tensor | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x (..., K) -> x @ W^T + bias (..., N) in x's dtype, W read from the packed layout (no autograd)."""
    _check(x, qweight, scales, zeros, bits, group_size, bias)
    return launch(x, qweight, scales, zeros, bits, False, group_size, bias, config)


def launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
           mxfp4: bool, group_size: int | None, bias: torch.Tensor | None, config: MatmulConfig | None) -> torch.Tensor:
    """Run the kernel on checked inputs (mxfp4: E2M1 codes with E8M0 scales, kernels/mxfp4_matmul.py)."""
    k, n = x.shape[-1], qweight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    config = config or _config_for(m, n, k, group_size, x.device)
    if group_size and group_size % config.block_k:
        raise ValueError(f"config.block_k={config.block_k} does not divide group_size={group_size}")
    y2 = y.view(m, n)
    out = y2 if config.split_k == 1 else torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    _weight_only_matmul_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(-2),
        out.stride(0) if config.split_k > 1 else 0, group_size or k,
        BITS=bits, MXFP4=mxfp4, SCALE_OUTPUT=bits == 8 and not group_size, HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0, SPLIT_K=config.split_k, PRECISION=dot_precision(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if config.split_k > 1:
        sum_split_k(out, y2, bias)
    return y


def sum_split_k(partials: torch.Tensor, y2: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A split-K launch's float32 partial sums (split_k, m, n), added up (with the bias) into y2 (m, n)."""
    total = partials.sum(0)
    if bias is not None:
        total += bias.float()
    y2.copy_(total)


def weight_only_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                 zeros: torch.Tensor | None, bits: int, group_size: int | None,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in torch: F.linear(x, the dequantized weight, bias)."""
    weight = dequantize_weight(qweight, scales, zeros, bits)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _save(ctx, qweight, scales, zeros, bits, bias):
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.bits = bits
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gradients(ctx, grad_y):
    """Gradients for (x, qweight, scales, zeros, bits, group_size, bias): only x and bias get one."""
    qweight, scales, zeros = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight = dequantize_weight(qweight, scales, zeros, ctx.bits)  # (N, K) in the compute dtype
        grad_x = grad_y @ weight.to(grad_y.dtype)  # (..., N) @ (N, K)
    if ctx.needs_input_grad[6]:
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, None, grad_bias


class WeightOnlyMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qweight, scales, zeros, bits, group_size, bias):
        _save(ctx, qweight, scales, zeros, bits, bias)
        return weight_only_matmul_forward(x, qweight, scales, zeros, bits, group_size, bias)

    @staticmethod
    def backward(ctx, grad_y):
        return _gradients(ctx, grad_y)


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       bits: int, group_size: int | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W^T + bias -> (..., out) in x's dtype, W given as WeightOnlyLinear stores it (qweight, scales,
    zeros for bits 4, group_size None for one group); differentiable in x and bias."""
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return torch.ops.gpuformers.weight_only_matmul(x, qweight, scales, zeros, bits, group_size or 0, bias)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return WeightOnlyMatmulFunction.apply(x, qweight, scales, zeros, bits, group_size, bias)
    return weight_only_matmul_forward(x, qweight, scales, zeros, bits, group_size, bias)


# --- the torch.library op (for torch.compile) -------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::weight_only_matmul", mutates_args=())
def _op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
        group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """group_size 0 means one group (a schema has no int | None that reads as well)."""
    return weight_only_matmul_forward(x, qweight, scales, zeros, bits, group_size or None, bias)


@_op.register_fake
def _(x, qweight, scales, zeros, bits, group_size, bias):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


def _op_setup(ctx, inputs, output):
    _, qweight, scales, zeros, bits, _, bias = inputs
    _save(ctx, qweight, scales, zeros, bits, bias)


_op.register_autograd(_gradients, setup_context=_op_setup)
