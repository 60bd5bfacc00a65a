"""Weight-only quantized Linear: int8 or int4 weights with float scales; activations stay in the compute dtype.

Storage (persistent buffers, what `state_dict()` and `save_pretrained` write; `G` = in_features // group_size,
or 1 with group_size None, which means one scale per output channel):

    bits 8   qweight  int8   (out, in)       w ~= qweight * scale                 symmetric, q in [-127, 127]
    bits 4   qweight  uint8  (out, in // 2)  w ~= (q - 8) * scale + zero           asymmetric, q in [0, 15]
             byte j of a row holds column 2j in its low nibble and column 2j + 1 in its high nibble
    both     scales   (out, G) in the compute dtype; bits 4 also has zeros (out, G) in the compute dtype
             bias     (out,) nn.Parameter in the compute dtype, when the layer has one

Scales and zeros are kept in the compute dtype: the CPU kernels take them in the activation dtype (no copy per
call), and the dequantized weight is rounded to the compute dtype anyway, so float32 scales would buy nothing.
Quantization runs in float32 against the *rounded* scale, so the stored integers and scales agree.

Error to expect (relative Frobenius error of dequantize() vs the float weight, 1024 x 1024, round to nearest):

    weights                    int8/channel  int8 g128  int4 g32  int4 g64  int4 g128
    nn.Linear init (uniform)       0.39%       0.39%      6.1%      6.4%      6.5%
    Gaussian                       0.78%       0.65%      7.8%      9.0%     10.0%
    Student-t(4), heavy tails      1.9%        1.1%       9.4%     11.8%     14.6%

int4 is asymmetric (min/max with a float zero) because that uses all 16 levels: 15-25% less error than symmetric
4 bits on the Gaussian and Student-t weights above, for one zero per group (about 3% more bytes at g128).

What forward runs, first match wins (the first two: x in the compute dtype, float16, bfloat16 or float32, no autocast):

    CUDA with triton            the Triton kernel (kernels/weight_only_matmul.py): reads the packed integers and
                                dequantizes tiles in registers, float32 accumulation; backward gives x and bias
                                their gradients (grad_y @ dequantize()). Not for a group size without a power-of-two
                                factor >= 16 (e.g. 24), nor with GPUFORMERS_DISABLE_KERNELS=1
    CPU, TRITON_ON_CPU = True   the same kernel under TRITON_INTERPRET=1 (tests only: ~2 ms per program)
    CPU, bfloat16, decode       torch's weight-only CPU kernels (below), with no gradient needed
    anything else               F.linear(x, dequantize(), bias); int8 with one scale per output channel multiplies
                                the output by the scales instead (the same product, rounded once more; no pass
                                over the weight for the scales)

The GPU kernel's speed is unmeasured: no GPU has run it yet (`python benchmarks/bench_quant.py --device cuda
--dtype bfloat16 --layers-only` compares it with dequantize-then-matmul and nn.Linear per layer).

On the CPU in bfloat16, with no gradient needed and a few rows (decode), torch's weight-only kernels give the same
numbers within bfloat16 rounding and are much faster (1 thread, one row; dequantize-then-matmul / kernel / the
bfloat16 nn.Linear):

    1024 x 1024   int8: 583 / 55 / 137 us    int4 g128: 1465 / 55 / 142 us
    1024 x 3072   int8: 1690 / 180 / 423 us  int4 g128: 5260 / 155 / 412 us

Their float32 and float16 paths are not vectorized and lose to dequantize-then-matmul, so those dtypes
dequantize per call on the CPU. The int4 kernel reads its own weight layout: it is built from qweight on first use
and kept beside it (in * out / 2 more bytes, not saved), which is the price of the int4 speed on the CPU.

Offers: WeightOnlyLinear, TRITON_ON_CPU (the storage layout and dequantize_weight: kernels/packed_formats.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.kernels.checks import interpreter_on
from gpuformers.kernels.mapping import DISABLE_ENV, kernels_available
from gpuformers.kernels.packed_formats import INT4_MID, dequantize_weight

BITS = (4, 8)
INT8_MAX = 127
INT4_LEVELS = 15  # q in [0, 15]
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)
# Rows (tokens) up to which torch's bfloat16 CPU kernels beat dequantize-then-matmul at 1 thread (1024 x 3072):
# int8 wins 2.8x at 8 rows and loses at 32; int4 wins 4.4x at 16 rows and loses at 64.
CPU_KERNEL_MAX_ROWS = {8: 16, 4: 32}
_TINY = torch.finfo(torch.float32).tiny
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Whether the CPU takes the Triton kernel under TRITON_INTERPRET=1 too. Off: the interpreter takes ~2 ms per program,
# and the kernel tests' conftest sets TRITON_INTERPRET=1 for the whole pytest process, so every CPU model test
# would crawl; the kernel tests switch it on for their layers.
TRITON_ON_CPU = False


class WeightOnlyLinear(nn.Module):
    """A Linear whose weight is stored as int8 or packed int4 with per-group float scales (see the module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int | None,
                 dtype: torch.dtype, device=None):
        super().__init__()
        _check_settings(in_features, bits, group_size, dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        groups = in_features // group_size if group_size else 1
        if bits == 8:
            self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        else:
            self.register_buffer("qweight",
                                 torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        if bits == 4:
            self.register_buffer("zeros", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        # torch's CPU kernels only read some shapes (int8: rows of 16-multiples, else wrong results or a crash;
        # int4: out_features a multiple of 16 and one of its group sizes).
        if bits == 8:
            self._cpu_kernel_fits = group_size is None and in_features % 16 == 0
        else:
            self._cpu_kernel_fits = group_size in INT4_KERNEL_GROUP_SIZES and out_features % 16 == 0
        self._int4_kernel_cache: tuple | None = None  # (key, packed weight, scales_and_zeros), see _int4_kernel_args

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the scales, so that module.to(torch.bfloat16) changes it as for nn.Linear."""
        return self.scales.dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int | None,
                    dtype: torch.dtype | None = None) -> "WeightOnlyLinear":
        """Quantize a float nn.Linear; the result lives on the Linear's device, computing in `dtype`
        (default: the Linear's weight dtype)."""
        dtype = dtype or linear.weight.dtype
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, bits, group_size, dtype,
                     device="meta")
        module.load_from_checkpoint("weight", linear.weight.detach())
        if linear.bias is not None:
            module.load_from_checkpoint("bias", linear.bias.detach())
        return module

    # -----------------------------------------------------------------------------------------------------
    # Loading

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor: a float "weight" (quantized here, on tensor.device), "bias", or a key of
        this module's own state_dict ("qweight", "scales", "zeros") from a pre-quantized checkpoint."""
        if name == "weight":
            self._expect(name, tensor, (self.out_features, self.in_features), floating=True)
            self._quantize(tensor)
        elif name == "bias":
            if self.bias is None:
                raise KeyError(f"'bias' given to a WeightOnlyLinear built without bias ({self.extra_repr()}); "
                               "build it with bias=True or drop the tensor")
            self._expect(name, tensor, (self.out_features,), floating=True)
            self.bias = nn.Parameter(tensor.to(self.dtype))
        elif name == "qweight":
            self._expect(name, tensor, tuple(self.qweight.shape), dtype=self.qweight.dtype)
            self.qweight = tensor
        elif name in self._buffers and name in ("scales", "zeros"):
            self._expect(name, tensor, tuple(self.scales.shape), floating=True)
            setattr(self, name, tensor.to(self.dtype))
        else:
            known = ", ".join(["weight", *([] if self.bias is None else ["bias"]), *self._buffers])
            raise KeyError(f"WeightOnlyLinear has no checkpoint tensor {name!r}; it takes: {known}")
        self._int4_kernel_cache = None

    def _expect(self, name: str, tensor: torch.Tensor, shape: tuple, floating: bool = False,
                dtype: torch.dtype | None = None) -> None:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name!r} has shape {list(tensor.shape)}, but this WeightOnlyLinear "
                             f"({self.extra_repr()}) expects {list(shape)}: the checkpoint was made for another "
                             "layer size or quantization setting")
        if floating and not tensor.is_floating_point():
            raise ValueError(f"{name!r} has dtype {tensor.dtype}; it must be a floating-point tensor")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"{name!r} has dtype {tensor.dtype}, but {self.bits}-bit weights are stored as "
                             f"{dtype}: the checkpoint was quantized with other settings")

    def _quantize(self, weight: torch.Tensor) -> None:
        """Round `weight` (out, in) to nearest, group by group, in float32; fill qweight, scales (and zeros)."""
        groups = self.scales.shape[1]
        w = weight.to(torch.float32).reshape(self.out_features, groups, -1)  # (out, G, group)
        if self.bits == 8:
            scale = (w.abs().amax(-1) / INT8_MAX).to(self.dtype)  # (out, G)
            # Divide by the rounded scale so that q * scale is what dequantize() returns; a zero scale (an
            # all-zero group) gives q = 0 or +-127, and 0 once multiplied back.
            q = (w / scale.float().clamp(min=_TINY)[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
            self.qweight = q.to(torch.int8).reshape(self.out_features, self.in_features)
        else:
            low, high = w.amin(-1), w.amax(-1)
            scale = ((high - low) / INT4_LEVELS).to(self.dtype)
            zero = (low + INT4_MID * scale.float()).to(self.dtype)
            q = ((w - zero.float()[..., None]) / scale.float().clamp(min=_TINY)[..., None] + INT4_MID)
            q = q.round_().clamp_(0, INT4_LEVELS).to(torch.uint8).reshape(self.out_features, self.in_features)
            self.qweight = q[:, 0::2] | (q[:, 1::2] << 4)
            self.zeros = zero
        self.scales = scale

    # -----------------------------------------------------------------------------------------------------
    # Compute

    def dequantize(self) -> torch.Tensor:
        """The weight the forward multiplies by: (out_features, in_features) in the compute dtype."""
        return dequantize_weight(self.qweight, self.scales, self.zeros if self.bits == 4 else None, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_triton_kernel(x):
            from gpuformers.kernels.weight_only_matmul import weight_only_matmul

            zeros = self.zeros if self.bits == 4 else None
            return weight_only_matmul(x, self.qweight, self.scales, zeros, self.bits, self.group_size, self.bias)
        if self._use_cpu_kernel(x):
            x2d = x.reshape(-1, self.in_features).contiguous()
            if self.bits == 8:
                out = torch._weight_int8pack_mm(x2d, self.qweight, self.scales.view(-1))
            else:
                packed, scales_and_zeros = self._int4_kernel_args()
                out = torch._weight_int4pack_mm_for_cpu(x2d, packed, self.group_size, scales_and_zeros)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.bits == 8 and self.scales.shape[1] == 1:
            # One scale per output channel: scale the output instead of the weight (x @ q.T * s = x @ (q * s).T),
            # a pass over the weight saved (1024 x 3072, one row, float32 CPU: 1.7 -> 1.15 ms).
            out = F.linear(x, self.qweight.to(x.dtype)) * self.scales.view(-1)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.dequantize(), self.bias)

    def _use_triton_kernel(self, x: torch.Tensor) -> bool:
        # In x's own compute dtype only: under autocast, or given another dtype, F.linear's rules apply as before.
        if not (x.dtype == self.dtype and x.dtype in TRITON_DTYPES and x.device == self.qweight.device
                and (x.device.type != "cpu" or TRITON_ON_CPU) and not torch.is_autocast_enabled(x.device.type)):
            return False
        return _triton_kernel_fits(x.device, self.in_features, self.group_size)

    def _use_cpu_kernel(self, x: torch.Tensor) -> bool:
        # The kernels have no autograd, and only their bfloat16 path is vectorized: in float32 / float16, and
        # beyond a few rows in bfloat16, dequantize-then-matmul wins (measurements in the module doc).
        return (self._cpu_kernel_fits and x.device.type == "cpu" and self.qweight.device.type == "cpu"
                and x.dtype == self.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and x.requires_grad)
                and x.numel() <= CPU_KERNEL_MAX_ROWS[self.bits] * self.in_features)

    def _int4_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """qweight and scales/zeros in the int4 CPU kernel's layout, rebuilt when a buffer is replaced (loading,
        .to(), load_state_dict reset the cache; an in-place edit of a buffer by hand does not)."""
        key = tuple(t.data_ptr() for t in (self.qweight, self.scales, self.zeros))
        if self._int4_kernel_cache is None or self._int4_kernel_cache[0] != key:
            q = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(self.out_features, -1)
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            # (G, out, 2): the kernel reads each group's (scale, zero) pair for all output channels together
            scales_and_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()
            self._int4_kernel_cache = (key, packed, scales_and_zeros)
        return self._int4_kernel_cache[1], self._int4_kernel_cache[2]

    def _apply(self, fn, recurse=True):
        self._int4_kernel_cache = None  # .to() / .half() move or convert the buffers the cache was built from
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._int4_kernel_cache = None  # load_state_dict copies into the buffers in place
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def _triton_kernel_fits(device: torch.device, in_features: int, group_size: int | None) -> bool:
    if torch.compiler.is_compiling():
        # Traced: kernels_available's cached "is triton importable" would be traced with a warning, and a GPU that
        # torch.compile runs on has triton (Inductor needs it), so the device and the off switch decide.
        available = ((device.type == "cuda" or interpreter_on())
                     and os.environ.get(DISABLE_ENV, "0") in ("", "0"))
    else:  # CUDA with triton, or the interpreter; not with GPUFORMERS_DISABLE_KERNELS=1
        available = kernels_available(device)[0]
    if not available:
        return False
    from gpuformers.kernels.weight_only_matmul import kernel_fits

    return kernel_fits(in_features, group_size)


def _check_settings(in_features: int, bits: int, group_size: int | None, dtype: torch.dtype) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported: WeightOnlyLinear stores 8-bit or 4-bit weights "
                         "(bits=8 or bits=4)")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype; the compute dtype is e.g. "
                         "torch.bfloat16")
    if group_size is not None:
        if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size:
            divisors = [d for d in (256, 128, 64, 32, 16) if in_features % d == 0]
            hint = f" (e.g. {divisors[0]})" if divisors else ""
            raise ValueError(f"group_size={group_size!r} does not divide in_features={in_features}: use a group "
                             f"size that divides it{hint}, or group_size=None for one scale per output channel")
    if bits == 4 and in_features % 2:
        raise ValueError(f"in_features={in_features} is odd, but 4-bit weights are packed two per byte along "
                         "in_features: use bits=8 for this layer, or skip it")
