"""The tokenizer: transformers' `PreTrainedTokenizerFast` API on the Rust `tokenizers` library.

A checkpoint's tokenizer is its `tokenizer.json` (read by `tokenizers`, which does the real work: normalise,
pre-tokenize, BPE / WordPiece / Unigram, post-process, byte-level decode) plus `tokenizer_config.json`, which
names the special tokens, the padding side, the maximum length and the chat template. This file wraps the two
so that code written for transformers runs unchanged:

    tok = PreTrainedTokenizerFast.from_pretrained("Qwen/Qwen3-0.6B")
    batch = tok(["hi", "a longer prompt"], padding=True, return_tensors="pt")   # BatchEncoding
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

Chat templates are rendered the way transformers renders them (sandboxed Jinja with trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `{% generation %}`
blocks for assistant masks), so a prompt is byte-for-byte the one the model was trained on.

Offers: PreTrainedTokenizerFast, BatchEncoding, byte_level_alphabet.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from gpuformers.chat_template import assistant_mask, render_chats
from gpuformers.hub import TOKENIZER_PATTERNS, HubKwargs, resolve_model_dir

# transformers' "no limit" value for model_max_length; a length above LARGE_INTEGER means "not set".
VERY_LARGE_INTEGER = int(1e30)
LARGE_INTEGER = int(1e20)

PADDING_STRATEGIES = ("longest", "max_length", "do_not_pad")
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second", "do_not_truncate")

# Config keys that are read into attributes (or are meaningless once loaded) rather than kept as extras.
_CONFIG_KEYS_CONSUMED = {
    "added_tokens_decoder",
    "additional_special_tokens",
    "extra_special_tokens",
    "chat_template",
    "model_max_length",
    "max_len",
    "padding_side",
    "truncation_side",
    "clean_up_tokenization_spaces",
    "split_special_tokens",
    "model_input_names",
    "tokenizer_class",
    "name_or_path",
    "auto_map",
    "add_bos_token",
    "add_eos_token",
    "tokenizer_file",
    "special_tokens_map_file",
    "init_inputs",
    "model_specific_special_tokens",
    "chat_control_tokens",
    "processor_class",
    "backend",
    "files_loaded",
    "is_local",
    "local_files_only",
}


@functools.cache
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the other 68 move to U+0100 upward,
    so every byte string is spelled with visible characters (space -> "Ġ", newline -> "Ċ")."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(0x100 + shifted)
            shifted += 1
    return table


class BatchEncoding(dict):
    """What a tokenizer call returns: a dict (`input_ids`, `attention_mask`, ...) that also reads as attributes.

    `encodings` holds the `tokenizers.Encoding` of each row (offsets, word ids) when the call made them.
    """

    def __init__(self, data: Mapping | None = None, encodings: list | None = None, tensor_type: str | None = None):
        super().__init__(data or {})
        self.encodings = encodings
        if tensor_type is not None:
            self.convert_to_tensors(tensor_type)

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"BatchEncoding has no field {name!r}; it holds: {', '.join(self) or 'nothing'}"
            ) from None

    def tokens(self, batch_index: int = 0) -> list[str]:
        if not self.encodings:
            raise ValueError(
                "tokens() needs the encodings of a tokenizer call; this BatchEncoding was built without them"
            )
        return self.encodings[batch_index].tokens

    def convert_to_tensors(self, tensor_type: str | None) -> "BatchEncoding":
        """Turn every list value into a `torch.Tensor` ("pt") or a `numpy.ndarray` ("np"), in place."""
        if tensor_type is None:
            return self
        if tensor_type not in ("pt", "np"):
            raise ValueError(f'return_tensors "{tensor_type}" is not one of: pt, np (or None for Python lists)')
        import numpy as np

        for key, value in self.items():
            if hasattr(value, "shape"):
                continue
            rows = value if value and isinstance(value[0], (list, tuple)) else None
            if rows is not None and len({len(row) for row in rows}) > 1:
                raise ValueError(
                    f"Unable to create a tensor from {key!r}: its rows have different lengths "
                    f"({sorted({len(row) for row in rows})}). Pass padding=True (and truncation=True) to get "
                    "rows of the same length."
                )
            if tensor_type == "pt":
                import torch

                # A single unbatched sequence still becomes a (1, seq) tensor, as in transformers.
                tensor = torch.tensor(value)
                self[key] = tensor.unsqueeze(0) if tensor.dim() == 1 and rows is None else tensor
            else:
                array = np.asarray(value)
                self[key] = array[None] if array.ndim == 1 and rows is None else array
        return self

    def to(self, device, non_blocking: bool = False) -> "BatchEncoding":
        """Move every tensor to `device` (a torch.device, a string like "cuda:0", or an int); returns self."""
        import torch

        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device, non_blocking=non_blocking)
        return self


def _as_added_token(value: Any, *, special: bool | None = None) -> AddedToken | str | None:
    """A token given as a string, an AddedToken, or the dict that tokenizer_config.json stores it as."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, AddedToken):
        if special is not None:
            value.special = special
        return value
    if isinstance(value, Mapping) and "content" in value:
        fields = {k: v for k, v in value.items() if k in ("single_word", "lstrip", "rstrip", "normalized", "special")}
        if special is not None:
            fields["special"] = special
        return AddedToken(value["content"], **fields)
    raise TypeError(f"a special token must be a string, an AddedToken or a {{'content': ...}} dict, got {value!r}")


def _added_token_state(token: AddedToken) -> dict:
    return {
        "content": token.content,
        "lstrip": token.lstrip,
        "normalized": token.normalized,
        "rstrip": token.rstrip,
        "single_word": token.single_word,
        "special": token.special,
    }


def _ids_as_list(ids: Any) -> list[int]:
    """Token ids given as an int, a list, a torch tensor or a numpy array -> a flat list of ints."""
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    if ids and isinstance(ids[0], (list, tuple)):
        raise TypeError(
            f"decode takes one sequence of ids, got a batch of {len(ids)}; use batch_decode, or decode(ids[0])"
        )
    return [int(i) for i in ids]


def _named_token(name: str) -> property:
    def get(self) -> str | None:
        value = self._special_tokens.get(name)
        return None if value is None else str(value)

    def set(self, value) -> None:
        self._special_tokens[name] = _as_added_token(value)

    return property(get, set, doc=f"The {name.replace('_', ' ')} as a string, or None when the tokenizer has none.")


def _named_token_id(name: str) -> property:
    def get(self) -> int | None:
        token = getattr(self, name)
        return None if token is None else self.convert_tokens_to_ids(token)

    def set(self, value) -> None:
        self._special_tokens[name] = None if value is None else self.convert_ids_to_tokens(int(value))

    return property(get, set, doc=f"The id of the {name.replace('_', ' ')}, or None.")


class PreTrainedTokenizerFast:
    """A `tokenizers.Tokenizer` with transformers' special tokens, padding, truncation and chat templates."""

    is_fast = True

    bos_token = _named_token("bos_token")
    eos_token = _named_token("eos_token")
    unk_token = _named_token("unk_token")
    sep_token = _named_token("sep_token")
    pad_token = _named_token("pad_token")
    cls_token = _named_token("cls_token")
    mask_token = _named_token("mask_token")
    bos_token_id = _named_token_id("bos_token")
    eos_token_id = _named_token_id("eos_token")
    unk_token_id = _named_token_id("unk_token")
    sep_token_id = _named_token_id("sep_token")
    pad_token_id = _named_token_id("pad_token")
    cls_token_id = _named_token_id("cls_token")
    mask_token_id = _named_token_id("mask_token")

    def __init__(
        self,
        tokenizer_object: tokenizers.Tokenizer,
        *,
        bos_token: str | AddedToken | None = None,
        eos_token: str | AddedToken | None = None,
        pad_token: str | AddedToken | None = None,
        unk_token: str | AddedToken | None = None,
        additional_special_tokens: Sequence[str | AddedToken] | None = None,
        chat_template: str | dict | list | None = None,
        model_max_length: int = VERY_LARGE_INTEGER,
        padding_side: str = "right",
        truncation_side: str = "right",
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
        **extra,
    ):
        """Wrap `tokenizer_object` (used as is, not copied: this tokenizer sets its padding and truncation).

        `extra` takes the other tokenizer_config.json keys: sep/cls/mask tokens, `extra_special_tokens` (the
        transformers 5 name of `additional_special_tokens`; a dict there names model-specific tokens),
        model-specific `*_token` keys (e.g. `image_token`), `added_tokens_decoder`, `split_special_tokens`,
        `model_input_names`; unknown keys are kept and written back by `save_pretrained`.
        """
        if not isinstance(tokenizer_object, tokenizers.Tokenizer):
            raise TypeError(f"tokenizer_object must be a tokenizers.Tokenizer, got {type(tokenizer_object).__name__}")
        self._tokenizer = tokenizer_object
        self._lock = threading.Lock()  # padding and truncation are set on the shared backend for each call
        self.name_or_path = str(name_or_path)
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        for label, side in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if side not in ("left", "right"):
                raise ValueError(f'{label} "{side}" is not one of: left, right')
        self.model_max_length = VERY_LARGE_INTEGER if model_max_length is None else int(model_max_length)
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.split_special_tokens = bool(extra.pop("split_special_tokens", False))
        self.model_input_names = list(extra.pop("model_input_names", None) or ["input_ids", "attention_mask"])
        self.tokenizer_class = extra.pop("tokenizer_class", None)
        self.chat_template = _normalise_chat_template(chat_template)

        # The backend's own padding / truncation (from tokenizer.json) would apply to every call; each call
        # sets what it asks for instead, as transformers does. A pad token stored there is still honoured.
        backend_padding = tokenizer_object.padding
        if pad_token is None and backend_padding and backend_padding.get("pad_token"):
            pad_token = backend_padding["pad_token"]
        tokenizer_object.no_padding()
        tokenizer_object.no_truncation()

        # Named tokens in transformers' order, which all_special_tokens keeps; model-specific ones follow.
        self._special_tokens: dict[str, AddedToken | str | None] = {
            "bos_token": _as_added_token(bos_token),
            "eos_token": _as_added_token(eos_token),
            "unk_token": _as_added_token(unk_token),
            "sep_token": _as_added_token(extra.pop("sep_token", None)),
            "pad_token": _as_added_token(pad_token),
            "cls_token": _as_added_token(extra.pop("cls_token", None)),
            "mask_token": _as_added_token(extra.pop("mask_token", None)),
        }
        extra_special = extra.pop("extra_special_tokens", None)
        if isinstance(extra_special, Mapping):
            extra.update(extra_special)  # named model-specific tokens, e.g. {"image_token": "<image>"}
            extra_special = None
        extra_special = extra_special if extra_special is not None else additional_special_tokens
        self._extra_special_tokens = [_as_added_token(t) for t in (extra_special or [])]
        for key in [k for k, v in extra.items() if k.endswith("_token") and isinstance(v, (str, AddedToken))]:
            self._special_tokens[key] = _as_added_token(extra.pop(key))

        added_tokens_decoder = {
            int(index): _as_added_token(token)
            for index, token in (extra.pop("added_tokens_decoder", None) or {}).items()
        }
        self._register_added_tokens(added_tokens_decoder)
        # Whatever is left is kept for save_pretrained (e.g. "errors", "add_prefix_space").
        self._extra_config = {k: v for k, v in extra.items() if k not in _CONFIG_KEYS_CONSUMED}

    def _register_added_tokens(self, added_tokens_decoder: dict[int, AddedToken | str]) -> None:
        """Make sure every added token of the config and every special token is an added token of the backend,
        so that it is never split and `decode(skip_special_tokens=True)` drops the special ones."""
        known = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        for _, token in sorted(added_tokens_decoder.items()):
            token = token if isinstance(token, AddedToken) else AddedToken(token, special=True, normalized=False)
            if token.content not in known:
                to_add.append(token)
                known.add(token.content)
        for token in [*self._special_tokens.values(), *self._extra_special_tokens]:
            if token is None or str(token) in known:
                continue
            if isinstance(token, str):
                token = AddedToken(token, special=True, normalized=False)
            else:
                token.special = True
            to_add.append(token)
            known.add(token.content)
        if to_add:
            # An added token whose text is already in the vocabulary keeps that id.
            self._tokenizer.add_tokens(to_add)

    def __getattr__(self, name: str):
        # Model-specific special tokens (image_token, image_token_id, ...) named in tokenizer_config.json.
        special = self.__dict__.get("_special_tokens", {})
        base = name.removesuffix("_id")
        if base in special and base.endswith("_token"):
            value = special[base]
            if value is None or base == name:
                return None if value is None else str(value)
            return self.convert_tokens_to_ids(str(value))
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __getstate__(self) -> dict:
        # The lock cannot be pickled (DataLoader workers, deepcopy); every copy gets its own.
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ loading and saving

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
                config[key] = _as_added_token(config[key])
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
                    str(index): _added_token_state(token) for index, token in sorted(self.added_tokens_decoder.items())
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

    # ------------------------------------------------------------------ vocabulary and special tokens

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without the added tokens (len(tokenizer) counts those too)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: index for index, token in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (bos_token, eos_token, ..., model-specific ones), as strings."""
        return {name: str(value) for name, value in self._special_tokens.items() if value is not None}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(t) for t in self._extra_special_tokens]

    @extra_special_tokens.setter
    def extra_special_tokens(self, tokens: Sequence[str | AddedToken] | None) -> None:
        self._extra_special_tokens = [_as_added_token(t) for t in (tokens or [])]

    additional_special_tokens = extra_special_tokens  # the transformers 4 name

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, each once."""
        tokens = [str(t) for t in self._special_tokens.values() if t is not None]
        tokens += [str(t) for t in self._extra_special_tokens]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def add_tokens(
        self, new_tokens: str | AddedToken | Sequence[str | AddedToken], special_tokens: bool = False
    ) -> int:
        """Add tokens to the vocabulary (never split); returns how many were new."""
        if isinstance(new_tokens, (str, AddedToken)):
            new_tokens = [new_tokens]
        if special_tokens:
            return self._tokenizer.add_special_tokens(list(new_tokens))
        return self._tokenizer.add_tokens(list(new_tokens))

    def add_special_tokens(self, special_tokens_dict: Mapping[str, Any]) -> int:
        """Set named special tokens (e.g. {"pad_token": "[PAD]"}) and add them to the vocabulary."""
        added = 0
        for name, value in special_tokens_dict.items():
            if name in ("additional_special_tokens", "extra_special_tokens"):
                self.extra_special_tokens = list(value)
                added += self.add_tokens(list(value), special_tokens=True)
            elif name.endswith("_token"):
                self._special_tokens[name] = _as_added_token(value)
                added += self.add_tokens([value], special_tokens=True)
            else:
                raise ValueError(
                    f"{name!r} is not a special token name; use bos_token, eos_token, pad_token, ... or extra_special_tokens"
                )
        return added

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Token string(s) -> id(s); an unknown token maps to unk_token_id (None when there is no unk token)."""
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None and tokens != self.unk_token else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in _ids_as_list(ids) if i not in skip]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    # ------------------------------------------------------------------ encoding

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        return self._tokenizer.encode(text, pair, add_special_tokens=add_special_tokens).tokens

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """Text -> ids (a (1, seq) tensor with return_tensors="pt"); takes the padding / truncation options of __call__."""
        return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    def __call__(
        self,
        text: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        stride: int = 0,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
        return_token_type_ids: bool | None = None,
        return_special_tokens_mask: bool = False,
        return_offsets_mapping: bool = False,
        return_length: bool = False,
        split_special_tokens: bool | None = None,
    ) -> BatchEncoding:
        """Tokenize one text or a batch; a single text gives flat lists (a (1, seq) tensor with return_tensors)."""
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        for item in texts:
            if not isinstance(item, str):
                raise TypeError(
                    f"text must be a string or a list of strings, got an item of type {type(item).__name__}: {item!r}"
                )
        if text_pair is not None:
            pairs = list(text_pair) if isinstance(text_pair, (list, tuple)) else [text_pair]
            if len(pairs) != len(texts):
                raise ValueError(f"text has {len(texts)} items but text_pair has {len(pairs)}; give one pair per text")
            inputs = list(zip(texts, pairs))
        else:
            inputs = texts

        padding_strategy, truncation_strategy, max_length = self._padding_and_truncation(
            padding, truncation, max_length
        )
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f'padding_side "{side}" is not one of: left, right')
        with self._lock:
            backend = self._tokenizer
            if truncation_strategy != "do_not_truncate":
                backend.enable_truncation(
                    max_length, stride=stride, strategy=truncation_strategy, direction=self.truncation_side
                )
            if padding_strategy != "do_not_pad":
                backend.enable_padding(
                    direction=side,
                    pad_id=self.pad_token_id,
                    pad_token=self.pad_token,
                    length=max_length if padding_strategy == "max_length" else None,
                    pad_to_multiple_of=pad_to_multiple_of,
                )
            backend.encode_special_tokens = (
                self.split_special_tokens if split_special_tokens is None else split_special_tokens
            )
            try:
                encodings = backend.encode_batch(inputs, add_special_tokens=add_special_tokens)
            finally:
                backend.no_truncation()
                backend.no_padding()
                backend.encode_special_tokens = self.split_special_tokens

        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        data: dict[str, list] = {"input_ids": [e.ids for e in encodings]}
        if return_token_type_ids:
            data["token_type_ids"] = [e.type_ids for e in encodings]
        if return_attention_mask:
            data["attention_mask"] = [e.attention_mask for e in encodings]
        if return_special_tokens_mask:
            data["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        if return_offsets_mapping:
            data["offset_mapping"] = [e.offsets for e in encodings]
        if return_length:
            data["length"] = [len(e.ids) for e in encodings]
        if not batched and return_tensors is None:
            data = {key: value[0] for key, value in data.items()}
        return BatchEncoding(data, encodings=encodings, tensor_type=return_tensors)

    def _padding_and_truncation(self, padding, truncation, max_length) -> tuple[str, str, int | None]:
        """Normalise the user's padding / truncation / max_length the way transformers does."""
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers: a max_length on its own means "truncate to it"
        if padding is True:
            padding_strategy = "longest"
        elif padding is False or padding is None:
            padding_strategy = "do_not_pad"
        elif str(padding) in PADDING_STRATEGIES:
            padding_strategy = str(padding)
        else:
            raise ValueError(f"padding {padding!r} is not one of: True, False, {', '.join(PADDING_STRATEGIES)}")
        if truncation is True:
            truncation_strategy = "longest_first"
        elif truncation is False or truncation is None:
            truncation_strategy = "do_not_truncate"
        elif str(truncation) in TRUNCATION_STRATEGIES:
            truncation_strategy = str(truncation)
        else:
            raise ValueError(
                f"truncation {truncation!r} is not one of: True, False, {', '.join(TRUNCATION_STRATEGIES)}"
            )
        if max_length is None:
            # With no max_length, both fall back to model_max_length, or switch off when it is not set.
            known = self.model_max_length <= LARGE_INTEGER
            if padding_strategy == "max_length":
                padding_strategy = "max_length" if known else "do_not_pad"
            if truncation_strategy != "do_not_truncate" and not known:
                truncation_strategy = "do_not_truncate"
            if known and (padding_strategy == "max_length" or truncation_strategy != "do_not_truncate"):
                max_length = self.model_max_length
        if padding_strategy != "do_not_pad" and (self.pad_token is None or self.pad_token_id is None):
            raise ValueError(
                "Asking to pad but the tokenizer does not have a padding token. Set one, e.g. "
                "`tokenizer.pad_token = tokenizer.eos_token`, or add a new one with "
                "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})`."
            )
        return padding_strategy, truncation_strategy, max_length

    def pad(
        self,
        encoded_inputs: Mapping | Sequence[Mapping],
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
        return_tensors: str | None = None,
    ) -> BatchEncoding:
        """Pad already-tokenized rows (a dict of lists, or a list of dicts as data collators pass them)."""
        if isinstance(encoded_inputs, Sequence) and not isinstance(encoded_inputs, Mapping):
            rows_as_dicts = list(encoded_inputs)
            encoded_inputs = {
                key: [row[key] for row in rows_as_dicts] for key in (rows_as_dicts[0] if rows_as_dicts else {})
            }
        data = {key: (value.tolist() if hasattr(value, "tolist") else value) for key, value in encoded_inputs.items()}
        if "input_ids" not in data:
            raise ValueError(f"pad() needs 'input_ids' among the inputs, got: {', '.join(data) or 'nothing'}")
        single = not data["input_ids"] or isinstance(data["input_ids"][0], int)
        if single:
            data = {key: [value] for key, value in data.items()}
        padding_strategy, _, max_length = self._padding_and_truncation(padding, False, max_length)
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_attention_mask and "attention_mask" not in data:
            data["attention_mask"] = [[1] * len(row) for row in data["input_ids"]]
        lengths = [len(row) for row in data["input_ids"]]
        target = max(lengths, default=0) if padding_strategy == "longest" else (max_length or 0)
        if pad_to_multiple_of and target % pad_to_multiple_of:
            target += pad_to_multiple_of - target % pad_to_multiple_of
        side = padding_side or self.padding_side
        fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1}
        if padding_strategy != "do_not_pad":
            for key, value in fill.items():
                if key in data:
                    data[key] = [
                        (
                            ([value] * (target - len(row)) + list(row))
                            if side == "left"
                            else (list(row) + [value] * (target - len(row)))
                        )
                        for row in data[key]
                    ]
        if single and return_tensors is None:
            data = {key: value[0] for key, value in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors)

    # ------------------------------------------------------------------ decoding

    def decode(
        self, token_ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Ids -> text. Byte-level BPE pieces are joined as bytes before decoding, so multi-byte characters
        (CJK, emoji) come out whole; a sequence cut inside a character ends in U+FFFD, never in a wrong letter."""
        text = self._tokenizer.decode(_ids_as_list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._clean_up(text, clean_up_tokenization_spaces)

    def batch_decode(
        self, sequences: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        texts = self._tokenizer.decode_batch(
            [_ids_as_list(s) for s in sequences], skip_special_tokens=skip_special_tokens
        )
        return [self._clean_up(text, clean_up_tokenization_spaces) for text in texts]

    def _clean_up(self, text: str, clean_up: bool | None) -> str:
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        # The clean-up joins " ," and " n't" for WordPiece-era tokenizers; on BPE it deletes real spaces, so
        # (like transformers) it is skipped there.
        if not clean_up or type(self._tokenizer.model).__name__ == "BPE":
            return text
        for spaced, joined in (
            (" .", "."),
            (" ?", "?"),
            (" !", "!"),
            (" ,", ","),
            (" ' ", "'"),
            (" n't", "n't"),
            (" 'm", "'m"),
            (" 's", "'s"),
            (" 've", "'ve"),
            (" 're", "'re"),
        ):
            text = text.replace(spaced, joined)
        return text

    # ------------------------------------------------------------------ chat templates

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: `chat_template` (a template or the name of one), else the tokenizer's own."""
        if isinstance(self.chat_template, dict):
            named = self.chat_template
            if chat_template is not None:
                return named.get(chat_template, chat_template)
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
            raise ValueError(
                f"this tokenizer has several chat templates and none is called 'default'; pass "
                f"chat_template= one of: {', '.join(sorted(named))}"
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer.chat_template is None). Pass chat_template= a Jinja "
                "template, or set tokenizer.chat_template, e.g. from the instruct version of the model."
            )
        return self.chat_template

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = True,
        chat_template: str | None = None,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict | None = None,
        sanitize_control_tokens: bool = False,
        **template_kwargs,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """Render a conversation (or a batch of them) with the chat template; tokenize it unless tokenize=False.

        As in transformers 5: with tokenize=True a BatchEncoding is returned unless return_dict=False (then the
        ids). Extra keyword arguments (e.g. enable_thinking=False) are template variables.
        """
        if sanitize_control_tokens:
            raise NotImplementedError(
                "sanitize_control_tokens=True (encoding control tokens found in user text as plain text) is not "
                "supported yet; strip such tokens from the messages before calling apply_chat_template"
            )
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError("return_assistant_tokens_mask=True needs tokenize=True and return_dict=True")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be set: the first continues the last "
                "message, the second starts a new assistant message"
            )
        if continue_final_message and return_assistant_tokens_mask:
            raise ValueError("continue_final_message cannot be combined with return_assistant_tokens_mask")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("the conversation is empty; give at least one message")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        )
        conversations = list(conversation) if batched else [conversation]
        variables = {**self.special_tokens_map, **template_kwargs}
        rendered, spans = render_chats(
            template,
            conversations,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            track_generation=return_assistant_tokens_mask,
            **variables,
        )
        if not tokenize:
            return rendered if batched else rendered[0]
        out = self(
            rendered if batched else rendered[0],
            add_special_tokens=False,  # the template writes BOS and the rest itself
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            return_tensors=return_tensors,
            **(tokenizer_kwargs or {}),
        )
        if not return_dict:
            return out["input_ids"]
        if return_assistant_tokens_mask:
            masks = [assistant_mask(encoding.offsets, row_spans) for encoding, row_spans in zip(out.encodings, spans)]
            out["assistant_masks"] = masks if batched or return_tensors else masks[0]
            if return_tensors:
                out.convert_to_tensors(return_tensors)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
            f"padding_side={self.padding_side!r}, special_tokens={self.special_tokens_map}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


def _normalise_chat_template(template: str | dict | list | None) -> str | dict | None:
    """A template, a {name: template} dict, or the [{"name", "template"}] list that configs store."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        named = dict(template)
    elif isinstance(template, (list, tuple)):
        try:
            named = {entry["name"]: entry["template"] for entry in template}
        except (TypeError, KeyError) as err:
            raise ValueError("chat_template as a list must hold {'name': ..., 'template': ...} entries") from err
    else:
        raise TypeError(
            f"chat_template must be a string, a dict of named templates or a list, got {type(template).__name__}"
        )
    return named["default"] if list(named) == ["default"] else named


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); fix or delete the file"
        ) from err


def _read_chat_template_files(folder: Path) -> str | dict | None:
    """chat_template.jinja (newer saves), chat_templates/*.jinja (named ones), or chat_template.json (older)."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        stored = _read_json(folder / "chat_template.json")
        template = stored.get("chat_template") if isinstance(stored, dict) else None
        if isinstance(template, str):
            templates["default"] = template
    if (folder / "chat_templates").is_dir():
        for path in sorted((folder / "chat_templates").glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if not templates:
        return None
    return templates["default"] if list(templates) == ["default"] else templates
