"""device_map: run a model placed by a plan (device_plan.py decides the plan) over GPUs, the CPU and disk.

    loaded model + plan --dispatch_model--> hooks: activations follow the layers; a GPU runs its own modules;
                                            modules offloaded to "cpu" or "disk" run on the plan's first GPU (the
                                            CPU if it has none), their weights streamed in for their forward only;
                                            outputs come back on the input's device

`prepare_device_map` turns what from_pretrained was given (a strategy name or a dict, max_memory) into a plan and,
when the plan uses "disk", the DiskOffload folder the loader writes those weights to. The planning names
(plan_device_map, module_tree, ...) are re-exported here, where callers have always imported them.

Offers: DiskOffload, plan_for, prepare_device_map, main_device, execution_device, dispatch_model, and device_plan.py's
ModuleNode, module_tree, tied_groups, parse_max_memory, available_memory, balanced_memory, plan_device_map,
device_for, STRATEGIES.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from gpuformers.loading.device_plan import (  # noqa: F401 (re-exported: the planning names' old home)
    STRATEGIES, Device, ModuleNode, available_memory, balanced_memory, device_for, is_inside, module_tree,
    parse_max_memory, plan_device_map, tied_groups)


# ---------------------------------------------------------------------------------------------- disk offload


class DiskOffload:
    """A folder of weights kept off memory: one safetensors file per tensor, read back for one forward."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, dict] = {}

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def save(self, name: str, tensor: torch.Tensor, aliases: Iterable[str] = ()) -> None:
        """Write `tensor` under `name`; `aliases` (the other names of a tied tensor) read the same file."""
        from safetensors.torch import save_file

        save_file({"tensor": tensor.detach().contiguous().cpu()}, str(self._path(name)))
        entry = {"file": self._path(name).name, "dtype": str(tensor.dtype).removeprefix("torch."),
                 "shape": list(tensor.shape)}
        for key in [name, *aliases]:
            self.index[key] = entry
        (self.folder / "index.json").write_text(json.dumps(self.index, indent=1))

    def load(self, name: str, device: torch.device) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.index:
            raise KeyError(f"{name!r} was not offloaded to {self.folder}")
        with safe_open(str(self.folder / self.index[name]["file"]), framework="pt", device=str(device)) as file:
            return file.get_tensor("tensor")


# -------------------------------------------------------------------------------------------------- dispatch


def _plan_value(value: Any) -> Device:
    """A device as users write it in a device_map dict -> what a plan holds: a GPU index, "cpu" or "disk"."""
    if value == "disk":
        return "disk"
    from gpuformers.device import resolve_device

    device = resolve_device(value)
    return "cpu" if device.type == "cpu" else device.index


def plan_for(model: nn.Module, device_map: str | dict, *, max_memory: dict | None = None,
             dtype: torch.dtype | None = None, cuda: Any = None) -> dict[str, Device]:
    """The plan of device_map="auto" | "balanced" | ... | {module: device} for `model` (on the meta device)."""
    if isinstance(device_map, str):
        limits = max_memory if max_memory is not None else available_memory(cuda)
        tree = module_tree(model, dtype, getattr(model, "no_split_modules", ()))
        return plan_device_map(tree, limits, strategy=device_map, tied=tied_groups(model),
                               user_limits=max_memory is not None)
    return {name: _plan_value(value) for name, value in device_map.items()}


def prepare_device_map(model: nn.Module, device_map: str | dict, *, max_memory: dict | None = None,
                       dtype: torch.dtype | None = None, offload_folder: str | Path | None = None,
                       cuda: Any = None) -> tuple[dict[str, Device], DiskOffload | None]:
    """What from_pretrained does with device_map="auto" | "balanced" | ... | {module: device}: the plan for `model`
    (on the meta device), and the offload folder when the plan uses "disk"."""
    plan = plan_for(model, device_map, max_memory=max_memory, dtype=dtype, cuda=cuda)
    offload = None
    if "disk" in plan.values():
        if offload_folder is None:
            on_disk = [k for k, v in plan.items() if v == "disk"]
            raise ValueError(f"the device_map puts {', '.join(on_disk[:3])}{' ...' if len(on_disk) > 3 else ''} on "
                             f'"disk": pass offload_folder="some/folder" for those weights, or give the GPUs and the '
                             f"CPU more room with max_memory")
        offload = DiskOffload(offload_folder)
    return plan, offload


def execution_device(value: Any, main: torch.device) -> torch.device:
    """Where a module placed at `value` runs: a GPU runs its own modules; modules offloaded to "cpu" or "disk" run
    on `main` (the first GPU, where the planner kept room for the largest of them), their weights streamed in."""
    from gpuformers.device import resolve_device

    return main if value in ("disk", "cpu") else resolve_device(value)


def main_device(plan: dict[str, Any]) -> torch.device:
    """The device offloaded ("cpu" or "disk") modules run on: the first GPU of the plan, else the CPU."""
    from gpuformers.device import resolve_device

    devices = [resolve_device(v) for v in plan.values() if v != "disk"]
    gpus = sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index)
    return gpus[0] if gpus else torch.device("cpu")


def _move(value: Any, device: torch.device) -> Any:
    """Tensors inside tuples, lists and dicts -> `device`; anything else (a KV cache) is left as it is."""
    if isinstance(value, torch.Tensor):
        # Blocking: a non-blocking copy to the CPU could be read before the GPU has written it.
        return value.to(device) if value.device != device else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


class _Placement:
    """The forward hooks of one module of the plan: inputs to its device, streamed weights in and out."""

    def __init__(self, device: torch.device, streamed: list[tuple[nn.Module, str, bool, str | None]],
                 offload: DiskOffload | None):
        self.device = device
        self.streamed = streamed  # (module, attribute, is_parameter, offload name or None = copy from where it is)
        self.offload = offload
        self.saved: list[torch.Tensor] = []

    def before(self, module, args, kwargs):
        self.saved = []
        for owner, attr, is_param, name in self.streamed:
            table = owner._parameters if is_param else owner._buffers
            original = table[attr]
            self.saved.append(original)
            value = self.offload.load(name, self.device) if name is not None else original.to(self.device)
            table[attr] = nn.Parameter(value, requires_grad=False) if is_param else value
        return _move(args, self.device), _move(kwargs, self.device)

    def after(self, module, args, output):
        for (owner, attr, is_param, _), original in zip(self.streamed, self.saved):
            (owner._parameters if is_param else owner._buffers)[attr] = original
        self.saved = []
        return output


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _output_to(output: Any, device: torch.device) -> Any:
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        changes = {f.name: _move(getattr(output, f.name), device) for f in dataclasses.fields(output)
                   if f.name != "past_key_values"}
        return dataclasses.replace(output, **changes)
    return _move(output, device)


def dispatch_model(model: nn.Module, plan: dict[str, Any], offload: DiskOffload | None = None) -> None:
    """Hook `model` (loaded as `plan` says: weights on their device, "disk" ones as meta tensors in `offload`) so
    that a forward runs each planned module on its device and returns outputs on the device of its first input."""
    main = main_device(plan)
    names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    plan = _callable_entries(model, plan)
    for key in sorted(plan, key=lambda k: (k.count("."), k)):
        try:
            module = model.get_submodule(key)
        except AttributeError:  # a parameter's own entry: the module that holds it runs where the plan puts it
            continue
        device = execution_device(device_for(plan, key), main)
        nested = [k for k in plan if k != key and is_inside(k, key)]
        streamed = []
        for sub_name, sub in module.named_modules(prefix=key):
            if any(is_inside(sub_name, k) for k in nested if _is_module(model, k)):
                continue  # another entry of the plan owns this submodule
            for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
                for attr, tensor in table.items():
                    if tensor is None or tensor.device == device:
                        continue
                    if not is_param and not tensor.is_meta:
                        table[attr] = tensor.to(device)  # buffers (rotary frequencies) simply live where they run
                        continue
                    if tensor.is_meta:
                        name = names.get(id(tensor))
                        if offload is None or name not in offload.index:
                            raise ValueError(f"{sub_name}.{attr} is on the meta device and not in the offload folder;"
                                             f" load the model with this device_map and an offload_folder")
                        streamed.append((sub, attr, is_param, name))
                    else:
                        streamed.append((sub, attr, is_param, None))
        if key == "" and not streamed and device.type == "cpu" and len(plan) == 1:
            return  # one device: nothing to move
        hooks = _Placement(device, streamed, offload)
        module.register_forward_pre_hook(hooks.before, with_kwargs=True)
        module.register_forward_hook(hooks.after)

    # Outputs come back on the device the inputs came from (input_ids on the CPU -> logits on the CPU); labels go
    # where the logits are made, so that the loss is computed there.
    state = {}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    head_device = execution_device(device_for(plan, head_name), main) if head_name is not None else None

    def remember(module, args, kwargs):
        first = _first_tensor(args, kwargs)
        state["device"] = first.device if first is not None else None
        if head_device is not None and isinstance(kwargs.get("labels"), torch.Tensor):
            kwargs = {**kwargs, "labels": kwargs["labels"].to(head_device)}
        return args, kwargs

    def give_back(module, args, output):
        return output if state.get("device") is None else _output_to(output, state["device"])

    model.register_forward_pre_hook(remember, with_kwargs=True, prepend=True)
    model.register_forward_hook(give_back)


def _callable_entries(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with containers (a ModuleList of layers), which are never called and so never run hooks,
    replaced by their children."""
    out, todo = {}, list(plan.items())
    while todo:
        key, value = todo.pop(0)
        module = model.get_submodule(key) if _is_module(model, key) else None
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            prefix = f"{key}." if key else ""
            todo += [(prefix + name, value) for name, _ in module.named_children()]
        else:
            out[key] = value
    return out


def _is_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
