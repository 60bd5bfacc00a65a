"""LoRA adapters in the PEFT format: the `peft` library's names, config file and weight keys, without peft.

Each target nn.Linear is wrapped in a LoraLinear that adds a low-rank update to its output:

    x ──> base_layer (frozen W, b) ───────────────────────────────────────> + ──> y
    └──> lora_dropout ──> lora_A (r, in) ──> lora_B (out, r) ──> * scaling ─┘

    scaling = lora_alpha / r        (lora_alpha / sqrt(r) with use_rslora)

The wrapper nests like peft's: PeftModel.base_model is a LoraModel, LoraModel.model is the user's model. So a
LoRA parameter's name is `base_model.model.<module>.lora_A.weight`, which is the key peft writes to
adapter_model.safetensors (peft drops its adapter name, "default", from the saved key; we have one adapter and
never put it in). An adapter saved here loads in peft and the other way round; adapter_config.json carries the
fields peft reads. PeftModel passes forward, generate and any attribute it lacks to the model, so generate(),
generate_batch() and the Trainer take it as they take the model.

Not here yet (each raises NotImplementedError naming it): quantized base layers (QLoRA), bias other than "none",
modules_to_save, DoRA, several adapters on one model, rank/alpha patterns and the other peft extras.

Offers: LoraConfig, LoraLinear, LoraModel, PeftModel (alias PeftModelForCausalLM), get_peft_model,
get_peft_model_state_dict, set_peft_model_state_dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"  # what peft wrote with safe_serialization=False
ALL_LINEAR = "all-linear"
_LORA_PARTS = (".lora_A.", ".lora_B.")

# peft's default targets when target_modules is None, for the model types gpuformers runs.
_DEFAULT_TARGETS = {t: ["q_proj", "v_proj"] for t in ("llama", "mistral", "qwen2", "qwen3")}

# Fields of peft's adapter_config.json that we write with peft's defaults and read back: any other value asks
# for a feature we do not have, and loading such an adapter would silently give other outputs.
_UNSUPPORTED_DEFAULTS = {
    "alpha_pattern": {},
    "rank_pattern": {},
    "layers_to_transform": None,
    "layers_pattern": None,
    "exclude_modules": None,
    "lora_bias": False,
    "layer_replication": None,
    "loftq_config": {},
    "megatron_config": None,
    "target_parameters": None,
    "trainable_token_indices": None,
}
# Fields peft writes that change nothing in the forward.
_IGNORED_FIELDS = {"peft_version", "auto_mapping", "megatron_core", "qalora_group_size", "ensure_weight_tying"}


@dataclass
class LoraConfig:
    """peft's LoraConfig for what gpuformers supports; the defaults are peft's."""

    r: int = 8
    lora_alpha: float = 8
    target_modules: list[str] | str | None = None
    lora_dropout: float = 0.0
    bias: str = "none"
    task_type: str | None = None
    modules_to_save: list[str] | None = None
    use_rslora: bool = False
    init_lora_weights: bool | str = True
    fan_in_fan_out: bool = False
    use_dora: bool = False
    inference_mode: bool = False
    base_model_name_or_path: str | None = None
    revision: str | None = None
    peft_type: str = "LORA"

    def __post_init__(self):
        self.task_type = getattr(self.task_type, "value", self.task_type)  # peft.TaskType is a str enum
        self.peft_type = getattr(self.peft_type, "value", self.peft_type)
        if self.peft_type != "LORA":
            raise NotImplementedError(f"peft_type {self.peft_type!r} is not supported: gpuformers has LoRA only")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"r={self.r!r}: the LoRA rank must be a positive integer, e.g. LoraConfig(r=8)")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)):
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be a number, e.g. lora_alpha=16 (2 * r)")
        if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout!r} must be a probability in [0, 1), e.g. 0.05")
        if self.bias != "none":
            if self.bias in ("all", "lora_only"):
                raise NotImplementedError(f'bias={self.bias!r} is not supported yet (no biases are trained with '
                                          f'LoRA in gpuformers); use bias="none"')
            raise ValueError(f'bias={self.bias!r} is not one of peft\'s "none", "all", "lora_only"; use "none"')
        if self.task_type not in (None, "CAUSAL_LM"):
            raise NotImplementedError(f"task_type={self.task_type!r} is not supported: gpuformers has causal "
                                      f"language models only; use task_type=\"CAUSAL_LM\" (or None)")
        if self.modules_to_save:
            raise NotImplementedError(f"modules_to_save={self.modules_to_save!r} is not supported yet: train "
                                      f"those modules fully without LoRA, or leave modules_to_save=None")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise NotImplementedError(f"init_lora_weights={self.init_lora_weights!r} is not supported; use True "
                                      f"(peft's default), False or \"gaussian\"")
        if self.fan_in_fan_out:
            raise NotImplementedError("fan_in_fan_out=True (GPT-2 style Conv1D weights) is not supported: "
                                      "gpuformers' layers are nn.Linear; use fan_in_fan_out=False")
        if self.use_dora:
            raise NotImplementedError("use_dora=True (DoRA) is not supported yet; use plain LoRA (use_dora=False)")
        targets = self.target_modules
        if isinstance(targets, (set, frozenset, tuple)):
            targets = sorted(targets)  # peft stores a set; a sorted list writes the same file every time
            self.target_modules = targets
        if isinstance(targets, list):
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"target_modules={targets!r} must name at least one layer, e.g. "
                                 f"[\"q_proj\", \"v_proj\"] or \"all-linear\"")
        elif targets is not None and not isinstance(targets, str):
            raise ValueError(f"target_modules={targets!r} must be a list of layer names (e.g. [\"q_proj\", "
                             f"\"v_proj\"]), a regular expression, or \"all-linear\"")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    # --- adapter_config.json ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**_UNSUPPORTED_DEFAULTS, **data}

    @classmethod
    def from_dict(cls, data: dict) -> "LoraConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in known or key in _IGNORED_FIELDS:
                continue
            if key in _UNSUPPORTED_DEFAULTS and value == _UNSUPPORTED_DEFAULTS[key]:
                continue
            if key not in _UNSUPPORTED_DEFAULTS and value in (None, False, {}, []):
                continue  # a peft field we do not know, left at an "off" value
            raise NotImplementedError(f"the adapter config sets {key}={value!r}, which gpuformers' LoRA does not "
                                      f"support yet; use an adapter trained without it")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "LoraConfig":
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {folder}: pass the folder save_pretrained() wrote")
        return cls.from_dict(json.loads(path.read_text()))


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: y = base_layer(x) + B(A(dropout(x))) * scaling."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig, autocast_adapter_dtype: bool = True):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.r, self.lora_alpha, self.scaling = config.r, config.lora_alpha, config.scaling
        weight = base_layer.weight
        # Like peft's autocast_adapter_dtype: half-precision bases get float32 adapters (stable AdamW updates).
        dtype = weight.dtype
        if autocast_adapter_dtype and dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, config.r, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(config.r, self.out_features, bias=False, device=weight.device, dtype=dtype)
        self.merged = False
        self.disabled = False
        self.reset_lora_parameters(config.init_lora_weights)

    @torch.no_grad()
    def reset_lora_parameters(self, init_lora_weights: bool | str) -> None:
        """True: A as nn.Linear's default (kaiming uniform, a=sqrt(5)), B zeros, so the model starts unchanged.
        "gaussian": A normal with std 1/r, B zeros. False: both random (for tests; the model changes)."""
        if init_lora_weights is False:
            nn.init.kaiming_uniform_(self.lora_B.weight, a=math.sqrt(5))
        else:
            nn.init.zeros_(self.lora_B.weight)
        if init_lora_weights == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1 / self.r)
        else:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))

    # The base layer's parameters read through the wrapper, as code written for nn.Linear expects.
    @property
    def weight(self) -> nn.Parameter:
        return self.base_layer.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged or self.disabled:
            return result
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        # Added in the adapter's precision (float32 over a bf16 base) and rounded once, as peft does.
        return (result + update * self.scaling).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling (out, in), in the base weight's dtype: what merging adds to the base weight."""
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling
        return delta.to(self.base_layer.weight.dtype)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False) -> None:
        if self.merged:
            return
        delta = self.delta_weight()
        if safe_merge and not torch.isfinite(self.base_layer.weight + delta).all():
            raise ValueError("merging this LoRA adapter gives NaN or inf weights; the adapter is broken (check its "
                             "training), so it was not merged")
        self.base_layer.weight.add_(delta)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base_layer.weight.sub_(self.delta_weight())
            self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}"


class LoraModel(nn.Module):
    """peft's tuner layer: holds the user's model as `.model` and swaps its target layers for LoraLinear."""

    def __init__(self, model: nn.Module, config: LoraConfig, adapter_name: str = "default",
                 autocast_adapter_dtype: bool = True, strict: bool = True):
        super().__init__()
        if any(isinstance(m, LoraLinear) for m in model.modules()):
            raise ValueError("this model already has LoRA layers; call merge_and_unload() or unload() on its "
                             "PeftModel first, or pass the model without adapters")
        self.model = model
        self.peft_config = {adapter_name: config}
        self.active_adapter = adapter_name
        _check_placement(model)
        names = _find_targets(model, config, strict)
        for name in names:  # every target checked before the first is replaced: an error leaves the model as it was
            module = model.get_submodule(name)
            if type(module) is not nn.Linear:
                raise NotImplementedError(
                    f"LoRA on {name} ({type(module).__name__}) is not supported: gpuformers wraps plain "
                    f"torch.nn.Linear layers only (quantized layers, i.e. QLoRA, are not available yet); "
                    f"choose target_modules among the model's nn.Linear layers")
        for name in names:
            parent_name, _, child = name.rpartition(".")
            layer = LoraLinear(model.get_submodule(name), config, autocast_adapter_dtype)
            setattr(model.get_submodule(parent_name), child, layer)
        # Only the adapters train (bias="none"); a frozen base stays bit-identical through training.
        for param_name, param in model.named_parameters():
            param.requires_grad_(not config.inference_mode and any(p in f".{param_name}" for p in _LORA_PARTS))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":  # not set yet: __init__ is still running, or the object is being unpickled
                raise
            return getattr(self.model, name)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def lora_layers(self) -> list[tuple[str, LoraLinear]]:
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoraLinear)]

    def _restore(self, merge: bool, safe_merge: bool = False) -> nn.Module:
        if merge:
            shared = _shared_parameter_ids(self.model)
            for name, layer in self.lora_layers():
                if id(layer.base_layer.weight) in shared:
                    raise ValueError(f"{name}.weight is tied to another weight (tie_word_embeddings), so merging "
                                     f"its LoRA would change both; untie the weights first, or call unload() "
                                     f"and keep the adapter separate")
        for name, layer in self.lora_layers():
            if merge:
                layer.merge(safe_merge)
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child, layer.base_layer)
        return self.model


def _check_placement(model: nn.Module) -> None:
    # device_map's hooks stream an offloaded layer's weights in for its forward, and only the weights they saw at
    # dispatch: adapters added afterwards would stay behind on the CPU (or the meta device, for "disk").
    places = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    if "disk" in places or ("cpu" in places and len(places) > 1):
        raise NotImplementedError(f"LoRA on a model with offloaded layers (device_map places some on "
                                  f"{', '.join(sorted(places & {'cpu', 'disk'}))}) is not supported yet; load the "
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


def _find_targets(model: nn.Module, config: LoraConfig, strict: bool) -> list[str]:
    """The names of the modules `config.target_modules` selects, with peft's matching rules: a list entry
    matches a module whose name is the entry or ends with "." + entry; a string is a regular expression that
    must match the whole name; "all-linear" is every nn.Linear but the LM head (and is replaced in the config by
    the names it found, as peft does, so the saved config names the layers)."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    linear_suffixes = sorted({n.rpartition(".")[2] for n, m in modules if isinstance(m, nn.Linear)})
    targets = config.target_modules
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in _DEFAULT_TARGETS:
            raise ValueError(f"target_modules=None and peft has no default targets for model_type {model_type!r}; "
                             f"pass target_modules, some of: {', '.join(linear_suffixes)} (or \"all-linear\")")
        targets = config.target_modules = list(_DEFAULT_TARGETS[model_type])
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        head = _output_head(model)
        names = [n for n, m in modules if isinstance(m, nn.Linear) and m is not head]
        config.target_modules = sorted(names)
        return names
    if isinstance(targets, str):
        names = [n for n, _ in modules if re.fullmatch(targets, n)]
        unmatched = [] if names else [targets]
    else:
        names = [n for n, _ in modules if any(n == t or n.endswith("." + t) for t in targets)]
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _ in modules)]
    if (strict and unmatched) or not names:
        raise ValueError(f"target_modules entry {', '.join(map(repr, unmatched))} matches no layer of "
                         f"{type(model).__name__}; its linear layers are named {', '.join(linear_suffixes)} "
                         f"(pass some of those, or \"all-linear\")")
    return names


class PeftModel(nn.Module):
    """A model with LoRA adapters, as peft's PeftModel: what get_peft_model and PeftModel.from_pretrained return.

    Calls, generate() and attributes it does not have itself go to the wrapped model (get_base_model())."""

    def __init__(self, model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default",
                 autocast_adapter_dtype: bool = True, _strict: bool = True):
        super().__init__()
        if isinstance(model, PeftModel):
            raise ValueError("the model is already a PeftModel; call merge_and_unload() or unload() first, or "
                             "pass the plain model")
        if not isinstance(peft_config, LoraConfig):
            if not callable(getattr(peft_config, "to_dict", None)):
                raise TypeError(f"peft_config is a {type(peft_config).__name__}; pass a gpuformers LoraConfig")
            peft_config = LoraConfig.from_dict(peft_config.to_dict())  # peft's own LoraConfig, ported as is
        config = dataclasses.replace(peft_config)  # "all-linear" is expanded in the copy, not the caller's
        if config.base_model_name_or_path is None:
            name = getattr(model, "name_or_path", None)
            config.base_model_name_or_path = str(name) if name else None
        self.base_model = LoraModel(model, config, adapter_name, autocast_adapter_dtype, strict=_strict)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    @property
    def peft_config(self) -> dict[str, LoraConfig]:
        return self.base_model.peft_config

    @property
    def active_adapter(self) -> str:
        return self.base_model.active_adapter

    def get_base_model(self) -> nn.Module:
        return self.base_model.model

    @property
    def forward(self) -> "_CallModel":
        """Calls the wrapped model (its hooks included) and shows its signature: code that reads the arguments
        a model accepts from `inspect.signature(model.forward)` (the Trainer's column filter) sees the model's."""
        return _CallModel(self.get_base_model())

    def generate(self, *args, **kwargs):
        return self.get_base_model().generate(*args, **kwargs)

    # --- counting --------------------------------------------------------------------------------------------

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts, each shared (tied) tensor counted once, as peft counts them."""
        trainable = total = 0
        for _, param in self.named_parameters():
            total += param.numel()
            trainable += param.numel() if param.requires_grad else 0
        return trainable, total

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / total:.4f}")

    # --- adapters on and off ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def disable_adapter(self):
        """Inside the block the model runs without its adapters (the base model's outputs)."""
        layers = [layer for _, layer in self.base_model.lora_layers()]
        previous = [layer.disabled for layer in layers]
        for layer in layers:
            layer.disabled = True
        try:
            yield
        finally:
            for layer, was in zip(layers, previous):
                layer.disabled = was

    def merge_adapter(self) -> None:
        for _, layer in self.base_model.lora_layers():
            layer.merge()

    def unmerge_adapter(self) -> None:
        for _, layer in self.base_model.lora_layers():
            layer.unmerge()

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False,
                         adapter_names: list[str] | None = None) -> nn.Module:
        """Add each B @ A * scaling to its base weight and return the plain model (LoRA layers gone)."""
        _check_adapter_names(self, adapter_names)
        return self.base_model._restore(merge=True, safe_merge=safe_merge)

    def unload(self) -> nn.Module:
        """Remove the LoRA layers without merging them and return the plain model, as it was before."""
        return self.base_model._restore(merge=False)

    # --- files -----------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, safe_serialization: bool = True,
                        selected_adapters: list[str] | None = None, state_dict: dict | None = None,
                        is_main_process: bool = True, **kwargs) -> None:
        """Write adapter_config.json and adapter_model.safetensors, in peft's layout. `state_dict` replaces the
        model's own (e.g. gathered from FSDP2 shards; its LoRA entries are saved); only the main process writes."""
        from gpuformers.loading.safetensors import write_file

        if not safe_serialization:
            raise NotImplementedError("safe_serialization=False (adapter_model.bin) is not supported; adapters "
                                      "are saved as safetensors")
        _check_adapter_names(self, selected_adapters)
        if kwargs:
            raise NotImplementedError(f"save_pretrained options not supported: {', '.join(sorted(kwargs))}")
        if not is_main_process:
            return
        path = Path(save_directory)
        if self.active_adapter != "default":  # peft's layout: a named adapter goes in a folder of its name
            path = path / self.active_adapter
        path.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(self.peft_config[self.active_adapter], inference_mode=True)
        config.save_pretrained(path)
        state = get_peft_model_state_dict(self, state_dict)
        state = {k: v.detach() for k, v in state.items()}
        write_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, model: nn.Module, model_id: str | os.PathLike, adapter_name: str = "default",
                        is_trainable: bool = False, config: LoraConfig | None = None,
                        autocast_adapter_dtype: bool = True, **kwargs) -> "PeftModel":
        """Load an adapter folder (written by us or by peft, or a Hub id) onto `model`."""
        from gpuformers.hub import HubKwargs, resolve_model_dir

        hub = HubKwargs.pop_from(kwargs)
        if kwargs:
            raise NotImplementedError(f"from_pretrained options not supported: {', '.join(sorted(kwargs))}")
        folder = resolve_model_dir(model_id, [CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME], hub)
        config = dataclasses.replace(config or LoraConfig.from_pretrained(folder), inference_mode=not is_trainable)
        peft_model = cls(model, config, adapter_name, autocast_adapter_dtype, _strict=False)
        try:
            set_peft_model_state_dict(peft_model, _read_adapter_weights(folder))
        except Exception:
            peft_model.unload()  # the caller's model back without LoRA layers
            raise
        if not is_trainable:
            peft_model.eval()  # dropout off, as peft does
        return peft_model


PeftModelForCausalLM = PeftModel


class _CallModel:
    """`model(...)` with the signature of `model.forward`, computed only when someone asks for it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.model.forward)


def _check_adapter_names(model: PeftModel, names: list[str] | None) -> None:
    if names is not None and list(names) != [model.active_adapter]:
        raise NotImplementedError(f"adapters {names!r}: gpuformers holds one adapter per model "
                                  f"({model.active_adapter!r}); several adapters are not supported yet")


def get_peft_model(model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default",
                   autocast_adapter_dtype: bool = True) -> PeftModel:
    """Wrap `model` with fresh LoRA adapters: base weights frozen, only lora_A / lora_B train."""
    return PeftModel(model, peft_config, adapter_name, autocast_adapter_dtype)


def get_peft_model_state_dict(model: PeftModel, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys peft saves: base_model.model.<module>.lora_A.weight, ...
    (taken from `state_dict` when given, a state dict of the whole PeftModel)."""
    state = model.state_dict() if state_dict is None else state_dict
    return {k: v for k, v in state.items() if any(p in k for p in _LORA_PARTS)}


def set_peft_model_state_dict(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (peft's saved keys) into the model's LoRA layers; every key must match exactly."""
    own = get_peft_model_state_dict(model)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"the adapter weights do not match this model's LoRA layers: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]} ({len(missing)} and {len(unexpected)} in all); load the "
                         f"adapter onto the base model it was trained on")
    with torch.no_grad():
        for key, tensor in state.items():
            if tensor.shape != own[key].shape:
                raise ValueError(f"adapter weight {key} has shape {tuple(tensor.shape)}, the model's LoRA layer "
                                 f"{tuple(own[key].shape)}; load the adapter onto the base model it was trained on")
            own[key].copy_(tensor)


def _read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from gpuformers.loading.safetensors import SafetensorsFile

    if (folder / WEIGHTS_NAME).is_file():
        with SafetensorsFile(folder / WEIGHTS_NAME) as f:
            return {name: f.read(name) for name in f.keys()}
    if (folder / LEGACY_WEIGHTS_NAME).is_file():
        return torch.load(folder / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder}: pass the folder an adapter was saved to")
