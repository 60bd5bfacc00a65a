"""bitsandbytes quantization while the checkpoint streams in: 4-bit (nf4 / fp4, QLoRA) and 8-bit (LLM.int8()).

`bnb_linear(linear, config, dtype)` turns an `nn.Linear` of a model built on the meta device into a meta-device
`BnbLinear4bit` (a `bitsandbytes.nn.Linear4bit`) or `BnbLinear8bitLt` (a `bitsandbytes.nn.Linear8bitLt`), set up
as transformers' `replace_with_bnb_linear` sets them up; the loader (loading/weights.py) then hands each layer its
checkpoint tensors through `load_from_checkpoint(name, tensor)`. The layers themselves, and the checkpoint keys they
read and write, are in bnb_layers.py, which needs bitsandbytes: it is imported only when a layer is made (bitsandbytes
is an optional dependency, and takes seconds to import).

Offers: bnb_linear, INSTALL_HINT, BnbLinear4bit, BnbLinear8bitLt (bnb_layers.py's, imported on first use).
"""

from __future__ import annotations

import torch
from torch import nn

INSTALL_HINT = "pip install bitsandbytes (or pip install gpuformers[quant])"


def bnb_linear(linear: nn.Linear, config, dtype: torch.dtype) -> nn.Module:
    """A meta-device bitsandbytes layer that replaces `linear` and quantizes its weight as it is loaded.

    config: a BitsAndBytesConfig (quantization/config.py: exactly one of 4 and 8 bits, dtypes already resolved, a
    missing compute dtype made float32 as transformers does); dtype: the model's dtype (what the checkpoint's float
    tensors are cast to before quantizing, and the bias's dtype).
    """
    layers = _layers()
    bias = linear.bias is not None
    if config.load_in_4bit:
        return layers.BnbLinear4bit(
            linear.in_features,
            linear.out_features,
            bias,
            compute_dtype=config.bnb_4bit_compute_dtype,
            compress_statistics=bool(config.bnb_4bit_use_double_quant),
            quant_type=config.bnb_4bit_quant_type,
            quant_storage=config.bnb_4bit_quant_storage,
            model_dtype=dtype,
        )
    return layers.BnbLinear8bitLt(
        linear.in_features,
        linear.out_features,
        bias,
        has_fp16_weights=bool(config.llm_int8_has_fp16_weight),
        threshold=float(config.llm_int8_threshold),
        model_dtype=dtype,
    )


def __getattr__(name: str):
    # The classes subclass bitsandbytes', so they exist only once bitsandbytes is imported.
    if name in ("BnbLinear4bit", "BnbLinear8bitLt"):
        return getattr(_layers(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layers():
    """The bnb_layers module, bitsandbytes checked for first (every time: an imported module must not hide that the
    package has gone)."""
    _import_bitsandbytes()
    # Late: bnb_layers imports bitsandbytes, an optional dependency (and seconds to import).
    from gpuformers.quantization import bnb_layers

    return bnb_layers


def _import_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(f"bitsandbytes quantization needs the bitsandbytes package: {INSTALL_HINT}") from err
    return bitsandbytes

