"""Checkpoint weights: find a folder's weight files, and fill a model built on the meta device from them.

    folder --CheckpointFiles.find--> [shard files] --load_weights--> every parameter / persistent buffer
                                                                      materialised in its final dtype and device

`load_weights` walks the checkpoint one tensor at a time. Each tensor is allocated once, in its final dtype
on its final device, and filled from the file: on the CPU with a matching dtype the bytes are read straight
into the parameter's memory; otherwise they pass through one small staging buffer (pinned for CUDA) in
chunks and are converted on copy. The file is never mmapped, so the process never holds a second copy of
the model: peak resident memory is about the model's size plus one chunk.

Names in the model and in the checkpoint are the same (model.layers.0.self_attn.q_proj.weight, ...).
Tied parameters (the same Parameter object in two modules, or a `tied` target -> source pair) are loaded
once and shared. A module that defines `load_from_checkpoint(name, tensor)` (a quantized Linear, say)
receives its tensors instead, and owns how they are stored. A model class whose checkpoints may store several of
its tensors in one (transformers' fused MoE experts) lists `checkpoint_fan_out` rules (loading/fan_out.py): a
checkpoint key the model lacks that a rule matches is cut into pieces, each read from the file like a tensor of
its own (into its parameter, or handed to its load_from_checkpoint module).

`device` is one device, or a placement per tensor (a device_map dict resolved by longest module prefix, or a
function name -> device); the target "disk" writes the tensor to an offload folder (`DiskOffload`) and leaves a
meta tensor in the model, which loading/device_map.py streams in when its layer runs.

Offers: CheckpointFiles, LoadingInfo, load_weights, assign_tensor.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from gpuformers.loading.fan_out import FanOut, Piece
from gpuformers.loading.safetensors import SafetensorsFile, TensorInfo, byte_view

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

# Bytes per staging chunk when a tensor must be converted or sent to a GPU: big enough that reads and
# copies run at full speed, small next to any model. A multiple of every element size.
CHUNK_BYTES = 64 * 1024 * 1024

ShardFn = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


# ---------------------------------------------------------------------------------------------------------
# Which files


@dataclass
class CheckpointFiles:
    """The weight files of one checkpoint folder: a single file, or shards listed by an index."""

    folder: Path
    format: str  # "safetensors" or "bin"
    files: list[Path]
    weight_map: dict[str, str] | None = None  # tensor name -> shard file name, when there is an index
    index: Path | None = None

    @classmethod
    def find(cls, model_dir: str | Path) -> "CheckpointFiles":
        """Find the weights in `model_dir`, preferring safetensors, then pytorch_model.bin."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
        for single, index, fmt in [(SAFE_WEIGHTS, SAFE_INDEX, "safetensors"), (BIN_WEIGHTS, BIN_INDEX, "bin")]:
            if (folder / single).is_file():
                return cls(folder, fmt, [folder / single])
            if (folder / index).is_file():
                return cls._from_index(folder, folder / index, fmt)
        present = sorted(p.name for p in folder.iterdir())
        shown = ", ".join(present[:20]) + (f", ... ({len(present)} in all)" if len(present) > 20 else "")
        raise FileNotFoundError(
            f"no model weights in {folder}: expected {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS} or {BIN_INDEX}; "
            f"the folder holds: {shown or 'nothing'}"
        )

    @classmethod
    def _from_index(cls, folder: Path, index: Path, fmt: str) -> "CheckpointFiles":
        try:
            data = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"checkpoint index {index} is not valid JSON ({err}); re-download or re-save it") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(
                f"checkpoint index {index} is malformed: it needs a 'weight_map' object of tensor name -> shard file"
            )
        files = []
        for name in sorted(set(weight_map.values())):
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"checkpoint index {index} names shard {name!r}, which is outside {folder}")
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"shard {name!r} named in {index} is missing from {folder}; download the checkpoint again"
                )
            files.append(folder / name)
        return cls(folder, fmt, files, weight_map, index)

    @contextmanager
    def open(self, path: Path) -> Iterator["SafetensorsFile | _TorchBinFile"]:
        """Open one of `files` for reading tensors by name."""
        reader = SafetensorsFile(path) if self.format == "safetensors" else _TorchBinFile(path)
        try:
            yield reader
        finally:
            reader.close()

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint (from the index, or the file's header)."""
        if self.weight_map is not None:
            return list(self.weight_map)
        with self.open(self.files[0]) as reader:
            return reader.keys()

    def first_floating_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor stored (what dtype="auto" falls back to)."""
        for path in self.files:
            with self.open(path) as reader:
                for name in reader.keys():
                    if reader.info(name).dtype.is_floating_point:
                        return reader.info(name).dtype
        return None


class _TorchBinFile:
    """A pytorch_model.bin, read with weights_only=True and mmap, behind the same small interface as SafetensorsFile."""

    def __init__(self, path: Path):
        self.path = path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            # Files from torch < 1.6 (the legacy, non-zip format) cannot be mmapped: read them whole.
            state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
        self.tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors[name]
        return TensorInfo(name, t.dtype, tuple(t.shape), 0, t.numel() * t.dtype.itemsize)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        self.tensors = {}


# ---------------------------------------------------------------------------------------------------------
# Filling a meta model


@dataclass
class LoadingInfo:
    """What a load did: keys the model wanted but the checkpoint lacked (allowed ones), and the reverse."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    num_loaded: int = 0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, list]:
        """The dict transformers returns for output_loading_info=True."""
        return {
            "missing_keys": self.missing,
            "unexpected_keys": self.unexpected,
            "mismatched_keys": [],
            "error_msgs": [],
        }


@dataclass
class _Target:
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


class _Staging:
    """One reusable chunk-sized CPU buffer (pinned when the destination is a GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None:
            size = CHUNK_BYTES
            try:
                self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            except RuntimeError:  # pinning can fail (locked-memory limits): pageable memory still works
                self.buffer = torch.empty(size, dtype=torch.uint8)
        return self.buffer[:nbytes]


def load_weights(
    model: nn.Module,
    files: CheckpointFiles,
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | dict | Callable[[str], object],
    tied: dict[str, str] | None = None,
    offload=None,
    ignore_missing: Sequence[str] = (),
    shard_fn: ShardFn | None = None,
    progress: bool = True,
) -> LoadingInfo:
    """Materialise every parameter and persistent buffer of `model` (built on the meta device) from `files`.

    dtype: floating tensors become this dtype (None keeps the stored one); integer and bool tensors keep the
      model's dtype. device: where every tensor is created: one device, a device_map dict (module prefix -> device,
      the longest prefix wins) or a function name -> device; a tensor placed on "disk" goes to `offload` (a
      loading.device_map.DiskOffload) and stays a meta tensor in the model (buffers are never offloaded: CPU).
    tied: target -> source names; the target becomes the source's Parameter and the checkpoint's copy of the
      target is skipped (it is read only when the source is absent).
    ignore_missing: regexes (re.search) of names the checkpoint may lack; those are created as zeros and listed
      in `LoadingInfo.missing` for the caller to initialise. Any other missing name is an error.
    shard_fn(name, full_shape) -> slices or None: load only that slice of a tensor (tensor parallelism); a
      slice along dim 0 reads only those rows from a safetensors file.
    The model's `checkpoint_fan_out` (a tuple of loading.fan_out.FanOut, default none) maps a checkpoint key it
      lacks to several of its tensors; a tensor found under its own name is never taken from a fan-out.
    Non-persistent buffers are left on the meta device: the caller computes them.
    """
    place = _placement(device, offload)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating dtype; pass torch.float32, torch.float16 or torch.bfloat16")
    targets, hooked = _collect_targets(model, tied or {})
    fan_out: tuple[FanOut, ...] = tuple(getattr(model, "checkpoint_fan_out", ()))  # any nn.Module loads
    checkpoint_keys = set(files.keys())
    info = LoadingInfo()

    # Choose each target's source key before reading anything, so that a missing tensor fails fast and a
    # tied target's own copy is never preferred over its source; a fused tensor fills what no key names.
    unique = list({id(t): t for t in targets.values()}.values())
    for target in unique:
        target.key = next((n for n in target.names if n in checkpoint_keys), None)
        if target.key is None:
            target.key = next((k for rule in fan_out for n in target.names
                               if (k := rule.source_of(n)) in checkpoint_keys), None)
    _check_missing([t.names[0] for t in unique if t.key is None], ignore_missing, files)

    stagings: dict[str, _Staging] = {}
    many = len(files.files) > 1
    for path in _progress(files.files, "Loading checkpoint shards", progress and many):
        with files.open(path) as reader:
            for key in _progress(reader.keys(), "Loading weights", progress and not many):
                stored = reader.info(key)
                pieces = [Piece(key, 0, stored.shape)] if key in targets else _fan_out(fan_out, key, stored.shape)
                if pieces is None:
                    if not _hand_to_module(hooked, key, lambda: reader.read(key), place):
                        info.unexpected.append(key)
                    continue
                for piece in pieces:
                    target = targets.get(piece.name)
                    if target is None:  # a piece of a module that loads itself, or of none (more experts than ours)
                        if (not _hand_to_module(hooked, piece.name, lambda: _read_piece(reader, key, piece), place)
                                and key not in info.unexpected):
                            info.unexpected.append(key)
                        continue
                    if key != target.key or target.loaded:
                        continue  # a tied copy, a key listed twice, or a piece the checkpoint also has on its own
                    where = place(target.names[0])
                    load_device = _CPU if where == "disk" else where
                    staging = stagings.setdefault(load_device.type, _Staging(load_device))
                    value = _read_tensor(reader, key, piece, target, dtype, load_device, shard_fn, staging)
                    _assign(target, value, where, offload)
                    info.num_loaded += 1
                    info.bytes_read += value.numel() * stored.dtype.itemsize

    # What is still on the meta device: keys an index promised but a shard lacked, allowed missing keys,
    # and tensors a load_from_checkpoint module did not fill.
    missing = [t.names[0] for t in unique if not t.loaded]
    for prefix, module in hooked.items():
        missing += [f"{prefix}.{n}" if prefix else n for n, t in _persistent(module) if t.is_meta]
    _check_missing(missing, ignore_missing, files)
    for target in unique:
        if not target.loaded:
            final = dtype if (dtype is not None and target.meta.is_floating_point()) else target.meta.dtype
            where = place(target.names[0])
            zeros = torch.zeros(target.meta.shape, dtype=final, device=_CPU if where == "disk" else where)
            _assign(target, zeros, where, offload)
    info.missing = missing
    return info


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
    slot = _Target([name], [(module, attr, is_param)], old if old is not None else value)
    slot.assign(value)


def _persistent(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers (not its children's)."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield attr, p
    for attr, b in module._buffers.items():
        if b is not None and attr not in module._non_persistent_buffers_set:
            yield attr, b


def _collect_targets(model: nn.Module, tied: dict[str, str]) -> tuple[dict[str, _Target], dict[str, nn.Module]]:
    """name -> _Target for every tensor to load (aliases share one _Target); and the modules with a load hook."""
    by_id: dict[int, _Target] = {}
    targets: dict[str, _Target] = {}
    hooked: dict[str, nn.Module] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if callable(getattr(module, "load_from_checkpoint", None)):
            hooked[prefix] = module
            continue
        if any(prefix.startswith(h + ".") or h == "" for h in hooked):
            continue  # inside a module that loads itself
        for attr, tensor in _persistent(module):
            name = f"{prefix}.{attr}" if prefix else attr
            target = by_id.setdefault(id(tensor), _Target([], [], tensor))
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


def _check_missing(missing: list[str], ignore_missing: Sequence[str], files: CheckpointFiles) -> None:
    patterns = [re.compile(p) for p in ignore_missing]
    bad = [n for n in missing if not any(p.search(n) for p in patterns)]
    if bad:
        shown = ", ".join(bad[:10]) + (f", ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ValueError(
            f"the checkpoint in {files.folder} lacks {len(bad)} tensor(s) the model needs: {shown}. "
            "Is config.json the one of these weights? (ignore_missing=[regex] allows keys to be absent)"
        )


def _fan_out(fan_out: tuple[FanOut, ...], key: str, shape: tuple[int, ...]) -> list[Piece] | None:
    """The pieces the first matching rule cuts checkpoint tensor `key` into; None when no rule matches it."""
    for rule in fan_out:
        pieces = rule.pieces(key, shape)
        if pieces is not None:
            return pieces
    return None


def _hand_to_module(hooked: dict[str, nn.Module], name: str, read: Callable[[], torch.Tensor], place) -> bool:
    """Give tensor `name` (read() reads it) to the innermost enclosing module that defines load_from_checkpoint;
    False if there is none."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = hooked.get(".".join(parts[:cut]))
        if module is not None:
            # Stored dtype, on the load device: the module decides how to convert or quantize it.
            device = place(name)
            if device == "disk":
                raise NotImplementedError(f"{name!r} belongs to a module that loads itself (a quantized layer); "
                                          f"offloading such modules to disk is not supported: put it on a device")
            module.load_from_checkpoint(".".join(parts[cut:]), read().to(device))
            return True
    return False


_CPU = torch.device("cpu")


def _placement(device, offload) -> Callable[[str], "torch.device | str"]:
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


def _assign(target: _Target, value: torch.Tensor, where, offload) -> None:
    """Put a loaded tensor in the model; a parameter placed on "disk" goes to the offload folder, leaving meta."""
    if where == "disk" and target.slots[0][2]:
        offload.save(target.names[0], value, target.names[1:])
        value = torch.empty_like(value, device="meta")
    target.assign(value)


def _read_tensor(reader, key: str, piece: Piece, target: _Target, dtype, device, shard_fn,
                 staging: _Staging) -> torch.Tensor:
    """Allocate `target`'s tensor in its final dtype on `device` and fill it with `piece` of checkpoint tensor `key`
    (the whole tensor, or a run of its elements: loading/fan_out.py)."""
    stored = reader.info(key)
    slices = shard_fn(piece.name, piece.shape) if shard_fn is not None else None
    shape = piece.shape if slices is None else tuple(torch.empty(piece.shape, device="meta")[slices].shape)
    if shape != tuple(target.meta.shape):
        what = f"shape {list(stored.shape)}"
        if piece.name != key:
            what += f", whose piece for {piece.name!r} is {list(piece.shape)}"
        if slices is not None:
            what += f" (slice {list(shape)})"
        raise ValueError(
            f"tensor {key!r} in {reader.path.name} has {what}, but the model's {target.names[0]!r} has shape "
            f"{list(target.meta.shape)}; is config.json the one of these weights?"
        )
    floating = target.meta.is_floating_point()
    final = (dtype or stored.dtype) if floating else target.meta.dtype
    if isinstance(reader, SafetensorsFile) and slices is None and device.type == "cpu" and final == stored.dtype:
        # Zero-copy: the parameter is a copy-on-write map of the file (the page cache is shared, nothing is
        # read twice, and resident memory stays at one copy of the weights).
        mapped = reader.mapped(key)
        if mapped is not None:
            return _cut(mapped, piece)
    out = torch.empty(shape, dtype=final, device=device)
    if not out.numel():
        return out

    rows = _row_range(slices, piece.shape)
    if isinstance(reader, SafetensorsFile) and rows is not None:
        row_bytes = prod(piece.shape[1:]) * stored.dtype.itemsize
        _fill(reader, stored.start + piece.first * stored.dtype.itemsize + rows[0] * row_bytes, stored.dtype, out,
              staging)
    else:
        # General slices, or a .bin file (already a tensor): read the piece, then copy what is needed.
        source = _read_piece(reader, key, piece)
        out.copy_(source[slices] if slices is not None else source)
    return out


def _read_piece(reader, key: str, piece: Piece) -> torch.Tensor:
    """`piece` of checkpoint tensor `key` as a CPU tensor of its stored dtype (from a safetensors file, only the
    piece's bytes are read)."""
    if not isinstance(reader, SafetensorsFile):
        return _cut(reader.read(key), piece)
    stored = reader.info(key)
    out = torch.empty(piece.shape, dtype=stored.dtype)
    if out.numel():
        reader.read_bytes_into(stored.start + piece.first * stored.dtype.itemsize, byte_view(out))
    return out


def _cut(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of `tensor` (contiguous) that `piece` names."""
    return tensor.reshape(-1)[piece.first : piece.first + prod(piece.shape)].view(piece.shape)


def _row_range(slices: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, stop) rows when `slices` is None or a step-1 slice of dim 0 only; None for anything else."""
    if slices is None:
        return 0, shape[0] if shape else 1
    if not isinstance(slices, tuple):
        slices = (slices,)
    if not shape or not slices or any(s != slice(None) for s in slices[1:]) or not isinstance(slices[0], slice):
        return None
    start, stop, step = slices[0].indices(shape[0])
    return (start, stop) if step == 1 else None


def _fill(reader: SafetensorsFile, start: int, stored: torch.dtype, out: torch.Tensor, staging: _Staging) -> None:
    """Fill contiguous `out` from the file's bytes at `start`, holding the stored dtype."""
    if out.device.type == "cpu" and out.dtype == stored:
        reader.read_bytes_into(start, byte_view(out))  # straight into the parameter's memory
        return
    flat = out.view(-1)  # (numel,)
    per_chunk = CHUNK_BYTES // stored.itemsize
    for first in range(0, flat.numel(), per_chunk):
        count = min(per_chunk, flat.numel() - first)
        chunk = staging.get(count * stored.itemsize)
        reader.read_bytes_into(start + first * stored.itemsize, byte_view(chunk))
        # Converts dtype and crosses to the GPU in one copy; synchronous, so the buffer is free afterwards.
        flat[first : first + count].copy_(chunk.view(stored))


def _progress(items: list, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc)
