"""Quantization settings, as `from_pretrained(quantization_config=...)` takes them and config.json stores them.

Three methods:
- `BitsAndBytesConfig` (quant_method "bitsandbytes"): transformers' class, field for field: NF4 / FP4 4-bit or
  LLM.int8() 8-bit weights through the `bitsandbytes` package (quantization/bnb.py).
- `WeightOnlyConfig` (quant_method "weight_only"): gpuformers' own int8 / int4 group-wise weights in plain torch
  (quantization/weight_only.py), no extra package; activations stay in the model's dtype.
- `FineGrainedFP8Config` (quant_method "fp8"): transformers' class, for loading fine-grained FP8 checkpoints
  (Qwen/Qwen3-8B-FP8, DeepSeek-V3), quantization/fp8.py: dequantized on load into the compute dtype (the model is
  then a plain one), or with `dequantize=False` kept in FP8 for a Triton FP8 matmul on CUDA >= 8.9.

`quantize_linear_layers` swaps a model's `nn.Linear` layers (built on the meta device, before any weight is read)
for the method's quantized layer, which then quantizes each weight as the loader hands it over: a float checkpoint
is quantized while loading (peak memory about one layer), a pre-quantized one is read as it is. The LM head is kept
in full precision unless named otherwise, as transformers does. Conv1D-style layers (GPT-2's: weights stored
(in, out), `fan_in_fan_out`) are swapped too, and their weights go in transposed: the quantized layer is a Linear with
the same outputs, as in transformers' bitsandbytes integration (a quantized checkpoint then stores them (out, in)).

- `CompressedTensorsConfig` (quant_method "compressed-tensors"): checkpoints written by llm-compressor, read by
  quantization/compressed_tensors.py: kept packed as WeightOnlyLinear where exact, else dequantized on load.
- `GPTQConfig` / `AwqConfig` (quant_method "gptq" / "awq"): GPTQ and AWQ checkpoints, read by
  quantization/gptq_awq.py: kept packed as WeightOnlyLinear where exact, else dequantized on load.
- `Mxfp4Config` (quant_method "mxfp4"): gpt-oss checkpoints whose experts are MXFP4 (quantization/mxfp4.py): the
  experts kept packed or dequantized on load; the model builds them packed, so no layer is swapped here.

Mixture-of-experts models load through the same layers (their experts are per-expert Linears); routers a checkpoint
quantizes and transformers' fused FP8 experts are handled by quantization/moe.py.

Other methods transformers knows (hqq, torchao, quanto, ...) raise NotImplementedError naming the method.

Offers: BitsAndBytesConfig, WeightOnlyConfig, FineGrainedFP8Config, CompressedTensorsConfig, GPTQConfig, AwqConfig,
Mxfp4Config, quantization_config_from, checkpoint_quantization, quantize_linear_layers, finish_loading, is_skipped
(transformers' skip_modules rule).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpuformers.layers.linear import is_fan_in_fan_out
from gpuformers.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    finish_compressed_loading,
    swap_compressed_layers,
)
from gpuformers.quantization.gptq_awq import (
    AwqConfig,
    GPTQConfig,
    finish_gptq_awq_loading,
    gptq_awq_quantization,
    swap_gptq_awq_layers,
)
from gpuformers.quantization.dequantize import remember_original
from gpuformers.quantization.mxfp4 import Mxfp4Config, keeps_mxfp4, packed_experts, unpack_experts

logger = logging.getLogger(__name__)

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


@dataclass
class FineGrainedFP8Config:
    """transformers' FineGrainedFP8Config: FP8 (e4m3) weights with one float32 scale per weight block.

    `dequantize=True`: each weight becomes weight * scale in the compute dtype as it loads (a plain model).
    `dequantize=False` (transformers' default) keeps the FP8 weights and scales for a Triton matmul, on CUDA GPUs of
    compute capability >= 8.9 only. A checkpoint loaded without a quantization_config is dequantized (with a
    warning), so that it loads anywhere. `modules_to_not_convert`: modules the checkpoint stores unquantized (the LM
    head is always among them, as in transformers).
    """

    activation_scheme: str = "dynamic"
    weight_block_size: list[int] | None = field(default_factory=lambda: [128, 128])
    dequantize: bool = False
    modules_to_not_convert: list[str] | None = None
    modules_to_convert: list[str] | None = None
    scale_fmt: str = "float"
    fmt: str = "e4m3"
    quant_method: str = field(default="fp8", init=False)

    def __post_init__(self):
        self.activation_scheme = str(self.activation_scheme).lower()
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"activation_scheme={self.activation_scheme!r}; use 'dynamic' or 'static'")
        if self.weight_block_size is not None:
            block = self.weight_block_size
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"weight_block_size={block!r} must be two positive ints [rows, columns] (e.g. "
                                 f"[128, 128]), or None for one scale per tensor")
            self.weight_block_size = list(block)
        if self.fmt != "e4m3":
            raise NotImplementedError(f"fmt={self.fmt!r}: gpuformers loads e4m3 FP8 checkpoints only")
        if self.scale_fmt != "float":
            raise NotImplementedError(f"scale_fmt={self.scale_fmt!r} (power-of-two ue8m0 scales, DeepSeek-V4 style) "
                                      f"is not supported by gpuformers; it loads scale_fmt='float' checkpoints")
        if self.modules_to_convert:
            raise NotImplementedError(f"modules_to_convert={self.modules_to_convert!r} (FP8 embeddings) is not "
                                      f"supported by gpuformers: only Linear layers may be stored in FP8")

    @property
    def skip_modules(self) -> list[str]:
        return ["lm_head", *(self.modules_to_not_convert or [])]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FineGrainedFP8Config":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        values = {k: v for k, v in data.items() if k in names}
        if values.get("modules_to_not_convert") is None and "ignored_layers" in data:  # MiniMax's name for it
            values["modules_to_not_convert"] = data["ignored_layers"]
        return cls(**values)


_METHODS = {"bitsandbytes": BitsAndBytesConfig, "weight_only": WeightOnlyConfig, "fp8": FineGrainedFP8Config,
            "compressed-tensors": CompressedTensorsConfig, "gptq": GPTQConfig, "awq": AwqConfig, "mxfp4": Mxfp4Config}
QuantizationConfig = (BitsAndBytesConfig | WeightOnlyConfig | FineGrainedFP8Config | CompressedTensorsConfig
                      | GPTQConfig | AwqConfig | Mxfp4Config)


def quantization_config_from(value) -> QuantizationConfig:
    """A config object, or its dict form (config.json, or transformers' BitsAndBytesConfig.to_dict()) -> ours."""
    if isinstance(value, tuple(_METHODS.values())):
        return value
    if not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
        # transformers' own config objects; its CompressedTensorsConfig leaves the `dequantize` flag out of to_dict()
        flag = {"dequantize": value.dequantize} if isinstance(getattr(value, "dequantize", None), bool) else {}
        value = {**value.to_dict(), **flag}
    if not isinstance(value, dict):
        raise TypeError(f"quantization_config must be a BitsAndBytesConfig, a WeightOnlyConfig, a "
                        f"FineGrainedFP8Config or a dict, not {type(value).__name__}")
    method = value.get("quant_method")
    if method is None and ("load_in_4bit" in value or "load_in_8bit" in value):
        method = "bitsandbytes"
    if method not in _METHODS:
        raise NotImplementedError(f"quantization method {method!r} is not supported by gpuformers; it loads "
                                  f"{', '.join(sorted(_METHODS))} (BitsAndBytesConfig, WeightOnlyConfig, "
                                  f"FineGrainedFP8Config)")
    return _METHODS[method].from_dict(value)


def checkpoint_quantization(stored, requested) -> QuantizationConfig | None:
    """The quantization to load with, from config.json's quantization_config (`stored`, a pre-quantized checkpoint)
    and from_pretrained's (`requested`). A stored config wins, as in transformers; for FP8 the requested
    `dequantize` and `modules_to_not_convert` apply to it (transformers' loading attributes)."""
    stored = quantization_config_from(stored) if stored is not None else None
    if isinstance(stored, CompressedTensorsConfig):
        return stored.for_loading(quantization_config_from(requested) if requested is not None else None)
    asked = quantization_config_from(requested) if requested is not None else None
    if isinstance(stored, (GPTQConfig, AwqConfig)) or (stored is None and isinstance(asked, (GPTQConfig, AwqConfig))):
        return gptq_awq_quantization(stored, asked)
    if isinstance(asked, Mxfp4Config) and not isinstance(stored, Mxfp4Config):
        raise NotImplementedError("Mxfp4Config loads checkpoints whose experts are already MXFP4 (gpt-oss); "
                                  "quantizing a model to MXFP4 while loading is not supported by gpuformers: use "
                                  "WeightOnlyConfig or BitsAndBytesConfig")
    if isinstance(stored, Mxfp4Config):
        if asked is not None and not isinstance(asked, Mxfp4Config):
            logger.warning("the checkpoint's experts are MXFP4 (config.json's quantization_config): %s passed to "
                           "from_pretrained is ignored; pass Mxfp4Config(dequantize=...) to choose how they load",
                           type(asked).__name__)
            asked = None
        return stored.for_loading(asked)
    if stored is not None and not isinstance(stored, FineGrainedFP8Config):
        if requested is not None:
            logger.warning("the checkpoint is already quantized (config.json has a quantization_config): its "
                           "settings are used and the quantization_config passed to from_pretrained is ignored")
        return stored
    requested = quantization_config_from(requested) if requested is not None else None
    if isinstance(requested, CompressedTensorsConfig) and stored is None:
        raise NotImplementedError("CompressedTensorsConfig loads checkpoints llm-compressor already quantized; "
                                  "quantizing while loading is not supported by gpuformers: use WeightOnlyConfig "
                                  "or BitsAndBytesConfig")
    if isinstance(requested, FineGrainedFP8Config):
        if stored is None:
            raise NotImplementedError("FineGrainedFP8Config loads checkpoints already in FP8; quantizing a model to "
                                      "FP8 while loading is not supported by gpuformers: use WeightOnlyConfig or "
                                      "BitsAndBytesConfig, or load an FP8 checkpoint")
        if requested.modules_to_not_convert is not None:
            stored = dataclasses.replace(stored, modules_to_not_convert=requested.modules_to_not_convert)
        return dataclasses.replace(stored, dequantize=requested.dequantize)
    if stored is None:
        return requested
    if requested is not None:
        logger.warning("the checkpoint's quantization_config (FP8) is used and the quantization_config passed to "
                       "from_pretrained is ignored")
    if not stored.dequantize:
        logger.warning("the checkpoint's weights are FP8: gpuformers dequantizes them on load (the memory of the "
                       "unquantized model); to keep them in FP8 on a GPU of compute capability >= 8.9, pass "
                       "quantization_config=FineGrainedFP8Config(dequantize=False)")
    return dataclasses.replace(stored, dequantize=True)


def _int4_group_size(in_features: int) -> int:
    """The int4 group when none is given: 128, else the largest of 64 and 32 that divides the layer's input."""
    for size in (128, 64, 32):
        if in_features % size == 0:
            return size
    raise ValueError(f"int4 needs groups of 32, 64 or 128 input columns, and none divides in_features={in_features}; "
                     f"pass WeightOnlyConfig(bits=4, group_size=...) with a divisor of it, or use bits=8")


def is_skipped(name: str, skip: list[str]) -> bool:
    """transformers' rule: a module is kept when a skip entry names it or one of its enclosing modules."""
    return any(name == key or name.startswith(key + ".") or name.endswith("." + key) or f".{key}." in name
               for key in skip)


def quantize_linear_layers(model: nn.Module, config: QuantizationConfig, dtype: torch.dtype,
                           loaded: bool = False) -> list[str]:
    """Swap every nn.Linear (and Conv1D-style layer, module doc) of `model` that `config` does not skip for its
    quantized layer; returns the names.

    Before loading (`loaded=False`, the model on the meta device) the new layers quantize their weights as the
    loader hands them over. `loaded=True` quantizes a model whose weights are already there (a GGUF file,
    dequantized on load), one layer at a time, each new layer on its weight's device.
    """
    # MoE: routers that a pre-quantized checkpoint may store quantized get a dequantizing stand-in
    from gpuformers.quantization.moe import fused_fp8_scale_rules, swap_routers

    if isinstance(config, CompressedTensorsConfig):  # its config groups choose the layers
        return swap_compressed_layers(model, config, dtype, loaded) + swap_routers(model, config, dtype)
    if isinstance(config, (GPTQConfig, AwqConfig)):  # pre-quantized layers, or unquantized ones as stored
        return swap_gptq_awq_layers(model, config, dtype, loaded) + swap_routers(model, config, dtype)
    if isinstance(config, Mxfp4Config):  # only gpt-oss's experts, which the model builds packed for it
        if not packed_experts(model):
            raise NotImplementedError(f"MXFP4 checkpoints are supported for gpt-oss's experts only, not for "
                                      f"{type(model).__name__}")
        return []
    if isinstance(config, BitsAndBytesConfig):
        from gpuformers.quantization.bnb import bnb_linear

        make = lambda name, linear: bnb_linear(linear, config, dtype)  # noqa: E731
    elif isinstance(config, FineGrainedFP8Config):
        from gpuformers.quantization.fp8 import FP8DequantizingLinear, FP8Linear

        if loaded:
            raise NotImplementedError("FineGrainedFP8Config loads FP8 checkpoints; a model already loaded (a GGUF "
                                      "file) cannot be quantized to FP8: use WeightOnlyConfig or BitsAndBytesConfig")
        fp8_class = FP8DequantizingLinear if config.dequantize else FP8Linear

        def make(name, linear):
            return fp8_class(linear.in_features, linear.out_features, linear.bias is not None,
                             config.weight_block_size, dtype, name, device="meta")
    else:
        from gpuformers.quantization.weight_only import WeightOnlyLinear

        def make(name, linear):
            group_size = config.group_size
            if group_size is None and config.bits == 4:
                group_size = _int4_group_size(linear.in_features)
            return WeightOnlyLinear(linear.in_features, linear.out_features, linear.bias is not None, config.bits,
                                    group_size, dtype, device="meta")

    tied = set(getattr(model, "tied_weights", {}))
    names = [name for name, module in model.named_modules()
             if (type(module) is nn.Linear or is_fan_in_fan_out(module))
             and not is_skipped(name, config.skip_modules)]
    conv1d_names = [name for name in names if is_fan_in_fan_out(model.get_submodule(name))]
    if conv1d_names and isinstance(config, FineGrainedFP8Config):
        raise NotImplementedError(f"FineGrainedFP8Config loads FP8 checkpoints of Linear layers; "
                                  f"{type(model).__name__} has Conv1D-style layers ({conv1d_names[0]}, ...): "
                                  "quantize it with WeightOnlyConfig or BitsAndBytesConfig")
    if not names:
        raise ValueError(f"quantization_config quantized no layer: every nn.Linear is in skip_modules "
                         f"{config.skip_modules}")
    for name in names:
        if f"{name}.weight" in tied:
            raise ValueError(f"{name} shares its weight with another layer (tied embeddings) and cannot be "
                             f"quantized on its own; keep it in full precision (leave it in skip_modules)")
    if conv1d_names and not loaded:
        # A quantized layer loads its own checkpoint keys: a rename rule whose source is one of them (GPT-2's, toward
        # the bare GPT2Model's names) would take the key away from it, to a name no module has
        own_keys = [f"{name}.{tensor}" for name in conv1d_names for tensor in ("weight", "bias")]
        model.checkpoint_fan_out = tuple(rule for rule in getattr(model, "checkpoint_fan_out", ())
                                         if not any(rule.matches(key) for key in own_keys))
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        linear = model.get_submodule(name)
        with torch.device("meta"):
            layer = make(name, linear)
        conv1d = is_fan_in_fan_out(linear)
        if conv1d and not loaded:
            _load_conv1d_checkpoint(layer, linear.in_features, linear.out_features)
        if loaded:
            layer.load_from_checkpoint("weight", linear.weight.detach().T if conv1d else linear.weight.detach())
            if linear.bias is not None:
                layer.load_from_checkpoint("bias", linear.bias.detach())
        remember_original(layer, linear)  # what model.dequantize() gives back
        setattr(model.get_submodule(parent_name), attr, layer)
    if isinstance(config, FineGrainedFP8Config):
        names += swap_routers(model, config, dtype)
        # transformers' fused FP8 experts: their scales are cut as the model cuts the weights
        scale_rules = fused_fp8_scale_rules(model, config.weight_block_size)
        if scale_rules:
            model.checkpoint_fan_out = (*model.checkpoint_fan_out, *scale_rules)
    return names


def _load_conv1d_checkpoint(layer: nn.Module, in_features: int, out_features: int) -> None:
    """`layer`, a Linear's quantized layer standing for a Conv1D, takes the Conv1D's float checkpoint weight
    (in_features, out_features) transposed while the checkpoint loads (transformers' bitsandbytes loading transposes
    it the same way). Pre-quantized tensors (already (out, in)) pass as they are. finish_loading removes this: later
    calls (a LoRA merge requantizing) hand over (out, in) weights, which a square layer could not tell apart."""
    load = layer.load_from_checkpoint

    def load_from_checkpoint(name: str, tensor: torch.Tensor) -> None:
        if name == "weight" and tensor.is_floating_point() and tuple(tensor.shape) == (in_features, out_features):
            tensor = tensor.T.contiguous()
        load(name, tensor)

    load_from_checkpoint.conv1d_checkpoint = True
    layer.load_from_checkpoint = load_from_checkpoint


def _end_conv1d_checkpoint(model: nn.Module) -> None:
    """Give the quantized Conv1D layers their own load_from_checkpoint back (_load_conv1d_checkpoint)."""
    for module in model.modules():
        if getattr(module.__dict__.get("load_from_checkpoint"), "conv1d_checkpoint", False):
            del module.load_from_checkpoint


def finish_loading(model: nn.Module, config: QuantizationConfig | None,
                   unexpected: list[str]) -> QuantizationConfig | None:
    """After the weights loaded: the quantization the model keeps (None for an FP8 checkpoint dequantized into
    plain nn.Linear layers, which then saves unquantized). `unexpected`: checkpoint keys nothing took."""
    from gpuformers.quantization.moe import restore_routers

    restore_routers(model)  # first: a router's stand-in is one of the method's layers
    _end_conv1d_checkpoint(model)
    if isinstance(config, CompressedTensorsConfig):
        return finish_compressed_loading(model)
    if isinstance(config, (GPTQConfig, AwqConfig)):
        return finish_gptq_awq_loading(model, config)
    if isinstance(config, Mxfp4Config):
        return _finish_mxfp4_loading(model, config)
    if not isinstance(config, FineGrainedFP8Config):
        return config
    from gpuformers.quantization.fp8 import check_fp8_devices, restore_linear_layers

    # FP8 scales for a layer kept unquantized: its weight was read as if it were not scaled, which would be wrong.
    scaled = [key for key in unexpected if key.endswith(".weight_scale_inv")]
    if scaled:
        raise ValueError(f"the checkpoint has FP8 scales for layers loaded unquantized: {', '.join(scaled[:5])}; "
                         f"remove them from quantization_config.modules_to_not_convert "
                         f"(now {config.modules_to_not_convert})")
    if not config.dequantize:
        check_fp8_devices(model)
        return config
    restore_linear_layers(model)
    model.config.extra.pop("quantization_config", None)
    return None


def _finish_mxfp4_loading(model: nn.Module, config: Mxfp4Config) -> Mxfp4Config | None:
    """Keep the packed MXFP4 experts, or dequantize them (quantization/mxfp4.py's table): the kept config, or None
    for a model that is then unquantized (and saves so)."""
    if keeps_mxfp4(config, {b.device for m in packed_experts(model) for b in m.buffers()}):
        return dataclasses.replace(config, dequantize=False)
    unpack_experts(model)
    model.config.extra.pop("quantization_config", None)
    return None
