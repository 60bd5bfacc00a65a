"""A model id or a folder -> local files.

`resolve_model_dir` turns what a user passes to `from_pretrained` into a local folder: a folder is used as it
is; anything else is a Hub id looked up through `huggingface_hub` in the standard HF cache (so a model that
transformers downloaded is found here too), honouring `HF_HUB_OFFLINE=1`, `revision`, `cache_dir`, `token` and
`local_files_only`. Only the files a step needs are fetched (`allow_patterns`): `gpuformers fit` reads the
config and the index without downloading the weights.

Offers: resolve_model_dir, HubKwargs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# What from_pretrained needs from a checkpoint; weights are fetched only when asked for.
CONFIG_PATTERNS = ["config.json", "generation_config.json"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
]


@dataclass
class HubKwargs:
    """The `from_pretrained` arguments that say where files come from."""

    revision: str | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False
    token: str | bool | None = None

    @classmethod
    def pop_from(cls, kwargs: dict) -> "HubKwargs":
        return cls(
            revision=kwargs.pop("revision", None),
            cache_dir=kwargs.pop("cache_dir", None),
            local_files_only=kwargs.pop("local_files_only", False),
            token=kwargs.pop("token", None),
        )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_dir(
    name_or_path: str | os.PathLike,
    allow_patterns: list[str] | None = None,
    hub: HubKwargs | None = None,
) -> Path:
    """Return a local folder holding the checkpoint's files (those matching `allow_patterns`)."""
    hub = hub or HubKwargs()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists():
        raise ValueError(f"{name!r} is a file; pass the folder that holds config.json (or gguf_file= for a GGUF file)")
    if name.count("/") > 1 or name.startswith((".", "/", "~")) or not name.strip():
        raise FileNotFoundError(f"no folder at {name!r}, and it is not a Hub id of the form 'org/name'")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    offline = hub.local_files_only or _offline()
    try:
        folder = snapshot_download(
            repo_id=name,
            revision=hub.revision,
            cache_dir=hub.cache_dir,
            local_files_only=offline,
            token=hub.token,
            allow_patterns=allow_patterns,
        )
    except LocalEntryNotFoundError as err:
        where = hub.cache_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        why = ("offline mode (HF_HUB_OFFLINE=1 or local_files_only=True) forbids a download" if offline else
               "the Hub could not be reached to download it")
        raise FileNotFoundError(
            f"{name!r} (revision {hub.revision or 'main'}) is not in the local HF cache at {where}, and {why}. "
            f"Download it once with network access, or pass a local folder."
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise FileNotFoundError(f"{name!r} (revision {hub.revision or 'main'}) was not found on the Hub: {err}") from err
    return Path(folder)
