"""Saving a checkpoint folder in the Hugging Face layout (what `save_pretrained` writes).

    save_directory/
      config.json                        the config dict, sorted keys
      generation_config.json             when given
      model.safetensors                  or, above max_shard_size:
      model-00001-of-0000N.safetensors   + model.safetensors.index.json {"metadata": {"total_size"}, "weight_map"}

Tensors are written one at a time (a GPU model is never copied to the host whole). Every file is written
under a temporary hidden name and renamed into place, and the shards of an earlier save in the same folder
are removed only once the new ones are complete: a crash mid-save leaves either the old checkpoint or the
new one, never a half-written file under a real name. Tied targets (lm_head.weight when tied to the
embeddings) are not written, as transformers does.

Offers: save_checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from gpuformers.loading.safetensors import write_file
from gpuformers.loading.weights import SAFE_INDEX, SAFE_WEIGHTS
from gpuformers.sizes import parse_size

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    *,
    config: dict,
    generation_config: dict | None = None,
    max_shard_size: int | str = "5GB",
    tied: dict[str, str] | None = None,
) -> list[Path]:
    """Write a checkpoint folder transformers can load; return the paths written.

    tied: target -> source names (e.g. {"lm_head.weight": "model.embed_tokens.weight"}); targets are not
    written. Other tensors that are exact aliases of an earlier one are dropped too, with a warning.
    """
    folder = Path(save_directory)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_directory {folder} is a file; pass a folder")
    folder.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size, name="max_shard_size")
    state = _tensors_to_save(model_or_state_dict, tied or {})
    for leftover in folder.glob(".model*.tmp"):  # from a save that crashed
        leftover.unlink()

    shards = _plan_shards(state, limit)
    names = [SAFE_WEIGHTS] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    # 1. every shard complete under a temporary name
    temps = []
    for name, shard in zip(names, shards):
        temps.append(_temp_path(folder, name))
        write_file({k: state[k] for k in shard}, temps[-1], metadata={"format": "pt"})
    # 2. into place, then the index that names them
    written = []
    for temp, name in zip(temps, names):
        os.replace(temp, folder / name)
        written.append(folder / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.dtype.itemsize for t in state.values())},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in sorted(shard)},
        }
        written.append(_write_json(folder / SAFE_INDEX, index))
    # 3. only now the files of an earlier save that the new one does not use
    for path in folder.iterdir():
        stale = path.name == SAFE_WEIGHTS or _SHARD_NAME.fullmatch(path.name) or path.name == SAFE_INDEX
        if stale and path not in written:
            path.unlink()

    written.append(_write_json(folder / "config.json", config))
    if generation_config is not None:
        written.append(_write_json(folder / "generation_config.json", generation_config))
    return written


def _tensors_to_save(source: nn.Module | Mapping[str, torch.Tensor], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """name -> tensor without tied targets and without exact aliases (the first name of each tensor is kept)."""
    state = source.state_dict() if isinstance(source, nn.Module) else dict(source)
    for name in tied:
        state.pop(name, None)
    seen: dict[tuple, str] = {}
    aliases = []
    for name, t in list(state.items()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cannot save {name!r}: it is a {type(t).__name__}, not a tensor")
        if t.device.type == "meta" or not t.numel():
            continue
        storage = t.untyped_storage().data_ptr()
        where = (t.device, storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if where in seen:
            aliases.append(f"{name} (= {seen[where]})")
            del state[name]
        else:
            seen[where] = name
    if aliases:
        warnings.warn(
            f"not saving {', '.join(aliases)}: the same tensor as an earlier name; pass tied={{target: source}} "
            "to say so and silence this",
            stacklevel=3,
        )
    return state


def _plan_shards(state: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Greedy in order: a shard closes when the next tensor would take it past `limit`; a bigger tensor sits alone."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _temp_path(folder: Path, name: str) -> Path:
    # Hidden, and matching no checkpoint pattern: loaders and the stale-file sweep never see it.
    return folder / f".{name}.{uuid.uuid4().hex[:8]}.tmp"


def _write_json(path: Path, data: dict) -> Path:
    temp = _temp_path(path.parent, path.name)
    temp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(temp, path)
    return path
