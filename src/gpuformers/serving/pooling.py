"""How `gpuformers serve --task embed` turns a decoder's hidden states into one vector per input: the pooling mode
(last token, mean, first token) and L2 normalisation, read from the checkpoint's sentence-transformers files, which
also give the longest input (sentence_bert_config.json's max_seq_length: 8192 for Qwen3-Embedding).

A sentence-transformers checkpoint lists its pipeline in modules.json; the Pooling module's folder holds a
config.json whose pooling_mode_* flag names the mode, and a Normalize module means unit vectors:

    modules.json   [{"type": "sentence_transformers.models.Transformer", "path": ""},
                    {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                    {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}]
    1_Pooling/config.json   {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false, ...}

Without modules.json the default is Qwen3-Embedding's: the last token, normalised. `--pooling` and
`--no-normalize` override what the checkpoint says.

Offers: POOLING_MODES, Pooling, resolve_pooling, pool, max_seq_length, read_checkpoint_json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_MODES = ("last", "mean", "cls")
_ST = "sentence_transformers.models."
# pooling_mode_* flags of a Pooling config.json -> our mode; the other flags (max, mean_sqrt_len, weightedmean) are
# modes we do not compute
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    """The pooling mode and whether vectors are L2-normalised; `source` says where they came from (for the log)."""

    mode: str = "last"
    normalize: bool = True
    source: str = "default (last token, normalised)"

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ValueError(f'pooling mode "{self.mode}" is not one of: {", ".join(POOLING_MODES)}')


def resolve_pooling(model: str | Path, mode: str | None = None, normalize: bool | None = None) -> Pooling:
    """The pooling of checkpoint `model` (a folder, a Hub id or a .gguf file beside its sentence-transformers files),
    with `mode` and `normalize` overriding it where given."""
    found = _sentence_transformers_pooling(model, need_mode=mode is None)
    if found is None:
        found = Pooling()
    if mode is None and normalize is None:
        return found
    mode, normalize = mode or found.mode, found.normalize if normalize is None else normalize
    return Pooling(mode, normalize, f"command line ({mode}, {'normalised' if normalize else 'not normalised'})")


def max_seq_length(model: str | Path) -> int | None:
    """sentence_bert_config.json's max_seq_length of checkpoint `model`: the longest input sentence-transformers
    embeds (it cuts longer ones there), or None when the checkpoint has no such file or value."""
    config = read_checkpoint_json(model, "sentence_bert_config.json")
    value = None if config is None else config.get("max_seq_length")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{model}: sentence_bert_config.json has max_seq_length {value!r}, not a number of tokens "
                         ">= 1; fix the file or pass --max-model-len")
    return value


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden (batch, seq, hidden) and attention_mask (batch, seq) of 1 / 0 -> (batch, hidden) float32.

    "last" reads each row's rightmost real token and "cls" its leftmost, so left and right padding both work; "mean"
    averages the real tokens. Padding positions never enter a sum: their hidden states are filled with 0 first."""
    hidden, mask = hidden.float(), attention_mask.bool()
    if mode == "mean":
        return hidden.masked_fill(~mask[..., None], 0.0).sum(1) / mask.sum(1, keepdim=True)
    batch, seq = mask.shape
    positions = torch.arange(seq, device=mask.device).expand(batch, seq)
    if mode == "last":
        index = torch.where(mask, positions, -1).amax(1)
    elif mode == "cls":
        index = torch.where(mask, positions, seq).amin(1)
    else:
        raise ValueError(f'pooling mode "{mode}" is not one of: {", ".join(POOLING_MODES)}')
    return hidden[torch.arange(batch, device=hidden.device), index]


def _sentence_transformers_pooling(model: str | Path, need_mode: bool) -> Pooling | None:
    """The Pooling of the checkpoint's modules.json, or None when it has none. A module other than Transformer,
    Pooling and Normalize (a Dense projection, say) is refused: the vectors would differ from the model's."""
    modules = read_checkpoint_json(model, "modules.json")
    if modules is None:
        return None
    kinds = {entry.get("type", "").removeprefix(_ST): entry.get("path", "") for entry in modules}
    others = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if others:
        raise ValueError(f"{model}: modules.json has the sentence-transformers module(s) {', '.join(others)}, which "
                         "gpuformers serve --task embed does not run (it runs the decoder, pooling and "
                         "normalisation only); the served vectors would not be the model's")
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds or not need_mode:
        return Pooling("last", normalize, f"{model}/modules.json (last token by default)")
    name = f"{kinds['Pooling']}/config.json".lstrip("/")
    config = read_checkpoint_json(model, name)
    if config is None:
        raise ValueError(f"{model}: modules.json names a Pooling module but {name} is missing; pass --pooling "
                         f"{{{','.join(POOLING_MODES)}}}")
    chosen = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    if len(chosen) != 1 or chosen[0] not in _ST_MODES:
        raise ValueError(f"{model}: {name} sets {', '.join(chosen) or 'no pooling_mode_*'}; gpuformers pools by "
                         f"exactly one of {', '.join(_ST_MODES)}: pass --pooling {{{','.join(POOLING_MODES)}}} to "
                         "choose")
    mode = _ST_MODES[chosen[0]]
    return Pooling(mode, normalize, f"{model}/{name} ({mode}, {'normalised' if normalize else 'not normalised'})")


def read_checkpoint_json(model: str | Path, name: str):
    """The JSON file `name` of the checkpoint, or None when it has none (fetched from the Hub for a Hub id)."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        folder = path.parent
    elif path.is_dir():
        folder = path
    else:
        from gpuformers.hub import resolve_model_dir

        folder = resolve_model_dir(str(model), allow_patterns=[name])
    file = folder / name
    return json.loads(file.read_text()) if file.is_file() else None
