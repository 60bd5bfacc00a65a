"""A LoRA model's adapter tensors as peft saves them: get_peft_model_state_dict gives them under peft's keys
(`base_model.model.<module>.lora_A.weight`, the modules_to_save copies under their modules' names, the embeddings
with save_embedding_layers, a family's checkpoint module names), set_peft_model_state_dict copies such a state back
with every key and shape checked, and read_adapter_weights reads an adapter folder's file (safetensors, or a legacy
adapter_model.bin with weights_only=True).

Offers: get_peft_model_state_dict, set_peft_model_state_dict, read_adapter_weights, PEFT_KEY_PREFIX.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpuformers.lora.config import (ALL_LINEAR, EMBEDDING_LAYER_NAMES, LEGACY_WEIGHTS_NAME, LORA_PARTS, WEIGHTS_NAME,
                                    LoraConfig)
from gpuformers.lora.embedding import TiedLoraLinear
from gpuformers.lora.lora_model import trained_bias_names
from gpuformers.lora.modules_to_save import ModulesToSaveWrapper

if TYPE_CHECKING:
    from gpuformers.lora.peft_model import PeftModel

PEFT_KEY_PREFIX = "base_model.model."  # a PeftModel's parameter names: the wrapped model's, under this


def get_peft_model_state_dict(model: PeftModel, state_dict: dict | None = None,
                              save_embedding_layers: bool | str = "auto") -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys peft saves (taken from `state_dict` when given, a state dict of the
    whole PeftModel):

        base_model.model.<module>.lora_A.weight, ...lora_B.weight      each LoRA layer (an LM head tied to a LoRA
                                                                       embedding: the embedding's B^T and A^T)
        base_model.model.<embedding>.lora_embedding_A, ..._B           each embedding LoRA layer
        base_model.model.<module>.bias, <target>.base_layer.bias       the biases bias="all" / "lora_only" trains
        base_model.model.<module>.weight (and .bias, ...)             each modules_to_save copy, under the
                                                                       module's own name, as peft saves it
        base_model.model.<embedding module>.<its state>                the input and output embeddings whole,
                                                                       with save_embedding_layers

    save_embedding_layers, peft's rule: True adds the embeddings, False does not, "auto" adds them when
    target_modules names an embedding layer, or when the model's vocab_size differs from its base checkpoint's
    (the tokens were resized; the base is read from base_model_name_or_path, a folder or the local HF cache)."""
    state = model.state_dict() if state_dict is None else state_dict
    adapter = {k: v for k, v in state.items() if any(p in k for p in LORA_PARTS)}
    for head_key, embedding_key in _tied_head_keys(model).items():
        adapter[head_key] = adapter[embedding_key].T.contiguous()
    config = _active_config(model)
    if config is not None:
        adapter.update({k: state[k] for k in trained_bias_names(model, config.bias) if k in state})
        if config.bias == "all":
            adapter.update({k: state[k] for k in _wrapper_bias_keys(state)})
    for name, wrapper in model.named_modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            copy_prefix = f"{name}.modules_to_save."
            adapter.update({f"{name}.{k.removeprefix(copy_prefix)}": v for k, v in state.items()
                            if k.startswith(copy_prefix)})
    targeted = _embedding_is_targeted(model)
    if _saves_embedding_layers(model, save_embedding_layers, targeted):
        prefixes = tuple(f"{name}." for name in _embedding_layer_names(model, targeted))
        adapter.update({k: v for k, v in state.items() if prefixes and k.startswith(prefixes)})
    return _checkpoint_keys(model, adapter)


def _wrapper_bias_keys(state: dict[str, torch.Tensor]) -> list[str]:
    """The biases inside modules_to_save wrappers (`<module>.original_module.bias`, `<module>.modules_to_save.bias`):
    peft's bias="all" saves every parameter named bias, these too, beside the copy's own `<module>.bias`."""
    return [k for k in state if k.endswith((".original_module.bias", ".modules_to_save.bias"))]


def _checkpoint_keys(model: nn.Module, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's keys under the module names of the model's checkpoints, for a family whose modules are named
    otherwise here (its `checkpoint_key`, e.g. GPT-NeoX's model.layers.0.self_attn -> gpt_neox.layers.0.attention):
    what peft saves over transformers' model, and reads back."""
    from gpuformers.lora.peft_model import PeftModel  # here: peft_model.py builds on this module

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    rename = getattr(base, "checkpoint_key", None)
    if rename is None:
        return adapter
    prefix = PEFT_KEY_PREFIX if isinstance(model, PeftModel) else ""
    return {prefix + rename(k.removeprefix(prefix)): v for k, v in adapter.items()}


def set_peft_model_state_dict(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (peft's saved keys) into the model's LoRA layers and modules_to_save copies; every
    such key must match exactly. Embedding weights saved with save_embedding_layers go into the model's
    embeddings, as peft loads them."""
    own = get_peft_model_state_dict(model, save_embedding_layers=False)
    # the wrappers' inner biases (bias="all") repeat the copy's and the frozen original's: files written before we
    # saved them as peft does may lack them
    optional = set(_wrapper_bias_keys(own))
    missing = sorted(set(own) - set(state) - optional)
    extra = sorted(set(state) - set(own))
    embeddings = _embedding_layer_state(model) if extra else {}
    unexpected = [k for k in extra if k not in embeddings]
    if missing or unexpected:
        raise ValueError(f"the adapter weights do not match this model's LoRA layers: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]} ({len(missing)} and {len(unexpected)} in all); load the "
                         f"adapter onto the base model it was trained on")
    targets = {**embeddings, **own}
    for key, tensor in state.items():
        if tensor.shape != targets[key].shape:
            resized = "" if ".lora_" in key else (f"; if it was trained after resizing the token embeddings, resize "
                                                  f"the model's to {tensor.shape[0]} tokens first")
            raise ValueError(f"adapter weight {key} has shape {tuple(tensor.shape)}, the model's "
                             f"{tuple(targets[key].shape)}; load the adapter onto the base model it was trained on"
                             f"{resized}")
    for head_key, embedding_key in _tied_head_keys(model).items():  # one pair here: the file's two must agree
        if not torch.equal(state[head_key], state[embedding_key].T):
            raise ValueError(f"adapter weight {head_key} is not {embedding_key} transposed, though "
                             f"ensure_weight_tying ties the LM head's LoRA to the embedding's: they were trained "
                             f"apart (peft does so over a float16 / bfloat16 base); load the adapter with config= a "
                             f"LoraConfig with ensure_weight_tying=False and the head in target_modules")
    with torch.no_grad():
        for key in extra:  # first: a copy's own key wins over the embedding state peft saves beside it
            embeddings[key].copy_(state[key])
        for key in own.keys() & state.keys():
            own[key].copy_(state[key])


def _tied_head_keys(model: nn.Module) -> dict[str, str]:
    """{saved key of a tied head's tensor: key of the embedding tensor it is the transpose of}: peft's head lora_A
    is lora_embedding_B^T and its lora_B is lora_embedding_A^T."""
    names = {id(m): n for n, m in model.named_modules()}
    keys = {}
    for name, head in model.named_modules():
        if isinstance(head, TiedLoraLinear):
            embedding = names[id(head.embedding)]
            keys[f"{name}.lora_A.weight"] = f"{embedding}.lora_embedding_B"
            keys[f"{name}.lora_B.weight"] = f"{embedding}.lora_embedding_A"
    return keys


def _active_config(model: nn.Module) -> LoraConfig | None:
    """The LoraConfig of the adapter whose layers are in the model: a PeftModel's active adapter's (the others are
    parked), the same for a model holding its adapters itself (integration.py's, through the PeftModel it keeps),
    else the model's only one."""
    from gpuformers.lora.integration import held_peft_model
    from gpuformers.lora.peft_model import PeftModel  # here: peft_model.py builds on this module

    if not isinstance(model, PeftModel):
        model = held_peft_model(model) or model
    if isinstance(model, PeftModel):
        return model.base_model.peft_config[model.active_adapter]  # its LoraModel's: set before it is registered
    configs = getattr(model, "peft_config", None)
    return next(iter(configs.values())) if isinstance(configs, dict) and len(configs) == 1 else None


def _embedding_is_targeted(model: nn.Module) -> bool:
    """peft's test (get_peft_model_state_dict): target_modules names an embedding layer."""
    config = _active_config(model)
    targets = config.target_modules if config is not None else None
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return any(re.fullmatch(targets, n) for n, _ in base.named_modules()
                   if any(re.match(rf"(.*\.)?{e}$", n) for e in EMBEDDING_LAYER_NAMES))
    return any(e in (targets or []) for e in EMBEDDING_LAYER_NAMES)


def _embedding_layer_names(model: nn.Module, targeted: bool) -> list[str]:
    """Full names of the modules whose state peft saves for the input and output embeddings
    (get_embedding_layer_name): each module (a modules_to_save wrapper whole, original and copy); when an
    embedding layer is a LoRA target, only the LoRA layers' base_layer."""
    names = []
    for getter in (getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)):
        layer = getter() if callable(getter) else None
        if layer is not None and targeted:
            layer = getattr(layer, "base_layer", None)
            layer = layer if isinstance(layer, (nn.Linear, nn.Embedding)) else None
        if layer is not None:
            names += [n for n, m in model.named_modules() if m is layer][:1]
    return names


def _embedding_layer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under every name peft may save embedding weights under."""
    prefixes = tuple(f"{n}." for n in _embedding_layer_names(model, False) + _embedding_layer_names(model, True))
    return {k: v for k, v in model.state_dict().items() if prefixes and k.startswith(prefixes)}


def _saves_embedding_layers(model: nn.Module, save_embedding_layers: bool | str, targeted: bool) -> bool:
    if save_embedding_layers != "auto":
        return bool(save_embedding_layers)
    if targeted:
        warnings.warn("Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`.")
        return True
    config = _active_config(model)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    base_vocab_size = _base_vocab_size(config.base_model_name_or_path) if config is not None and vocab_size else None
    if base_vocab_size and vocab_size != base_vocab_size:
        warnings.warn("Setting `save_embedding_layers` to `True` as the embedding layer has been resized during "
                      "finetuning.")
        return True
    return False


def _base_vocab_size(name_or_path: str | None) -> int | None:
    """vocab_size in the base checkpoint's config.json: a folder, or a Hub id already in the local cache (no
    download: peft asks the Hub, but a base that is not at hand is taken as unchanged, as peft takes one it
    cannot reach)."""
    if not name_or_path:
        return None
    from gpuformers.hub import HubKwargs, resolve_model_dir

    try:
        path = resolve_model_dir(name_or_path, ["config.json"], HubKwargs(local_files_only=True)) / "config.json"
        return json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError, ImportError):
        return None


def read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from gpuformers.loading.safetensors import SafetensorsFile

    if (folder / WEIGHTS_NAME).is_file():
        with SafetensorsFile(folder / WEIGHTS_NAME) as f:
            return {name: f.read(name) for name in f.keys()}
    if (folder / LEGACY_WEIGHTS_NAME).is_file():
        return torch.load(folder / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder}: pass the folder an adapter was saved to")
