"""PeftModel: a model with its LoRA adapter, as peft's: calls and attributes pass through to the model; saving,
loading, merging and unloading the adapter; and prepare_model_for_kbit_training, peft's set-up of a quantized
model for QLoRA.

Offers: PeftModel (alias PeftModelForCausalLM), get_peft_model, prepare_model_for_kbit_training; and, from
adapter_state.py, get_peft_model_state_dict and set_peft_model_state_dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from pathlib import Path

import torch
from torch import nn

from gpuformers.lora.adapter_state import (get_peft_model_state_dict, read_adapter_weights,  # noqa: F401 (offered)
                                           set_peft_model_state_dict)
from gpuformers.lora.config import CLASSIFIER_MODULES, CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME, LoraConfig
from gpuformers.lora.layers import quantized_linear_types
from gpuformers.lora.lora_model import LoraModel
from gpuformers.lora.multi_adapter import MultiAdapterMixin


class PeftModel(MultiAdapterMixin, nn.Module):
    """A model with LoRA adapters, as peft's PeftModel: what get_peft_model and PeftModel.from_pretrained return.
    Several adapters may be loaded, one active (multi_adapter.py).

    Calls, generate() and attributes it does not have itself go to the wrapped model (get_base_model())."""

    def __init__(self, model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default",
                 autocast_adapter_dtype: bool = True, _strict: bool = True):
        super().__init__()
        if isinstance(model, PeftModel):
            raise ValueError("the model is already a PeftModel; call merge_and_unload() or unload() first, or "
                             "pass the plain model")
        from gpuformers.tensor_parallel import refuse

        refuse(model, "LoRA adapters")
        config = self._prepare_config(model, peft_config)
        self.base_model = LoraModel(model, config, adapter_name, autocast_adapter_dtype, strict=_strict)
        self.__dict__["_adapters"] = {adapter_name: self.base_model}  # out of the module tree: parked ones too

    @staticmethod
    def _prepare_config(model: nn.Module, peft_config) -> LoraConfig:
        """The LoraConfig the adapter is built with: a copy ("all-linear" is expanded in it, not in the caller's),
        from peft's own LoraConfig too, with peft's additions (SEQ_CLS's head, base_model_name_or_path)."""
        if not isinstance(peft_config, LoraConfig):
            if not callable(getattr(peft_config, "to_dict", None)):
                raise TypeError(f"peft_config is a {type(peft_config).__name__}; pass a gpuformers LoraConfig")
            peft_config = LoraConfig.from_dict(peft_config.to_dict())  # peft's own LoraConfig, ported as is
        config = dataclasses.replace(peft_config)
        if config.task_type == "SEQ_CLS":  # peft's PeftModelForSequenceClassification: the head trains fully
            # an adapter_config.json saved with SEQ_CLS lists them already: add each once
            present = config.modules_to_save or []
            config.modules_to_save = [*present, *(m for m in CLASSIFIER_MODULES if m not in present)]
        if config.base_model_name_or_path is None:
            name = getattr(model, "name_or_path", None)
            config.base_model_name_or_path = str(name) if name else None
        return config

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

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
        """(trainable, all) parameter counts, each shared (tied) tensor counted once, as peft counts them: a
        bitsandbytes 4-bit weight counts its 4-bit values (two per byte of storage), not its bytes."""
        trainable = total = 0
        for _, param in self.named_parameters():
            count = param.numel()
            if type(param).__name__ == "Params4bit":
                count *= 2 * param.element_size()
            total += count
            trainable += count if param.requires_grad else 0
        return trainable, total

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / total:.4f}")

    # --- adapters on and off ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def disable_adapter(self):
        """Inside the block the model runs without its adapters (the base model's outputs): LoRA layers off,
        modules_to_save back to their originals."""
        layers = [m for _, m in self.base_model.lora_layers() + self.base_model.modules_to_save_wrappers()]
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
        """Add each B @ A * scaling to its base weight (DoRA: and rescale its rows to the magnitude) and return the
        plain model (LoRA layers gone); each modules_to_save module is its trained copy."""
        self._check_one_adapter(adapter_names, "merging")
        self._drop_parked()
        return self.base_model._restore(merge=True, safe_merge=safe_merge)

    def unload(self) -> nn.Module:
        """Remove the LoRA layers without merging them and return the plain model. As in peft, each
        modules_to_save module stays its trained copy (the frozen original is dropped)."""
        self._drop_parked()
        return self.base_model._restore(merge=False)

    # --- files -----------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, safe_serialization: bool = True,
                        selected_adapters: list[str] | None = None, state_dict: dict | None = None,
                        is_main_process: bool = True, save_embedding_layers: bool | str = "auto",
                        **kwargs) -> None:
        """Write each adapter (or the selected ones) in peft's layout: adapter_config.json and
        adapter_model.safetensors, "default" in `save_directory` and any other in its subfolder of the adapter's
        name. `state_dict` replaces the model's own for the active adapter (e.g. gathered from FSDP2 shards; its
        adapter entries are saved); only the main process writes. save_embedding_layers: see
        get_peft_model_state_dict."""
        from gpuformers.loading.safetensors import write_file

        if not safe_serialization:
            raise NotImplementedError("safe_serialization=False (adapter_model.bin) is not supported; adapters "
                                      "are saved as safetensors")
        if kwargs:
            raise NotImplementedError(f"save_pretrained options not supported: {', '.join(sorted(kwargs))}")
        names = list(self._adapters) if selected_adapters is None else list(selected_adapters)
        unknown = [name for name in names if name not in self._adapters]
        if unknown:
            raise ValueError(f"selected_adapters {unknown} are not adapters of this model ({list(self._adapters)})")
        active = self.active_adapter
        if state_dict is not None and names != [active]:
            raise ValueError(f"state_dict holds the active adapter's tensors ({active!r}): save it alone "
                             f"(selected_adapters=[{active!r}]) and the others without state_dict")
        if not is_main_process:
            return
        try:
            for name in names:
                self._switch(name)  # its layers in the model, to read their tensors
                path = Path(save_directory) if name == "default" else Path(save_directory) / name
                path.mkdir(parents=True, exist_ok=True)
                dataclasses.replace(self.peft_config[name], inference_mode=True).save_pretrained(path)
                state = get_peft_model_state_dict(self, state_dict, save_embedding_layers=save_embedding_layers)
                write_file({k: v.detach() for k, v in state.items()}, path / WEIGHTS_NAME, metadata={"format": "pt"})
        finally:
            self._switch(active)

    @classmethod
    def from_pretrained(cls, model: nn.Module, model_id: str | os.PathLike, adapter_name: str = "default",
                        is_trainable: bool = False, config: LoraConfig | None = None,
                        autocast_adapter_dtype: bool = True, **kwargs) -> "PeftModel":
        """Load an adapter folder (written by us or by peft, or a Hub id) onto `model`."""
        folder, config = cls._adapter_files(model_id, config, is_trainable, kwargs)
        peft_model = cls._build(model, config, adapter_name, autocast_adapter_dtype, weights=folder)
        if not is_trainable:
            peft_model.eval()  # dropout off, as peft does
        return peft_model

    @classmethod
    def _build(cls, model: nn.Module, config: LoraConfig, adapter_name: str, autocast_adapter_dtype: bool,
               weights: Path | dict[str, torch.Tensor] | None = None) -> "PeftModel":
        """A PeftModel with one adapter: a fresh one (weights=None; every target_modules entry must match), or one
        holding `weights` (see _load_weights); if they do not fit, the caller's model is left as it was."""
        peft_model = cls(model, config, adapter_name, autocast_adapter_dtype, _strict=weights is None)
        if weights is None:
            return peft_model
        try:
            peft_model._load_weights(weights)
        except Exception:
            peft_model.base_model._restore(merge=False, keep_trained_copies=False)  # the caller's model as it was
            raise
        return peft_model

    @staticmethod
    def _adapter_files(model_id: str | os.PathLike, config: LoraConfig | None, is_trainable: bool,
                       kwargs: dict) -> tuple[Path, LoraConfig]:
        """The adapter's folder (a Hub id resolved; revision=, token=, ... in kwargs) and its LoraConfig."""
        from gpuformers.hub import HubKwargs, resolve_model_dir

        hub = HubKwargs.pop_from(kwargs)
        if kwargs:
            raise NotImplementedError(f"adapter loading options not supported: {', '.join(sorted(kwargs))}")
        folder = resolve_model_dir(model_id, [CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME], hub)
        config = config or LoraConfig.from_pretrained(folder)
        return folder, dataclasses.replace(config, inference_mode=not is_trainable)

    def _load_weights(self, weights: Path | dict[str, torch.Tensor]) -> None:
        """Saved adapter tensors into the active adapter's layers: an adapter folder's file, or the tensors under
        peft's keys."""
        set_peft_model_state_dict(self, weights if isinstance(weights, dict) else read_adapter_weights(weights))


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


def get_peft_model(model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default",
                   autocast_adapter_dtype: bool = True) -> PeftModel:
    """Wrap `model` with fresh LoRA adapters: base weights frozen, only lora_A / lora_B (lora_embedding_A / _B on an
    embedding, DoRA's magnitude), the copies of the modules_to_save and the biases `bias` names train."""
    return PeftModel(model, peft_config, adapter_name, autocast_adapter_dtype)


def prepare_model_for_kbit_training(model: nn.Module, use_gradient_checkpointing: bool = True,
                                    gradient_checkpointing_kwargs: dict | None = None) -> nn.Module:
    """peft's preparation of a quantized model for LoRA training (QLoRA), step for step; call it before
    get_peft_model. Returns the model.

    1. Every parameter is frozen (get_peft_model then makes the adapters trainable).
    2. Every float16 / bfloat16 parameter but the bitsandbytes 4-bit weights becomes float32 (embeddings, norms,
       LM head, biases): the activations then flow in float32 between the quantized layers, which compute in
       their compute dtype. A model with WeightOnlyLinear layers is left in its dtype, as peft leaves the models
       of its other quantization methods (gptq, hqq, torchao, ...), whose layers compute in theirs.
    3. On a quantized model, with use_gradient_checkpointing: each decoder layer is recomputed in the backward
       (torch.utils.checkpoint with `gradient_checkpointing_kwargs`; use_reentrant defaults to False, as in
       transformers and the Trainer), and, unless use_reentrant=False is given, the input embeddings' output
       requires grad, which reentrant checkpointing needs to reach the adapters (peft's condition).
    """
    from gpuformers.layers.blocks import checkpoint_decoder_layers
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    kwargs = dict(gradient_checkpointing_kwargs or {})
    layer_types = {type(m) for m in model.modules()}
    quantized = getattr(model, "is_quantized", False) or any(t in layer_types for t in quantized_linear_types())
    for param in model.parameters():
        param.requires_grad_(False)
    if WeightOnlyLinear not in layer_types:
        for param in model.parameters():
            if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
                param.data = param.data.to(torch.float32)
    if not (quantized and use_gradient_checkpointing):
        return model
    checkpoint_decoder_layers(model, "use_gradient_checkpointing", **{"use_reentrant": False, **kwargs})
    # peft's condition, on the kwargs as given: the hook unless use_reentrant=False was passed
    if kwargs.get("use_reentrant", True) and getattr(model, "_require_grads_hook", None) is None:
        model._require_grads_hook = model.get_input_embeddings().register_forward_hook(_make_output_require_grad)
    return model


def _make_output_require_grad(module: nn.Module, inputs, output: torch.Tensor) -> None:
    output.requires_grad_(True)

