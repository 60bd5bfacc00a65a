"""device_map planning: where each part of a model lives (GPUs, then the CPU, then disk), decided from module sizes
and device limits before any weight is loaded; device_map.py runs a model so placed.

    model on meta --module_tree--> ModuleNode tree (bytes per module in the load dtype)
                   --plan_device_map(tree, max_memory, strategy)--> {"model.layers.0": 0, ..., "lm_head": "cpu"}

The planner is a pure function of module sizes and device limits (tests inject 1, 2 or 4 simulated GPUs). Its rules
are accelerate's, as transformers applies them, so that a plan here equals the one users get there:
- modules are taken in order (own parameters, children, own buffers); one that does not fit on the current device
  is split into its children, unless it is a leaf or a no-split class (a decoder layer: its residual stream must
  stay on one device); when it cannot be split the planner moves on to the next device, never back;
- on the "main" devices (the first GPU and the CPU) room for the largest remaining layer is kept free, because
  offloaded layers are brought there to run;
- tied weights (lm_head = embed_tokens) go with the module that holds their first copy;
- "balanced" / "auto" first lowers each GPU's limit (but the last) to an even share plus a margin
  (`balanced_memory`); "balanced_low_0" keeps GPU 0 as empty as possible (generate() uses it); "sequential" fills
  GPU 0, then 1, ...; whatever is left goes to "cpu", then "disk".

Offers: ModuleNode, module_tree, tied_groups, parse_max_memory, available_memory, balanced_memory,
plan_device_map, device_for, is_inside, STRATEGIES, Device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from gpuformers.sizes import parse_size

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

Device = int | str  # a GPU index, "cpu" or "disk": the values of a plan


# ------------------------------------------------------------------------------------------------ module sizes


@dataclass
class ModuleNode:
    """A module (or a lone parameter / buffer) with its size in bytes, as the planner sees it."""

    name: str  # "model.layers.3"; "" for the root
    size: int
    children: list["ModuleNode"] = field(default_factory=list)  # own parameters first, then child modules
    buffers: list["ModuleNode"] = field(default_factory=list)  # own buffers: placed with the module, dropped on split
    no_split: bool = False  # a no-split class (a decoder layer): placed whole or not at all
    is_module: bool = True  # False for a parameter or buffer

    @property
    def whole(self) -> bool:
        """Placed as one piece: a tensor, a no-split module, or a module without child modules (a Linear)."""
        return not self.is_module or self.no_split or not any(c.is_module for c in self.children)

    @property
    def splittable(self) -> bool:
        return not self.whole

    def leaves_biggest(self) -> int:
        """The biggest sum of one module's own tensors (usually the embedding), over the whole subtree."""
        own = sum(c.size for c in self.children + self.buffers if not c.is_module)
        return max([own] + [c.leaves_biggest() for c in self.children if c.is_module])

    def walk(self) -> Iterable["ModuleNode"]:
        yield self
        for child in self.children + self.buffers:
            yield from child.walk()


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    # Floating tensors are loaded in `dtype`; integer and bool tensors keep theirs (as the loader does).
    if tensor.is_floating_point():
        # A bitsandbytes weight still to be quantized has its float (out, in) shape on the meta device, but is
        # stored in 4 bits (two per byte) or 8; sized as float, a 4-bit model would be planned 4x too big and
        # needlessly offloaded. Sizes as transformers plans them (statistics left out).
        kind = type(tensor).__name__
        if kind == "Params4bit" and not getattr(tensor, "bnb_quantized", False):
            return (tensor.numel() + 1) // 2
        if kind == "Int8Params" and not getattr(tensor, "has_fp16_weights", False):
            return tensor.numel()
    size = dtype.itemsize if (dtype is not None and tensor.is_floating_point()) else tensor.element_size()
    return tensor.numel() * size


def module_tree(model: nn.Module, dtype: torch.dtype | None = None, no_split: Iterable[str] = ()) -> ModuleNode:
    """The size tree of `model` (meta tensors are fine): each shared tensor counted once, where it first appears."""
    no_split, seen = set(no_split), set()

    def build(name: str, module: nn.Module) -> ModuleNode:
        prefix = f"{name}." if name else ""

        def tensors(items) -> list[ModuleNode]:
            nodes = []
            for attr, tensor in items:
                if tensor is None:
                    continue
                first = id(tensor) not in seen
                seen.add(id(tensor))
                nodes.append(ModuleNode(prefix + attr, _tensor_bytes(tensor, dtype) if first else 0, is_module=False))
            return nodes

        params = tensors(module._parameters.items())
        kids = [build(prefix + child_name, child) for child_name, child in module.named_children()]
        buffers = tensors(module._buffers.items())
        size = sum(n.size for n in params + kids + buffers)
        return ModuleNode(name, size, params + kids, buffers, no_split=type(module).__name__ in no_split)

    return build("", model)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (tied embeddings), one sorted list per tensor shared by several."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(group) for group in names.values() if len(group) > 1]


# ---------------------------------------------------------------------------------------------- device limits


def parse_max_memory(max_memory: dict) -> dict[Device, int]:
    """{0: "20GiB", "cuda:1": 10**10, "cpu": "64GB", "disk": ...} -> bytes, GPUs first by index, then cpu, disk."""
    gpus, others = {}, {}
    for key, value in max_memory.items():
        if isinstance(key, torch.device):
            key = key.index if key.type == "cuda" else key.type
        if isinstance(key, str) and (m := re.fullmatch(r"cuda:(\d+)", key.strip())):
            key = int(m[1])
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            gpus[key] = parse_size(value, name=f"max_memory[{key!r}]", allow_zero=True)
        elif key in ("cpu", "disk"):
            others[key] = parse_size(value, name=f"max_memory[{key!r}]", allow_zero=True)
        else:
            raise ValueError(f"max_memory key {key!r} is not a device; use GPU indices (0, 1, ...), \"cpu\" or \"disk\"")
    return {**dict(sorted(gpus.items())), **{k: others[k] for k in ("cpu", "disk") if k in others}}


def available_memory(cuda: Any = None) -> dict[Device, int]:
    """What each device has free now: every visible GPU's free memory, and 90% of the CPU's available RAM
    (a load has short spikes above the model's size; offloading a little more to disk is the safer side).
    A GPU's free memory counts what this process's caching allocator holds unused (a model loaded and deleted
    before): the driver sees it as taken, but the load can use it, as transformers counts it."""
    import psutil

    cuda = torch.cuda if cuda is None else cuda
    limits: dict[Device, int] = {}
    if cuda.is_available():
        for index in range(cuda.device_count()):
            cached = 0
            if hasattr(cuda, "memory_reserved"):  # (fakes in tests may not have it)
                cached = cuda.memory_reserved(index) - cuda.memory_allocated(index)
            limits[index] = int(cuda.mem_get_info(index)[0]) + int(cached)
    limits["cpu"] = int(psutil.virtual_memory().available * 0.9)
    return limits


def balanced_memory(tree: ModuleNode, max_memory: dict[Device, int], *, low_zero: bool = False,
                    user_limits: bool = True) -> dict[Device, int]:
    """Lower each GPU's limit (all but the last) to an even share of the model plus a margin of 1.25 x the largest
    no-split module or leaf, so that "balanced" spreads layers over every GPU instead of filling GPU 0 first.

    low_zero: GPU 0 gets only what the other GPUs cannot hold. user_limits=False (limits measured, not given): a
    lone GPU keeps 10% free for activations."""
    limits = dict(max_memory)
    gpus = sorted(k for k, v in limits.items() if isinstance(k, int) and v > 0)
    if not gpus:
        return limits
    if len(gpus) == 1:
        low_zero = False
        if not user_limits:
            limits[gpus[0]] = int(limits[gpus[0]] * 0.9)
    layers = [n.size for n in tree.walk() if n.no_split]
    margin = int(1.25 * max(max(layers, default=0), tree.leaves_biggest()))
    share = tree.size // (len(gpus) - 1 if low_zero else len(gpus)) + margin
    for index in gpus[:-1]:
        limits[index] = min(limits[0] if low_zero and index == 0 else share, limits[index])
    if low_zero:
        rest = sum(limits[i] for i in range(1, len(gpus)))
        limits[0] = min(max(0, tree.size - rest), limits[0])
    return limits


# ------------------------------------------------------------------------------------------------- the planner


def _largest_layer(nodes: list[ModuleNode]) -> tuple[int, list[str]]:
    """Size and names of the largest unit that will be placed whole (a leaf or a no-split module) under `nodes`."""
    best, names, todo = 0, [], list(nodes)
    while todo:
        node = todo.pop(0)
        if node.whole:
            if node.size > best:
                best, names = node.size, [node.name]
            elif node.size == best:
                names.append(node.name)
        else:
            todo = node.children + todo
    return best, names


def is_inside(name: str, prefix: str) -> bool:
    """Whether module or tensor `name` is `prefix` or lies under it ("" holds everything)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def plan_device_map(tree: ModuleNode, max_memory: dict, *, strategy: str = "sequential",
                    tied: list[list[str]] = (), user_limits: bool = True) -> dict[str, Device]:
    """module name -> 0, 1, ..., "cpu" or "disk", filling devices in order (see the module docstring).

    tree: from module_tree(model, dtype, model.no_split_modules). max_memory: bytes (or "20GiB") per device, e.g.
    {0: "10GiB", 1: "10GiB", "cpu": "64GiB"}; a device that is absent gets nothing; "disk" is unlimited.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f'device_map strategy "{strategy}" is not one of: {", ".join(STRATEGIES)}')
    limits = parse_max_memory(max_memory)
    if strategy != "sequential":
        limits = balanced_memory(tree, limits, low_zero=strategy == "balanced_low_0", user_limits=user_limits)
    devices: list[Device] = [d for d in limits if d != "disk"] + ["disk"]
    gpus = [d for d in devices if isinstance(d, int)]
    main = {gpus[0], "cpu"} if gpus else {"cpu"}

    queue = tree.children + tree.buffers
    plan: dict[str, Device] = {}
    used = {d: 0 for d in devices}
    current = 0
    reserve, reserve_names = _largest_layer(queue)
    while queue:
        node = queue.pop(0)
        reserve_names = [n for n in reserve_names if not is_inside(n, node.name)]
        if not reserve_names:
            reserve, reserve_names = _largest_layer([n for n in queue if n.is_module])
        device = devices[current]
        limit = None if device == "disk" else limits[device]
        held = reserve if device in main else 0  # room kept for the largest offloaded layer to run here
        if limit is not None:
            limit -= held

        # Tied tensors that live outside this module: their modules must come along.
        outside = [p for group in tied if any(is_inside(p, node.name) for p in group)
                   and not all(is_inside(p, node.name) for p in group) for p in group if not is_inside(p, node.name)]
        partners: list[ModuleNode] = []
        for param in outside:
            holder = next((n for n in queue if param.startswith(n.name + ".")), None)
            if holder is not None and holder not in partners:
                partners.append(holder)
        size_with_ties = node.size + sum(p.size for p in partners)

        if limit is None or used[device] + size_with_ties <= limit:
            used[device] += size_with_ties
            plan[node.name] = device
            for partner in partners:
                queue.remove(partner)
                plan[partner.name] = device
            continue
        if partners and used[device] + node.size <= limit:
            # The module fits alone: split a tied partner so that the tied part can come along.
            splittable = next((p for p in partners if p.splittable), None)
            if splittable is not None:
                at = queue.index(splittable)
                queue = [node] + queue[:at] + splittable.children + queue[at + 1:]
                reserve, reserve_names = _largest_layer([n for n in queue if n.is_module])
                continue
        if used[device] + node.size >= limit and node.splittable:
            queue = node.children + queue
            reserve, reserve_names = _largest_layer([n for n in queue if n.is_module])
            continue
        # Nothing more goes here: the device keeps the reserve, and the planner moves on.
        used[device] += held
        current += 1
        queue.insert(0, node)
    return _merge_same_device(plan)


def _merge_same_device(plan: dict[str, Device], prefix: str = "") -> dict[str, Device]:
    """Replace every group of entries under one module that share a device by that module's single entry."""
    under = [k for k in plan if is_inside(k, prefix)]
    values = {plan[k] for k in under}
    if len(values) == 1 and len(under) > 1:
        device = plan[under[0]]
        for key in under:
            del plan[key]
        plan[prefix] = device
    depth = len(prefix.split(".")) + 1 if prefix else 1
    for child in {".".join(k.split(".")[:depth]) for k in plan if is_inside(k, prefix) and len(k) > len(prefix)}:
        _merge_same_device(plan, child)
    return plan


def device_for(plan: dict[str, Any], name: str) -> Any:
    """The device of tensor or module `name` under `plan`: the entry of its longest enclosing prefix."""
    parts = name.split(".")
    for cut in range(len(parts), -1, -1):
        key = ".".join(parts[:cut])
        if key in plan:
            return plan[key]
    raise ValueError(f"device_map has no entry for {name!r} (nor for any module that holds it); add one, "
                     f'e.g. {{"{parts[0]}": "cpu"}}, or {{"": "cpu"}} for the whole model')
