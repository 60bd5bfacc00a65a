"""Checkpoint files: find and index the weight files of one checkpoint folder, and open them for reading by name.

    folder --CheckpointFiles.find--> model.safetensors                        (one file)
                                     model.safetensors.index.json -> shards   (sharded: the index's weight_map)
                                     pytorch_model.bin[.index.json]           (when there is no safetensors)

A safetensors file is read with loading/safetensors.py; a pytorch_model.bin is loaded with weights_only=True
(and mmap when its format allows) behind the same small reader interface (keys, info, read, close), so the loader
(loading/weights.py) reads either kind the same way.

Offers: CheckpointFiles, and the file names SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from gpuformers.loading.safetensors import SafetensorsFile, TensorInfo

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


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
