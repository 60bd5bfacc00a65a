"""GPTQ and AWQ checkpoints (config.json quantization_config "quant_method": "gptq" or "awq": Qwen/*-GPTQ-Int4,
*-GPTQ-Int8, Qwen/Qwen3-8B-AWQ, TheBloke/*-GPTQ / *-AWQ), loaded into gpuformers' own model classes in plain torch:
neither gptqmodel, optimum nor autoawq is needed.

What a quantized Linear stores (int32 words, value k of a word in bits [k * bits, (k + 1) * bits), lowest first;
G groups; `in` and `out` the Linear's input and output sizes):

    GPTQ  qweight  (in * bits / 32, out)  packed along the input: input i is value i % (32 / bits) of row
                                          i // (32 / bits)
          qzeros   (G, out * bits / 32)   packed along the output the same way
          scales   (G, out) float16       g_idx (in,): the group of each input column, i // group_size, or with
                                          act-order (desc_act) a permuted grouping;  bias (out,) when the layer has one
          w[o, i] = (q[i, o] - z[g_idx[i], o]) * scales[g_idx[i], o]
          checkpoint_format "gptq" (v1, the default) stores every zero minus 1: gptqmodel subtracts
          0x11111111 (4 bits; 0x01010101 for 8, 0x55555555 for 2) from each int32 word of qzeros, so it is read back
          by adding that constant to the word (the carry included, as gptqmodel's v1 -> v2 conversion does); "gptq_v2"
          stores the zeros as they are. Symmetric checkpoints store z = 2^(bits-1) everywhere.

    AWQ   qweight  (in, out / 8)          4 bits, packed along the output, interleaved: value k of word c holds
          qzeros   (G, out / 8)           output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]
          scales   (G, out) float16       groups of group_size consecutive input columns (-1: one group)
          w[o, i] = (q[i, o] - z[i // group_size, o]) * scales[i // group_size, o]
          zero_point=false checkpoints store the same tensors, every zero 8 (gptqmodel's symmetric AWQ).

The product is taken in float32 (exact: a 16-bit scale times an integer of at most 9 bits) and rounded once to the
compute dtype. Layers the checkpoint stores unquantized (a `weight`: lm_head, modules_to_not_convert, gptqmodel's
"dynamic" exclusions, modules_in_block_to_quantize) are read as they are.

How layers load (packed.py: `GPTQAwqLinear` stands in while the checkpoint loads, `finish_gptq_awq_loading`
swaps it): kept packed as a `WeightOnlyLinear` where that layer holds exactly the same weights, checked on the
layer's values: 4 or 8 bits, contiguous groups (g_idx = i // group_size; int4 needs a group size), 16-bit scales
that the compute dtype holds exactly, and zeros it can hold: int8 only symmetric (z = 128: WeightOnlyLinear's int8
has no zero point), int4's float zero (8 - z) * scale exact in the compute dtype. In float32 every 4-bit and
symmetric 8-bit GPTQ / AWQ checkpoint qualifies; in float16 (the dtype GPTQ / AWQ configs name, so dtype="auto")
symmetric GPTQ and zero_point=false AWQ do, while asymmetric zeros (AWQ's, mostly) round; bfloat16 does not hold
float16 scales. A device_map plans with the packed sizes. Dequantized into a plain nn.Linear everywhere else
(act-order, 2 bits, asymmetric int8, scales or zeros that would round), with a warning that says which layers and
why, and for every layer with `dequantize=True` (the name of transformers' FineGrainedFP8Config / Mxfp4Config
field).

Refused by name: GPTQ bits 3 (values cross int32 words) and other bits, checkpoint formats other than gptq /
gptq_v2 (marlin, bitblas, gptq_p, ...), pack_dtype other than int32, gptqmodel "dynamic" per-module overrides
(other bits or group sizes per layer; its "-:" exclusions load), AWQ bits other than 4 and versions other than
gemm (gemv, gemv_fast, llm-awq), and quantizing a float model (GPTQ / AWQ need calibration: use WeightOnlyConfig).

Offers: GPTQConfig, AwqConfig, GPTQAwqLinear, unpack_gptq, unpack_awq, dequantize_packed, swap_gptq_awq_layers,
finish_gptq_awq_loading.
"""

from __future__ import annotations

import dataclasses
import logging
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

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_FORMATS = ("gemm",)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value k of an AWQ word holds output column 8c + AWQ_PACK_ORDER[k]
_SCALE_DTYPES = (torch.float16, torch.bfloat16)  # at most 11 significant bits: integer * scale is exact in float32
_PARTS = ("qweight", "qzeros", "scales")  # a quantized layer's tensors (GPTQ's optional g_idx aside)
_DEQUANTIZE_ROWS = 4096  # input rows dequantized at a time: the float32 temporaries stay (4096, out)


def _check_group_size(group_size) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"group_size={group_size!r} must be a positive int, or -1 for one group per output channel")


@dataclass
class GPTQConfig:
    """transformers' GPTQConfig, the fields that loading reads (calibration ones are accepted and ignored).

    `format` ("gptq" = v1, "gptq_v2"; config.json's legacy `checkpoint_format` wins, as in transformers),
    `lm_head` (gptqmodel: the LM head is quantized too) and `dynamic` (gptqmodel's per-module rules) come from the
    checkpoint. `dequantize`: see the module doc.
    """

    bits: int
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    format: str = "gptq"
    lm_head: bool = False
    dynamic: dict[str, Any] | None = None
    pack_dtype: str = "int32"
    dequantize: bool = False
    quant_method: str = field(default="gptq", init=False)

    def __post_init__(self):
        if self.bits == 3:
            raise NotImplementedError("bits=3: 3-bit GPTQ packs values across int32 words, which gpuformers does not "
                                      "read; it loads 2-, 4- and 8-bit GPTQ checkpoints")
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits={self.bits!r}: GPTQ checkpoints have 2, 3, 4 or 8 bits (gpuformers reads 2, 4, 8)")
        _check_group_size(self.group_size)
        self.format = str(self.format).lower()
        if self.format not in GPTQ_FORMATS:
            raise NotImplementedError(f"format={self.format!r} (checkpoint_format): gpuformers reads GPTQ checkpoints "
                                      f"in the {' and '.join(GPTQ_FORMATS)} formats, not kernel-specific layouts")
        if str(self.pack_dtype).removeprefix("torch.") != "int32":
            raise NotImplementedError(f"pack_dtype={self.pack_dtype!r}: gpuformers reads GPTQ weights packed in "
                                      f"int32 words only")
        # "-:" rules exclude layers (stored unquantized, read as they are); others set per-layer bits / group sizes
        overrides = {k: v for k, v in (self.dynamic or {}).items() if not str(k).startswith("-:") and v}
        if overrides:
            raise NotImplementedError(f"dynamic={overrides!r}: per-module GPTQ settings (gptqmodel's dynamic "
                                      f"overrides) are not supported by gpuformers; only '-:' exclusions are")

    @property
    def skip_modules(self) -> list[str]:
        return [] if self.lm_head else ["lm_head"]

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "checkpoint_format": self.format}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTQConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        values = {k: v for k, v in data.items() if k in names}
        if data.get("checkpoint_format") is not None:
            values["format"] = data["checkpoint_format"]
        if "bits" not in values:
            raise ValueError("the GPTQ quantization_config has no 'bits'; is config.json complete?")
        return cls(**values)


@dataclass
class AwqConfig:
    """transformers' AwqConfig, the fields that loading reads. `format` is config.json's `version` ("gemm": what
    AutoAWQ writes by default). `modules_to_not_convert`: modules the checkpoint stores unquantized (the LM head is
    always kept). `dequantize`: see the module doc."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    format: str = "gemm"
    modules_to_not_convert: list[str] | None = None
    dequantize: bool = False
    quant_method: str = field(default="awq", init=False)

    def __post_init__(self):
        if self.bits != 4:
            raise NotImplementedError(f"bits={self.bits!r}: gpuformers reads 4-bit AWQ checkpoints (what AutoAWQ "
                                      f"writes), not {self.bits}-bit ones")
        _check_group_size(self.group_size)
        self.format = str(self.format).lower()
        if self.format not in AWQ_FORMATS:
            raise NotImplementedError(f"version={self.format!r}: gpuformers reads AWQ checkpoints of version 'gemm' "
                                      f"only (gemv, gemv_fast and llm-awq pack their weights differently)")

    @property
    def skip_modules(self) -> list[str]:
        return ["lm_head", *(self.modules_to_not_convert or [])]

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "version": self.format}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AwqConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        values = {k: v for k, v in data.items() if k in names}
        if data.get("version") is not None:  # config.json's name for it; transformers lets it win
            values["format"] = data["version"]
        return cls(**values)


PackedConfig = GPTQConfig | AwqConfig


def gptq_awq_quantization(stored: PackedConfig | None, requested) -> PackedConfig:
    """The config to load with, from config.json's (`stored`) and from_pretrained's (`requested`, already one of
    gpuformers' config objects or None): the stored one, with a requested GPTQConfig / AwqConfig's `dequantize`."""
    if not isinstance(stored, (GPTQConfig, AwqConfig)):
        raise NotImplementedError(f"{type(requested).__name__} loads checkpoints already quantized with "
                                  f"{requested.quant_method.upper()} (config.json has its quantization_config); "
                                  f"quantizing a float model needs calibration, which gpuformers does not do: use "
                                  f"WeightOnlyConfig(bits=4) to quantize while loading, or load a "
                                  f"{requested.quant_method.upper()} checkpoint")
    if requested is None:
        return stored
    if type(requested) is not type(stored):
        logger.warning("the checkpoint is already quantized (%s): its settings are used and the quantization_config "
                       "passed to from_pretrained is ignored", stored.quant_method)
        return stored
    return dataclasses.replace(stored, dequantize=requested.dequantize)


# -----------------------------------------------------------------------------------------------------------------
# Unpacking and dequantizing


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, in_features: int, out_features: int,
                checkpoint_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's int32 qweight and qzeros -> integer weights (in, out) and zeros (G, out), int32 (module doc)."""
    q = unpack_fields(qweight, bits, dim=0)[:in_features]
    if checkpoint_format == "gptq":  # v1: each word was stored minus one per value, borrows included
        ones = sum(1 << (bits * k) for k in range(32 // bits))
        qzeros = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF
    z = unpack_fields(qzeros, bits, dim=1)[:, :out_features].to(torch.int32)
    return q, z


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ gemm's int32 qweight and qzeros -> integer weights (in, out) and zeros (G, out), int32 (module doc)."""
    order = torch.tensor(AWQ_PACK_ORDER, device=qweight.device)
    # Output column 8c + m sits in value argsort(order)[m] of word c.
    columns = (torch.arange(qweight.shape[1], device=qweight.device)[:, None] * 8 + order.argsort()).reshape(-1)
    return unpack_fields(qweight, 4, dim=1)[:, columns], unpack_fields(qzeros, 4, dim=1)[:, columns]


def dequantize_packed(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """w[o, i] = (q[i, o] - zeros[g, o]) * scales[g, o] with g = g_idx[i], in float32, rounded once to `dtype`:
    the (out, in) weight. q (in, out), zeros and scales (G, out), g_idx (in,)."""
    in_features, out_features = q.shape
    out = torch.empty(out_features, in_features, dtype=dtype, device=q.device)
    g_idx = g_idx.long()
    for first in range(0, in_features, _DEQUANTIZE_ROWS):
        group = g_idx[first:first + _DEQUANTIZE_ROWS]
        rows = (q[first:first + _DEQUANTIZE_ROWS].float() - zeros[group].float()).mul_(scales[group].float())
        out[:, first:first + _DEQUANTIZE_ROWS] = rows.t()
    return out


def _weight_only_reason(bits: int, group_size: int | None, q: torch.Tensor, zeros: torch.Tensor,
                        scales: torch.Tensor, g_idx: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when a WeightOnlyLinear in `dtype` with `group_size` (None: one scale per output channel) holds exactly
    these weights (module doc), else why not."""
    in_features = q.shape[0]
    # (with group_size None, g_idx is all 0: the layout check first gives the same reasons)
    if reason := layout_reason(bits, group_size, in_features):
        return reason
    if not torch.equal(g_idx.long(), torch.arange(in_features, device=g_idx.device) // (group_size or in_features)):
        return "act-order (desc_act) groups"
    if scales.dtype not in _SCALE_DTYPES or not torch.equal(scales.to(dtype).to(scales.dtype), scales):
        return f"{scales.dtype} scales that {dtype} does not hold exactly"
    if bits == 8:
        return None if bool((zeros == 128).all()) else "8-bit zero points (asymmetric)"
    offset = (8 - zeros).float() * scales.float()  # exact in float32 (module doc)
    if not torch.equal(offset.to(dtype).float(), offset):
        return f"zero points that {dtype} does not hold exactly (asymmetric)"
    return None


# -----------------------------------------------------------------------------------------------------------------
# The stand-in layer


class GPTQAwqLinear(PackedStandIn, nn.Module):
    """Stands in for an nn.Linear while a GPTQ / AWQ checkpoint loads: takes qweight, qzeros, scales (and GPTQ's
    g_idx) in any order, or a plain `weight`, and keeps either a WeightOnlyLinear (`packed`) or the dequantized
    weight (module doc). `name` is the module's name in the model, for errors."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: PackedConfig, dtype: torch.dtype,
                 name: str, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.config, self.compute_dtype, self.name = config, dtype, name
        self.is_gptq = isinstance(config, GPTQConfig)
        # Input columns per group (-1: all of them), and the number of groups as GPTQ counts them
        self.group = in_features if config.group_size == -1 else config.group_size
        self.groups = -(-in_features // self.group)
        # Meta placeholders of the packed shapes (what a device_map plans with): left meta, the loader names them
        # missing. g_idx is optional (i // group_size).
        shapes = self._expected_shapes()
        for part, stored in zip(_PARTS, (torch.int32, torch.int32, torch.float16)):
            self.register_buffer(part, torch.empty(shapes[part], dtype=stored, device="meta"))
        self.g_idx: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.weight: nn.Parameter | None = None
        self.packed: nn.Module | None = None
        self.reason: str | None = None  # why a quantized layer was dequantized rather than kept packed

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor: qweight, qzeros, scales, g_idx (GPTQ), bias, or an unquantized weight."""
        if name == "weight":
            if self._started():
                raise ValueError(f"{self.name} has both a quantized qweight and an unquantized weight in the "
                                 f"checkpoint (or two weights): one of them is from another file")
            self._check(name, tensor, (self.out_features, self.in_features), floating=True)
            self._take(_PARTS)  # no quantized parts will come: the layer is stored unquantized
            self.weight = nn.Parameter(tensor.to(self.compute_dtype))
        elif name == "bias":
            if self.bias is None:
                if not tensor.count_nonzero():
                    return  # older AutoGPTQ saved a zero bias for every layer
                raise KeyError(f"{self.name}.bias is in the checkpoint, but the model's layer has no bias; is "
                               f"config.json the one of these weights?")
            self._check(name, tensor, (self.out_features,), floating=True)
            self.bias = nn.Parameter(tensor.to(self.compute_dtype))
        elif name in ("qweight", "qzeros", "scales") or (name == "g_idx" and self.is_gptq):
            if self.weight is not None or self.packed is not None or (name == "g_idx" and self.g_idx is not None):
                raise ValueError(f"{self.name}.{name} came for a layer already loaded (an unquantized weight, or "
                                 f"a second copy): one of them is from another file")
            self._check_part(name, tensor)
            if name == "g_idx":
                self.g_idx = tensor
            else:
                setattr(self, name, tensor)
            if self.g_idx is not None or not self.is_gptq:
                self._convert_when_complete()
        else:
            parts = "qweight, qzeros, scales" + (", g_idx" if self.is_gptq else "")
            raise KeyError(f"{self.name}.{name} is not part of a {self.config.quant_method.upper()} Linear; it takes "
                           f"{parts}, bias, or an unquantized weight")

    def _started(self) -> bool:
        """Whether a weight, or a quantized part of one, has come."""
        return (self.weight is not None or self.packed is not None or self.g_idx is not None
                or any(not self._buffers[part].is_meta for part in _PARTS))

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        per_word = 32 // self.config.bits  # GPTQ rounds a partial last word up; AWQ layers fill theirs
        if self.is_gptq:
            return {"qweight": (-(-self.in_features // per_word), self.out_features),
                    "qzeros": (self.groups, -(-self.out_features // per_word)),
                    "scales": (self.groups, self.out_features), "g_idx": (self.in_features,)}
        return {"qweight": (self.in_features, self.out_features // 8), "qzeros": (self.groups, self.out_features // 8),
                "scales": (self.groups, self.out_features)}

    def _check_part(self, name: str, tensor: torch.Tensor) -> None:
        if not self.is_gptq and (self.out_features % 8 or self.in_features % self.group):
            raise ValueError(f"{self.name} ({self.in_features} -> {self.out_features}) cannot be an AWQ gemm layer: "
                             f"its output size must be a multiple of 8 and group_size={self.config.group_size} must "
                             f"divide its input size")
        self._check(name, tensor, self._expected_shapes()[name], floating=name == "scales")
        if name in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise ValueError(f"{self.name}.{name} has dtype {tensor.dtype}; GPTQ / AWQ pack their values in int32")
        if name == "g_idx" and (tensor.is_floating_point() or int(tensor.min()) < 0
                                or int(tensor.max()) >= self.groups):
            raise ValueError(f"{self.name}.g_idx must hold group numbers in [0, {self.groups}) for "
                             f"group_size={self.config.group_size}; it has {tensor.dtype} values in "
                             f"[{tensor.min().item()}, {tensor.max().item()}]: is config.json's group_size the one "
                             f"of these weights?")

    def _check(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], floating: bool = False) -> None:
        if tuple(tensor.shape) != shape:
            fields = f"bits={self.config.bits}, group_size={self.config.group_size}"
            raise ValueError(f"{self.name}.{name} has shape {list(tensor.shape)}, but a {self.in_features} -> "
                             f"{self.out_features} layer with {fields} needs {list(shape)}; are config.json's "
                             f"quantization_config and model config the ones of these weights?")
        if floating and not tensor.is_floating_point():
            raise ValueError(f"{self.name}.{name} has dtype {tensor.dtype}; it must be a floating-point tensor")

    def _convert_when_complete(self) -> None:
        if self._awaiting(_PARTS):
            return
        parts = self._take(_PARTS)
        bits, scales = self.config.bits, parts["scales"]
        if self.is_gptq:
            q, zeros = unpack_gptq(parts["qweight"], parts["qzeros"], bits, self.in_features, self.out_features,
                                   self.config.format)
        else:
            q, zeros = unpack_awq(parts["qweight"], parts["qzeros"])
        g_idx = self.g_idx
        if g_idx is None:  # AWQ, or a GPTQ checkpoint without g_idx: consecutive groups
            g_idx = torch.arange(self.in_features, device=q.device) // self.group
        group_size = None if self.config.group_size == -1 else self.config.group_size
        reason = ("dequantize=True" if self.config.dequantize
                  else _weight_only_reason(bits, group_size, q, zeros, scales, g_idx, self.compute_dtype))
        if reason is None:
            self.packed = weight_only_linear(q.t(), zeros.t(), scales.t(), bits, group_size, self.compute_dtype)
        else:
            self.weight = nn.Parameter(dequantize_packed(q, zeros, scales, g_idx, self.compute_dtype))
            self.reason = reason
        self.g_idx = None

    def finish(self) -> nn.Module:
        """The loaded layer: a WeightOnlyLinear or an nn.Linear, with the bias."""
        if self.weight is None and self.packed is None and self.is_gptq and self.g_idx is None:
            if self.config.desc_act:
                raise ValueError(f"{self.name}.g_idx is missing from the checkpoint; an act-order (desc_act=True) "
                                 f"GPTQ checkpoint needs it")
            self._convert_when_complete()  # a GPTQ checkpoint without g_idx: consecutive groups
        if self.weight is None and self.packed is None:
            raise ValueError(f"{self.name} was not loaded: the checkpoint lacks its qweight / qzeros / scales")
        return super().finish()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.config.quant_method}, bits={self.config.bits}, group_size={self.config.group_size}")


# -----------------------------------------------------------------------------------------------------------------
# Before and after loading


def swap_gptq_awq_layers(model: nn.Module, config: PackedConfig, dtype: torch.dtype,
                         loaded: bool = False) -> list[str]:
    """Replace every nn.Linear that `config` does not skip with a GPTQAwqLinear (model on the meta device); returns
    the names."""
    from gpuformers.quantization.config import is_skipped

    if loaded:
        refuse_loaded(config, config.quant_method.upper())
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and not is_skipped(name, config.skip_modules)]
    for name in names:
        swap_in(model, name, lambda linear: GPTQAwqLinear(linear.in_features, linear.out_features,
                                                          linear.bias is not None, config, dtype, name))
    if not names:
        raise ValueError(f"the {config.quant_method.upper()} quantization_config quantizes no layer: every nn.Linear "
                         f"is in {config.skip_modules}")
    return names


def finish_gptq_awq_loading(model: nn.Module, config: PackedConfig):
    """Put each loaded GPTQAwqLinear's weights in the model: a WeightOnlyLinear where it kept them packed, a plain
    nn.Linear otherwise. Returns the WeightOnlyConfig the model then carries, or None (a plain model)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, GPTQAwqLinear)}
    finished = {name: layer.finish() for name, layer in layers.items()}
    reasons = sorted({layer.reason for layer in layers.values() if layer.reason and not config.dequantize})
    if reasons:
        count = sum(layer.reason is not None for layer in layers.values())
        logger.warning("%d of %d %s layers were dequantized into %s (its memory, not the packed one's) because "
                       "gpuformers' WeightOnlyLinear cannot hold them exactly: %s. In float32 every 4-bit and "
                       "symmetric 8-bit layer with consecutive groups stays packed", count, len(layers),
                       config.quant_method.upper(), next(iter(layers.values())).compute_dtype, "; ".join(reasons))
    return install_finished_layers(model, finished)
