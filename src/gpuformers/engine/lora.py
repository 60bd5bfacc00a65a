"""The engine's adapter bank: many LoRA adapters served at once over one base model (vLLM's multi-LoRA).

Requests with different adapters, and requests with none, share one step and one paged KV cache. The bank wraps each
linear layer that some adapter targets, in place, in a MultiLoraLinear; the model runner tells the wrappers, for
the step being run, which rows of the flattened batch belong to which adapter (`adapter_rows`, a thread-local
context like paged_attention's `paged_context`):

    flattened tokens   [ d0 | d1 | d2 | p3 p3 p3 p3 | p4 p4 ]     sequences 0 and 3 use "a", 1 and 2 "b", 4 none
    adapter             a    b    b    a             -
    rows per adapter   a: rows 0, 3..6 (two runs: an index tensor)    b: rows 1..2 (one run: a slice)

    y = base(x);  for each adapter k of the step:  y[rows_k] += (x[rows_k] @ A_k^T) @ B_k^T * scaling_k

Neighbouring sequences with the same adapter are merged into one run; an adapter whose rows are one run is sliced,
one with several is gathered and scattered back once (one pair of matmuls per adapter and layer, not per run).
The runs are decided on the host each step, which a captured CUDA graph cannot follow: while adapters are loaded
the manager runs without CUDA graphs. Outside an engine step (plain generate) a wrapper is exactly its base layer.
When the bank is emptied or the manager stops, the wrappers are taken out again and the model is as it was.
The manager reads an adapter (`read`, files to the device) in the caller's thread and adds or deletes it between two
steps of its loop, so a step never sees the adapters change.

Adapters are peft folders (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.<module>.lora_A.weight`): plain LoRA on linear layers, any rank and targets per adapter, the
weights cast to the model's dtype and device. What would need more (DoRA, embedding or LM-head targets,
modules_to_save, trained biases, tensor parallelism, a model that already holds an adapter) is refused by name.

Offers: AdapterBank, LoadedAdapter, MultiLoraLinear, adapter_rows, current_adapter_rows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpuformers.engine.sampler import device_tensor
from gpuformers.layers.blocks import replace_submodule

if TYPE_CHECKING:
    from gpuformers.lora.config import LoraConfig

_PEFT_PREFIX = "base_model.model."
_local = threading.local()


def current_adapter_rows() -> dict[str, slice | torch.Tensor] | None:
    """This thread's step: {adapter name: its rows of the flattened batch}, or None outside a step with adapters."""
    return getattr(_local, "rows", None)


@contextlib.contextmanager
def adapter_rows(rows: dict[str, slice | torch.Tensor] | None):
    """Make `rows` the adapters' rows the MultiLoraLinear layers see in this thread, for one forward."""
    previous = current_adapter_rows()
    _local.rows = rows
    try:
        yield rows
    finally:
        _local.rows = previous


class MultiLoraLinear(nn.Module):
    """A linear layer (nn.Linear or a quantized one) plus, in an engine step, each adapter's low-rank update on the
    rows of the sequences that use it. The adapters' tensors are plain attributes, not parameters: the model's
    state_dict and parameter count do not change."""

    def __init__(self, base_layer: nn.Module):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        # adapter name -> (A (r, in), B (out, r), scaling)
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    # The base layer's parameters read through the wrapper, as code written for the wrapped layer expects.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        rows = current_adapter_rows()
        if rows is None:
            return out
        flat_x, flat_out = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        for name, where in rows.items():
            lora = self.adapters.get(name)
            if lora is None:  # this adapter does not target this layer
                continue
            a, b, scaling = lora
            if isinstance(where, slice):
                flat_out[where] += (((flat_x[where].to(a.dtype) @ a.T) @ b.T) * scaling).to(out.dtype)
            else:
                update = ((flat_x.index_select(0, where).to(a.dtype) @ a.T) @ b.T) * scaling
                flat_out.index_add_(0, where, update.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"adapters={list(self.adapters)}"


@dataclass
class LoadedAdapter:
    """One adapter in the bank: its LoRA pairs per target module, on the model's device and in its dtype."""

    name: str
    adapter_id: int  # unique to this load: the prefix cache's chain start (a reloaded name never reuses blocks)
    config: LoraConfig  # from adapter_config.json
    # module name -> (A (r, in), B (out, r), scaling): r and scaling per module (rank_pattern / alpha_pattern)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


class AdapterBank:
    """The adapters a ContinuousBatchingManager serves, and the MultiLoraLinear wrappers they need in its model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, LoadedAdapter] = {}
        self._wrappers: dict[str, MultiLoraLinear] = {}  # module name -> its wrapper, while installed
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # install / uninstall from the caller's thread and the engine's

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def __contains__(self, name) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    @property
    def nbytes(self) -> int:
        """Device memory the adapters' tensors take."""
        return sum(t.numel() * t.element_size() for adapter in self.adapters.values()
                   for pair in adapter.pairs.values() for t in pair[:2])

    def adapter_id(self, name: str) -> int | None:
        adapter = self.adapters.get(name)
        return adapter.adapter_id if adapter is not None else None

    def check_name(self, name: str) -> None:
        """ValueError naming the loaded adapters when `name` is not one of them."""
        if name not in self.adapters:
            loaded = ", ".join(map(repr, self.adapters)) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {loaded}); load it with "
                             f"manager.load_adapter(folder, {name!r}), or send adapter_name=None for the base model")

    # --- loading ----------------------------------------------------------------------------------------------

    def read(self, peft_model_id: str | os.PathLike, adapter_name: str, **hub_kwargs) -> LoadedAdapter:
        """Read an adapter folder (or Hub id) onto the model's device and check that the engine can serve it (the
        bank is not changed: add() does that)."""
        from gpuformers.hub import HubKwargs, resolve_model_dir
        from gpuformers.lora.config import CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME, LoraConfig
        from gpuformers.lora.adapter_state import read_adapter_weights

        if not isinstance(adapter_name, str) or not adapter_name:
            raise ValueError(f"adapter_name={adapter_name!r} must be a non-empty string (what requests send)")
        if adapter_name in self.adapters:
            raise ValueError(f"adapter {adapter_name!r} is already loaded; delete_adapter({adapter_name!r}) first "
                             f"to replace it")
        self._check_model()
        folder = resolve_model_dir(peft_model_id, [CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME],
                                   HubKwargs(**hub_kwargs))
        config = LoraConfig.from_pretrained(folder)
        _check_config(config, adapter_name)
        pairs = self._pairs(read_adapter_weights(folder), config, adapter_name)
        return LoadedAdapter(adapter_name, next(self._ids), config, pairs)

    def add(self, adapter: LoadedAdapter) -> None:
        """Serve a read adapter: wrap the layers it targets."""
        if adapter.name in self.adapters:  # loaded meanwhile under the same name
            raise ValueError(f"adapter {adapter.name!r} is already loaded; delete_adapter({adapter.name!r}) first "
                             f"to replace it")
        self.adapters[adapter.name] = adapter
        self.install()

    def delete(self, adapter_name: str) -> None:
        self.check_name(adapter_name)
        del self.adapters[adapter_name]
        self.install()  # drops its tensors from the wrappers, and the wrappers no adapter needs any more

    def _check_model(self) -> None:
        from gpuformers.lora.layers import LoraLayer
        from gpuformers.lora.modules_to_save import ModulesToSaveWrapper
        from gpuformers.tensor_parallel import refuse

        refuse(self.model, "multi-LoRA serving")
        if getattr(self.model, "_hf_peft_config_loaded", False) or any(
                isinstance(m, (LoraLayer, ModulesToSaveWrapper)) for m in self.model.modules()):
            raise NotImplementedError(
                "this model already holds a LoRA adapter in place (model.load_adapter / add_adapter / PeftModel), "
                "and the engine's adapters would stack on it; serve the plain model and load every adapter into the "
                "engine (adapters={name: folder} or manager.load_adapter), or merge_and_unload() it first")

    def _pairs(self, weights: dict[str, torch.Tensor], config, adapter_name: str) -> dict:
        """{module name: (A, B)} from peft's keys, checked against the model's layers, cast to its dtype/device."""
        from gpuformers.layers.linear import is_fan_in_fan_out
        from gpuformers.lora.layers import quantized_linear_types

        found: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            module, part = _split_key(key)
            if part is not None:
                found.setdefault(module, {})[part] = tensor
        if not weights:
            raise ValueError(f"adapter {adapter_name!r} has no weights in its adapter_model.safetensors")
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        # adapter files name modules as the family's checkpoints do (GPT-NeoX: gpt_neox.layers.0.attention...)
        rename = getattr(self.model, "checkpoint_key", None)
        ours = {rename(n): n for n, _ in self.model.named_modules()} if rename else {}
        found = {ours.get(name, name): parts for name, parts in found.items()}
        supported = (nn.Linear, *quantized_linear_types())
        device, dtype = self.model.device, self.model.dtype
        pairs = {}
        for name, parts in found.items():
            if set(parts) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter {adapter_name!r}: {name} has {sorted(parts)} but needs lora_A and lora_B")
            try:
                layer = self.model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"adapter {adapter_name!r} targets {name}, which this model does not have; load "
                                 f"the adapter onto the base model it was trained on") from None
            if isinstance(layer, MultiLoraLinear):
                layer = layer.base_layer
            if isinstance(layer, nn.Embedding) or layer is head:
                raise NotImplementedError(
                    f"adapter {adapter_name!r} targets {name} ({type(layer).__name__}): LoRA on the embeddings or "
                    f"the LM head is not supported in multi-LoRA serving; merge that adapter into the model "
                    f"(merge_and_unload) and serve the result")
            if type(layer) not in supported and not is_fan_in_fan_out(layer):
                raise NotImplementedError(f"adapter {adapter_name!r} targets {name} ({type(layer).__name__}): "
                                          f"multi-LoRA serving wraps nn.Linear and gpuformers' quantized linear "
                                          f"layers only")
            a, b = parts["lora_A"], parts["lora_B"]
            own = config.for_module(name)  # its r and lora_alpha (rank_pattern / alpha_pattern)
            if a.shape != (own.r, layer.in_features) or b.shape != (layer.out_features, own.r):
                raise ValueError(f"adapter {adapter_name!r}: {name} has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)}, but r={own.r} and the layer is {layer.in_features} -> "
                                 f"{layer.out_features}; load the adapter onto the base model it was trained on")
            pairs[name] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), own.scaling)
        others = [key for key in weights if _split_key(key)[1] is None]
        if others:
            embeddings = [key for key in others if ".lora_embedding_" in key]
            what = f"LoRA on an embedding ({embeddings[0]})" if embeddings else others[0]
            raise NotImplementedError(
                f"adapter {adapter_name!r} holds {what}, which multi-LoRA serving does not support (only lora_A / "
                f"lora_B of linear layers: no embedding LoRA, saved embeddings, biases or modules_to_save copies); "
                f"merge such an adapter into the model instead (merge_and_unload) and serve the result")
        return pairs

    # --- the wrappers -----------------------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return bool(self._wrappers)

    def install(self) -> None:
        """Wrap every layer some adapter targets (and only those) and give each wrapper its adapters' tensors."""
        with self._lock:
            wanted: dict[str, dict] = {}
            for adapter in self.adapters.values():
                for module, lora in adapter.pairs.items():
                    wanted.setdefault(module, {})[adapter.name] = lora
            for module in [m for m in self._wrappers if m not in wanted]:
                replace_submodule(self.model, module, self._wrappers.pop(module).base_layer)
            for module, loras in wanted.items():
                wrapper = self._wrappers.get(module)
                if wrapper is None:
                    wrapper = self._wrappers[module] = MultiLoraLinear(self.model.get_submodule(module))
                    replace_submodule(self.model, module, wrapper)
                wrapper.adapters = loras

    def uninstall(self) -> None:
        """Put the model's own layers back (the adapters stay loaded; the next step that needs them wraps again)."""
        with self._lock:
            for module, wrapper in self._wrappers.items():
                replace_submodule(self.model, module, wrapper.base_layer)
            self._wrappers = {}

    # --- one step ---------------------------------------------------------------------------------------------

    def rows(self, sequences, num_tokens: list[int]) -> dict[str, slice | torch.Tensor] | None:
        """Per adapter used in the step, its rows of the flattened batch (a slice for one run, else an index
        tensor on the model's device); None when no sequence of the step uses an adapter."""
        runs: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for seq, n in zip(sequences, num_tokens):
            name = seq.adapter_name
            if name is not None:
                spans = runs.setdefault(name, [])
                if spans and spans[-1][1] == start:  # the previous sequence's run: merge
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not runs:
            return None
        if not self.installed:  # the manager was stopped and is stepping again
            self.install()
        return {name: slice(*spans[0]) if len(spans) == 1
                else device_tensor([r for s, e in spans for r in range(s, e)], self.model.device)
                for name, spans in runs.items()}


def _check_config(config, adapter_name: str) -> None:
    """Refuse, by name, the adapter settings that multi-LoRA serving does not implement."""
    refused = []
    if config.use_dora:
        refused.append("use_dora=True (DoRA)")
    if config.modules_to_save:
        refused.append(f"modules_to_save={config.modules_to_save!r}")
    if config.bias != "none":
        refused.append(f"bias={config.bias!r}")
    if refused:
        raise NotImplementedError(f"adapter {adapter_name!r} sets {', '.join(refused)}, which multi-LoRA serving "
                                  f"does not support (only plain LoRA on linear layers); merge it into the model "
                                  f"(model.load_adapter(folder) then merge_and_unload()) and serve the result")


def _split_key(key: str) -> tuple[str, str | None]:
    """peft's saved key -> (module name in the model, "lora_A" / "lora_B"), or (key, None) for any other tensor."""
    name = key.removeprefix(_PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if name.endswith(suffix):
            return name[:-len(suffix)], part
    return key, None
