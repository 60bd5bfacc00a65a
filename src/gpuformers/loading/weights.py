"""Checkpoint weights: fill a model built on the meta device from a checkpoint folder's weight files.

    folder --CheckpointFiles.find--> [shard files] --load_weights--> every parameter / persistent buffer
                                                                      materialised in its final dtype and device

`load_weights` walks the checkpoint one tensor at a time. Each tensor is allocated once, in its final dtype
on its final device, and filled from the file: on the CPU with a matching dtype the parameter maps the
safetensors file copy-on-write (or the bytes are read straight into its memory); otherwise they pass through
one small staging buffer (pinned for CUDA) in chunks and are converted on copy. The process never holds a
second copy of the model: peak resident memory is about the model's size plus one chunk.

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

A model that is already built, whose tensors must stay the objects they are (DeepSpeed ZeRO-3's partitioned
parameters, models/load_steps.py), is filled in place instead: `fill(target, read)` is called for each tensor, in
the same order in every process, and decides whether and where to read it (read() returns it on the CPU).

This module is the load loop (which key fills which tensor, missing and unexpected keys, fan-out pieces, the
hand-over to load_from_checkpoint modules, the progress bar). Its parts live beside it: finding and opening the
files in loading/checkpoint_files.py, the model's tensors and their placement in loading/targets.py, reading one
tensor in chunks in loading/tensor_reader.py; CheckpointFiles, the file names and assign_tensor are re-exported
here, their import path since the start.

Offers: CheckpointFiles, LoadingInfo, load_weights, assign_tensor.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

# re-exported: CheckpointFiles, the file names and assign_tensor have always been importable from this module
from gpuformers.loading.checkpoint_files import (  # noqa: F401
    BIN_INDEX,
    BIN_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    CheckpointFiles,
)
from gpuformers.loading.fan_out import FanOut, Piece
from gpuformers.loading.targets import assign_tensor  # noqa: F401
from gpuformers.loading.targets import LoadTarget, assign_loaded, collect_targets, persistent_tensors, placement
from gpuformers.loading.tensor_reader import StagingBuffer, read_piece, read_tensor

# Bytes per staging chunk when a tensor must be converted or sent to a GPU: big enough that reads and
# copies run at full speed, small next to any model. A multiple of every element size.
CHUNK_BYTES = 64 * 1024 * 1024

ShardFn = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]
FillFn = Callable[[LoadTarget, Callable[[], torch.Tensor]], None]

_CPU = torch.device("cpu")


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
    fill: FillFn | None = None,
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
    fill(target, read): for a model already built (not on the meta device), put each tensor into target.meta (the
      model's own tensor) instead of creating it: read() returns the checkpoint's tensor on the CPU (zeros for an
      allowed missing one) and need not be called (a process that receives the tensor from another). It is called
      for the tensors in the same order in every process, so it may run collectives. `device` is then unused.
    Non-persistent buffers are left on the meta device: the caller computes them.
    """
    place = placement(device, offload)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating dtype; pass torch.float32, torch.float16 or torch.bfloat16")
    targets, hooked = collect_targets(model, tied or {})
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

    stagings: dict[str, StagingBuffer] = {}
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
                        if (not _hand_to_module(hooked, piece.name, lambda: read_piece(reader, key, piece), place)
                                and key not in info.unexpected):
                            info.unexpected.append(key)
                        continue
                    if key != target.key or target.loaded:
                        continue  # a tied copy, a key listed twice, or a piece the checkpoint also has on its own
                    if fill is not None:  # filled in place; the bytes counted are those this process read
                        staging = stagings.setdefault("fill", StagingBuffer(_CPU, CHUNK_BYTES))
                        fill(target, _counting_reader(info, stored.dtype.itemsize, lambda: read_tensor(
                            reader, key, piece, target, dtype, _CPU, shard_fn, staging)))
                        target.loaded = True
                        info.num_loaded += 1
                        continue
                    where = place(target.names[0])
                    load_device = _CPU if where == "disk" else where
                    staging = stagings.setdefault(load_device.type, StagingBuffer(load_device, CHUNK_BYTES))
                    value = read_tensor(reader, key, piece, target, dtype, load_device, shard_fn, staging)
                    assign_loaded(target, value, where, offload)
                    info.num_loaded += 1
                    info.bytes_read += value.numel() * stored.dtype.itemsize

    # What is still on the meta device: keys an index promised but a shard lacked, allowed missing keys,
    # and tensors a load_from_checkpoint module did not fill.
    missing = [t.names[0] for t in unique if not t.loaded]
    for prefix, module in hooked.items():
        missing += [f"{prefix}.{n}" if prefix else n for n, t in persistent_tensors(module) if t.is_meta]
    _check_missing(missing, ignore_missing, files)
    for target in unique:
        if not target.loaded and fill is not None:
            fill(target, functools.partial(_zeros_like_target, target, dtype))
            target.loaded = True
        elif not target.loaded:
            final = dtype if (dtype is not None and target.meta.is_floating_point()) else target.meta.dtype
            where = place(target.names[0])
            zeros = torch.zeros(target.meta.shape, dtype=final, device=_CPU if where == "disk" else where)
            assign_loaded(target, zeros, where, offload)
    info.missing = missing
    return info


def _counting_reader(info: LoadingInfo, itemsize: int, read: Callable[[], torch.Tensor]):
    """read(), adding what it read to info.bytes_read."""

    def counted() -> torch.Tensor:
        value = read()
        info.bytes_read += value.numel() * itemsize
        return value

    return counted


def _zeros_like_target(target, dtype: torch.dtype | None) -> torch.Tensor:
    """Zeros for an allowed missing tensor filled in place, in the shape the model's tensor has when read() is
    called (ZeRO-3: gathered)."""
    final = dtype if (dtype is not None and target.meta.is_floating_point()) else target.meta.dtype
    return torch.zeros(target.meta.shape, dtype=final)


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


def _progress(items: list, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc)
