"""compressed-tensors checkpoints (config.json quantization_config "quant_method": "compressed-tensors", written by
llm-compressor: RedHatAI/*-quantized.w4a16, *-quantized.w8a16, *-FP8-dynamic, *-quantized.w8a8), loaded into
gpuformers' own model classes. Plain torch: the `compressed-tensors` package is not needed to load.

What a quantized Linear stores, by format (the config's "format", or each config group's own under
"mixed-precision"):

    pack-quantized    weight_packed int32 (out, ceil(in * bits / 32))   q + 2^(bits-1), 32 / bits values per int32,
                                                                        value i of a row in bits [i*bits % 32, ...)
                      weight_scale, weight_shape [out, in], weight_zero_point (asymmetric; group / channel ones
                      packed the same way along the output dimension)
    int-quantized,    weight int8 (out, in), weight_scale, weight_zero_point (asymmetric)
    naive-quantized
    float-quantized   weight float8_e4m3fn (out, in), weight_scale
    dense             weight as usual (nothing to do)

    w = (q - zero_point) * scale        scale by strategy: tensor (1,), channel (out, 1), group (out, in / group),
                                        block (ceil(out / bm), ceil(in / bn)); actorder "group" checkpoints add
                                        weight_g_idx (in,), the group of each input column

The product is taken in float32 (exact for these integer / FP8 values), rounded once to the scale's dtype, then
converted to the compute dtype: what compressed-tensors' own dequantize does, so the weights are bit-equal to
transformers' `CompressedTensorsConfig(dequantize=True)` (the old `run_compressed=False`).

How layers load (packed.py: `CompressedLinear` stands in while the checkpoint loads, `finish_compressed_loading`
swaps it): kept packed as a `WeightOnlyLinear` where that layer holds exactly the same weights: pack-quantized,
symmetric, 4 bits with group scales or 8 bits with group or channel scales, no weight_g_idx, scales stored in the
compute dtype (bfloat16 checkpoints loaded in bfloat16, the usual case), and for 4 bits a bfloat16 / float16
compute dtype (its float32 dequantization takes two roundings, not one). Dequantized into a plain nn.Linear
everywhere else, and for every layer with `CompressedTensorsConfig(dequantize=True)`: asymmetric zero points
(stored in the compute dtype, a zero times a scale would round), 2-bit, g_idx, int-quantized / naive-quantized,
and FP8 (float-quantized) weights, whose per-channel scales (the FP8-dynamic layout) FP8Linear does not take and
whose kernel needs CUDA >= 8.9.

Activation quantization (input_activations: W8A8, FP8, FP8-dynamic) is not applied: the weights are dequantized
and activations run in the compute dtype, as in transformers' dequantize=True. vLLM and transformers'
`dequantize=False` quantize activations on the fly, which moves tiny random models' logits by ~1e-2.

Refused by name (NotImplementedError): other formats (nvfp4-pack-quantized, mxfp4/6/8, marlin-24, sparse-*),
sparsity and transform (Hadamard) configs, tensor_group strategies, FP8 other than e4m3 8-bit, packed bit widths
that do not divide 32, and targets that quantize an Embedding.

Offers: CompressedTensorsConfig, CompressedLinear, dequantize_compressed, unpack_int32, swap_compressed_layers,
finish_compressed_loading.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpuformers.quantization.packed import (
    PackedStandIn,
    install_finished_layers,
    layout_reason,
    refuse_loaded,
    swap_in,
    unpack_fields,
    weight_only_linear,
)

logger = logging.getLogger(__name__)

FORMATS = ("dense", "pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")
_ACTIVATION_TENSORS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization, read from its config.json dict."""

    group: str
    targets: tuple[str, ...]
    format: str
    num_bits: int
    type: str  # "int" or "float"
    strategy: str
    symmetric: bool = True
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    g_idx: bool = False  # actorder "group": columns carry their group in weight_g_idx
    quantized_activations: bool = False

    @classmethod
    def from_dict(cls, group: str, data: Any, default_format: str) -> "WeightScheme | None":
        """None for a group that quantizes no weight (activations or KV cache only)."""
        if not isinstance(data, dict):
            raise ValueError(f"compressed-tensors config group {group!r} is {data!r}; config.json stores each group "
                             f"as a dict with targets and weights (a preset name is resolved by llm-compressor "
                             f"when it saves)")
        weights = data.get("weights")
        if weights is None:
            return None
        fmt = data.get("format") or default_format
        if fmt == "mixed-precision":
            raise ValueError(f"config group {group!r} has no format of its own, which a 'mixed-precision' "
                             f"checkpoint needs")
        if fmt not in FORMATS:
            raise NotImplementedError(f"compressed-tensors format {fmt!r} (config group {group!r}) is not supported "
                                      f"by gpuformers; it loads {', '.join(FORMATS)}")
        group_size = weights.get("group_size")
        strategy = weights.get("strategy") or ("tensor" if group_size is None else
                                               "channel" if group_size == -1 else "group")
        if strategy not in _STRATEGIES:
            raise NotImplementedError(f"weight strategy {strategy!r} (config group {group!r}) is not supported by "
                                      f"gpuformers; it loads {', '.join(_STRATEGIES)}")
        num_bits, kind = int(weights.get("num_bits", 8)), str(weights.get("type", "int"))
        if kind == "float" and num_bits != 8:
            raise NotImplementedError(f"{num_bits}-bit float weights (config group {group!r}) are not supported by "
                                      f"gpuformers; it loads FP8 (e4m3) and 1- to 8-bit integer weights")
        if kind == "int" and not 1 <= num_bits <= 8:
            raise NotImplementedError(f"{num_bits}-bit integer weights (config group {group!r}): gpuformers loads "
                                      f"1 to 8 bits")
        if fmt == "pack-quantized" and 32 % num_bits:
            # Packings of 3, 5, 6, 7 bits changed between compressed-tensors versions (padded words, then dense):
            # refused rather than read with the wrong one.
            raise NotImplementedError(f"pack-quantized {num_bits}-bit weights (config group {group!r}) are not "
                                      f"supported by gpuformers; it unpacks 1, 2, 4 and 8 bits")
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise ValueError(f"config group {group!r} has strategy 'group' but group_size={group_size!r}")
        block = weights.get("block_structure")
        if strategy == "block" and (not isinstance(block, (list, tuple)) or len(block) != 2):
            raise ValueError(f"config group {group!r} has strategy 'block' but block_structure={block!r}")
        actorder = weights.get("actorder")
        return cls(group=group, targets=tuple(data.get("targets") or ()), format=fmt, num_bits=num_bits, type=kind,
                   strategy=strategy, symmetric=bool(weights.get("symmetric", True)),
                   group_size=group_size if strategy == "group" else None,
                   block_structure=tuple(block) if strategy == "block" else None,
                   g_idx=actorder is True or str(actorder).lower() in ("group", "dynamic"),
                   quantized_activations=data.get("input_activations") is not None)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors a layer of this scheme needs, besides an optional bias and weight_shape."""
        names = ["weight_packed" if self.format == "pack-quantized" else "weight"]
        if self.format != "dense":
            names.append("weight_scale")
            if not self.symmetric:
                names.append("weight_zero_point")
            if self.g_idx:
                names.append("weight_g_idx")
        return tuple(names)


@dataclass
class CompressedTensorsConfig:
    """transformers' CompressedTensorsConfig: the checkpoint's quantization_config, plus how to load it.

    `dequantize=True` turns every quantized layer into a plain nn.Linear in the compute dtype; with False (the
    default) layers that gpuformers' WeightOnlyLinear holds exactly stay packed (module doc). `run_compressed` is
    transformers' old name: run_compressed=False means dequantize=True. Passed to from_pretrained without
    config_groups, it only carries those loading settings for the checkpoint's own config.
    """

    config_groups: dict[str, Any] | None = None
    format: str = "dense"
    ignore: list[str] | None = None
    quantization_status: str = "compressed"
    kv_cache_scheme: dict | None = None
    sparsity_config: dict | None = None
    transform_config: dict | None = None
    global_compression_ratio: float | None = None
    version: str | None = None
    run_compressed: bool | None = None
    dequantize: bool = False
    quant_method: str = field(default="compressed-tensors", init=False)

    def __post_init__(self):
        if self.run_compressed is not None:
            self.dequantize = self.dequantize or not self.run_compressed
        if self.sparsity_config:
            raise NotImplementedError(f"compressed-tensors sparsity ({self.sparsity_config.get('format')!r}) is not "
                                      f"supported by gpuformers; it loads quantized, unsparsified checkpoints")
        if self.transform_config:
            raise NotImplementedError("compressed-tensors transforms (transform_config: Hadamard / SpinQuant "
                                      "rotations) are not supported by gpuformers")
        if self.kv_cache_scheme is not None:
            logger.warning("the checkpoint quantizes the KV cache (kv_cache_scheme); gpuformers keeps the KV cache "
                           "in the compute dtype and ignores its k_scale / v_scale")
        self.schemes = [scheme for name, data in (self.config_groups or {}).items()
                        if (scheme := WeightScheme.from_dict(name, data, self.format)) is not None]
        if any(s.quantized_activations for s in self.schemes):
            logger.warning("the checkpoint quantizes activations too (input_activations); gpuformers dequantizes "
                           "the weights and runs activations in the compute dtype (transformers' dequantize=True)")

    def scheme_for(self, name: str, module: nn.Module) -> WeightScheme | None:
        """The scheme that quantizes module `name`, compressed-tensors' rule: a target or ignore entry is a full
        module name, "re:" and a regex matched from the name's start, or a class name in the module's MRO; the
        most specific target wins (a name, then a regex, then a class)."""
        if any(_matches(name, module, entry) for entry in self.ignore or []):
            return None
        best = None
        for scheme in self.schemes:
            for target in scheme.targets:
                rank = 0 if target == name else 1 if target.startswith("re:") else 2
                if _matches(name, module, target) and (best is None or rank < best[0]):
                    best = (rank, scheme)
        return best[1] if best else None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CompressedTensorsConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in data.items() if k in names})

    def for_loading(self, requested) -> "CompressedTensorsConfig":
        """This config, read from the checkpoint, with from_pretrained's `requested` one applied: a
        CompressedTensorsConfig gives its `dequantize` (transformers' loading attribute); another is ignored."""
        if requested is None:
            return self
        if not isinstance(requested, CompressedTensorsConfig):
            logger.warning("the checkpoint is compressed-tensors (config.json has its quantization_config): the "
                           "quantization_config passed to from_pretrained (%s) is ignored", requested.quant_method)
            return self
        loading = copy.copy(self)
        loading.dequantize = requested.dequantize
        return loading


def _matches(name: str, module: nn.Module, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(cls.__name__ == target for cls in type(module).__mro__)


# -----------------------------------------------------------------------------------------------------------------
# Dequantization


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int) -> torch.Tensor:
    """Signed integers (.., length) int32 from pack-quantized int32 words (.., words): 32 / num_bits values per
    word, value i in bits [i * num_bits, (i + 1) * num_bits) of its word, stored with an offset of 2^(num_bits-1)."""
    return unpack_fields(packed, num_bits)[..., :length] - (1 << (num_bits - 1))


def _expand(values: torch.Tensor, scheme: WeightScheme, shape: tuple[int, int],
            g_idx: torch.Tensor | None) -> torch.Tensor:
    """A scale or zero-point grid -> broadcastable to the (out, in) weight."""
    if scheme.strategy == "tensor":
        return values.reshape(())
    if scheme.strategy == "channel":
        return values.reshape(shape[0], 1)
    if scheme.strategy == "group":
        if g_idx is not None:
            return values.index_select(1, g_idx.to(device=values.device, dtype=torch.long))
        return values.repeat_interleave(scheme.group_size, dim=1)[:, :shape[1]]
    rows, cols = scheme.block_structure
    return values.repeat_interleave(rows, dim=0)[:shape[0]].repeat_interleave(cols, dim=1)[:, :shape[1]]


def _grid_shape(scheme: WeightScheme, out_features: int, in_features: int) -> tuple[int, ...]:
    if scheme.strategy == "tensor":
        return (1,)
    if scheme.strategy == "channel":
        return (out_features, 1)
    if scheme.strategy == "group":
        return (out_features, math.ceil(in_features / scheme.group_size))
    rows, cols = scheme.block_structure
    return (math.ceil(out_features / rows), math.ceil(in_features / cols))


def integer_weight(parts: dict[str, torch.Tensor], scheme: WeightScheme, shape: tuple[int, int]) -> torch.Tensor:
    """The quantized values (out, in): int32 for integer formats (unpacked), float8 as stored for float-quantized."""
    if scheme.format == "pack-quantized":
        return unpack_int32(parts["weight_packed"], scheme.num_bits, shape[1])
    return parts["weight"]


def zero_point(parts: dict[str, torch.Tensor], scheme: WeightScheme, shape: tuple[int, int]) -> torch.Tensor | None:
    """The zero-point grid (unpacked: group / channel ones are packed along the output dimension), or None."""
    if scheme.symmetric:
        return None
    zeros = parts["weight_zero_point"]
    grid = _grid_shape(scheme, *shape)
    if scheme.format == "pack-quantized" and tuple(zeros.shape) != grid:  # packed along the output dimension
        zeros = unpack_int32(zeros.transpose(0, 1), scheme.num_bits, grid[0]).transpose(0, 1)
    return zeros


def dequantize_compressed(parts: dict[str, torch.Tensor], scheme: WeightScheme, shape: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """One layer's weight (out, in) in `dtype` from its checkpoint tensors (module doc): (q - zero_point) * scale
    in float32, rounded once to the scale's dtype, then converted to `dtype`, as compressed-tensors does."""
    if scheme.format == "dense":
        return parts["weight"].to(dtype)
    scale = parts["weight_scale"]
    g_idx = parts.get("weight_g_idx")
    weight = integer_weight(parts, scheme, shape).to(torch.float32)
    zeros = zero_point(parts, scheme, shape)
    if zeros is not None:
        weight -= _expand(zeros.to(torch.float32), scheme, shape, g_idx)
    weight *= _expand(scale.to(torch.float32), scheme, shape, g_idx)
    return weight.to(scale.dtype).to(dtype)


# -----------------------------------------------------------------------------------------------------------------
# The layer that loads


class CompressedLinear(PackedStandIn, nn.Linear):
    """An nn.Linear that takes one compressed-tensors layer's checkpoint tensors (module doc) while loading.

    Until they have all arrived, each awaited tensor is a meta buffer under its checkpoint name, so that the loader
    names a missing one; then the layer holds either its dequantized weight or, `keep_packed`, a WeightOnlyLinear
    (`self.packed`) with the same weights. `finish_compressed_loading` puts what it holds in the model.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme, dtype: torch.dtype,
                 name: str, keep_packed: bool, device=None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.scheme, self.compute_dtype, self.name = scheme, dtype, name
        self.keep_packed = keep_packed and _packable(scheme, in_features, dtype)
        self.packed: nn.Module | None = None
        del self.weight  # until the parts arrive
        for part in scheme.tensor_names:
            self.register_buffer(part, torch.empty(0, device="meta"))

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor: the scheme's tensor_names, "weight_shape", "bias", activation scales."""
        if name == "bias" and self.bias is not None:
            self._check(name, tensor, (self.out_features,))
            self.bias = nn.Parameter(tensor.to(self.compute_dtype))
        elif name == "weight_shape":
            if [int(v) for v in tensor.tolist()] != [self.out_features, self.in_features]:
                raise ValueError(f"{self.name}.weight_shape is {tensor.tolist()}, but the model's layer is "
                                 f"[{self.out_features}, {self.in_features}]; is config.json the one of these weights?")
        elif name in _ACTIVATION_TENSORS:
            return  # activations run unquantized (module doc)
        elif name == "weight_zero_point" and self.scheme.symmetric:  # older llm-compressor saved zeros for these
            if tensor.any():
                raise ValueError(f"{self.name}.weight_zero_point is not zero, but config group "
                                 f"{self.scheme.group!r} is symmetric; is config.json the one of these weights?")
        elif name in self._buffers and self._buffers[name].is_meta:
            self._check_part(name, tensor)
            self._buffers[name] = tensor
            if not self._awaiting(self.scheme.tensor_names):
                self._build()
        else:
            expected = ", ".join([*self.scheme.tensor_names, "weight_shape", *(["bias"] if self.bias is not None
                                                                             else [])])
            raise KeyError(f"{self.name}.{name} is not a tensor of a {self.scheme.format} layer (config group "
                           f"{self.scheme.group!r}); it takes {expected}. Is config.json the one of these weights?")

    def _check_part(self, name: str, tensor: torch.Tensor) -> None:
        scheme, shape = self.scheme, (self.out_features, self.in_features)
        if name == "weight_packed":
            self._check(name, tensor, (shape[0], math.ceil(shape[1] * scheme.num_bits / 32)), torch.int32)
        elif name == "weight":
            self._check(name, tensor, shape)
            if (tensor.dtype != torch.float8_e4m3fn) if scheme.type == "float" else tensor.is_floating_point():
                raise ValueError(f"{self.name}.weight is {tensor.dtype}, but config group {scheme.group!r} stores "
                                 f"{'float8_e4m3fn' if scheme.type == 'float' else 'int8'} weights")
        elif name == "weight_scale":
            grid = _grid_shape(scheme, *shape)
            if tensor.numel() != math.prod(grid) or not tensor.is_floating_point():
                raise ValueError(f"{self.name}.weight_scale is {tensor.dtype} {list(tensor.shape)}; a "
                                 f"{scheme.strategy} scale of this layer is floating-point with {list(grid)} "
                                 f"values: is the config group {scheme.group!r} the one these weights were "
                                 f"quantized with?")
        elif name == "weight_g_idx":
            self._check(name, tensor, (shape[1],))

    def _check(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None):
        if tuple(tensor.shape) != tuple(shape) or (dtype is not None and tensor.dtype != dtype):
            raise ValueError(f"{self.name}.{name} is {tensor.dtype} {list(tensor.shape)}, but the model's layer needs "
                             f"{list(shape)}{f' {dtype}' if dtype else ''}; is config.json the one of these weights?")

    def _build(self) -> None:
        parts, scheme = self._take(self.scheme.tensor_names), self.scheme
        shape = (self.out_features, self.in_features)
        if self.keep_packed and parts["weight_scale"].dtype == self.compute_dtype:
            group_size = scheme.group_size if scheme.strategy == "group" else None  # None: int8 per output channel
            q = unpack_fields(parts["weight_packed"], scheme.num_bits)[:, :shape[1]]  # (out, in) in [0, 2^bits)
            self.packed = weight_only_linear(q, None, parts["weight_scale"].reshape(shape[0], -1), scheme.num_bits,
                                             group_size, self.compute_dtype)
        else:
            self.weight = nn.Parameter(dequantize_compressed(parts, self.scheme, shape, self.compute_dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.scheme.format}, bits={self.scheme.num_bits}"


def _packable(scheme: WeightScheme, in_features: int, dtype: torch.dtype) -> bool:
    """Whether WeightOnlyLinear holds this layer's weights bit for bit (the scale dtype is checked when it comes)."""
    if not (scheme.format == "pack-quantized" and scheme.symmetric and not scheme.g_idx
            and scheme.strategy in ("group", "channel")):
        return False
    if layout_reason(scheme.num_bits, scheme.group_size if scheme.strategy == "group" else None, in_features):
        return False
    # 4 bits: WeightOnlyLinear dequantizes as q * scale + (zero - 8 * scale) in float32, exact for 16-bit scales
    # only; in float32 that is two roundings, not compressed-tensors' one.
    return scheme.num_bits == 8 or dtype in (torch.bfloat16, torch.float16)


# -----------------------------------------------------------------------------------------------------------------
# Before and after loading


def swap_compressed_layers(model: nn.Module, config: CompressedTensorsConfig, dtype: torch.dtype,
                           loaded: bool = False) -> list[str]:
    """Replace every nn.Linear the config quantizes with a CompressedLinear (model on the meta device); returns
    the names."""
    if loaded:
        refuse_loaded(config, "compressed-tensors")
    if not config.schemes:
        raise ValueError("the compressed-tensors quantization_config has no config group that quantizes weights; "
                         "is config.json complete?")
    matched, swapped = 0, []
    for name, module in list(model.named_modules()):
        scheme = config.scheme_for(name, module) if isinstance(module, (nn.Linear, nn.Embedding)) else None
        matched += scheme is not None
        if scheme is None or scheme.format == "dense":  # dense: stored unquantized, loads as it is
            continue
        if type(module) is not nn.Linear:
            raise NotImplementedError(f"the compressed-tensors config group {scheme.group!r} quantizes {name} "
                                      f"({type(module).__name__}); gpuformers loads quantized Linear layers only")
        swap_in(model, name, lambda linear: CompressedLinear(linear.in_features, linear.out_features,
                                                             linear.bias is not None, scheme, dtype, name,
                                                             keep_packed=not config.dequantize),
                " or add it to the config's ignore list")
        swapped.append(name)
    if not matched:
        raise ValueError(f"the compressed-tensors config quantizes none of the model's layers (targets "
                         f"{[t for s in config.schemes for t in s.targets]}, ignore {config.ignore}); is config.json "
                         f"the one of these weights?")
    return swapped


def finish_compressed_loading(model: nn.Module):
    """Put each loaded CompressedLinear's weights in the model: a WeightOnlyLinear where it kept them packed, a
    plain nn.Linear otherwise. Returns the WeightOnlyConfig the model then carries, or None (a plain model)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, CompressedLinear)}
    packed = {name: m for name, m in layers.items() if m.packed is not None}
    kinds = {(m.packed.bits, m.packed.group_size) for m in packed.values()}
    if len(kinds) > 1:  # one WeightOnlyConfig describes one bits / group size: the others dense, exactly as well
        logger.info("the checkpoint mixes weight-only settings %s: dequantizing them all", sorted(kinds, key=str))
        for m in packed.values():
            m.weight, m.packed = nn.Parameter(m.packed.dequantize()), None
    # complete: the loader names any tensor still missing
    return install_finished_layers(model, {name: layer.finish() for name, layer in layers.items()})
