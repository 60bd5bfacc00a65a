"""Quantized weights: bitsandbytes NF4 / FP4 / int8 and gpuformers' own weight-only int8 / int4.

Offers: BitsAndBytesConfig, WeightOnlyConfig, quantization_config_from, quantize_linear_layers.
"""

from gpuformers.quantization.config import (
    BitsAndBytesConfig,
    WeightOnlyConfig,
    quantization_config_from,
    quantize_linear_layers,
)

__all__ = ["BitsAndBytesConfig", "WeightOnlyConfig", "quantization_config_from", "quantize_linear_layers"]
