"""Fine-grained FP8 checkpoints (quant_method "fp8", DeepSeek-V3 / Qwen3-*-FP8 style), dequantized on load.

Such a checkpoint stores each quantized Linear as two tensors:

    weight            float8_e4m3fn  (out, in)
    weight_scale_inv  float32        (ceil(out / bm), ceil(in / bn))   one scale per bm x bn block
                                                                        (weight_block_size = [bm, bn])

    w[i, j] = float(weight[i, j]) * weight_scale_inv[i // bm, j // bn]

so the last block row / column covers only what is left of the weight when bm or bn does not divide its shape.
`weight_block_size: null` means one scale for the whole tensor.

Two ways to load them (FineGrainedFP8Config.dequantize):

- True: `FP8DequantizingLinear` stands in for an nn.Linear while the checkpoint loads: it takes the two tensors (in
  either order) and keeps their product in the compute dtype. `restore_linear_layers` then turns each back into a
  plain nn.Linear, so the loaded model is an ordinary bfloat16 / float32 model (the unquantized weights' memory) and
  saves as an unquantized checkpoint. A weight the checkpoint stores unquantized (bfloat16, no scale) is taken as is.
- False: `FP8Linear` keeps both tensors (half of bfloat16's weight memory) and multiplies with the Triton kernel of
  quantization/fp8_matmul.py, which scales the FP8 tiles in registers. The kernel needs CUDA with compute capability
  >= 8.9 (or the Triton interpreter, for tests); elsewhere, and for blocks the kernel does not take, the forward
  dequantizes the weight per call. The model saves back as the same FP8 checkpoint.

Offers: FP8Linear, FP8DequantizingLinear, dequantize_fp8_weight, restore_linear_layers, check_fp8_devices,
FP8_DTYPES, FP8_MIN_CAPABILITY.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MIN_CAPABILITY = (8, 9)  # Triton converts float8_e4m3fn from sm_89 on (H100, L4, 4090)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Scales stored in fewer than 16 bits (ue8m0 exponents, 1 byte) need their own decoding: refused, not guessed.
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dequantize_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | None,
                          dtype: torch.dtype) -> torch.Tensor:
    """FP8 `weight` (out, in) times its per-block `scale_inv` (module doc) -> (out, in) in `dtype`, on weight's
    device. The product is taken in float32 and rounded once to `dtype`."""
    if block_size is None:
        return (weight.to(torch.float32) * scale_inv.to(torch.float32).reshape(())).to(dtype)
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    # One block row at a time: the float32 temporaries are (block_rows, in), not weight-sized.
    for i, first in enumerate(range(0, rows, block_rows)):
        scales = scale_inv[i].to(device=weight.device, dtype=torch.float32)
        scales = scales.repeat_interleave(block_cols)[:cols]  # (in,): a partial last block is cut to the weight
        out[first:first + block_rows] = weight[first:first + block_rows].to(torch.float32) * scales
    return out


def scale_grid(out_features: int, in_features: int, block_size: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of weight_scale_inv for a (out, in) weight: one scale per block, partial blocks included."""
    if block_size is None:
        return ()
    return math.ceil(out_features / block_size[0]), math.ceil(in_features / block_size[1])


def _check_scales(name: str, tensor: torch.Tensor, out_features: int, in_features: int,
                  block_size: tuple[int, int] | None) -> None:
    expected = scale_grid(out_features, in_features, block_size)
    if tuple(tensor.shape) != expected and not (expected == () and tensor.numel() == 1):
        raise ValueError(
            f"{name}.weight_scale_inv has shape {list(tensor.shape)}, but a [{out_features}, {in_features}] weight "
            f"in blocks of weight_block_size={list(block_size or [])} needs {list(expected)} (one scale per block, "
            f"partial blocks included); is weight_block_size in config.json's quantization_config the one these "
            f"weights were quantized with?")
    if tensor.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name}.weight_scale_inv has dtype {tensor.dtype}; gpuformers reads float32, bfloat16 or "
                         f"float16 scales (not ue8m0 exponents)")


class FP8Linear(nn.Module):
    """A Linear whose weight stays float8_e4m3fn with its float32 block scales (module doc); computes in x's dtype.

    `name` is the module's name in the model, for errors that point at the checkpoint tensor.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, block_size: tuple[int, int] | None,
                 dtype: torch.dtype, name: str, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size = tuple(block_size) if block_size is not None else None
        self.name = name
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(scale_grid(out_features, in_features, self.block_size),
                                                             dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.compute_dtype = dtype

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor: "weight" (float8_e4m3fn), "weight_scale_inv", "bias"."""
        if name == "weight":
            if tuple(tensor.shape) != (self.out_features, self.in_features) or tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{self.name}.weight is {tensor.dtype} {list(tensor.shape)}; kept in FP8 this layer "
                                 f"needs float8_e4m3fn [{self.out_features}, {self.in_features}]. A layer the "
                                 f"checkpoint stores unquantized belongs in modules_to_not_convert")
            self.weight = nn.Parameter(tensor, requires_grad=False)
        elif name == "weight_scale_inv":
            _check_scales(self.name, tensor, self.out_features, self.in_features, self.block_size)
            self.weight_scale_inv = tensor.to(torch.float32).reshape(self.weight_scale_inv.shape)
        elif name == "bias" and self.bias is not None:
            if tuple(tensor.shape) != (self.out_features,):
                raise ValueError(f"{self.name}.bias has shape {list(tensor.shape)}, expected [{self.out_features}]")
            self.bias = nn.Parameter(tensor.to(self.compute_dtype))
        elif name not in ("activation_scale", "input_scale"):  # static activation scales: activations stay float
            raise KeyError(f"{self.name}.{name} is not part of an FP8 Linear; it takes weight, weight_scale_inv"
                           f"{' and bias' if self.bias is not None else ''}")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (out, in) in `dtype` (default: the compute dtype)."""
        return dequantize_fp8_weight(self.weight, self.weight_scale_inv, self.block_size, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_kernel(x):
            from gpuformers.quantization.fp8_matmul import fp8_matmul

            return fp8_matmul(x, self.weight, self.weight_scale_inv, self.block_size, self.bias)
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _use_kernel(self, x: torch.Tensor) -> bool:
        # The weight's dtype too: model.to(torch.bfloat16) converts it (exactly), and then only dequantizing reads it.
        if (x.dtype not in _KERNEL_DTYPES or self.weight.dtype != torch.float8_e4m3fn or x.device != self.weight.device
                or not fp8_kernel_runs_on(x.device)):
            return False
        from gpuformers.quantization.fp8_matmul import kernel_fits

        return kernel_fits(self.in_features, self.block_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={list(self.block_size) if self.block_size else None}, bias={self.bias is not None}")


def fp8_kernel_runs_on(device: torch.device) -> bool:
    """CUDA with compute capability >= 8.9 and triton, or the CPU under TRITON_INTERPRET=1 (tests)."""
    from gpuformers.kernels.mapping import kernels_available

    if not kernels_available(device)[0]:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_fp8_devices(model: nn.Module) -> None:
    """Refuse FP8Linear layers placed where the FP8 kernel cannot run (it would dequantize on every call)."""
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear) and not fp8_kernel_runs_on(module.weight.device):
            device = module.weight.device
            where = (f"{device} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                     if device.type == "cuda" else str(device))
            raise NotImplementedError(
                f"FineGrainedFP8Config(dequantize=False) keeps FP8 weights for a Triton FP8 matmul, which needs a CUDA "
                f"GPU of compute capability >= 8.9 (H100, H200, L4, RTX 4090) with triton; {name} is on {where}. "
                f"Load with FineGrainedFP8Config(dequantize=True) (or no quantization_config) to dequantize instead")


class FP8DequantizingLinear(nn.Linear):
    """An nn.Linear that loads from an FP8 checkpoint's `weight` and `weight_scale_inv` (module doc).

    `name` is the module's name in the model, for errors that point at the checkpoint tensor.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, block_size: tuple[int, int] | None,
                 dtype: torch.dtype, name: str, device=None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.block_size = tuple(block_size) if block_size is not None else None
        self.compute_dtype = dtype
        self.name = name
        # A meta placeholder until the checkpoint's arrives: left meta, the loader reports it missing by name.
        self.register_buffer("weight_scale_inv", torch.empty(scale_grid(out_features, in_features, self.block_size),
                                                             dtype=torch.float32, device="meta"))

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor: "weight" (FP8, or unquantized), "weight_scale_inv", "bias"."""
        if name == "weight":
            self._check_shape(name, tensor, (self.out_features, self.in_features))
            if tensor.dtype in FP8_DTYPES:
                self.weight = nn.Parameter(tensor, requires_grad=False)  # kept until its scales come
            elif tensor.is_floating_point():
                scales = self._buffers.get("weight_scale_inv")
                if scales is not None and not scales.is_meta:
                    raise ValueError(f"{self.name}.weight is stored unquantized ({tensor.dtype}) but the checkpoint "
                                     f"also has {self.name}.weight_scale_inv: one of the two is from another file")
                self._buffers.pop("weight_scale_inv", None)  # an unquantized weight has no scales
                self.weight = nn.Parameter(tensor.to(self.compute_dtype))
                return
            else:
                raise ValueError(f"{self.name}.weight has dtype {tensor.dtype}; an FP8 checkpoint stores "
                                 f"float8_e4m3fn weights (or unquantized floating-point ones)")
        elif name == "weight_scale_inv":
            if "weight_scale_inv" not in self._buffers:
                raise ValueError(f"{self.name}.weight_scale_inv was given for a weight stored unquantized "
                                 f"({self.name}.weight is not float8): the checkpoint is inconsistent")
            _check_scales(self.name, tensor, self.out_features, self.in_features, self.block_size)
            self.weight_scale_inv = tensor
        elif name == "bias":
            self._check_shape(name, tensor, (self.out_features,))
            if self.bias is None:
                raise KeyError(f"{self.name}.bias is in the checkpoint, but the model's layer has no bias; is "
                               f"config.json the one of these weights?")
            self.bias = nn.Parameter(tensor.to(self.compute_dtype))
            return
        elif name in ("activation_scale", "input_scale"):
            return  # static activation scales only matter to an FP8 matmul; the weights here are dequantized
        else:
            raise KeyError(f"{self.name}.{name} is not part of an FP8 Linear; it takes weight, weight_scale_inv "
                           f"and bias")
        self._dequantize_when_complete()

    def _dequantize_when_complete(self) -> None:
        if self.weight.dtype not in FP8_DTYPES or self.weight_scale_inv.is_meta:
            return
        weight = dequantize_fp8_weight(self.weight.data, self.weight_scale_inv, self.block_size, self.compute_dtype)
        del self._buffers["weight_scale_inv"]
        self.weight = nn.Parameter(weight)

    def _check_shape(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.name}.{name} has shape {list(tensor.shape)}, but the model's layer needs "
                             f"{list(shape)}; is config.json the one of these weights?")


def restore_linear_layers(model: nn.Module) -> int:
    """Swap every loaded FP8DequantizingLinear of `model` for a plain nn.Linear with its weight and bias; returns
    how many. Code that recognises plain Linear layers (kernels, LoRA, the fused LM head) then sees them."""
    names = [name for name, module in model.named_modules() if isinstance(module, FP8DequantizingLinear)]
    for name in names:
        layer = model.get_submodule(name)
        if layer.weight.dtype in FP8_DTYPES or layer.weight.is_meta:
            raise ValueError(f"{name}.weight was not dequantized: the checkpoint lacks it or its weight_scale_inv")
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight = layer.weight
        linear.bias = layer.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, linear)
    return len(names)
