"""Tensor reader: fill one model tensor from one checkpoint tensor (or a fan-out piece of one), in its final dtype
on its final device.

The tensor is allocated once and filled from the file: on the CPU with a matching dtype the bytes are read
straight into its memory (or the file is mapped copy-on-write); otherwise they pass through one small staging
buffer (pinned for CUDA) in chunks and are converted on copy, so a load never holds a second copy of the model.
A shard_fn slice along dim 0 reads only those rows from a safetensors file; any other slice, or a
pytorch_model.bin, reads the piece and copies what is needed.

Offers, for loading/weights.py: StagingBuffer, read_tensor, read_piece.
"""

from __future__ import annotations

from math import prod

import torch

from gpuformers.loading.fan_out import Piece
from gpuformers.loading.safetensors import SafetensorsFile, byte_view
from gpuformers.loading.targets import LoadTarget


class StagingBuffer:
    """One reusable chunk-sized CPU buffer (pinned when the destination is a GPU); `_fill` reads chunks of its size."""

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.device = device
        self.chunk_bytes = chunk_bytes  # a multiple of every element size
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None:
            size = self.chunk_bytes
            try:
                self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            except RuntimeError:  # pinning can fail (locked-memory limits): pageable memory still works
                self.buffer = torch.empty(size, dtype=torch.uint8)
        return self.buffer[:nbytes]


def read_tensor(reader, key: str, piece: Piece, target: LoadTarget, dtype, device, shard_fn,
                 staging: StagingBuffer) -> torch.Tensor:
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
        source = read_piece(reader, key, piece)
        out.copy_(source[slices] if slices is not None else source)
    return out


def read_piece(reader, key: str, piece: Piece) -> torch.Tensor:
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


def _fill(reader: SafetensorsFile, start: int, stored: torch.dtype, out: torch.Tensor, staging: StagingBuffer) -> None:
    """Fill contiguous `out` from the file's bytes at `start`, holding the stored dtype."""
    if out.device.type == "cpu" and out.dtype == stored:
        reader.read_bytes_into(start, byte_view(out))  # straight into the parameter's memory
        return
    flat = out.view(-1)  # (numel,)
    per_chunk = staging.chunk_bytes // stored.itemsize
    for first in range(0, flat.numel(), per_chunk):
        count = min(per_chunk, flat.numel() - first)
        chunk = staging.get(count * stored.itemsize)
        reader.read_bytes_into(start + first * stored.itemsize, byte_view(chunk))
        # Converts dtype and crosses to the GPU in one copy; synchronous, so the buffer is free afterwards.
        flat[first : first + count].copy_(chunk.view(stored))
