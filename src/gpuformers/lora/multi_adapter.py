"""Several adapters on one PeftModel, one active at a time, as peft's PeftModel holds them: add_adapter and
load_adapter add an adapter without activating it, set_adapter switches (the active adapter's weights then require
grad, as in peft), delete_adapter drops one (the active one: the first remaining takes its place), and
save_pretrained writes every adapter (or the selected ones), "default" in the folder itself and the others in
subfolders of their names, as peft lays them out.

The inactive adapters are parked (LoraModel.park: their layers taken out of the model, tensors kept) and a switch
puts the same layers back, so optimizers holding their parameters keep working. Unlike peft, only the active
adapter's tensors are in `state_dict()` and `parameters()`; several active at once (peft's set_adapter([a, b]),
add_weighted_adapter) are refused. integration.py's adapters on the model itself are held here too, in one PeftModel
the model keeps: they add with activate=True, as transformers activates a new adapter.

Offers: MultiAdapterMixin, one_adapter_name, set_adapter_requires_grad.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from gpuformers.lora.config import LoraConfig
from gpuformers.lora.layers import LoraLayer
from gpuformers.lora.lora_model import LoraModel
from gpuformers.lora.modules_to_save import ModulesToSaveWrapper


class MultiAdapterMixin:
    """PeftModel's adapter management (module doc). PeftModel provides base_model (the active LoraModel),
    `_adapters` ({name: LoraModel}, the active one included), _prepare_config, _adapter_files and _load_weights."""

    @property
    def peft_config(self) -> dict[str, LoraConfig]:
        return {name: lora.peft_config[name] for name, lora in self._adapters.items()}

    @property
    def active_adapter(self) -> str:
        return self.base_model.active_adapter

    @property
    def active_adapters(self) -> list[str]:
        return [self.active_adapter]

    def add_adapter(self, adapter_name: str, peft_config, low_cpu_mem_usage: bool = False,
                    autocast_adapter_dtype: bool = True) -> None:
        """A fresh adapter beside the others, not active (set_adapter it to use or train it), as peft's."""
        self._add(adapter_name, self._prepare_config(self.get_base_model(), peft_config), autocast_adapter_dtype)

    def load_adapter(self, model_id: str | os.PathLike, adapter_name: str, is_trainable: bool = False,
                     autocast_adapter_dtype: bool = True, **kwargs) -> None:
        """Another saved adapter (a folder or Hub id) beside the others, not active, as peft's load_adapter; with
        is_trainable=False the model is put in eval() (dropout off), as peft does."""
        folder, config = self._adapter_files(model_id, None, is_trainable, kwargs)
        self._add(adapter_name, self._prepare_config(self.get_base_model(), config), autocast_adapter_dtype,
                  weights=folder)
        if not is_trainable:
            self.eval()

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make `adapter_name` the active adapter; its weights then require grad (peft's rule)."""
        self._switch(one_adapter_name(adapter_name, list(self._adapters)))
        set_adapter_requires_grad(self.get_base_model(), True)

    def delete_adapter(self, adapter_name: str) -> None:
        """Drop an adapter; deleting the active one makes the first remaining adapter active (as peft does)."""
        if adapter_name not in self._adapters:
            raise ValueError(f"adapter {adapter_name!r} not found: this model's adapters are {list(self._adapters)}")
        if len(self._adapters) == 1:
            raise ValueError(f"{adapter_name!r} is this model's only adapter; unload() or merge_and_unload() to take "
                             f"it out")
        if adapter_name == self.active_adapter:
            self.set_adapter(next(name for name in self._adapters if name != adapter_name))
        del self._adapters[adapter_name]  # parked: its layers are out of the model already

    # --- helpers ------------------------------------------------------------------------------------------------

    def _add(self, adapter_name: str, config: LoraConfig, autocast_adapter_dtype: bool,
             weights: Path | dict[str, torch.Tensor] | None = None, activate: bool = False) -> None:
        """Build a new adapter's LoraModel (from a prepared config) with the active one parked and load `weights`
        into it (see _load_weights; None: a fresh adapter). Unless `activate` (transformers' integration), park it
        and bring the active one back. On failure the model is as it was."""
        if adapter_name in self._adapters:
            raise ValueError(f"adapter {adapter_name!r} already exists; pass another adapter_name, or "
                             f"delete_adapter({adapter_name!r}) first")
        active = self.base_model
        active.park()
        try:
            # strict: a fresh adapter's target_modules must all match; a saved one's need not, as in peft
            self.base_model = LoraModel(self.get_base_model(), config, adapter_name, autocast_adapter_dtype,
                                        strict=weights is None)
            if weights is not None:
                self._load_weights(weights)  # into the active adapter's layers: the new ones
        except BaseException:
            if self.base_model is not active:  # built, then failed to load its weights
                self.base_model._restore(merge=False, keep_trained_copies=False)
            active.reinstall()
            self.base_model = active
            raise
        self._adapters[adapter_name] = self.base_model
        if not activate:
            self._switch(active.active_adapter)

    def _switch(self, adapter_name: str) -> None:
        """Park the active adapter and put `adapter_name`'s layers in the model (requires_grad as they were)."""
        if adapter_name == self.active_adapter:
            return
        self.base_model.park()
        target = self._adapters[adapter_name]
        target.reinstall()
        self.base_model = target

    def _drop_parked(self) -> None:
        """Forget every adapter but the active one (merge_and_unload / unload leave the model without adapters)."""
        for name in [n for n in self._adapters if n != self.active_adapter]:
            del self._adapters[name]

    def _check_one_adapter(self, names: list[str] | None, what: str) -> None:
        """`what` (merging) takes the active adapter only."""
        if names is not None and list(names) != [self.active_adapter]:
            raise NotImplementedError(f"{what} adapters {list(names)!r}: only the active adapter "
                                      f"({self.active_adapter!r}) can be; set_adapter() the one you want first")


def one_adapter_name(adapter_name: str | list[str], known: list[str]) -> str:
    """set_adapter's argument (a name, or a list of one) checked against the adapters `known`: the name."""
    names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"adapter {', '.join(map(repr, unknown))} not found: this model's adapters are {known}")
    if len(names) != 1:
        raise NotImplementedError(f"set_adapter({names!r}): several active adapters at once are not supported; "
                                  f"activate one, or merge them into one adapter offline")
    return names[0]


def set_adapter_requires_grad(model: nn.Module, requires_grad: bool) -> None:
    """The adapter weights in `model` (lora_A, lora_B, lora_embedding_A / _B, DoRA's magnitude, the modules_to_save
    copies) train or not; the base never. Biases trained with bias="all" / "lora_only" are left as they are, as
    peft's layers leave them."""
    for module in model.modules():
        if isinstance(module, LoraLayer):
            parts = module.adapter_parameters()
        elif isinstance(module, ModulesToSaveWrapper):
            parts = module.modules_to_save.parameters()
        else:
            continue
        for part in parts:
            part.requires_grad_(requires_grad)
