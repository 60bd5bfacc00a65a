"""Quantization settings, as `from_pretrained(quantization_config=...)` takes them and config.json stores them.

Two methods:
- `BitsAndBytesConfig` (quant_method "bitsandbytes"): transformers' class, field for field: NF4 / FP4 4-bit or
  LLM.int8() 8-bit weights through the `bitsandbytes` package (quantization/bnb.py).
- `WeightOnlyConfig` (quant_method "weight_only"): gpuformers' own int8 / int4 group-wise weights in plain torch
  (quantization/weight_only.py), no extra package; activations stay in the model's dtype.

`quantize_linear_layers` swaps a model's `nn.Linear` layers (built on the meta device, before any weight is read)
for the method's quantized layer, which then quantizes each weight as the loader hands it over: a float checkpoint
is quantized while loading (peak memory about one layer), a pre-quantized one is read as it is. The LM head is kept
in full precision unless named otherwise, as transformers does.

Other methods transformers knows (gptq, awq, hqq, torchao, fp8, compressed-tensors, quanto, ...) raise
NotImplementedError naming the method.

Offers: BitsAndBytesConfig, WeightOnlyConfig, quantization_config_from, quantize_linear_layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_QUANT_TYPES = ("fp4", "nf4")


def _as_dtype(value, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, value.removeprefix("torch."))
    raise ValueError(f"{name}={value!r} is not a torch dtype; pass e.g. torch.bfloat16 or 'bfloat16'")


@dataclass
class BitsAndBytesConfig:
    """transformers' BitsAndBytesConfig: exactly one of load_in_4bit / load_in_8bit.

    As in transformers, `bnb_4bit_compute_dtype=None` means float32 and `bnb_4bit_quant_storage=None` means uint8.
    `llm_int8_skip_modules`: module names kept in full precision (default: the LM head).
    """

    load_in_8bit: bool = False
    load_in_4bit: bool = False
    llm_int8_threshold: float = 6.0
    llm_int8_skip_modules: list[str] | None = None
    llm_int8_enable_fp32_cpu_offload: bool = False
    llm_int8_has_fp16_weight: bool = False
    bnb_4bit_compute_dtype: Any = None
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_quant_storage: Any = None
    quant_method: str = field(default="bitsandbytes", init=False)

    def __post_init__(self):
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both True; choose one")
        if not (self.load_in_4bit or self.load_in_8bit):
            raise ValueError("BitsAndBytesConfig needs load_in_4bit=True or load_in_8bit=True")
        if self.bnb_4bit_quant_type not in _QUANT_TYPES:
            raise ValueError(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}; use one of {_QUANT_TYPES}")
        if not isinstance(self.llm_int8_threshold, (int, float)) or self.llm_int8_threshold < 0:
            raise ValueError(f"llm_int8_threshold={self.llm_int8_threshold!r} must be a number >= 0")
        self.bnb_4bit_compute_dtype = _as_dtype(self.bnb_4bit_compute_dtype, "bnb_4bit_compute_dtype") or torch.float32
        self.bnb_4bit_quant_storage = _as_dtype(self.bnb_4bit_quant_storage, "bnb_4bit_quant_storage") or torch.uint8
        if self.llm_int8_enable_fp32_cpu_offload:
            raise NotImplementedError("llm_int8_enable_fp32_cpu_offload is not supported by gpuformers yet: keep "
                                      "every quantized layer on one device")

    @property
    def bits(self) -> int:
        return 4 if self.load_in_4bit else 8

    @property
    def skip_modules(self) -> list[str]:
        return list(self.llm_int8_skip_modules) if self.llm_int8_skip_modules is not None else ["lm_head"]

    def to_dict(self) -> dict[str, Any]:
        """The config.json form transformers writes (dtypes as strings, the private _load_in_* twins included)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["bnb_4bit_compute_dtype"] = str(self.bnb_4bit_compute_dtype).removeprefix("torch.")
        out["bnb_4bit_quant_storage"] = str(self.bnb_4bit_quant_storage).removeprefix("torch.")
        out["_load_in_4bit"], out["_load_in_8bit"] = self.load_in_4bit, self.load_in_8bit
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BitsAndBytesConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        values = {k: v for k, v in data.items() if k in names}
        for private in ("load_in_4bit", "load_in_8bit"):  # transformers keeps the truth in _load_in_*
            if f"_{private}" in data:
                values[private] = data[f"_{private}"]
        return cls(**values)


@dataclass
class WeightOnlyConfig:
    """int8 or int4 weights, scaled per output channel or per group of `group_size` input columns.

    group_size=None: for bits=8 one scale per output channel; for bits=4 groups of 128 columns, or of 64 or 32 in
    a layer whose input size 128 does not divide (SmolLM2's 576, say). A group_size given is used as it is.
    `skip_modules`: module names kept in full precision (default: the LM head).
    """

    bits: int = 8
    group_size: int | None = None
    skip_modules: list[str] | None = None
    quant_method: str = field(default="weight_only", init=False)

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits!r}: weight-only quantization has 8 (int8) or 4 (int4) bits")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ValueError(f"group_size={self.group_size!r} must be a positive int (or None: one scale per row)")
        if self.skip_modules is None:
            self.skip_modules = ["lm_head"]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WeightOnlyConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in data.items() if k in names})


_METHODS = {"bitsandbytes": BitsAndBytesConfig, "weight_only": WeightOnlyConfig}
QuantizationConfig = BitsAndBytesConfig | WeightOnlyConfig


def quantization_config_from(value) -> QuantizationConfig:
    """A config object, or its dict form (config.json, or transformers' BitsAndBytesConfig.to_dict()) -> ours."""
    if isinstance(value, (BitsAndBytesConfig, WeightOnlyConfig)):
        return value
    if not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()  # transformers' own BitsAndBytesConfig object
    if not isinstance(value, dict):
        raise TypeError(f"quantization_config must be a BitsAndBytesConfig, a WeightOnlyConfig or a dict, not "
                        f"{type(value).__name__}")
    method = value.get("quant_method")
    if method is None and ("load_in_4bit" in value or "load_in_8bit" in value):
        method = "bitsandbytes"
    if method not in _METHODS:
        raise NotImplementedError(f"quantization method {method!r} is not supported by gpuformers; it loads "
                                  f"{', '.join(sorted(_METHODS))} (BitsAndBytesConfig, WeightOnlyConfig)")
    return _METHODS[method].from_dict(value)


def _int4_group_size(in_features: int) -> int:
    """The int4 group when none is given: 128, else the largest of 64 and 32 that divides the layer's input."""
    for size in (128, 64, 32):
        if in_features % size == 0:
            return size
    raise ValueError(f"int4 needs groups of 32, 64 or 128 input columns, and none divides in_features={in_features}; "
                     f"pass WeightOnlyConfig(bits=4, group_size=...) with a divisor of it, or use bits=8")


def _skipped(name: str, skip: list[str]) -> bool:
    """transformers' rule: a module is kept when a skip entry names it or one of its enclosing modules."""
    return any(name == key or name.startswith(key + ".") or name.endswith("." + key) or f".{key}." in name
               for key in skip)


def quantize_linear_layers(model: nn.Module, config: QuantizationConfig, dtype: torch.dtype,
                           loaded: bool = False) -> list[str]:
    """Swap every nn.Linear of `model` that `config` does not skip for its quantized layer; returns the names.

    Before loading (`loaded=False`, the model on the meta device) the new layers quantize their weights as the
    loader hands them over. `loaded=True` quantizes a model whose weights are already there (a GGUF file,
    dequantized on load), one layer at a time, each new layer on its weight's device.
    """
    if isinstance(config, BitsAndBytesConfig):
        from gpuformers.quantization.bnb import bnb_linear

        make = lambda linear: bnb_linear(linear, config, dtype)  # noqa: E731
    else:
        from gpuformers.quantization.weight_only import WeightOnlyLinear

        def make(linear):
            group_size = config.group_size
            if group_size is None and config.bits == 4:
                group_size = _int4_group_size(linear.in_features)
            return WeightOnlyLinear(linear.in_features, linear.out_features, linear.bias is not None, config.bits,
                                    group_size, dtype, device="meta")

    tied = set(getattr(model, "tied_weights", {}))
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and not _skipped(name, config.skip_modules)]
    if not names:
        raise ValueError(f"quantization_config quantized no layer: every nn.Linear is in skip_modules "
                         f"{config.skip_modules}")
    for name in names:
        if f"{name}.weight" in tied:
            raise ValueError(f"{name} shares its weight with another layer (tied embeddings) and cannot be "
                             f"quantized on its own; keep it in full precision (leave it in skip_modules)")
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        linear = model.get_submodule(name)
        with torch.device("meta"):
            layer = make(linear)
        if loaded:
            layer.load_from_checkpoint("weight", linear.weight.detach())
            if linear.bias is not None:
                layer.load_from_checkpoint("bias", linear.bias.detach())
        setattr(model.get_submodule(parent_name), attr, layer)
    return names
