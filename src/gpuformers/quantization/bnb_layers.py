"""The bitsandbytes layers: `BnbLinear4bit` (a `bitsandbytes.nn.Linear4bit`, nf4 / fp4, QLoRA) and `BnbLinear8bitLt`
(a `bitsandbytes.nn.Linear8bitLt`, LLM.int8()), which quantize their weight while the checkpoint streams in.

Importing this module needs bitsandbytes (the classes subclass its layers, and it takes seconds to import):
quantization/bnb.py imports it late, when a layer is made. The layers are set up as transformers'
`replace_with_bnb_linear` sets them up, so that forward, state_dict and training are bitsandbytes' own and the logits
equal transformers'. What is added is `load_from_checkpoint(name, tensor)`, which the loader (loading/weights.py)
calls with each tensor under the layer's prefix:

    float "weight" (out, in)  --cast to the model dtype, quantize on its device-->  Params4bit / Int8Params
    pre-quantized pieces      --gathered until the set is complete-->               Params4bit.from_prequantized
        4 bit: weight (packed, (n, 1)), weight.absmax, weight.quant_map, [weight.nested_absmax,
               weight.nested_quant_map], weight.quant_state.bitsandbytes__nf4 | __fp4
        8 bit: weight (int8, (out, in)), SCB, weight_format
    "bias"                    --the model dtype (bitsandbytes casts it in forward, as in transformers)

These are the keys the layers' own state_dict() writes and transformers saves, so a quantized checkpoint
round-trips; `dequantize()` gives each layer's float weight.

Offers: BnbLinear4bit, BnbLinear8bitLt.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from torch import nn

_4BIT_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_4BIT_BLOBS = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


class BnbLinear4bit(bnb.nn.Linear4bit):
    """bitsandbytes' 4-bit Linear (nf4 / fp4) that quantizes its weight when the loader hands it over."""

    def __init__(self, in_features, out_features, bias, *, compute_dtype, compress_statistics, quant_type,
                 quant_storage, model_dtype):
        if quant_type not in ("nf4", "fp4"):
            raise ValueError(f'bnb_4bit_quant_type={quant_type!r} is not one of: "nf4", "fp4"')
        super().__init__(in_features, out_features, bias, compute_dtype, compress_statistics=compress_statistics,
                         quant_type=quant_type, quant_storage=quant_storage, device="meta")
        self.model_dtype = model_dtype
        self.requires_grad_(False)
        self._pending: dict[str, torch.Tensor] = {}  # pre-quantized pieces until the set is complete
        if out_features % 32 or in_features % self.weight.blocksize:
            # bitsandbytes' AVX512-BF16 CPU kernel needs these; its forward would crash repacking the weight
            # (transformers' layer does), so use the portable path instead.
            self.support_avx512bf16_for_cpu = False

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            _check_bias(self, tensor)
            self.bias = nn.Parameter(tensor.to(self.model_dtype), requires_grad=False)
        elif name == "weight" and tensor.is_floating_point() and tuple(tensor.shape) == self._shape():
            # Params4bit quantizes in .to(device): the tensor is already there, so this quantizes in place.
            self.weight = bnb.nn.Params4bit(
                tensor.to(self.model_dtype), requires_grad=False, blocksize=self.weight.blocksize,
                compress_statistics=self.weight.compress_statistics, quant_type=self.weight.quant_type,
                quant_storage=self.weight.quant_storage, module=self,
            ).to(tensor.device)
        elif name == "weight" and (tensor.dim() != 2 or tensor.shape[1] != 1):
            raise ValueError(f"weight of shape {list(tensor.shape)} is neither a float ({self.out_features}, "
                             f"{self.in_features}) weight nor a packed 4-bit one (n, 1); is config.json the one "
                             f"of these weights?")
        elif name == "weight" or name.removeprefix("weight.") in _4BIT_STATS + _4BIT_BLOBS:
            self._pending[name.removeprefix("weight.")] = tensor
            self._build_if_complete()
        else:
            pieces = tuple(f"weight.{k}" for k in _4BIT_STATS + _4BIT_BLOBS)
            raise _unexpected(self, name, ("weight", "bias") + pieces)

    def dequantize(self) -> torch.Tensor:
        """The weight, (out_features, in_features), in the compute dtype."""
        data, state = _unpacked(self.weight)
        return bnb.functional.dequantize_4bit(data, state).to(self.compute_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # bitsandbytes' own version undoes the CPU repacking in place, so that saving changes the layer's
        # outputs (and without double quantization leaves absmax transposed: see _unpacked()). This one writes
        # the portable layout and leaves the layer as it is.
        nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)  # weight, bias
        if self.weight.quant_state is None:
            return  # not loaded yet
        data, state = _unpacked(self.weight)
        if state is not self.weight.quant_state:
            destination[prefix + "weight"] = data
        for key, value in state.as_dict(packed=True).items():
            destination[f"{prefix}weight.{key}"] = value if keep_vars else value.detach()

    def _apply(self, fn, recurse=True):
        # Params4bit.to() moves a weight repacked for the CPU kernel (see _unpacked()) as it is; only its .cuda()
        # reads it back, so model.to("cuda") after a CPU eval forward would multiply by scrambled weights.
        # Back to the portable layout first (its own state_dict, reloaded); a later CPU forward repacks it.
        if getattr(self.weight.quant_state, "packing_format_for_cpu", False):
            for name, tensor in self.state_dict().items():
                if name != "bias":  # left as it is (prepare_model_for_kbit_training may have upcast it)
                    self.load_from_checkpoint(name, tensor)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, quant_type={self.weight.quant_type}, compute_dtype={self.compute_dtype}, "
                f"double_quant={self.weight.compress_statistics}, quant_storage={self.weight.quant_storage}")

    def _shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _build_if_complete(self) -> None:
        pending = self._pending
        blobs = [k for k in _4BIT_BLOBS if k in pending]
        if not blobs or not {"weight", "absmax", "quant_map"} <= pending.keys():
            return
        from bitsandbytes.utils import unpack_tensor_to_dict

        if "nested_blocksize" in unpack_tensor_to_dict(pending[blobs[0]]) and not {
                "nested_absmax", "nested_quant_map"} <= pending.keys():
            return  # double-quantized: the nested statistics are still to come
        data = pending.pop("weight")
        expected = (self.out_features * self.in_features + 1) // 2  # two 4-bit values per byte
        if data.numel() * data.element_size() != expected:
            raise ValueError(f"pre-quantized 4-bit weight holds {data.numel() * data.element_size()} bytes, but "
                             f"a ({self.out_features}, {self.in_features}) weight packs into {expected}; "
                             f"is config.json the one of these weights?")
        self.weight = bnb.nn.Params4bit.from_prequantized(data=data, quantized_stats=pending, requires_grad=False,
                                                          device=data.device, module=self)
        self._pending = {}


class BnbLinear8bitLt(bnb.nn.Linear8bitLt):
    """bitsandbytes' LLM.int8() Linear that quantizes its weight (int8, a float scale per row) as it loads."""

    def __init__(self, in_features, out_features, bias, *, has_fp16_weights, threshold, model_dtype):
        super().__init__(in_features, out_features, bias, has_fp16_weights=has_fp16_weights, threshold=threshold,
                         device="meta")
        self.model_dtype = model_dtype
        self.requires_grad_(False)
        self._pending: dict[str, torch.Tensor] = {}  # int8 weight and SCB until both are here

    def load_from_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            _check_bias(self, tensor)
            self.bias = nn.Parameter(tensor.to(self.model_dtype), requires_grad=False)
        elif name == "weight" and tuple(tensor.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {list(tensor.shape)} does not fit a ({self.out_features}, "
                             f"{self.in_features}) layer; is config.json the one of these weights?")
        elif name == "weight" and tensor.is_floating_point():
            self.weight = self._quantize(tensor.to(self.model_dtype))
        elif name in ("weight", "SCB"):
            self._pending[name] = tensor
            if self._pending.keys() == {"weight", "SCB"}:
                cb, scb = self._pending.pop("weight"), self._pending.pop("SCB")
                self.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
        elif name == "weight_format":
            # 0 is bitsandbytes' row-major layout, the only one it still reads (older ones were GPU-specific).
            layout = int(tensor.item())
            if layout != 0:
                raise ValueError(f"weight_format={layout} is an old bitsandbytes layout; only row-major (0) "
                                 f"checkpoints load: re-save it with a recent bitsandbytes")
        else:
            raise _unexpected(self, name, ("weight", "bias", "SCB", "weight_format"))

    def _quantize(self, weight: torch.Tensor):
        if self.state.has_fp16_weights:  # kept as is; bitsandbytes quantizes it in every forward
            return bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=True)
        # What Int8Params.to(device) does, but on the tensor's own device (no trip through the CPU).
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
        return bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)

    def dequantize(self) -> torch.Tensor:
        """The weight, (out_features, in_features), in the model dtype: int8 rows times SCB / 127."""
        if self.state.has_fp16_weights:
            return self.weight.data.to(self.model_dtype)
        # The first forward moves SCB from the weight to self.state.
        scb = self.weight.SCB if self.weight.SCB is not None else self.state.SCB
        return bnb.functional.int8_vectorwise_dequant(self.weight.data, scb).to(self.model_dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, threshold={self.state.threshold}, "
                f"has_fp16_weights={self.state.has_fp16_weights}")


def _unpacked(weight) -> tuple[torch.Tensor, object]:
    """(packed 4-bit data (n, 1), QuantState) in bitsandbytes' portable layout, leaving `weight` as it is.

    On CPUs with AVX512-BF16, bitsandbytes' forward repacks the weight for its CPU kernel (absmax becomes
    bfloat16, transposed to (in / blocksize, out)); its inverse leaves that absmax transposed when there is no
    double quantization, so we reshape it back here (else a state_dict saved after a forward would not load)."""
    state = weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False):
        return weight.data, state
    # Only bitsandbytes versions that repack (0.48 and later) have, and need, its inverse.
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    nested = state.original_nested
    data, state = _convert_weight_packed_for_cpu_inverse(weight.data, _shallow_copy(state))
    if not nested:
        state.absmax = state.absmax.T.reshape(-1).float()  # (in / blocksize, out) -> (out * in / blocksize,)
    return data, state


def _shallow_copy(state):
    """A QuantState copy whose fields can be reassigned without touching the original's."""
    copy = object.__new__(type(state))
    copy.__dict__.update(state.__dict__)
    return copy


def _check_bias(layer: nn.Module, tensor: torch.Tensor) -> None:
    if layer.bias is None:
        raise ValueError(f"the checkpoint has a bias for a {type(layer).__name__} built without one "
                         f"(in_features={layer.in_features}, out_features={layer.out_features})")
    if tuple(tensor.shape) != (layer.out_features,):
        raise ValueError(f"bias of shape {list(tensor.shape)} does not fit out_features={layer.out_features}")


def _unexpected(layer: nn.Module, name: str, expected) -> ValueError:
    return ValueError(f"{type(layer).__name__} got an unexpected checkpoint tensor {name!r}; it takes: "
                      f"{', '.join(expected)}. Is the checkpoint quantized with another method?")
