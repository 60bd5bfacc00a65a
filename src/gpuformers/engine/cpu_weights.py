"""Prepacked linear weights for the engine's CPU steps: each float32 nn.Linear's weight kept a second time in
oneDNN's blocked layout, so the matmuls of a decode step stop re-packing it on every call.

torch's nn.Linear on the CPU calls MKL's sgemm, which copies the weight into its own panel layout on every call.
At the few rows of a decode step that copy is most of the work; a weight reordered once into oneDNN's layout
(torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU weight freezing uses) skips it. Measured on
this project's 2-core CPU, 1 thread, the 100M Qwen3-shaped stack with its LM head (weights cold in cache, as in a
real step), ms per pass, F.linear vs the packed weight (`python benchmarks/bench_cpu_linear.py`):

    rows      1     2     3     4    16    32    48    64   128   192   256   512
    MKL      31    33    36    61    85    99   122   143   211   249   310   677
    packed   34    37    41    39    58    81   103   121   174   244   301   753

so the packed path takes the matmuls of PACKED_ROWS (4..192 rows) and F.linear keeps the rest (1-3 rows, where
MKL's GEMV is better, and big prefill chunks). The results differ from F.linear's by rounding only (another
summation order), as MKL's own kernels do between row counts. Sibling layers fed the same input (q/k/v,
gate/up) share one packed weight, so one wider matmul serves them (3% of the offline benchmark).

The model is untouched outside a step: `PackedLinears.active()` sets the packed forward on each layer instance for
the duration of one step (as kernelize does for its kernels) and takes it away after, so generate(), training and
saving never see it, and the copies go with the runner that owns them. A weight changed since it was packed
(its version counter or storage moved: load_state_dict, an optimizer step) is packed again before its next use.
The cost is the linear weights' size again in memory, which `ContinuousBatchingConfig.resolve` weighs (config.py).

Offers: PackedLinears, prepack_available, packable_linears, PACKED_ROWS, SIBLINGS.
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
    """The model's plain float32 nn.Linear layers on the CPU with plain weights (quantized and LoRA layers are other
    classes, but the base layer inside a LoRA wrapper is a plain one and counts; tensor-parallel weights are
    DTensors and do not)."""
    return [m for m in model.modules()
            if type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor)  # not a DTensor, say
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


# Sibling layers that a decoder feeds the same input, one after the other: one packed weight serves each group
# (one matmul of the summed width instead of three or two narrower ones, 4-8% of a step's matmul time).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _PackedGroup:
    """One packed weight for one layer, or for sibling layers stacked along their outputs. The first of them called
    with an input runs the matmul for all; each gets its own columns (a view) of that output, plus its own bias."""

    __slots__ = ("layers", "widths", "packed", "versions", "last_input", "last_outputs")

    def __init__(self, layers: list[nn.Linear]):
        self.layers = layers
        self.widths = [layer.out_features for layer in layers]
        self.last_input = self.last_outputs = None
        self.repack()

    @torch.inference_mode()  # the copies are constants: no autograd record of the concatenation
    def repack(self) -> None:
        weight = torch.cat([layer.weight for layer in self.layers]) if len(self.layers) > 1 \
            else self.layers[0].weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
        self.versions = self._weight_versions()

    def _weight_versions(self) -> list[tuple[int, int]]:
        return [(_version(layer.weight), layer.weight.data_ptr()) for layer in self.layers]

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows not in PACKED_ROWS or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, layer.weight, layer.bias)
        if self.last_input is not x or _version(x) != self.last_outputs[0]:
            if self._weight_versions() != self.versions:  # load_state_dict, an optimizer step: pack it again
                self.repack()
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]).contiguous(), self.packed,
                                                     None, "none", [], "")
            self.last_input, self.last_outputs = x, (_version(x), *out.split(self.widths, dim=-1))
        out = self.last_outputs[1 + index].view(*x.shape[:-1], self.widths[index])  # (..., out_features)
        return out if layer.bias is None else out + layer.bias

    def forget_input(self) -> None:
        self.last_input = self.last_outputs = None


def _version(t: torch.Tensor) -> int:
    """How many times t was changed in place; 0 for a tensor made in inference mode, which does not count (the
    steps' activations are such, and they are not changed between two sibling calls)."""
    return 0 if t.is_inference() else t._version


def _groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The packable layers, siblings (SIBLINGS, of the same input width) together, every other layer alone."""
    packable = {id(layer): layer for layer in packable_linears(model)}
    groups = []
    for module in model.modules():
        for names in SIBLINGS:
            layers = [module._modules.get(name) for name in names]
            if all(layer is not None and id(layer) in packable for layer in layers) \
                    and len({layer.in_features for layer in layers}) == 1:
                groups.append(layers)
                for layer in layers:
                    del packable[id(layer)]
    return groups + [[layer] for layer in packable.values()]


class PackedLinears:
    """Packed copies of a model's plain float32 linear weights, and the switch that makes one step use them."""

    def __init__(self, model: nn.Module):
        self.groups = [_PackedGroup(layers) for layers in _groups(model)]

    @property
    def nbytes(self) -> int:
        """Memory the packed copies take (about the linear weights' own size)."""
        return sum(g.packed.numel() * g.packed.element_size() for g in self.groups)

    @contextlib.contextmanager
    def active(self):
        """Route the model's linear layers through their packed weights until the block ends (one engine step)."""
        installed = []
        try:
            for group in self.groups:
                for index, layer in enumerate(group.layers):
                    if "forward" not in layer.__dict__:  # another wrapper's instance forward stays as it is
                        layer.forward = functools.partial(group.forward, index)
                        installed.append(layer)
            yield
        finally:
            for layer in installed:
                del layer.forward
            for group in self.groups:
                group.forget_input()  # the step's activations are not kept alive
