"""Quantized weights: bitsandbytes NF4 / FP4 / int8, gpuformers' own weight-only int8 / int4, fine-grained FP8
checkpoints, compressed-tensors (llm-compressor) checkpoints, and GPTQ / AWQ checkpoints.

Offers: BitsAndBytesConfig, WeightOnlyConfig, FineGrainedFP8Config, CompressedTensorsConfig, GPTQConfig, AwqConfig,
quantization_config_from, quantize_linear_layers.
"""

from gpuformers.quantization.config import (
    AwqConfig,
    BitsAndBytesConfig,
    CompressedTensorsConfig,
    FineGrainedFP8Config,
    GPTQConfig,
    WeightOnlyConfig,
    quantization_config_from,
    quantize_linear_layers,
)

__all__ = ["BitsAndBytesConfig", "WeightOnlyConfig", "FineGrainedFP8Config", "CompressedTensorsConfig", "GPTQConfig",
           "AwqConfig", "quantization_config_from", "quantize_linear_layers"]
