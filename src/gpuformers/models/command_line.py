"""What every command-line verb that loads a model shares (`gpuformers generate`, `chat`, `serve`, the embedding
server, `train`): the --quantization flag and the config it means, the backend and kernel flags
(--attn-implementation, --use-kernels, --kernel-config, --allow-all-kernels) and the from_pretrained keywords they
mean, and loading a model (a Hub id, a folder, a .gguf file, or the embedded default) with its tokenizer.

Offers: load_model_and_tokenizer, add_quantization_argument, quantization_config_for, QUANTIZATION_CHOICES,
add_kernel_arguments, kernel_options.
"""

from __future__ import annotations

import argparse
import json
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


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """The attention backend and kernel flags, the same for every verb (their from_pretrained keywords: kernel_options)."""
    parser.add_argument("--attn-implementation", default=None, metavar="NAME",
                        help="attention backend: sdpa (the default), eager, triton, flex_attention, "
                             "flash_attention_2, flash_attention_3, flash_attention_4, or a Hub kernel 'org/repo' "
                             "(the kernels package). Served generation attends through the engine's paged kernels; "
                             "the name applies outside engine steps")
    parser.add_argument("--use-kernels", action="store_true",
                        help="swap in the fused Triton kernels (RMSNorm, SwiGLU, rotary, MoE experts, losses); on a "
                             "CPU only under TRITON_INTERPRET=1")
    parser.add_argument("--kernel-config", default=None, metavar="JSON",
                        help='kernels per layer, transformers\' KernelConfig mapping as JSON, e.g. '
                             '\'{"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm", "SwiGLUMLP": "torch"}\' '
                             'or \'{"kernel_mapping": {...}, "use_local_kernel": true}\'; implies --use-kernels')
    parser.add_argument("--allow-all-kernels", action="store_true",
                        help="trust a Hub attention kernel outside kernels-community (--attn-implementation "
                             "org/repo): loading it runs its code")


def kernel_options(args: argparse.Namespace) -> dict:
    """--attn-implementation / --use-kernels / --kernel-config / --allow-all-kernels as from_pretrained keywords,
    checked before any weight is read (an unknown backend name or a bad mapping fails at once)."""
    from gpuformers.kernels.mapping import KernelConfig
    from gpuformers.layers.attention import AttentionInterface

    options = {}
    name = getattr(args, "attn_implementation", None)
    if name:
        if "/" not in name:  # a Hub kernel is loaded (and trusted or refused) with the model
            AttentionInterface.get(name)
        options["attn_implementation"] = name
    if getattr(args, "allow_all_kernels", False):
        options["allow_all_kernels"] = True
    text = getattr(args, "kernel_config", None)
    if text is not None:
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kernel-config is not JSON ({error}): give a mapping such as "
                             f"'{{\"RMSNorm\": \"triton\", \"SwiGLUMLP\": \"torch\"}}'") from None
        if not isinstance(mapping, dict):
            raise ValueError(f"--kernel-config must be a JSON object of layer name -> kernel, got {text!r}")
        if "kernel_mapping" in mapping:  # the KernelConfig's own fields
            unknown = set(mapping) - {"kernel_mapping", "use_local_kernel"}
            if unknown:
                raise ValueError(f"--kernel-config: unknown keys {sorted(unknown)} beside kernel_mapping (known: "
                                 f"kernel_mapping, use_local_kernel)")
            config = KernelConfig(mapping["kernel_mapping"], use_local_kernel=bool(mapping.get("use_local_kernel")))
        else:
            config = KernelConfig(mapping)
        options.update(use_kernels=True, kernel_config=config)
    elif getattr(args, "use_kernels", False):
        options["use_kernels"] = True
    return options


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
                             quantization: str | None = None, tensor_parallel: bool = False,
                             kernels: dict | None = None):
    """(model, tokenizer) from a Hub id, folder or .gguf path (None: the embedded default). tensor_parallel: this
    process's slices of a model split over the torchrun processes (tp_plan="auto"; each on its own device).
    kernels: from_pretrained's backend and kernel keywords (kernel_options)."""
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
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **placement, **kwargs, **(kernels or {}))
    kwargs.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    return lm, tokenizer
