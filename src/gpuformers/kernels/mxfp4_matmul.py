"""y = x @ W^T + b for MXFP4 weights (gpt-oss's packed experts, quantization/mxfp4.py) as a Triton kernel.

It is the weight-only matmul kernel (kernels/weight_only_matmul.py) in its MXFP4 mode, which decodes each E2M1 code
into its float32 bit pattern and multiplies by the block's 2^(scale - 127), also built from bits, so the dequantized
tile is exact before it is rounded to x's dtype (where every such value fits, barring the exponent range) and
multiplied on the tensor cores:

    blocks (N, K / 32, 16) uint8 ── viewed (N, K / 2) ──► q tile ──► codes ──► E2M1 bits * 2^(s - 127) ─┐
    x (M, K) ──► x tile ────────────────────────────────────────────────────────────────────── tl.dot ──► y (M, N)

Block sizes are the weight-only matmul's (choose_config) with group size 32, so every K step stays inside one scale's
block (BLOCK_K <= 32). No autograd: mxfp4_linear takes the torch path when the input needs a gradient. Not yet run on a
GPU; tested against mxfp4_matmul_reference under TRITON_INTERPRET=1.

Offers: mxfp4_matmul_forward, mxfp4_matmul_reference.
"""

from __future__ import annotations

import torch

from gpuformers.kernels.checks import check_bias_and_devices, check_tensor
from gpuformers.kernels.weight_only_matmul import MatmulConfig, launch
from gpuformers.kernels.packed_formats import MXFP4_BLOCK as BLOCK
from gpuformers.kernels.packed_formats import mxfp4_linear_reference


def _check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensor("x", x)
    check_tensor("blocks", blocks, ndim=3, dtypes=(torch.uint8,))
    check_tensor("scales", scales, ndim=2, dtypes=(torch.uint8,))
    k, n = x.shape[-1], blocks.shape[0]
    if tuple(blocks.shape) != (n, k // BLOCK, BLOCK // 2) or k % BLOCK:
        raise ValueError(f"blocks has shape {tuple(blocks.shape)}, but x has {k} features: MXFP4 blocks must be "
                         f"(out_features, in_features / {BLOCK}, {BLOCK // 2}) with in_features a multiple of {BLOCK}")
    if tuple(scales.shape) != (n, k // BLOCK):
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {(n, k // BLOCK)} (out_features, "
                         f"in_features / {BLOCK})")
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous (each row's bytes in column order); pass blocks.contiguous()")
    tensors = dict(x=x, blocks=blocks, scales=scales)
    check_bias_and_devices(bias, n, **tensors)


def mxfp4_matmul_forward(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x (..., K) -> x @ W^T + bias (..., N) in x's dtype, W (N, K) read from MXFP4 blocks (N, K / 32, 16) and
    scales (N, K / 32), both uint8 (no autograd)."""
    _check(x, blocks, scales, bias)
    qweight = blocks.view(blocks.shape[0], -1)  # (N, K / 2): byte j holds columns 2j (low nibble) and 2j + 1
    return launch(x, qweight, scales, None, 4, True, BLOCK, bias, config)


mxfp4_matmul_reference = mxfp4_linear_reference  # what the kernel computes, in torch
