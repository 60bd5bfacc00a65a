"""MXFP4: the OCP microscaling 4-bit format gpt-oss's experts ship in, and `Mxfp4Config`, transformers' name for how
to load it.

    blocks  uint8 (..., rows, cols / 32, 16)   two E2M1 codes a byte, the even column in the low nibble
    scales  uint8 (..., rows, cols / 32)       E8M0: the block of 32 values is multiplied by 2^(scale - 127)

    E2M1 code c (4 bits): sign c >> 3, exponent e = (c >> 1) & 3, mantissa m = c & 1
        e == 0: m / 2   (0 or 0.5)            e > 0: (1 + m / 2) * 2^(e - 1)   (1, 1.5, 2, 3, 4, 6)

Every value is a 2-bit-mantissa number times a power of two, so float32, bfloat16 and float16 hold it exactly (within
their exponent range): dequantizing into any of them loses nothing.

Loading an MXFP4 gpt-oss checkpoint (models/gpt_oss.py), the experts are either kept packed, about 4.25 bits a weight
(gpt-oss-20b: ~14 GB instead of ~42 GB in bfloat16), or dequantized once into ordinary parameters:

    quantization_config          experts
    none                         kept packed on a CUDA GPU with Triton, dequantized elsewhere (transformers decides
                                 the same way, by whether its MXFP4 kernels can run)
    Mxfp4Config()                kept packed everywhere; on the CPU each forward dequantizes the experts it runs
                                 (memory of the packed model, slower than dequantized weights)
    Mxfp4Config(dequantize=True) dequantized (the model is then unquantized and saves so)

A packed expert computes x @ W^T + b with `mxfp4_linear`: on CUDA the weight-only matmul kernel decodes the codes
in registers (kernels/mxfp4_matmul.py; not yet run on a GPU), elsewhere, and whenever autograd needs the input's
gradient, the weight is dequantized for the call (the packed weights take no gradient). A model keeping its experts
packed saves them packed, with the quantization_config, as the Hub's checkpoints are. Quantizing a float model to
MXFP4 while loading is not supported (NotImplementedError).

The format itself (E2M1 values, blocks of 32, dequantize_mxfp4, the torch reference) is defined once in
kernels/packed_formats.py, beside the kernel that reads it.

Offers: Mxfp4Config, mxfp4_linear, keeps_mxfp4, packed_experts, unpack_experts, TRITON_ON_CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuformers.kernels.packed_formats import mxfp4_linear_reference

TRITON_ON_CPU = False  # tests only: mxfp4_linear takes the Triton kernel on the CPU too (TRITON_INTERPRET=1)


@dataclass
class Mxfp4Config:
    """transformers' Mxfp4Config, for loading MXFP4 checkpoints (gpt-oss). `dequantize=True` turns the experts into
    ordinary parameters in the model's dtype; False keeps them packed (module doc). None, what a checkpoint loaded
    without a quantization_config gets: packed on a CUDA GPU with Triton, else dequantized. `modules_to_not_convert`:
    the modules the checkpoint stores unquantized (everything but the experts, for gpt-oss)."""

    modules_to_not_convert: list[str] | None = None
    dequantize: bool | None = False
    quant_method: str = field(default="mxfp4", init=False)

    def __post_init__(self):
        if self.dequantize is not None and not isinstance(self.dequantize, bool):
            raise ValueError(f"Mxfp4Config(dequantize={self.dequantize!r}) must be True or False")

    @property
    def skip_modules(self) -> list[str]:
        return list(self.modules_to_not_convert or [])

    def to_dict(self) -> dict[str, Any]:
        # `dequantize` is how to load, not what the checkpoint is: config.json does not keep it (transformers' neither)
        return {"quant_method": self.quant_method, "modules_to_not_convert": self.modules_to_not_convert}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Mxfp4Config":
        return cls(modules_to_not_convert=data.get("modules_to_not_convert"),
                   dequantize=data.get("dequantize", False))

    def for_loading(self, requested: "Mxfp4Config | None") -> "Mxfp4Config":
        """The checkpoint's config (self) with how to load it: `requested`'s dequantize, or None (decided by the
        device once the weights are there) when from_pretrained was given none."""
        return dataclasses.replace(self, dequantize=None if requested is None else requested.dequantize)


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W^T + bias -> (..., out) in x's dtype, W (out, in) given as MXFP4 blocks (out, in / 32, 16) and
    scales (out, in / 32); differentiable in x and bias (module doc for which path runs)."""
    if _use_triton_kernel(x, blocks):
        from gpuformers.kernels.mxfp4_matmul import mxfp4_matmul_forward

        return mxfp4_matmul_forward(x, blocks, scales, bias)
    return mxfp4_linear_reference(x, blocks, scales, bias)


def _use_triton_kernel(x: torch.Tensor, blocks: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
        return False  # traced or differentiated: torch ops, which both handle
    if x.device != blocks.device or (x.device.type == "cpu" and not TRITON_ON_CPU):
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or torch.is_autocast_enabled(x.device.type):
        return False
    from gpuformers.kernels.mapping import kernels_available

    return kernels_available(x.device)[0]


def keeps_mxfp4(config: Mxfp4Config, devices: set[torch.device]) -> bool:
    """Whether a model whose packed experts sit on `devices` keeps them packed under `config` (module doc's table)."""
    if config.dequantize is not None:
        return not config.dequantize
    from gpuformers.kernels.checks import triton_importable

    return bool(devices) and all(d.type == "cuda" for d in devices) and triton_importable()


def packed_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts that hold MXFP4 blocks and scales (gpt-oss's GptOssExperts before `unpack`)."""
    return [m for m in model.modules() if getattr(m, "packed", False) and callable(getattr(m, "unpack", None))]


def unpack_experts(model: torch.nn.Module, dtype: torch.dtype | None = None,
                   requires_grad: bool | None = None) -> None:
    """Dequantize every packed expert into its parameters (in `dtype` when given), and drop the config's note that
    the model builds them packed."""
    for module in packed_experts(model):
        module.unpack()
        if dtype is not None:
            module.to(dtype)
        if requires_grad is not None:
            module.requires_grad_(requires_grad)
    model.config.extra.pop("mxfp4_experts", None)
