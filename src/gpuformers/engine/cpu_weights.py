"""Prepacked linear weights for the engine's CPU steps: each float32 nn.Linear's weight kept a second time in
oneDNN's blocked layout, so the matmuls of a decode step stop re-packing it on every call.

torch's nn.Linear on the CPU calls MKL's sgemm, which copies the weight into its own panel layout on every call.
At the few rows of a decode step that copy is most of the work; a weight reordered once into oneDNN's layout
(torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU weight freezing uses) skips it. Measured on
this project's 2-core CPU, 1 thread, the 100M Qwen3-shaped stack with its LM head (weights cold in cache, as in a
real step), ms per pass, F.linear vs the packed weight:

    rows      1     2     3     4    16    32    48    64   128   192   256   512
    MKL      31    33    36    61    85    99   122   143   211   249   310   677
    packed   34    37    41    39    58    81   103   121   174   244   301   753

so the packed path takes the matmuls of PACKED_ROWS (4..192 rows) and F.linear keeps the rest (1-3 rows, where
MKL's GEMV is better, and big prefill chunks). The results differ from F.linear's by rounding only (another
summation order), as MKL's own kernels do between row counts.

The model is untouched outside a step: `PackedLinears.active()` sets the packed forward on each layer instance for
the duration of one step (as kernelize does for its kernels) and takes it away after, so generate(), training and
saving never see it, and the copies go with the runner that owns them. A weight changed since it was packed
(its version counter or storage moved: load_state_dict, an optimizer step) is packed again before its next use.
The cost is the linear weights' size again in memory, which `ContinuousBatchingConfig.resolve` weighs (config.py).

Offers: PackedLinears, prepack_available, packable_linears, PACKED_ROWS.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = range(4, 193)  # row counts the packed weight is faster for (the table above)
_PACK_HINT_ROWS = 32  # the row count oneDNN is told to expect; the packed weight serves any count


def prepack_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder op (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packable_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain float32 nn.Linear layers on the CPU (quantized and LoRA layers are other classes; the base
    layer inside a LoRA wrapper is a plain one and counts)."""
    return [m for m in model.modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


class _Packed:
    """One layer's packed copy and the version of the weight it was made from."""

    __slots__ = ("layer", "packed", "version")

    def __init__(self, layer: nn.Linear):
        self.layer = layer
        self.repack()

    def repack(self) -> None:
        weight = self.layer.weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
        self.version = (weight._version, weight.data_ptr())

    def forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        weight = layer.weight
        if rows not in PACKED_ROWS or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, weight, layer.bias)
        if (weight._version, weight.data_ptr()) != self.version:
            self.repack()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]).contiguous(), self.packed,
                                                 layer.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinears:
    """Packed copies of a model's plain float32 linear weights, and the switch that makes one step use them."""

    def __init__(self, model: nn.Module):
        self.layers = [_Packed(layer) for layer in packable_linears(model)]

    @property
    def nbytes(self) -> int:
        """Memory the packed copies take (about the linear weights' own size)."""
        return sum(p.packed.numel() * p.packed.element_size() for p in self.layers)

    @contextlib.contextmanager
    def active(self):
        """Route the model's linear layers through their packed weights until the block ends (one engine step)."""
        installed = []
        try:
            for p in self.layers:
                if "forward" not in p.layer.__dict__:  # another wrapper's instance forward stays as it is
                    p.layer.forward = functools.partial(p.forward, p.layer)
                    installed.append(p.layer)
            yield
        finally:
            for layer in installed:
                del layer.forward
