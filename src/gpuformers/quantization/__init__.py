"""Quantized weights: bitsandbytes NF4 / FP4 / int8, gpuformers' own weight-only int8 / int4, and fine-grained FP8
checkpoints.

Offers: BitsAndBytesConfig, WeightOnlyConfig, FineGrainedFP8Config, quantization_config_from, quantize_linear_layers.
"""

from gpuformers.quantization.config import (
    BitsAndBytesConfig,
    FineGrainedFP8Config,
    WeightOnlyConfig,
    quantization_config_from,
    quantize_linear_layers,
)

__all__ = ["BitsAndBytesConfig", "WeightOnlyConfig", "FineGrainedFP8Config", "quantization_config_from",
           "quantize_linear_layers"]
