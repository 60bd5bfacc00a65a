"""Loading and saving a tokenizer folder: tokenizer.json, tokenizer_config.json and the chat template files.

Reads what transformers writes (including the older special_tokens_map.json and chat_template.json) and
writes what transformers reads, from a local folder or a Hub id.

Offers: PretrainedMixin (from_pretrained, save_pretrained).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from gpuformers.chat_template import note_template_source
from gpuformers.hub import TOKENIZER_PATTERNS, HubKwargs, resolve_model_dir
from gpuformers.tokenization.encoding import VERY_LARGE_INTEGER
from gpuformers.tokenization.vocabulary import added_token_state, as_added_token

if TYPE_CHECKING:
    from gpuformers.tokenization.tokenizer_fast import PreTrainedTokenizerFast


class PretrainedMixin:
    """The from_pretrained / save_pretrained part of PreTrainedTokenizerFast."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        **kwargs,
    ) -> "PreTrainedTokenizerFast":
        """Load the tokenizer of a folder or Hub id; `kwargs` override tokenizer_config.json (e.g. padding_side)."""
        for ignored in ("trust_remote_code", "use_fast", "subfolder", "force_download"):
            kwargs.pop(ignored, None)
        if kwargs.get("gguf_file"):
            raise ValueError(
                "PreTrainedTokenizerFast.from_pretrained reads tokenizer.json; for a GGUF file use "
                f"AutoTokenizer.from_pretrained({str(name_or_path)!r}, gguf_file={kwargs['gguf_file']!r}), "
                "which builds the tokenizer from the GGUF metadata"
            )
        hub = HubKwargs(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
        folder = resolve_model_dir(name_or_path, allow_patterns=TOKENIZER_PATTERNS + ["chat_templates/*"], hub=hub)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
            raise FileNotFoundError(
                f"no tokenizer.json in {folder} (it holds: {', '.join(present) or 'nothing'}). Only fast tokenizers "
                "(tokenizer.json) are supported: convert a sentencepiece / tiktoken tokenizer once with transformers "
                "(AutoTokenizer.from_pretrained(path).save_pretrained(path)), then load it here."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust error names the JSON problem; say which file it was
            raise ValueError(f"{tokenizer_file} is not a tokenizer.json that `tokenizers` can read: {err}") from err

        config = _read_json(folder / "tokenizer_config.json") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{folder / 'tokenizer_config.json'} must hold a JSON object, got {type(config).__name__}")
        if "added_tokens_decoder" not in config:
            # Older saves keep the special tokens in special_tokens_map.json instead.
            for key, value in (_read_json(folder / "special_tokens_map.json") or {}).items():
                config[key] = value
        # With a tokenizer.json, its post-processor decides BOS/EOS (transformers 5 ignores these flags too).
        config.pop("add_bos_token", None)
        config.pop("add_eos_token", None)
        _note_template_sources(config.get("chat_template"), folder / "tokenizer_config.json")

        templates = _read_chat_template_files(folder)
        if templates:
            config["chat_template"] = templates
        config.update(kwargs)
        config["name_or_path"] = str(name_or_path)
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        config.pop("additional_special_tokens", None)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            if isinstance(config.get(key), Mapping):
                config[key] = as_added_token(config[key])
        if config.get("model_max_length") is None:
            config["model_max_length"] = config.pop("max_len", None) or VERY_LARGE_INTEGER
        return cls(backend, **config)

    def save_pretrained(self, save_directory: str | os.PathLike, **_: Any) -> tuple[str, ...]:
        """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) that transformers loads too."""
        folder = Path(save_directory)
        if folder.is_file():
            raise ValueError(f"save_pretrained needs a folder, but {folder} is a file")
        folder.mkdir(parents=True, exist_ok=True)

        config: dict[str, Any] = dict(self._extra_config)
        config.update(
            {
                "added_tokens_decoder": {
                    str(index): added_token_state(token) for index, token in sorted(self.added_tokens_decoder.items())
                },
                "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
                "model_max_length": self.model_max_length,
                "padding_side": self.padding_side,
                "truncation_side": self.truncation_side,
                "split_special_tokens": self.split_special_tokens,
                "model_input_names": self.model_input_names,
                "tokenizer_class": self.tokenizer_class or "PreTrainedTokenizerFast",
            }
        )
        # Named tokens as plain strings (None too, so that a reload does not pick up a default).
        for name, value in self._special_tokens.items():
            if value is not None or name in ("bos_token", "eos_token", "unk_token", "pad_token"):
                config[name] = None if value is None else str(value)
        if self._extra_special_tokens:
            # The transformers 4 name; transformers 5 reads it as extra_special_tokens.
            config["additional_special_tokens"] = [str(t) for t in self._extra_special_tokens]

        written = [folder / "tokenizer_config.json"]
        if isinstance(self.chat_template, str):
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
            written.append(folder / "chat_template.jinja")
        elif isinstance(self.chat_template, dict):
            for name, template in self.chat_template.items():
                if name == "default":
                    path = folder / "chat_template.jinja"
                else:
                    if not name or "/" in name or "\\" in name or name.startswith("."):
                        raise ValueError(f"chat template name {name!r} cannot be a file name; rename it")
                    path = folder / "chat_templates" / f"{name}.jinja"
                    path.parent.mkdir(exist_ok=True)
                path.write_text(template, encoding="utf-8")
                written.append(path)
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        self._tokenizer.save(str(folder / "tokenizer.json"))
        written.append(folder / "tokenizer.json")
        return tuple(str(p) for p in written)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); fix or delete the file"
        ) from err


def _note_template_sources(templates: Any, path: Path) -> None:
    """Tell chat_template.py which file each template came from: its syntax errors, found when it is first
    rendered, name the file to fix."""
    if isinstance(templates, str):
        note_template_source(templates, str(path))
    elif isinstance(templates, Mapping):
        for template in templates.values():
            _note_template_sources(template, path)
    elif isinstance(templates, (list, tuple)):  # [{"name": ..., "template": ...}]
        for entry in templates:
            _note_template_sources(entry.get("template") if isinstance(entry, Mapping) else None, path)


def _read_chat_template_files(folder: Path) -> str | dict | None:
    """chat_template.jinja (newer saves), chat_templates/*.jinja (named ones), or chat_template.json (older)."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        _note_template_sources(templates["default"], folder / "chat_template.jinja")
    elif (folder / "chat_template.json").is_file():
        stored = _read_json(folder / "chat_template.json")
        template = stored.get("chat_template") if isinstance(stored, dict) else None
        if isinstance(template, str):
            templates["default"] = template
            _note_template_sources(template, folder / "chat_template.json")
    if (folder / "chat_templates").is_dir():
        for path in sorted((folder / "chat_templates").glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
            _note_template_sources(templates[path.stem], path)
    if not templates:
        return None
    return templates["default"] if list(templates) == ["default"] else templates
