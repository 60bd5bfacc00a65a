"""Pre-quantized mixture-of-experts checkpoints: what loading them needs beyond the dense path.

The experts are per-expert nn.Linear layers (layers/moe.py: mlp.experts.{e}.gate_proj, ...), so each method swaps
them for its quantized layer as it swaps any Linear, and the per-expert keys of the Hub's checkpoints
(Qwen/Qwen3-30B-A3B-FP8, *-GPTQ-Int4, llm-compressor's w4a16 / FP8) load as a dense model's do. Two things are
MoE's own:

- The router (TopKRouter, mlp.gate / block_sparse_moe.gate) is no nn.Linear here nor in transformers 5, but it was
  one in the models the quantizers ran on (transformers 4, llm-compressor, gptqmodel): a checkpoint whose config
  does not leave it out (modules_to_not_convert, compressed-tensors' ignore) may store it quantized.
  `swap_routers` stands such a router in as the method's dequantizing layer, which takes whatever the checkpoint
  stores (quantized or, for FP8 / GPTQ / AWQ, a plain weight); `restore_routers` puts the loaded weight back
  into the router. A router the config leaves out loads as a plain weight; quantizing while loading (bitsandbytes,
  weight-only) leaves routers alone, as transformers does.
- transformers' fused FP8 experts (FP8Experts, what its save_pretrained(save_original_format=False) writes):

      mlp.experts.gate_up_proj            float8  (experts, 2 * intermediate, hidden)    gate rows, then up rows
      mlp.experts.gate_up_proj_scale_inv  float32 (experts, 2 * intermediate / bm, ceil(hidden / bn))
      mlp.experts.down_proj (+ _scale_inv)         (experts, hidden, intermediate)

  The model's checkpoint_fan_out cuts the weights into the per-expert Linears; `fused_fp8_scale_rules` cuts their
  scales the same way. That takes intermediate a multiple of bm (weight_block_size[0]; Qwen3-30B-A3B: 768 and
  128): otherwise one block of scales covers gate and up rows, which per-expert layers cannot hold, and the
  checkpoint tensor is refused by name.

Offers: swap_routers, restore_routers, fused_fp8_scale_rules, RefusedFanOut.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from gpuformers.layers.blocks import replace_submodule
from gpuformers.layers.moe import TopKRouter
from gpuformers.loading.fan_out import FanOut, Piece
from gpuformers.quantization.packed import PackedStandIn


def swap_routers(model: nn.Module, config, dtype: torch.dtype) -> list[str]:
    """Replace every router that pre-quantized `config` would quantize, were it an nn.Linear, with that method's
    dequantizing stand-in (model on the meta device); returns the names."""
    from gpuformers.quantization.compressed_tensors import CompressedLinear, CompressedTensorsConfig
    from gpuformers.quantization.config import FineGrainedFP8Config, is_skipped
    from gpuformers.quantization.fp8 import FP8DequantizingLinear
    from gpuformers.quantization.gptq_awq import AwqConfig, GPTQAwqLinear, GPTQConfig

    if isinstance(config, CompressedTensorsConfig):
        def make(name, linear):
            scheme = config.scheme_for(name, linear)
            if scheme is None or scheme.format == "dense":
                return None
            return CompressedLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, dtype,
                                    name, keep_packed=False)
    elif isinstance(config, (GPTQConfig, AwqConfig)):
        dequantizing = dataclasses.replace(config, dequantize=True)  # a router is a plain weight in the model

        def make(name, linear):
            if is_skipped(name, config.skip_modules):
                return None
            return GPTQAwqLinear(linear.in_features, linear.out_features, linear.bias is not None, dequantizing,
                                 dtype, name)
    elif isinstance(config, FineGrainedFP8Config):
        def make(name, linear):
            if is_skipped(name, config.skip_modules):
                return None
            return FP8DequantizingLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                         config.weight_block_size, dtype, name, device="meta")
    else:
        return []
    swapped = []
    for name, router in list(model.named_modules()):
        if not isinstance(router, TopKRouter):
            continue
        experts, hidden = router.weight.shape
        with torch.device("meta"):
            # the Linear the quantizer saw (GPT-OSS's router has a bias): compressed-tensors matches its "Linear"
            # targets on the class
            stand_in = make(name, nn.Linear(hidden, experts, bias=getattr(router, "bias", None) is not None))
        if stand_in is None:
            continue
        # Kept outside the module tree (not a child): neither loaded, sized by a device_map, nor saved.
        object.__setattr__(stand_in, "replaced_router", router)
        replace_submodule(model, name, stand_in)
        swapped.append(name)
    return swapped


def restore_routers(model: nn.Module) -> None:
    """After loading: put each router stand-in's dequantized weight back into the router it replaced."""
    for name, stand_in in list(model.named_modules()):
        router = stand_in.__dict__.get("replaced_router")
        if router is None:
            continue
        linear = stand_in.finish() if isinstance(stand_in, PackedStandIn) else stand_in  # FP8: already dequantized
        router.weight = nn.Parameter(linear.weight.detach())
        if linear.bias is not None:
            router.bias = nn.Parameter(linear.bias.detach())
        replace_submodule(model, name, router)


@dataclass
class RefusedFanOut(FanOut):
    """A fan-out rule whose source the model cannot take: a checkpoint holding it fails with `reason`."""

    reason: str = ""

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece] | None:
        if not self.matches(key):
            return None
        raise NotImplementedError(f"checkpoint tensor {key!r}: {self.reason}")


def fused_fp8_scale_rules(model: nn.Module, block_size: list[int] | None) -> tuple[FanOut, ...]:
    """For each of the model's checkpoint_fan_out rules that fills FP8 layers' weights, the rule that fills their
    weight_scale_inv from the fused tensor's scales (module doc), or refuses them when blocks of `block_size` rows
    would span two of its targets."""
    from gpuformers.quantization.fp8 import FP8DequantizingLinear, FP8Linear

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, (FP8DequantizingLinear, FP8Linear))]
    rules = []
    for rule in getattr(model, "checkpoint_fan_out", ()):
        filled = next((m for name, m in layers if rule.source_of(f"{name}.weight") is not None), None)
        if filled is None or not all(t.endswith(".weight") for t in rule.targets):
            continue
        # transformers names a Linear's scales weight_scale_inv, a fused parameter's {name}_scale_inv
        source = (rule.source.removesuffix("weight") + "weight_scale_inv" if rule.source.endswith(".weight")
                  else f"{rule.source}_scale_inv")
        targets = tuple(t.removesuffix("weight") + "weight_scale_inv" for t in rule.targets)
        rows = filled.out_features
        if len(targets) > 1 and block_size is not None and rows % block_size[0]:
            rules.append(RefusedFanOut(source, targets, reason=(
                f"the FP8 scales of transformers' fused experts, {len(targets)} projections of {rows} rows each "
                f"in blocks of weight_block_size[0]={block_size[0]} rows: {rows} is not a multiple of "
                f"{block_size[0]}, so a block of scales spans two projections, which gpuformers' per-expert "
                f"layers cannot hold. Quantize the experts with a block size that divides {rows}, or save the "
                f"model dequantized")))
        else:
            rules.append(FanOut(source, targets))
    return tuple(rules)
