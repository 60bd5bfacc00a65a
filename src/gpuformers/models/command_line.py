"""What every command-line verb that loads a model shares (`gpuformers generate`, `chat`, `serve`, the embedding
server): the --quantization flag and the config it means, and loading a model (a Hub id, a folder, a .gguf file, or
the embedded default) with its tokenizer.

Offers: load_model_and_tokenizer, add_quantization_argument, quantization_config_for, QUANTIZATION_CHOICES.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gpuformers.default_model import default_gguf_path
from gpuformers.models.auto import AutoModelForCausalLM, AutoTokenizer
from gpuformers.quantization.config import BitsAndBytesConfig, WeightOnlyConfig

QUANTIZATION_CHOICES = ("bnb-4bit", "bnb-8bit", "int8", "int4")


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="quantize the linear layers while loading: bnb-4bit (NF4) / bnb-8bit (bitsandbytes), "
                             "int8 / int4 (weight-only; int4 in groups of 128 columns, or 64 / 32 where 128 does not "
                             "fit); default: none")


def quantization_config_for(choice: str | None, dtype: str, device: str):
    """A --quantization choice -> the config from_pretrained takes (None for none)."""
    if choice is None:
        return None
    if choice == "int8":
        return WeightOnlyConfig(bits=8)
    if choice == "int4":
        return WeightOnlyConfig(bits=4)
    if choice == "bnb-8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    # NF4 computing in the model's dtype (bfloat16 on a GPU when --dtype is auto), not bitsandbytes' float32 default
    compute = dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)


def load_model_and_tokenizer(model: str | None, dtype: str = "auto", device: str | None = None,
                             quantization: str | None = None, tensor_parallel: bool = False):
    """(model, tokenizer) from a Hub id, folder or .gguf path (None: the embedded default). tensor_parallel: this
    process's slices of a model split over the torchrun processes (tp_plan="auto"; each on its own device)."""
    if tensor_parallel and device is not None:
        raise ValueError(f"--device {device} with tensor parallelism: each process computes on its own GPU "
                         "(cuda:LOCAL_RANK), or on the CPU where none is visible; drop --device")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None:
        model = str(default_gguf_path())
    path = Path(model)
    if path.suffix == ".gguf":
        folder, kwargs = path.parent, {"gguf_file": path.name}
    else:
        folder, kwargs = model, {}
    config = quantization_config_for(quantization, dtype, device)
    if config is not None:
        kwargs["quantization_config"] = config
    placement = {"tp_plan": "auto"} if tensor_parallel else {"device_map": device}
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **placement, **kwargs)
    kwargs.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    return lm, tokenizer
