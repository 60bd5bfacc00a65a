"""Training checkpoints: written whole or not at all, and read back for an exact resume.

    output_dir/
      checkpoint-N/
        config.json, model.safetensors      the model, loadable by from_pretrained and by transformers
        optimizer.pt, scheduler.pt          their state_dicts (scaler.pt too with fp16)
        rng_state.pth                       python, numpy, torch CPU and CUDA generators (under torchrun one
                                            rng_state_<process>.pth per process, as transformers writes them)
        trainer_state.json                  global step, epoch, data position, log history, callback states
        training_args.json                  the arguments, for people
      .tmp-checkpoint-N-<pid>/             a save in progress, or a checkpoint being deleted; never read, removed
                                            by the next save

A save writes everything into the temporary folder, flushes it to disk, then renames it to checkpoint-N: a
rename is atomic, so a crash at any moment leaves either no checkpoint-N or a complete one. Deleting one (the
rotation of save_total_limit) is the same in reverse: checkpoint-N is renamed to a .tmp- folder first, then removed,
so a crash in the middle leaves a .tmp- folder, never a checkpoint-N with files missing. A checkpoint-N that lacks
a file all the same (left half-removed by an earlier gpuformers or by transformers' rotation: trainer_state.json but
no weights, say) is incomplete (incomplete_reason): never listed as a checkpoint, skipped by a resume with a warning,
and removed by the next rotation. Reading uses
torch.load(weights_only=True) only, so a checkpoint cannot run code (transformers' rng_state.pth holds a NumPy
array: the few NumPy globals that rebuild it are allowed for that file, nothing else).

This is transformers' Trainer's layout, file for file, and each Trainer resumes from the other's checkpoints
(transformers writes training_args.bin, which no resume reads), LoRA runs included (both keep the empty no-decay
optimizer group of a LoRA model; one-process checkpoints of ours from before that still resume). Its FSDP
checkpoints, and another optimizer's or scheduler's state, are refused with the file and the reason; its DeepSpeed
checkpoints (global_stepN/ with DeepSpeed's sharded states, and `latest`, instead of optimizer.pt and scheduler.pt;
model.safetensors only where the weights are whole) are what a DeepSpeed run writes and resumes from
(deepspeed_engine.py), and are refused elsewhere.

Offers: save_training_checkpoint, load_training_state, get_last_checkpoint, sorted_checkpoints,
incomplete_reason, rotate_checkpoints, remove_checkpoint, load_model_weights_in_place, load_optimizer_state,
capture_rng_state, restore_rng_state, CHECKPOINT_PREFIX.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuformers.training.arguments import OPTIMIZERS, SCHEDULERS

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
_TMP_PREFIX = f".tmp-{CHECKPOINT_PREFIX}-"
STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME, RNG_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"
# the model's weights as both Trainers' save_pretrained writes them: one file, a LoRA adapter, or an index of shards
_WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# ------------------------------------------------------------------------------------------------ RNG state


def capture_rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, in the layout transformers' Trainer reads (so that it resumes
    from our checkpoints) and in types torch.load(weights_only=True) accepts: NumPy's state is the dict form of
    np.random.get_state with its key as a list (transformers saves the tuple, with an array), the CUDA state is
    the one GPU's (every GPU's when several are visible)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    state = {"python": random.getstate(), "numpy": numpy_state, "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        several = torch.cuda.device_count() > 1
        state["cuda"] = torch.cuda.get_rng_state_all() if several else torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what capture_rng_state or transformers' Trainer saved (or our earlier layout: lists, and NumPy's
    state as a dict with a tensor)."""
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    n = state["numpy"]
    if isinstance(n, dict) and "kind" in n:  # our earlier layout
        n = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)  # a tuple (transformers) or the dict form
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if torch.is_tensor(saved):  # one GPU's state
            torch.cuda.set_rng_state(saved)
        elif len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:  # another number of visible GPUs: restore what lines up, the rest keep their seed
            for index, rng in enumerate(saved[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, index)


# ----------------------------------------------------------------------------------------------- writing


def _fsync_tree(folder: Path) -> None:
    """Flush every file and the folder itself, so the rename never publishes data still in the page cache."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # folders cannot be opened on some platforms (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_training_checkpoint(output_dir: str | os.PathLike, step: int, *, model, state, args=None, optimizer=None,
                             scheduler=None, scaler=None, save_only_model: bool = False,
                             model_state_dict: dict | None = None, optimizer_state_dict: dict | None = None,
                             rng_states: list[dict] | None = None, weights: bool = True,
                             moved_in: Path | None = None) -> Path:
    """Write checkpoint-`step` atomically (see the module docstring) and return its path. The state dicts, when
    given, replace the model's and the optimizer's own (the gathered states of a model sharded by FSDP2).
    rng_states: every process's capture_rng_state(), in rank order (gathered under torchrun), each written to
    rng_state_<process>.pth; None: this process's own, to rng_state.pth. weights=False: the model's config alone
    (ZeRO-3 weights not gathered). moved_in: a folder whose entries (DeepSpeed's global_stepN/ and latest, written
    by every process) are moved into the checkpoint before it is published, then removed."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(f"{_TMP_PREFIX}*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    final = output_dir / f"{CHECKPOINT_PREFIX}-{step}"
    tmp = output_dir / f"{_TMP_PREFIX}{step}-{os.getpid()}"
    tmp.mkdir()
    if not weights:
        model.config.save_pretrained(tmp)
    elif model_state_dict is None:
        model.save_pretrained(tmp)
    else:
        model.save_pretrained(tmp, state_dict=model_state_dict)
    if moved_in is not None:
        for entry in moved_in.iterdir():
            os.rename(entry, tmp / entry.name)
        moved_in.rmdir()
    if not save_only_model:
        if optimizer is not None:
            state_dict = optimizer_state_dict if optimizer_state_dict is not None else optimizer.state_dict()
            torch.save(state_dict, tmp / OPTIMIZER_NAME)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_NAME)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / SCALER_NAME)
        if rng_states is None or len(rng_states) == 1:
            torch.save(capture_rng_state() if rng_states is None else rng_states[0], tmp / RNG_NAME)
        else:  # each process draws its own dropout masks (its own batches, its own GPU's generator)
            for index, rng in enumerate(rng_states):
                torch.save(rng, tmp / f"rng_state_{index}.pth")
    if args is not None:
        (tmp / "training_args.json").write_text(args.to_json_string(), encoding="utf-8")
    state.save_to_json(tmp / STATE_NAME)  # last: a folder with trainer_state.json had everything written first
    _fsync_tree(tmp)
    if final.exists():  # saving the same step again (e.g. after a resume): swap, then drop the old one
        old = output_dir / f"{_TMP_PREFIX}{step}-old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(output_dir)
    return final


def _checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """Every checkpoint-N folder in `output_dir`, complete or not, oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m[1]), p) for p in folder.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _weights_missing(folder: Path) -> str | None:
    if any((folder / name).is_file() for name in _WEIGHT_FILES):
        return None
    for name in _WEIGHT_INDEXES:
        if (folder / name).is_file():
            try:
                shards = set(json.loads((folder / name).read_text(encoding="utf-8"))["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError):
                return f"{name} cannot be read"
            gone = sorted(shard for shard in shards if not (folder / shard).is_file())
            return f"the shards {', '.join(gone[:3])} named in {name} are gone" if gone else None
    return f"no model weights ({', '.join(_WEIGHT_FILES[:2])} or a sharded index)"


def incomplete_reason(folder: str | os.PathLike) -> str | None:
    """Why checkpoint folder `folder` is not whole (None when it is): trainer_state.json, the model's weights (every
    shard an index names), and optimizer.pt and scheduler.pt both or neither, as both Trainers write them. (A missing RNG file is no sign: both Trainers resume without
    one, from another number of processes say, with a warning here.) Our rotation never leaves an incomplete folder;
    a rotation of an earlier gpuformers or of transformers' Trainer killed while it deleted files one by one does."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder is gone"
    if not (folder / STATE_NAME).is_file():
        return f"no {STATE_NAME}"
    if _foreign_layout(folder):  # a DeepSpeed or FSDP folder of transformers: refused by name when it is loaded
        return None
    if (missing := _weights_missing(folder)) is not None:
        return missing
    # The optimizer's and the scheduler's states are written together or not at all (save_training_checkpoint
    # without an optimizer writes neither, and save_only_model neither), so one without the other is a half delete.
    training = {name: (folder / name).is_file() for name in (OPTIMIZER_NAME, SCHEDULER_NAME)}
    if any(training.values()) and not all(training.values()):
        return f"no {' or '.join(name for name, there in training.items() if not there)}"
    return None


def sorted_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint-N folders in `output_dir` (incomplete_reason), oldest step first."""
    return [p for p in _checkpoint_folders(output_dir) if incomplete_reason(p) is None]


def get_last_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint-N in `output_dir`; newer incomplete ones are skipped with a warning."""
    for path in reversed(_checkpoint_folders(output_dir)):
        reason = incomplete_reason(path)
        if reason is None:
            return path
        logger.warning("skipping %s: it is incomplete (%s), what a crash while it was being deleted leaves; resuming "
                       "from an earlier checkpoint. Delete the folder (the next save_total_limit rotation does)",
                       path, reason)
    return None


def remove_checkpoint(folder: str | os.PathLike) -> None:
    """Delete checkpoint folder `folder` so that no crash leaves it looking complete: renamed out of the way first
    (atomic), to a .tmp- name that nothing reads and the next save removes, then deleted."""
    folder = Path(folder)
    trash = folder.parent / f"{_TMP_PREFIX}{folder.name.removeprefix(CHECKPOINT_PREFIX + '-')}-removed-{os.getpid()}"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(folder, trash)
    except OSError as error:  # (a file held open on Windows, say) then it stays whole
        logger.warning("could not delete checkpoint %s (%s); it is left as it was", folder, error)
        return
    _fsync_dir(folder.parent)  # the rename on disk before any file goes
    shutil.rmtree(trash, ignore_errors=True)


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None,
                       keep: tuple[str | os.PathLike | None, ...] = ()) -> None:
    """Delete the oldest checkpoints beyond save_total_limit, never the newest one nor those in `keep` (the one just
    written, the best one): with save_total_limit=1 and a best checkpoint older than the newest, both stay, as in
    transformers. Incomplete checkpoint-N folders older than the newest complete one (the remains of an interrupted
    deletion) count for nothing, and go too."""
    if not save_total_limit:
        return
    folders = _checkpoint_folders(output_dir)
    reasons = [incomplete_reason(path) for path in folders]
    checkpoints = [path for path, reason in zip(folders, reasons) if reason is None]
    if not checkpoints:
        return
    protected = {checkpoints[-1].resolve()} | {Path(p).resolve() for p in keep if p is not None}
    newest = folders.index(checkpoints[-1])
    for path, reason in zip(folders[:newest], reasons[:newest]):
        if reason is not None and path.resolve() not in protected:
            logger.warning("deleting %s: it is incomplete (%s), the remains of an interrupted deletion", path, reason)
            remove_checkpoint(path)
    if len(checkpoints) <= save_total_limit:
        return
    excess = len(checkpoints) - save_total_limit
    for path in checkpoints:
        if excess <= 0:
            break
        if path.resolve() in protected:
            continue
        remove_checkpoint(path)
        excess -= 1


# ----------------------------------------------------------------------------------------------- reading


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _numpy_rng_globals() -> list:
    """What unpickling np.random.get_state() needs, and nothing more: transformers' rng_state.pth holds that tuple
    (a uint32 array), which torch.load(weights_only=True) refuses unless these are allowed (transformers' own
    trainer_pt_utils.safe_globals allows the same)."""
    core = np._core if hasattr(np, "_core") else np.core  # NumPy 2 renamed numpy.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_rng(path: Path) -> dict[str, Any]:
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        return _load(path)


def read_model_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, on the CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(path))
    if not state:
        raise FileNotFoundError(f"{folder} holds no *.safetensors model weights")
    return state


def load_model_weights_in_place(model, folder: Path) -> None:
    """Copy the checkpoint's safetensors into the model's existing parameters (the optimizer holds those very
    tensors, so they must not be replaced)."""
    state = read_model_weights(folder)
    if hasattr(model, "peft_config"):  # a LoRA model's checkpoint holds its adapter weights only
        from gpuformers.lora import PeftModel, set_peft_model_state_dict

        if not isinstance(model, PeftModel):  # an adapter on the model itself (add_adapter): its own names
            state = {key.removeprefix("base_model.model."): tensor for key, tensor in state.items()}
        set_peft_model_state_dict(model, state)
        return
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "tied_weights", {}) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder} does not match the model: missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}; resume with the model the checkpoint was trained from")


def _deepspeed_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("global_step*")) + [path for path in [folder / "latest"] if path.is_file()]


def _fsdp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("pytorch_model_fsdp*")) + sorted(folder.glob("optimizer_*")) + [
        path for path in [folder / "optimizer.bin"] if path.exists()]


def _foreign_layout(folder: Path) -> bool:
    return bool(_deepspeed_files(folder) or _fsdp_files(folder))


def _refuse_foreign_layouts(folder: Path) -> None:
    """A checkpoint-N that transformers' Trainer wrote under DeepSpeed or accelerate's FSDP keeps its optimizer
    (and maybe its weights) in their own sharded formats, which this Trainer cannot read: refused before anything
    is loaded, rather than resumed with a fresh optimizer."""
    deepspeed = _deepspeed_files(folder)
    if deepspeed:
        raise ValueError(f"{deepspeed[0]}: {folder} is a DeepSpeed checkpoint (a Trainer with deepspeed=...), "
                         f"whose optimizer state is in DeepSpeed's ZeRO files: resume it with the same "
                         f"deepspeed=... config, or start a new run from its weights (from_pretrained; under ZeRO-3 "
                         f"after its zero_to_fp32.py)")
    fsdp = _fsdp_files(folder)
    if fsdp:
        raise ValueError(f"{fsdp[0]}: {folder} was written by transformers' Trainer under FSDP (accelerate's "
                         f"state dicts), which gpuformers cannot read; resume it with transformers, or start a new "
                         f"run from its weights (from_pretrained)")


# what each optimizer keeps per parameter, to refuse another optimizer's state before it breaks the first step
_OPTIMIZER_STATE_KEYS = {torch.optim.Adam: {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},  # AdamW too
                         torch.optim.SGD: {"momentum_buffer"}}


def _load_optimizer(optimizer, state: dict, path: Path) -> list[int]:
    """optimizer.load_state_dict, after checking that `state` is this optimizer's kind over these parameters.
    Both Trainers keep a weight-decay group even when it is empty (the no-decay group of a LoRA model, which has no
    bias or norm to train). A state without its empty groups (gpuformers' checkpoints before they were kept) gets
    them back, and the saved empty groups are left out for an optimizer without them (one passed to the Trainer).
    Returns the indices of the saved groups left out."""
    expected = next((keys for kind, keys in _OPTIMIZER_STATE_KEYS.items() if isinstance(optimizer, kind)), None)
    saved = set().union(*(entry.keys() for entry in state["state"].values()))
    if expected is not None and not saved <= expected:
        raise ValueError(f"{path} holds the state of another optimizer (per parameter: {sorted(saved)}; "
                         f"{type(optimizer).__name__} keeps {sorted(expected)}): resume with the optim the checkpoint "
                         f"was trained with (gpuformers has {', '.join(OPTIMIZERS)})")
    saved_groups, ours, dropped = state["param_groups"], optimizer.param_groups, []
    empty = [index for index, group in enumerate(ours) if not group["params"]]
    if len(saved_groups) > len(ours):
        dropped = [index for index, group in enumerate(saved_groups) if not group["params"]]
        saved_groups = [group for group in saved_groups if group["params"]]
    elif empty and saved_groups and len(saved_groups) == len(ours) - len(empty):
        # the empty group's own settings, and the learning rate that the schedule gives every group (both Trainers
        # give every group learning_rate); the saved parameter ids, positions over the groups, stay as they are
        kept = iter(saved_groups)
        saved_groups = [{**group, "params": [], "lr": saved_groups[0]["lr"]} if index in empty else next(kept)
                        for index, group in enumerate(ours)]
    saved_ids = [group["params"] for group in saved_groups]
    params = [group["params"] for group in ours]
    if [len(g) for g in saved_ids] != [len(g) for g in params]:
        raise ValueError(f"{path} holds {[len(g) for g in saved_ids]} parameters per group, the optimizer has "
                         f"{[len(g) for g in params]}: resume with the model, the trainable parameters and the "
                         f"weight_decay groups the checkpoint was trained with")
    # the ids are positions: a shape tells a parameter from another (for the optimizers above, whose state has the
    # parameter's shape; Adafactor's factored rows and columns do not)
    for group_ids, group_params in zip(saved_ids, params) if expected is not None else ():
        for index, param in zip(group_ids, group_params):
            for value in state["state"].get(index, {}).values():
                if torch.is_tensor(value) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"{path}: the state of parameter {index} has shape {tuple(value.shape)}, the "
                                     f"model's parameter {tuple(param.shape)}: resume with the model the checkpoint "
                                     f"was trained with")
    optimizer.load_state_dict({**state, "param_groups": saved_groups})
    return dropped


def _load_scheduler(scheduler, path: Path, dropped_groups: list[int]) -> None:
    """scheduler.load_state_dict, less the values of the optimizer groups that _load_optimizer left out, and with
    values for the empty groups that gpuformers' earlier checkpoints lack: the first group's, as every group has
    one learning rate and one schedule in both Trainers."""
    state = _load(path)
    groups = scheduler.optimizer.param_groups
    empty = [index for index, group in enumerate(groups) if not group["params"]]
    for key in ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs"):  # one value per optimizer group
        if key not in state:
            continue
        values = [value for index, value in enumerate(state[key]) if index not in dropped_groups]
        if empty and values and len(values) == len(groups) - len(empty):
            kept = iter(values)
            values = [values[0] if index in empty else next(kept) for index in range(len(groups))]
        state[key] = values
    # private fields (_last_lr, _is_initial, ...) come and go with torch versions; public ones name the scheduler
    unknown = sorted(key for key in state if not key.startswith("_") and key not in scheduler.state_dict())
    if unknown:
        raise ValueError(f"{path} holds the state of another kind of scheduler than {type(scheduler).__name__} "
                         f"({', '.join(unknown)}): resume with the lr_scheduler_type the checkpoint was trained "
                         f"with (gpuformers has {', '.join(SCHEDULERS)})")
    scheduler.load_state_dict(state)


def load_training_state(checkpoint: str | os.PathLike, *, model, optimizer=None, scheduler=None,
                        scaler=None, process_index: int = 0, deepspeed: bool = False) -> dict[str, Any]:
    """Load model weights, optimizer, scheduler and scaler states into the given objects; return
    {"state_path": ..., "rng": rng state or None} for the caller to restore at the right moment. Reads checkpoints
    of transformers' Trainer too (one process or DDP: rng_state_<process_index>.pth). deepspeed: the run is a
    DeepSpeed one, whose engine loads the global_stepN/ states itself; its layout is then not refused."""
    folder = Path(checkpoint)
    if not (folder / STATE_NAME).is_file():
        raise FileNotFoundError(f"{folder} is not a complete training checkpoint (no {STATE_NAME}); pass a "
                                f"checkpoint-N folder written by the Trainer, or resume_from_checkpoint=True")
    if not deepspeed:
        _refuse_foreign_layouts(folder)
    if (reason := incomplete_reason(folder)) is not None:
        raise FileNotFoundError(f"{folder} is not a complete training checkpoint ({reason}; a crash while it was being "
                                f"deleted leaves that): pass an earlier checkpoint-N, or resume_from_checkpoint=True, "
                                f"which takes the newest complete one")
    if model is not None:
        load_model_weights_in_place(model, folder)
    dropped_groups = []
    if optimizer is not None and (state := load_optimizer_state(folder)) is not None:
        dropped_groups = _load_optimizer(optimizer, state, folder / OPTIMIZER_NAME)
    if scheduler is not None and (folder / SCHEDULER_NAME).is_file():
        _load_scheduler(scheduler, folder / SCHEDULER_NAME, dropped_groups)
    if scaler is not None and (folder / SCALER_NAME).is_file():
        scaler.load_state_dict(_load(folder / SCALER_NAME))
    # under torchrun both Trainers write one RNG file per process
    rng_path = next((path for path in (folder / RNG_NAME, folder / f"rng_state_{process_index}.pth")
                     if path.is_file()), None)
    if rng_path is None and ((folder / OPTIMIZER_NAME).is_file() or _deepspeed_files(folder)):
        logger.warning("%s holds no %s (nor rng_state_%d.pth): the random generators go on from where they are, so "
                       "dropout will not draw what the run that wrote it drew", folder, RNG_NAME, process_index)
    return {"state_path": folder / STATE_NAME, "rng": _load_rng(rng_path) if rng_path else None}


def load_optimizer_state(checkpoint: str | os.PathLike) -> dict | None:
    """The optimizer state a checkpoint holds (None when it was saved without one, save_only_model)."""
    path = Path(checkpoint) / OPTIMIZER_NAME
    return _load(path) if path.is_file() else None
