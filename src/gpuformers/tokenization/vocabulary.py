"""The vocabulary side of the tokenizer: named special tokens, added tokens, and token <-> id conversion.

Special tokens (bos, eos, pad, ..., model-specific ones like `image_token` named in tokenizer_config.json)
are kept as `AddedToken`s on the tokenizer and registered as added tokens of the `tokenizers` backend, so
they are never split and `decode(skip_special_tokens=True)` drops them.

Offers: VocabularyMixin (bos_token / bos_token_id and the other named tokens, special_tokens_map,
all_special_tokens, add_tokens, add_special_tokens, convert_tokens_to_ids, ...), and for the other tokenizer
modules as_added_token and added_token_state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken

from gpuformers.tokenization.encoding import ids_as_list


def as_added_token(value: Any, *, special: bool | None = None) -> AddedToken | str | None:
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


def added_token_state(token: AddedToken) -> dict:
    return {
        "content": token.content,
        "lstrip": token.lstrip,
        "normalized": token.normalized,
        "rstrip": token.rstrip,
        "single_word": token.single_word,
        "special": token.special,
    }


def _named_token(name: str) -> property:
    def get(self) -> str | None:
        value = self._special_tokens.get(name)
        return None if value is None else str(value)

    def set(self, value) -> None:
        self._special_tokens[name] = as_added_token(value)

    return property(get, set, doc=f"The {name.replace('_', ' ')} as a string, or None when the tokenizer has none.")


def _named_token_id(name: str) -> property:
    def get(self) -> int | None:
        token = getattr(self, name)
        return None if token is None else self.convert_tokens_to_ids(token)

    def set(self, value) -> None:
        self._special_tokens[name] = None if value is None else self.convert_ids_to_tokens(int(value))

    return property(get, set, doc=f"The id of the {name.replace('_', ' ')}, or None.")


class VocabularyMixin:
    """The special-token and vocabulary part of PreTrainedTokenizerFast.

    Reads `self._tokenizer` (the `tokenizers.Tokenizer`), `self._special_tokens` (name -> token) and
    `self._extra_special_tokens`, which PreTrainedTokenizerFast.__init__ sets.
    """

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

    def _register_added_tokens(self, added_tokens_decoder: dict[int, AddedToken | str]) -> None:
        """Make sure every added token of the config and every special token is an added token of the backend,
        so that it is never split and `decode(skip_special_tokens=True)` drops the special ones."""
        known = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        # Every token of the config is added again, even one tokenizer.json has: where the two files disagree on
        # lstrip / rstrip / special, the config wins, as in transformers (re-adding keeps the id, sets the flags).
        for _, token in sorted(added_tokens_decoder.items()):
            token = token if isinstance(token, AddedToken) else AddedToken(token, special=True, normalized=False)
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
        self._extra_special_tokens = [as_added_token(t) for t in (tokens or [])]

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
                self._special_tokens[name] = as_added_token(value)
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
        return [self._tokenizer.id_to_token(i) for i in ids_as_list(ids) if i not in skip]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)
