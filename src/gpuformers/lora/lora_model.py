"""LoraModel, peft's tuner: it puts LoRA layers (layers.py's LoraLinear, dora.py's DoraLinear, embedding.py's
LoraEmbedding and TiedLoraLinear) and, for modules_to_save, modules_to_save.py's ModulesToSaveWrapper in place of a
model's layers, chosen by the LoraConfig's target_modules as peft chooses them; park() / reinstall() take them out
and put the same layers back (how several adapters share one model, multi_adapter.py), _restore() takes them out
for good, merged or not. bias="all" / "lora_only" train every bias of the model / of the LoRA targets in place, as
peft does.

Offers: LoraModel, trained_bias_names.
"""

from __future__ import annotations

import itertools
import re
import sys
import warnings

import torch
from torch import nn

from gpuformers.device import is_offloaded, mapped_devices
from gpuformers.lora.config import ALL_LINEAR, CLASSIFIER_MODULES, DEFAULT_TARGET_MODULES, LORA_PARTS, LoraConfig
from gpuformers.lora.dora import DoraLinear
from gpuformers.lora.embedding import LoraEmbedding, TiedLoraLinear
from gpuformers.layers.blocks import replace_submodule
from gpuformers.layers.linear import is_fan_in_fan_out
from gpuformers.lora.layers import LoraLayer, LoraLinear, quantized_linear_types
from gpuformers.lora.modules_to_save import (ModulesToSaveWrapper, check_tied_modules, find_modules_to_save,
                                           in_modules_to_save, peft_names)


class LoraModel(nn.Module):
    """peft's tuner layer: holds the user's model as `.model` and swaps its target layers for LoraLinear and its
    modules_to_save for ModulesToSaveWrapper."""

    def __init__(self, model: nn.Module, config: LoraConfig, adapter_name: str = "default",
                 autocast_adapter_dtype: bool = True, strict: bool = True):
        super().__init__()
        if any(isinstance(m, (LoraLayer, ModulesToSaveWrapper)) for m in model.modules()):
            raise ValueError("this model already has LoRA layers; call merge_and_unload() or unload() on its "
                             "PeftModel first, or pass the model without adapters")
        self.model = model
        self.peft_config = {adapter_name: config}
        self.active_adapter = adapter_name
        _check_placement(model)
        config.modules_to_save = list(config.modules_to_save) if config.modules_to_save is not None else None
        # may add the embedding to config.modules_to_save or config.target_modules
        modules_to_tie, targets_to_tie = check_tied_modules(model, config)
        heads_to_tie = [n for n, _ in model.named_modules() if n and _is_tied_target(n, targets_to_tie)]
        names = [n for n in _find_targets(model, config, strict) if n not in heads_to_tie]
        # SEQ_CLS: peft's classifier names, of which a model has one or none (PeftModel added them)
        optional = CLASSIFIER_MODULES if config.task_type == "SEQ_CLS" else ()
        to_save = find_modules_to_save(model, config.modules_to_save or [], names, strict, optional)
        to_tie = find_modules_to_save(model, modules_to_tie, names, strict) if modules_to_tie else []
        supported = (nn.Linear, nn.Embedding, *quantized_linear_types())
        for name in names + heads_to_tie:  # all checked before the first is replaced: an error leaves the model as is
            module = model.get_submodule(name)
            if type(module) not in supported and not is_fan_in_fan_out(module):
                raise NotImplementedError(
                    f"LoRA on {name} ({type(module).__name__}) is not supported: gpuformers wraps torch.nn.Linear "
                    f"(and Conv1D-style layers such as GPT-2's), for QLoRA its own quantized linear layers "
                    f"(bitsandbytes 4-bit / 8-bit as loaded with quantization_config, WeightOnlyLinear), and "
                    f"nn.Embedding only; choose target_modules among the model's linear and embedding layers")
            if config.use_dora and type(module) is nn.Embedding:
                raise NotImplementedError(
                    f"LoRA on {name} (Embedding) is not supported with DoRA (use_dora=True): gpuformers' DoRA wraps "
                    f"torch.nn.Linear layers only; leave the embedding out of target_modules, or use plain LoRA")
            if config.use_dora and type(module) is not nn.Linear:
                raise NotImplementedError(
                    f"DoRA (use_dora=True) on {name} ({type(module).__name__}) is not supported: gpuformers' DoRA "
                    f"wraps unquantized torch.nn.Linear layers only; load the model without quantization_config, "
                    f"or use plain LoRA (use_dora=False)")
        for name in names:
            module = model.get_submodule(name)
            layer_class = (LoraEmbedding if type(module) is nn.Embedding else DoraLinear if config.use_dora
                           else LoraLinear)
            replace_submodule(model, name, layer_class(module, _config_for(model, config, name), autocast_adapter_dtype))
        for name in heads_to_tie:  # after the embedding's LoRA layer, whose tensors the tied heads use
            replace_submodule(model, name, TiedLoraLinear(model.get_submodule(name), model.get_input_embeddings(), config))
        for name in to_save:
            replace_submodule(model, name, ModulesToSaveWrapper(model.get_submodule(name)))
        if to_tie:  # after the embedding's wrapper: the tied modules share its copy's weight
            embedding_copy = model.get_input_embeddings().modules_to_save
            for name in to_tie:
                replace_submodule(model, name, ModulesToSaveWrapper(model.get_submodule(name), tied_to=embedding_copy))
        # Only the adapters, the modules_to_save copies and the biases `bias` names train; the rest of the base stays
        # bit-identical.
        trainable_parts = (*LORA_PARTS, ".modules_to_save.")
        biases = set(trained_bias_names(model, config.bias))
        for param_name, param in model.named_parameters():
            trained = any(p in f".{param_name}" for p in trainable_parts) or param_name in biases
            param.requires_grad_(not config.inference_mode and trained)
        self._unpack_hooks = [] if config.inference_mode else _unpack_4bit_weights_for_backward(model)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":  # not set yet: __init__ is still running, or the object is being unpickled
                raise
            return getattr(self.model, name)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def lora_layers(self) -> list[tuple[str, LoraLayer]]:
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoraLayer)]

    def modules_to_save_wrappers(self) -> list[tuple[str, ModulesToSaveWrapper]]:
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, ModulesToSaveWrapper)]

    def park(self) -> None:
        """Take the adapter out of the model but keep its layers (their tensors, trained or not), so that
        reinstall() puts the same layers back: how a model holding several adapters runs one at a time."""
        self._parked = [(n, m) for n, m in self.model.named_modules()
                        if isinstance(m, (LoraLayer, ModulesToSaveWrapper))]
        self._restore(merge=False, keep_trained_copies=False)

    def reinstall(self) -> None:
        """Put the layers park() took out back in the model (their adapter tensors moved to where the base layer
        now is, should the model have moved meanwhile)."""
        for name, module in self._parked:
            lora = isinstance(module, LoraLayer)
            base = module.base_layer if lora else module.original_module
            # buffers too: a WeightOnlyLinear without bias keeps its weight (qweight) in a buffer, no parameter
            device = next(itertools.chain(base.parameters(), base.buffers())).device
            for part in module.adapter_parameters() if lora else module.modules_to_save.parameters():
                if part.device != device:
                    part.data = part.data.to(device)
            replace_submodule(self.model, name, module)
        self._parked = []
        inference_mode = self.peft_config[self.active_adapter].inference_mode
        self._unpack_hooks = [] if inference_mode else _unpack_4bit_weights_for_backward(self.model)

    def _restore(self, merge: bool, safe_merge: bool = False, keep_trained_copies: bool = True) -> nn.Module:
        """Take the adapters out of the model and return it: LoRA layers merged into their base (merge) or dropped;
        a modules_to_save wrapper leaves its trained copy in the model with or without merge, as peft's does
        (keep_trained_copies=False puts the untouched originals back: a failed load undone)."""
        if merge:
            # A weight shared with a TiedLoraLinear head is merged once, for both, by the embedding's LoRA layer.
            shared = _shared_parameter_ids(self.model) - {id(layer.base_layer.weight) for _, layer in self.lora_layers()
                                                          if isinstance(layer, TiedLoraLinear)}
            for name, layer in self.lora_layers():
                if id(getattr(layer.base_layer, "weight", None)) in shared:
                    raise ValueError(f"{name}.weight is tied to another weight (tie_word_embeddings), so merging "
                                     f"its LoRA would change both; untie the weights first, call unload() and "
                                     f"keep the adapter separate, or train with ensure_weight_tying=True")
        for hook in self._unpack_hooks:
            hook.remove()
        for name, layer in self.lora_layers():
            if merge:
                layer.merge(safe_merge)
            replace_submodule(self.model, name, layer.base_layer)
        wrappers = self.modules_to_save_wrappers()
        for name, wrapper in wrappers:
            replace_submodule(self.model, name, wrapper.modules_to_save if keep_trained_copies else wrapper.original_module)
        if wrappers and keep_trained_copies:
            _untie_config_if_diverged(self.model)
        return self.model


def trained_bias_names(model: nn.Module, bias: str) -> list[str]:
    """The parameter names (in `model`) of the biases LoraConfig.bias trains, by peft's rule: "all" every parameter
    named `bias` (a modules_to_save wrapper's are its copy's: trained and saved as the copy), "lora_only" the LoRA
    targets' (`...base_layer.bias`), "none" none. They train in place and are saved under their own names."""
    if bias == "all":
        return [n for n, _ in model.named_parameters() if n.rpartition(".")[2] == "bias"
                and ".original_module." not in f".{n}" and ".modules_to_save." not in f".{n}"]
    if bias == "lora_only":
        return [f"{n}.base_layer.bias" for n, m in model.named_modules()
                if isinstance(m, LoraLayer) and getattr(m.base_layer, "bias", None) is not None]
    return []


def _is_tied_target(name: str, tied: list[str]) -> bool:
    """peft's _check_tied_module_exists: the module is one of the heads tied to the LoRA embedding."""
    return any(name == t or name.endswith("." + t) for t in tied)


def _untie_config_if_diverged(model: nn.Module) -> None:
    """peft's check after merging: separate trained copies of a tied embedding and LM head are no longer one
    tensor, so the config must stop saying so (tie_word_embeddings=True would make save_pretrained store one
    of them and a reload tie the other to it). peft checks this on merge_and_unload only; on unload the copies
    have diverged just the same, so we check it there too."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    head, embedding = _output_head(model), model.get_input_embeddings()
    if head is not None and head.weight is not embedding.weight:
        config.tie_word_embeddings = False
        warnings.warn("Input and output embeddings are no longer tied: their modules_to_save copies were trained "
                      "apart. Setting `tie_word_embeddings=False` in the model config (ensure_weight_tying=True in "
                      "the LoraConfig keeps them one tensor).")


def _unpack_4bit_weights_for_backward(model: nn.Module) -> list:
    """Make the model's 4-bit layers pass gradients to their inputs while adapters train; returns the hooks.

    On CPUs with AVX512-BF16, bitsandbytes (0.48 to 0.50 at least) repacks a 4-bit weight for a faster kernel at an
    eval-mode forward without grad, and keeps using that kernel, training forwards included. The kernel has no
    backward: no gradient reaches the layer's input (adapters below it learn nothing, silently), and a layer with a
    bias fails. The hook reads a repacked weight back to the portable layout (the layer's own state_dict, reloaded)
    before a forward whose input needs a gradient; evaluation repacks it as before, so outputs stay bitsandbytes'."""
    if "bitsandbytes" not in sys.modules:
        return []
    from gpuformers.quantization.bnb_layers import BnbLinear4bit

    return [m.register_forward_pre_hook(_unpack_if_grad_needed) for m in model.modules()
            if isinstance(m, BnbLinear4bit)]


def _unpack_if_grad_needed(module: nn.Module, args: tuple) -> None:
    if not (torch.is_grad_enabled() and args[0].requires_grad):
        return
    if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
        for name, tensor in module.state_dict().items():
            if name != "bias":  # left as it is (prepare_model_for_kbit_training may have upcast it)
                module.load_from_checkpoint(name, tensor)


def _check_placement(model: nn.Module) -> None:
    # device_map's hooks stream an offloaded layer's weights in for its forward, and only the weights they saw at
    # dispatch: adapters added afterwards would stay behind on the CPU (or the meta device, for "disk").
    if is_offloaded(model):
        offloaded = sorted(mapped_devices(model) & {"cpu", "disk"})
        raise NotImplementedError(f"LoRA on a model with offloaded layers (device_map places some on "
                                  f"{', '.join(offloaded)}) is not supported yet; load the "
                                  f"model on GPUs only, or on the CPU only")


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    seen, shared = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if head is not None else getattr(model, "lm_head", None)


def _config_for(model: nn.Module, config: LoraConfig, name: str) -> LoraConfig:
    """config.for_module for layer `name`: the rank and alpha patterns are matched against its transformers name
    first, then ours (peft_names)."""
    aliases = peft_names(model, name)
    default = (config.r, config.lora_alpha)
    return config.for_module(next((a for a in aliases if config.rank_and_alpha(a) != default), aliases[0]))


def _is_linear(module: nn.Module) -> bool:
    """A layer "all-linear" selects: an nn.Linear (bitsandbytes' layers are subclasses), a WeightOnlyLinear, or a
    Conv1D-style layer (GPT-2's, weight stored (in, out): `fan_in_fan_out`), as peft selects Conv1D."""
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    return isinstance(module, (nn.Linear, WeightOnlyLinear)) or is_fan_in_fan_out(module)


def _find_targets(model: nn.Module, config: LoraConfig, strict: bool) -> list[str]:
    """The names of the modules `config.target_modules` selects, with peft's matching rules: a list entry
    matches a module whose name is the entry or ends with "." + entry; a string is a regular expression that
    must match the whole name; "all-linear" is every nn.Linear but the LM head (and is replaced in the config by
    the names it found, as peft does, so the saved config names the layers). Quantized linear layers count as
    linear."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    # each module's names to match: transformers' (peft's), then ours where they differ (GPT-NeoX)
    aliases = {n: peft_names(model, n) for n, _ in modules}
    linear_suffixes = sorted({n.rpartition(".")[2] for n, m in modules if _is_linear(m)})
    targets = config.target_modules
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in DEFAULT_TARGET_MODULES:
            raise ValueError(f"target_modules=None and peft has no default targets for model_type {model_type!r}; "
                             f"pass target_modules, some of: {', '.join(linear_suffixes)} (or \"all-linear\")")
        targets = config.target_modules = list(DEFAULT_TARGET_MODULES[model_type])
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        head = _output_head(model)
        names = [n for n, m in modules if _is_linear(m) and m is not head
                 and not any(in_modules_to_save(a, config) or config.excludes(a) for a in aliases[n])]
        config.target_modules = sorted(aliases[n][0] for n in names)  # transformers' names: the file loads in peft
        return names
    if isinstance(targets, str):
        names = [n for n, _ in modules if any(re.fullmatch(targets, a) for a in aliases[n])]
        unmatched = [] if names else [targets]
    else:
        def selects(n: str, t: str) -> bool:
            return any(a == t or a.endswith("." + t) for a in aliases[n])

        names = [n for n, _ in modules if any(selects(n, t) for t in targets)]
        unmatched = [t for t in targets if not any(selects(n, t) for n, _ in modules)]
        # peft applies layers_to_transform to a list's suffix matches only: an entry that is a module's whole name
        # ("lm_head") selects it whatever the layer indices
        selected = names
        names = [n for n in names if any(a in targets for a in aliases[n]) or config.in_transformed_layer(n)]
        if selected and not names:
            raise ValueError(f"layers_to_transform={config.layers_to_transform!r} (layers_pattern="
                             f"{config.layers_pattern!r}) keeps none of the layers target_modules={targets!r} "
                             f"selects ({', '.join(selected[:2])}, ...); pass the indices of existing layers")
    if (strict and unmatched) or not names:
        raise ValueError(f"target_modules entry {', '.join(map(repr, unmatched))} matches no layer of "
                         f"{type(model).__name__}; its linear layers are named {', '.join(linear_suffixes)} "
                         f"(pass some of those, or \"all-linear\")")
    if excluded := [n for n in names if any(config.excludes(a) for a in aliases[n])]:
        names = [n for n in names if n not in excluded]
        if not names:
            raise ValueError(f"exclude_modules={config.exclude_modules!r} takes back every layer target_modules="
                             f"{targets!r} selects ({', '.join(excluded[:4])}); exclude fewer layers")
    kept = [n for n in names if not any(in_modules_to_save(a, config) for a in aliases[n])]
    if not kept:
        raise ValueError(f"target_modules={targets!r} selects only layers inside modules_to_save="
                         f"{config.modules_to_save!r} ({', '.join(names[:4])}), which are trained fully and get no "
                         f"LoRA; target other layers, or drop them from modules_to_save")
    return kept
