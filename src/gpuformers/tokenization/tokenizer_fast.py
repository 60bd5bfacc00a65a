"""PreTrainedTokenizerFast: transformers' fast-tokenizer class on the Rust `tokenizers` library.

The class puts together its parts (vocabulary.py, encoding.py, chat.py, pretrained.py) and holds the
constructor, which takes a `tokenizers.Tokenizer` and the keys of tokenizer_config.json.

Offers: PreTrainedTokenizerFast.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import tokenizers
from tokenizers import AddedToken

from gpuformers.tokenization.chat import ChatTemplateMixin, normalise_chat_template
from gpuformers.tokenization.encoding import VERY_LARGE_INTEGER, EncodingMixin
from gpuformers.tokenization.pretrained import PretrainedMixin
from gpuformers.tokenization.vocabulary import VocabularyMixin, as_added_token


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


class PreTrainedTokenizerFast(VocabularyMixin, EncodingMixin, ChatTemplateMixin, PretrainedMixin):
    """A `tokenizers.Tokenizer` with transformers' special tokens, padding, truncation and chat templates."""

    is_fast = True

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
        self.chat_template = normalise_chat_template(chat_template)

        # The backend's own padding / truncation (from tokenizer.json) would apply to every call; each call
        # sets what it asks for instead, as transformers does. A pad token stored there is still honoured.
        backend_padding = tokenizer_object.padding
        if pad_token is None and backend_padding and backend_padding.get("pad_token"):
            pad_token = backend_padding["pad_token"]
        tokenizer_object.no_padding()
        tokenizer_object.no_truncation()

        # Named tokens in transformers' order, which all_special_tokens keeps; model-specific ones follow.
        self._special_tokens: dict[str, AddedToken | str | None] = {
            "bos_token": as_added_token(bos_token),
            "eos_token": as_added_token(eos_token),
            "unk_token": as_added_token(unk_token),
            "sep_token": as_added_token(extra.pop("sep_token", None)),
            "pad_token": as_added_token(pad_token),
            "cls_token": as_added_token(extra.pop("cls_token", None)),
            "mask_token": as_added_token(extra.pop("mask_token", None)),
        }
        extra_special = extra.pop("extra_special_tokens", None)
        if isinstance(extra_special, Mapping):
            extra.update(extra_special)  # named model-specific tokens, e.g. {"image_token": "<image>"}
            extra_special = None
        extra_special = extra_special if extra_special is not None else additional_special_tokens
        self._extra_special_tokens = [as_added_token(t) for t in (extra_special or [])]
        for key in [k for k, v in extra.items() if k.endswith("_token") and isinstance(v, (str, AddedToken))]:
            self._special_tokens[key] = as_added_token(extra.pop(key))

        added_tokens_decoder = {
            int(index): as_added_token(token)
            for index, token in (extra.pop("added_tokens_decoder", None) or {}).items()
        }
        self._register_added_tokens(added_tokens_decoder)
        # Whatever is left is kept for save_pretrained (e.g. "errors", "add_prefix_space").
        self._extra_config = {k: v for k, v in extra.items() if k not in _CONFIG_KEYS_CONSUMED}

    def __getstate__(self) -> dict:
        # The lock cannot be pickled (DataLoader workers, deepcopy); every copy gets its own.
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
            f"padding_side={self.padding_side!r}, special_tokens={self.special_tokens_map}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )
