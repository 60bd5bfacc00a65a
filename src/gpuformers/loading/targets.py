"""Load targets: the tensors of a meta-device model that a load fills, and where each one goes.

A `LoadTarget` is one tensor of the model under every name it is known by: a Parameter shared by two modules, or a
tied target -> source pair, is one target, loaded once and put in every slot. A module that defines
`load_from_checkpoint` (a quantized Linear, say) loads itself, so its tensors are set aside rather than collected.
Placement turns load_weights' `device` (one device, a device_map dict resolved by longest module prefix, or a
function name -> device) into a function name -> torch.device or "disk"; a parameter placed on "disk" is written
to the offload folder (loading/device_map.py's DiskOffload) and stays a meta tensor in the model.

Offers: assign_tensor; for loading/weights.py, LoadTarget, collect_targets, persistent_tensors, placement,
assign_loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass
class LoadTarget:
    """One tensor of the model, under all the names it is known by (more than one when tied)."""

    names: list[str]
    slots: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    meta: torch.Tensor
    key: str | None = None  # the checkpoint key chosen to fill it
    loaded: bool = False

    def assign(self, value: torch.Tensor) -> None:
        if self.slots[0][2]:
            value = nn.Parameter(value, requires_grad=self.meta.requires_grad and value.is_floating_point())
        for module, attr, is_param in self.slots:
            (module._parameters if is_param else module._buffers)[attr] = value
        self.loaded = True


def assign_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in the model's parameter or buffer `name` (on any device, meta included), as a loader does:
    a parameter stays an nn.Parameter (requires_grad for floating tensors), a buffer stays a buffer."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    is_param = attr in module._parameters
    if not is_param and attr not in module._buffers:
        raise KeyError(f"{name!r} is not a parameter or buffer of {type(model).__name__}")
    old = (module._parameters if is_param else module._buffers)[attr]
    if old is not None and tuple(old.shape) != tuple(value.shape):
        raise ValueError(
            f"cannot assign {name!r}: the model's shape is {list(old.shape)}, the tensor's {list(value.shape)}"
        )
    slot = LoadTarget([name], [(module, attr, is_param)], old if old is not None else value)
    slot.assign(value)


def persistent_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers (not its children's)."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield attr, p
    for attr, b in module._buffers.items():
        if b is not None and attr not in module._non_persistent_buffers_set:
            yield attr, b


def collect_targets(model: nn.Module, tied: dict[str, str]) -> tuple[dict[str, LoadTarget], dict[str, nn.Module]]:
    """name -> LoadTarget for every tensor to load (aliases share one LoadTarget); and the modules with a load hook."""
    by_id: dict[int, LoadTarget] = {}
    targets: dict[str, LoadTarget] = {}
    hooked: dict[str, nn.Module] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if callable(getattr(module, "load_from_checkpoint", None)):
            hooked[prefix] = module
            continue
        if any(prefix.startswith(h + ".") or h == "" for h in hooked):
            continue  # inside a module that loads itself
        for attr, tensor in persistent_tensors(module):
            name = f"{prefix}.{attr}" if prefix else attr
            target = by_id.setdefault(id(tensor), LoadTarget([], [], tensor))
            target.names.append(name)
            target.slots.append((module, attr, attr in module._parameters))
            targets[name] = target
    for dst, src in tied.items():
        for name in (dst, src):
            if name not in targets:
                raise ValueError(f"tied weight {name!r} ({dst!r} -> {src!r}) is not a parameter of the model")
        source, target = targets[src], targets[dst]
        if source is target:
            continue
        if tuple(source.meta.shape) != tuple(target.meta.shape):
            raise ValueError(
                f"cannot tie {dst!r} {list(target.meta.shape)} to {src!r} {list(source.meta.shape)}: shapes differ"
            )
        source.names += target.names  # the source's names come first: its checkpoint key wins
        source.slots += target.slots
        for name in target.names:
            targets[name] = source
    return targets, hooked


def placement(device, offload) -> Callable[[str], "torch.device | str"]:
    """`device` as load_weights takes it -> a function tensor name -> torch.device or "disk"."""
    if isinstance(device, dict):
        from gpuformers.loading.device_map import device_for

        plan = device
        choose = lambda name: device_for(plan, name)  # noqa: E731
    elif callable(device):
        choose = device
    else:
        single = device
        choose = lambda name: single  # noqa: E731
    known: dict[object, torch.device | str] = {}

    def place(name: str) -> torch.device | str:
        value = choose(name)
        key = str(value)
        if key not in known:
            if value == "disk":
                if offload is None:
                    raise ValueError(f"{name!r} is placed on \"disk\" but no offload folder was given; pass "
                                     f"offload_folder=\"some/folder\" (or more max_memory for the GPUs and the CPU)")
                known[key] = "disk"
            else:
                resolved = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
                if resolved.type == "cuda" and not torch.cuda.is_available():
                    raise RuntimeError(f"device {str(resolved)!r} was asked for, but torch sees no CUDA GPU; "
                                       f"load on 'cpu' instead")
                known[key] = resolved
        return known[key]

    return place


def assign_loaded(target: LoadTarget, value: torch.Tensor, where, offload) -> None:
    """Put a loaded tensor in the model; a parameter placed on "disk" goes to the offload folder, leaving meta."""
    if where == "disk" and target.slots[0][2]:
        offload.save(target.names[0], value, target.names[1:])
        value = torch.empty_like(value, device="meta")
    target.assign(value)
