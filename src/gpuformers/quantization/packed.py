"""Pre-quantized packed-integer checkpoints: what GPTQ / AWQ (gptq_awq.py) and compressed-tensors
(compressed_tensors.py) loading share; each of those modules keeps its own key names, bit orders and zero conventions.

Both load the same way. Before the weights, every quantized nn.Linear is swapped for a stand-in layer that takes the
layer's checkpoint tensors in any order (meta buffers until they come, so that the loader names a missing one) and,
once it has them all, becomes either

- a `WeightOnlyLinear` (gpuformers' int4 / int8 weight-only layer: the Triton kernel on a GPU, torch's int4 / int8
  kernels for CPU decode), where that layer holds exactly the checkpoint's weights: only the packing is
  rearranged. The loaded model then carries a `WeightOnlyConfig` and saves as gpuformers' weight-only checkpoint;
- or a plain nn.Linear with the weights dequantized into the compute dtype, everywhere else (and everywhere with
  `dequantize=True`: cuBLAS matmuls, LoRA and training on ordinary layers).

Either way the model computes with exactly the weights the format's reference dequantization gives in the compute
dtype: packing where it is exact only saves memory (int4 with groups of 128: about 3.7x less than float16), and
dequantizing where it is not keeps the numbers right.

Offers: unpack_fields, layout_reason, weight_only_linear, PackedStandIn, refuse_loaded, swap_in,
install_finished_layers.
"""

from __future__ import annotations

from typing import Callable, NoReturn

import torch
from torch import nn

from gpuformers.layers.blocks import replace_submodule


def unpack_fields(words: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """The 32 / bits values of each int32 (or int64 holding 32 bits) word, lowest bits first, laid out along `dim`:
    (.., words, ..) -> (.., words * 32 / bits, ..), in the words' dtype."""
    dim %= words.dim()
    shifts = torch.arange(0, 32, bits, dtype=words.dtype, device=words.device)
    values = words.unsqueeze(dim + 1) >> shifts.view(-1, *[1] * (words.dim() - dim - 1))  # (.., words, 32 / bits, ..)
    return (values & ((1 << bits) - 1)).flatten(dim, dim + 1)


def layout_reason(bits: int, group_size: int | None, in_features: int) -> str | None:
    """None when WeightOnlyLinear's layout takes a layer of these settings (group_size None: one scale per output
    channel), else why not."""
    if bits not in (4, 8):
        return f"{bits}-bit weights"
    if group_size is not None and in_features % group_size:
        return f"group_size {group_size} that does not divide the layer's {in_features} input columns"
    # int4 per channel would give each layer its own group size (its in_features), which one WeightOnlyConfig
    # cannot describe for saving
    if bits == 4 and group_size is None:
        return "int4 with one scale per output channel (group_size -1)"
    if bits == 4 and in_features % 2:
        return f"int4 over an odd number of input columns ({in_features}: packed two per byte)"
    return None


def weight_only_linear(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, bits: int,
                       group_size: int | None, dtype: torch.dtype) -> nn.Module:
    """A WeightOnlyLinear (no bias) with w = (q - zeros) * scales, repacked: q (out, in) integers in [0, 2^bits),
    scales (out, G), zeros (out, G) integer zero points, or None for the symmetric 2^(bits-1). The caller has checked
    that the layout holds these weights exactly (8 bits: zeros all 2^(bits-1), since its layout has no zero point)."""
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    out_features, in_features = q.shape
    layer = WeightOnlyLinear(in_features, out_features, False, bits, group_size, dtype, device="meta")
    mid = 1 << (bits - 1)
    if bits == 8:
        layer.load_from_checkpoint("qweight", (q - mid).to(torch.int8).contiguous())
    else:  # WeightOnlyLinear's int4: (q - 8) * scale + zero, column 2j in the low nibble
        u = q.to(torch.uint8)
        layer.load_from_checkpoint("qweight", (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous())
        # (q - z) * s = (q - 8) * s + (8 - z) * s
        offset = torch.zeros_like(scales) if zeros is None else (mid - zeros).float() * scales.float()
        layer.load_from_checkpoint("zeros", offset.contiguous())
    layer.load_from_checkpoint("scales", scales.contiguous())
    return layer


class PackedStandIn:
    """Mixed into a stand-in layer, an nn.Module with in_features, out_features, bias, and once built either a
    `weight` (dequantized) or `packed` (a WeightOnlyLinear); its awaited checkpoint tensors are meta buffers until
    they come (what a device_map plans with, and what the loader names when one is missing)."""

    def _awaiting(self, parts) -> bool:
        """Whether any of `parts` has not come yet."""
        return any(self._buffers[part].is_meta for part in parts)

    def _take(self, parts) -> dict[str, torch.Tensor]:
        """Remove `parts` from the buffers (they become a weight or a WeightOnlyLinear) and return them."""
        return {part: self._buffers.pop(part) for part in parts}

    def finish(self) -> nn.Module:
        """The loaded layer, with its bias: the WeightOnlyLinear, or an nn.Linear of the dequantized weight."""
        if self.packed is not None:
            self.packed.bias = self.bias
            return self.packed
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def refuse_loaded(config, checkpoints: str) -> NoReturn:
    """The error for a model whose weights are already there (a GGUF file): these configs only read checkpoints."""
    raise NotImplementedError(f"{type(config).__name__} loads {checkpoints} checkpoints; a model already loaded (a "
                              f"GGUF file) cannot be converted: use WeightOnlyConfig or BitsAndBytesConfig")


def swap_in(model: nn.Module, name: str, make: Callable[[nn.Linear], nn.Module], untie_hint: str = "") -> None:
    """Replace the nn.Linear `name` (model on the meta device) with the stand-in `make(linear)` builds."""
    if f"{name}.weight" in getattr(model, "tied_weights", {}):
        raise ValueError(f"{name} shares its weight with the embeddings (tied), but the checkpoint quantizes it; "
                         f"untie it (tie_word_embeddings=false){untie_hint}")
    with torch.device("meta"):
        replace_submodule(model, name, make(model.get_submodule(name)))


def install_finished_layers(model: nn.Module, finished: dict[str, nn.Module]):
    """Put the `finished` layers (name -> nn.Linear or WeightOnlyLinear, all of one bits and group size) in the
    model. Returns the WeightOnlyConfig the model then carries, or None (a plain model)."""
    from gpuformers.quantization.config import WeightOnlyConfig

    for name, new in finished.items():
        replace_submodule(model, name, new)
    kinds = {(m.bits, m.group_size) for m in finished.values() if not isinstance(m, nn.Linear)}
    if not kinds:
        model.config.extra.pop("quantization_config", None)
        return None
    (bits, group_size), = kinds  # one WeightOnlyConfig describes one bits and group size
    dense = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    weight_only = WeightOnlyConfig(bits=bits, group_size=group_size, skip_modules=dense)
    model.config.extra["quantization_config"] = weight_only.to_dict()  # save_pretrained writes gpuformers' format
    return weight_only
