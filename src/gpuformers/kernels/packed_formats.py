"""The packed weight formats the kernels read, defined once: the quantization layers (quantization/weight_only.py,
quantization/mxfp4.py) store weights in them and the Triton kernels (weight_only_matmul.py, mxfp4_matmul.py) decode
them, so both import the layout from here.

Weight-only int8 / int4 (WeightOnlyLinear): int8 q with a scale per (row, group); int4 two codes a byte (the even
column in the low nibble) read as (q - INT4_MID) * scale + zero, the layout torch's int4 CPU kernel reads.

MXFP4 (gpt-oss's experts): blocks uint8 (..., rows, cols / 32, 16), two E2M1 codes a byte, the even column in the low
nibble; scales uint8 (..., rows, cols / 32), E8M0, each block of MXFP4_BLOCK values times 2^(scale - 127).

Offers: INT4_MID, dequantize_weight, MXFP4_BLOCK, E2M1_VALUES, dequantize_mxfp4, mxfp4_linear_reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_MID = 8  # dequantize as (q - 8) * scale + zero: the layout torch's int4 CPU kernel reads
# E2M1 code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per E8M0 scale


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bits: int) -> torch.Tensor:
    """The float weight (out, in) in scales' dtype from WeightOnlyLinear's storage (module doc); zeros for bits 4."""
    out_features, groups = scales.shape
    in_features = qweight.shape[1] * (2 if bits == 4 else 1)
    if bits == 8:
        # |q| <= 127 is exact in every float dtype, so one multiply in the compute dtype rounds once, as
        # float32 math then a cast would. In place: a second weight-sized buffer costs its page faults too
        # (8.7 -> 1.2 ms for 1024 x 3072 on the CPU).
        q = qweight.to(scales.dtype).view(out_features, groups, -1)
        return q.mul_(scales[..., None]).view(out_features, in_features)
    q = torch.stack([qweight & 15, qweight >> 4], dim=-1)  # (out, in // 2, 2): columns 2j, 2j + 1
    q = q.view(out_features, groups, -1).to(torch.float32)
    # (q - 8) * scale + zero as q * scale + (zero - 8 * scale): two in-place passes over the weight, not three.
    scale = scales.float()
    offset = zeros.float() - INT4_MID * scale
    w = q.mul_(scale[..., None]).add_(offset[..., None])
    return w.view(out_features, in_features).to(scales.dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks (..., groups, 16) uint8 and scales (..., groups) uint8 -> values (..., groups * 32) in `dtype`.
    Computed in float32, which holds every product exactly (module doc)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks "
                         f"are (..., groups, 16) and scales (..., groups)")
    table = _e2m1_table(blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (..., groups, 32), low nibble first
    values = table[codes.long()] * torch.exp2(scales.to(torch.float32) - 127.0)[..., None]
    return values.flatten(-2).to(dtype)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """E2M1_VALUES (float32, 16) computed on `device` from the codes (module doc), not copied there from a Python
    list: a copy from host memory waits for the GPU, and a training forward dequantizes every expert it runs."""
    codes = torch.arange(16, device=device)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa / 2, (1 + mantissa / 2) * torch.exp2(exponent - 1.0))
    return torch.where(codes >= 8, -magnitude, magnitude)


def mxfp4_linear_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """mxfp4_linear in torch: F.linear(x, the dequantized weight, bias), for the call only."""
    return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype), None if bias is None else bias.to(x.dtype))
