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

One adapter per model: a second name raises NotImplementedError (delete_adapter the first one). Unlike
transformers 5.24, enable_adapters() switches modules_to_save copies back on too (transformers leaves them off).
Under the hood the layers are those of a PeftModel (layers.py, peft_model.py) that the model holds out of its
module tree.

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
from gpuformers.lora.peft_model import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

_PEFT_PREFIX = "base_model.model."  # peft's saved keys: the model's parameter names under PeftModel's
_WRAPPER = "_lora_wrapper"  # the PeftModel whose layers the model holds


class PeftAdapterMixin:
    """transformers' PeftAdapterMixin for gpuformers' LoRA: one adapter, put into the model in place."""

    _hf_peft_config_loaded = False

    # --- adding and loading ----------------------------------------------------------------------------------

    def add_adapter(self, adapter_config, adapter_name: str | None = None) -> None:
        """Add a fresh LoRA adapter (a gpuformers or peft LoraConfig) for training: the base model is frozen."""
        adapter_name = adapter_name or "default"
        self._check_new_adapter(adapter_name)
        # transformers names the model the adapter was added to, whatever the config said
        config = dataclasses.replace(_lora_config(adapter_config, "adapter_config"),
                                     base_model_name_or_path=self.name_or_path)
        self._hold(PeftModel(self, config, adapter_name, autocast_adapter_dtype=False))
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
            raise NotImplementedError("hotswap=True is not supported: gpuformers holds one adapter; call "
                                      "delete_adapter() and then load_adapter() the new one")
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
            wrapper = PeftModel.from_pretrained(self, peft_model_id, adapter_name=adapter_name,
                                                is_trainable=is_trainable, config=config,
                                                autocast_adapter_dtype=False, **dataclasses.asdict(hub))
        else:
            if config is None:
                config = LoraConfig.from_pretrained(resolve_model_dir(peft_model_id, [CONFIG_NAME], hub))
            config = dataclasses.replace(config, inference_mode=not is_trainable)
            wrapper = PeftModel(self, config, adapter_name, autocast_adapter_dtype=False, _strict=False)
            try:
                set_peft_model_state_dict(wrapper, {k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k: v
                                                    for k, v in adapter_state_dict.items()})
            except Exception:
                _take_out(wrapper)
                raise
            if not is_trainable:
                self.eval()
        self._hold(wrapper)

    # --- the active adapter ----------------------------------------------------------------------------------

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make `adapter_name` the active adapter; as peft's set_adapter, its weights then require grad."""
        self._require_adapter()
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        unknown = [name for name in names if name not in self.peft_config]
        if unknown:
            raise ValueError(f"adapter {', '.join(map(repr, unknown))} not found: this model's adapter is "
                             f"{self.active_adapters()[0]!r}")
        self._set_lora_requires_grad(True)

    def disable_adapters(self) -> None:
        """Run the base model alone (LoRA layers off, modules_to_save back to their originals; the adapter stays,
        frozen) until enable_adapters()."""
        self._require_adapter()
        for module in self._adapter_modules():
            module.disabled = True
        self._set_lora_requires_grad(False)

    def enable_adapters(self) -> None:
        """Run the adapter again; as peft's, its weights then require grad."""
        self._require_adapter()
        for module in self._adapter_modules():
            module.disabled = False
        self._set_lora_requires_grad(True)

    def active_adapters(self) -> list[str]:
        self._require_adapter()
        return [self.__dict__[_WRAPPER].active_adapter]

    def get_adapter_state_dict(self, adapter_name: str | None = None,
                               state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The adapter's tensors under the model's parameter names (model.layers.0.self_attn.q_proj.lora_A.weight,
        ...), taken from `state_dict` when given (a state dict of the whole model, e.g. gathered from FSDP2)."""
        self._require_adapter()
        if adapter_name is not None and adapter_name not in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} not found: this model's adapter is "
                             f"{self.active_adapters()[0]!r}")
        return get_peft_model_state_dict(self, state_dict)

    def delete_adapter(self, adapter_names: str | list[str]) -> None:
        """Take the adapter out again: the model's own layers and modules back (it stays frozen, as in
        transformers)."""
        self._require_adapter()
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        missing = [name for name in names if name not in self.peft_config]
        if missing:
            raise ValueError(f"adapter {', '.join(map(repr, missing))} is not on this model and cannot be deleted; "
                             f"its adapter is {self.active_adapters()[0]!r}")
        _take_out(self.__dict__.pop(_WRAPPER))
        del self.peft_config
        del self._hf_peft_config_loaded  # back to the class's False

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
        state = {_PEFT_PREFIX + k: v.detach() for k, v in self.get_adapter_state_dict(state_dict=state_dict).items()}
        write_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})

    # --- helpers ---------------------------------------------------------------------------------------------

    def _hold(self, wrapper: PeftModel) -> None:
        # Kept in __dict__, out of the module tree: wrapper.base_model.model is this model, and a cycle of
        # submodules would make state_dict() recurse forever. The wrapper's unload() takes the layers out again.
        self.__dict__[_WRAPPER] = wrapper
        self.peft_config = wrapper.peft_config
        self._hf_peft_config_loaded = True

    def _check_new_adapter(self, adapter_name: str) -> None:
        if not self._hf_peft_config_loaded:
            return
        loaded = self.active_adapters()[0]
        if adapter_name == loaded:
            raise ValueError(f"adapter {adapter_name!r} already exists on this model; call "
                             f"delete_adapter({adapter_name!r}) first to replace it")
        raise NotImplementedError(f"adapter {adapter_name!r}: this model already has the adapter {loaded!r}, and "
                                  f"gpuformers holds one adapter per model (several adapters are not supported "
                                  f"yet); call delete_adapter({loaded!r}) first")

    def _require_adapter(self) -> None:
        if not self._hf_peft_config_loaded:
            raise ValueError("this model has no adapter; add one with model.add_adapter(LoraConfig(...)) or "
                             "model.load_adapter(folder)")

    def _adapter_modules(self) -> list[LoraLayer | ModulesToSaveWrapper]:
        return [m for m in self.modules() if isinstance(m, (LoraLayer, ModulesToSaveWrapper))]

    def _set_lora_requires_grad(self, requires_grad: bool) -> None:
        """The adapter's weights (lora_A, lora_B, lora_embedding_A / _B, DoRA's magnitude, the modules_to_save
        copies) train or not; the base never. Biases trained with bias="all" / "lora_only" are left as they are,
        as peft's layers leave them."""
        for module in self._adapter_modules():
            is_lora = isinstance(module, LoraLayer)
            for part in module.adapter_parameters() if is_lora else module.modules_to_save.parameters():
                part.requires_grad_(requires_grad)


def _take_out(wrapper: PeftModel) -> None:
    """The model's own layers back in place of the adapter's: LoRA layers unmerged, modules_to_save originals
    (not their trained copies, which unload() would keep)."""
    wrapper.base_model._restore(merge=False, keep_trained_copies=False)


def _lora_config(value, argument: str) -> LoraConfig:
    """A gpuformers LoraConfig from ours, peft's (ported through its to_dict) or a dict of adapter_config.json."""
    if isinstance(value, LoraConfig):
        return value
    if isinstance(value, dict):
        return LoraConfig.from_dict(value)
    if callable(getattr(value, "to_dict", None)):
        return LoraConfig.from_dict(value.to_dict())
    raise TypeError(f"{argument} is a {type(value).__name__}; pass a LoraConfig (gpuformers' or peft's)")

