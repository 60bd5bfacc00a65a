"""LoRA adapters on the model itself, as transformers' PEFT integration offers them (no PeftModel wrapper).

`model.add_adapter(LoraConfig(...))` or `model.load_adapter(folder_or_hub_id)` puts LoraLinear layers in place
of the model's target layers: the model keeps its class, so generate(), generate_batch() and the Trainer take it
as before, and `model.save_pretrained(folder)` then writes the adapter alone (adapter_config.json,
adapter_model.safetensors under peft's keys, and generation_config.json), as transformers does; transformers'
load_adapter and peft read that folder. The attributes transformers sets are the same: `_hf_peft_config_loaded`
(False on a model without an adapter) and `peft_config` ({adapter name: LoraConfig}, absent without one).

As in transformers (peft's tuner layers underneath):
    add_adapter         freezes the base model; the adapter trains
    load_adapter        is_trainable=False (the default): everything frozen and the model in eval(); True: the
                        adapter trains
    set_adapter,        make the adapter's weights require grad (peft's set_adapter), even after a frozen load;
    enable_adapters     disable_adapters freezes them and leaves the base model's outputs
    adapter dtype       the base weight's (no float32 upcast over a bf16 base: transformers does not cast, unlike
                        get_peft_model)

Several adapters, one active at a time, as in transformers: add_adapter and load_adapter make the new adapter the
active one, set_adapter(name) switches, delete_adapter of the active one activates the first remaining, and
save_pretrained writes the active one; disable_adapters() holds across switches. Several active at once
(set_adapter([a, b])) raises NotImplementedError. Unlike transformers 5.24, enable_adapters() switches
modules_to_save copies back on too (transformers leaves them off).
Under the hood the model holds one PeftModel (peft_model.py), out of its module tree, whose adapters are
multi_adapter.py's: the methods here delegate to it and add transformers' differences (a new adapter becomes the
active one, disable_adapters() holds across switches, the last adapter can be deleted). The inactive adapters are
parked (LoraModel.park: taken out, their tensors kept), so a switch puts the same layers back and an optimizer holding
their parameters keeps working.

Offers: PeftAdapterMixin.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from gpuformers.lora.config import CONFIG_NAME, WEIGHTS_NAME, LoraConfig
from gpuformers.lora.layers import LoraLayer
from gpuformers.lora.modules_to_save import ModulesToSaveWrapper
from gpuformers.lora.multi_adapter import set_adapter_requires_grad
from gpuformers.lora.adapter_state import PEFT_KEY_PREFIX, get_peft_model_state_dict
from gpuformers.lora.peft_model import PeftModel

_PEFT_MODEL = "_lora_peft_model"  # the PeftModel holding every adapter; its active one's layers are in the model
_DISABLED = "_lora_disabled"  # disable_adapters() was called (it holds across set_adapter)


class PeftAdapterMixin:
    """transformers' PeftAdapterMixin for gpuformers' LoRA: adapters put into the model in place, one active."""

    _hf_peft_config_loaded = False

    # --- adding and loading ----------------------------------------------------------------------------------

    def add_adapter(self, adapter_config, adapter_name: str | None = None) -> None:
        """Add a fresh LoRA adapter (a gpuformers or peft LoraConfig) for training: the base model is frozen."""
        adapter_name = adapter_name or "default"
        self._check_new_adapter(adapter_name)
        # transformers names the model the adapter was added to, whatever the config said
        config = dataclasses.replace(_lora_config(adapter_config, "adapter_config"),
                                     base_model_name_or_path=self.name_or_path)
        self._add_active(adapter_name, config)
        self.set_adapter(adapter_name)

    def load_adapter(self, peft_model_id: str | os.PathLike | None = None, adapter_name: str | None = None,
                     peft_config=None, adapter_state_dict: dict[str, torch.Tensor] | None = None,
                     low_cpu_mem_usage: bool = False, is_trainable: bool = False, hotswap: bool | str = "auto",
                     local_files_only: bool = False, adapter_kwargs: dict | None = None, **kwargs) -> None:
        """Load an adapter saved by peft, transformers or gpuformers: a local folder or a Hub id (revision, token,
        cache_dir, local_files_only in adapter_kwargs or as keywords). `peft_config` and `adapter_state_dict` stand
        in for the folder's adapter_config.json and weights (keys with or without peft's "base_model.model.").
        low_cpu_mem_usage is accepted and changes nothing (the adapters are small)."""
        from gpuformers.hub import HubKwargs, resolve_model_dir

        adapter_name = adapter_name or "default"
        self._check_new_adapter(adapter_name)
        if hotswap is True:
            raise NotImplementedError("hotswap=True (loading new weights into the active adapter's tensors) is not "
                                      "supported; load_adapter() the new one under another name and set_adapter() "
                                      "it, or delete_adapter() the old one first")
        options = {**(adapter_kwargs or {}), **kwargs}
        hub = HubKwargs.pop_from(options)
        if options:
            raise NotImplementedError(f"load_adapter options not supported: {', '.join(sorted(options))}")
        hub.local_files_only = hub.local_files_only or local_files_only
        if peft_model_id is None and (peft_config is None or adapter_state_dict is None):
            raise ValueError("load_adapter needs the adapter's folder or Hub id (peft_model_id), or both "
                             "peft_config and adapter_state_dict")
        config = None if peft_config is None else _lora_config(peft_config, "peft_config")

        if adapter_state_dict is None:
            weights, config = PeftModel._adapter_files(peft_model_id, config, is_trainable, dataclasses.asdict(hub))
        else:
            if config is None:
                config = LoraConfig.from_pretrained(resolve_model_dir(peft_model_id, [CONFIG_NAME], hub))
            config = dataclasses.replace(config, inference_mode=not is_trainable)
            weights = {k if k.startswith(PEFT_KEY_PREFIX) else PEFT_KEY_PREFIX + k: v
                       for k, v in adapter_state_dict.items()}
        self._add_active(adapter_name, config, weights)  # the new adapter is the active one, as in transformers
        if not is_trainable:
            self.eval()

    # --- the active adapter ----------------------------------------------------------------------------------

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make `adapter_name` the active adapter (the others stay loaded, unused); as peft's set_adapter, its
        weights then require grad."""
        self._require_adapter()
        self.__dict__[_PEFT_MODEL].set_adapter(adapter_name)
        self._apply_disabled()

    def disable_adapters(self) -> None:
        """Run the base model alone (LoRA layers off, modules_to_save back to their originals; the adapter stays,
        frozen) until enable_adapters()."""
        self._require_adapter()
        self.__dict__[_DISABLED] = True
        self._apply_disabled()
        set_adapter_requires_grad(self, False)

    def enable_adapters(self) -> None:
        """Run the active adapter again; as peft's, its weights then require grad."""
        self._require_adapter()
        self.__dict__[_DISABLED] = False
        self._apply_disabled()
        set_adapter_requires_grad(self, True)

    def active_adapters(self) -> list[str]:
        self._require_adapter()
        return self.__dict__[_PEFT_MODEL].active_adapters

    def get_adapter_state_dict(self, adapter_name: str | None = None,
                               state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The adapter's tensors under the model's parameter names (model.layers.0.self_attn.q_proj.lora_A.weight,
        ...), taken from `state_dict` when given (a state dict of the whole model, e.g. gathered from FSDP2)."""
        self._require_adapter()
        active = self.active_adapters()[0]
        if adapter_name is None or adapter_name == active:
            return get_peft_model_state_dict(self, state_dict)
        if adapter_name not in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} not found: this model's adapters are {list(self.peft_config)}")
        if state_dict is not None:
            raise ValueError(f"state_dict holds the active adapter's tensors ({active!r}), not {adapter_name!r}'s; "
                             f"set_adapter({adapter_name!r}) first")
        peft_model = self.__dict__[_PEFT_MODEL]
        peft_model._switch(adapter_name)  # its layers in the model for a moment, to read their tensors
        try:
            return get_peft_model_state_dict(self)
        finally:
            peft_model._switch(active)

    def delete_adapter(self, adapter_names: str | list[str]) -> None:
        """Take adapters out again. Deleting the active one activates the first remaining (as peft does); with
        none left the model's own layers and modules are back (it stays frozen, as in transformers)."""
        self._require_adapter()
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        missing = [name for name in names if name not in self.peft_config]
        if missing:
            raise ValueError(f"adapter {', '.join(map(repr, missing))} is not on this model and cannot be deleted; "
                             f"its adapters are {list(self.peft_config)}")
        peft_model = self.__dict__[_PEFT_MODEL]
        if set(self.peft_config) <= set(names):
            # the model's own layers and original modules back (not the trained copies unload() would keep)
            peft_model.base_model._restore(merge=False, keep_trained_copies=False)
            for key in (_PEFT_MODEL, _DISABLED):
                self.__dict__.pop(key)
            del self.peft_config
            del self._hf_peft_config_loaded  # back to the class's False
            return
        for name in dict.fromkeys(names):
            peft_model.delete_adapter(name)  # the active one: the first remaining takes its place
        self.peft_config = peft_model.peft_config
        self._apply_disabled()

    # --- saving (save_pretrained delegates here) -------------------------------------------------------------

    def _save_adapter(self, save_directory: str | os.PathLike,
                      state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """What transformers' save_pretrained writes for a model with an adapter: adapter_config.json,
        adapter_model.safetensors (peft's keys) and generation_config.json; no config.json, no base weights."""
        from gpuformers.loading.safetensors import write_file

        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.peft_config[self.active_adapters()[0]].save_pretrained(path)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(path)
        state = {PEFT_KEY_PREFIX + k: v.detach()
                 for k, v in self.get_adapter_state_dict(state_dict=state_dict).items()}
        write_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})

    # --- helpers ---------------------------------------------------------------------------------------------

    def _add_active(self, adapter_name: str, config: LoraConfig,
                    weights: Path | dict[str, torch.Tensor] | None = None) -> None:
        """Add an adapter (fresh, or holding `weights`: a folder or peft's keys) as the active one; it runs (a new
        adapter's layers are enabled, as in transformers, even after disable_adapters()). On failure the model and
        its adapters are as they were."""
        peft_model = self.__dict__.get(_PEFT_MODEL)
        if peft_model is None:
            # Kept in __dict__, out of the module tree: peft_model.base_model.model is this model, and a cycle of
            # submodules would make state_dict() recurse forever.
            peft_model = PeftModel._build(self, config, adapter_name, autocast_adapter_dtype=False, weights=weights)
            self.__dict__[_PEFT_MODEL] = peft_model
        else:
            peft_model._add(adapter_name, peft_model._prepare_config(self, config), autocast_adapter_dtype=False,
                            weights=weights, activate=True)
        self.__dict__[_DISABLED] = False
        self.peft_config = peft_model.peft_config
        self._hf_peft_config_loaded = True

    def _apply_disabled(self) -> None:
        """disable_adapters() / enable_adapters() hold for whichever adapter set_adapter makes active, as in
        transformers."""
        disabled = self.__dict__.get(_DISABLED, False)
        for module in self.modules():
            if isinstance(module, (LoraLayer, ModulesToSaveWrapper)):
                module.disabled = disabled

    def _check_new_adapter(self, adapter_name: str) -> None:
        if self._hf_peft_config_loaded and adapter_name in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} already exists on this model; pass another adapter_name, "
                             f"or call delete_adapter({adapter_name!r}) first to replace it")

    def _require_adapter(self) -> None:
        if not self._hf_peft_config_loaded:
            raise ValueError("this model has no adapter; add one with model.add_adapter(LoraConfig(...)) or "
                             "model.load_adapter(folder)")


def held_peft_model(model: torch.nn.Module) -> PeftModel | None:
    """The PeftModel holding the adapters that the model-level API added to `model`, or None."""
    return model.__dict__.get(_PEFT_MODEL)


def _lora_config(value, argument: str) -> LoraConfig:
    """A gpuformers LoraConfig from ours, peft's (ported through its to_dict) or a dict of adapter_config.json."""
    if isinstance(value, LoraConfig):
        return value
    if isinstance(value, dict):
        return LoraConfig.from_dict(value)
    if callable(getattr(value, "to_dict", None)):
        return LoraConfig.from_dict(value.to_dict())
    raise TypeError(f"{argument} is a {type(value).__name__}; pass a LoraConfig (gpuformers' or peft's)")
