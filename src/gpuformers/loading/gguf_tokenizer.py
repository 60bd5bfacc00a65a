"""The tokenizer of a GGUF file, rebuilt as a `tokenizers.Tokenizer` plus a tokenizer_config dict.

llama.cpp stores the vocabulary, its token types, the merges (or SentencePiece scores) and the name of the
pre-tokenizer as tokenizer.* metadata. Two vocabulary kinds are rebuilt:

    tokenizer.ggml.model "gpt2"  -> byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM, Mistral tekken), pre-tokenizer by
                                    tokenizer.ggml.pre from `_PRE_TOKENIZER_KINDS`
    tokenizer.ggml.model "llama" -> SentencePiece BPE ("\u2581" for spaces, <0xNN> byte fallback); merges come from
                                    the file or are derived from the piece scores. Two architectures spell it
                                    otherwise, as their HF tokenizers do (and transformers' GGUF loader):
        gemma2, gemma3              no prefix space; runs of spaces stored as "  " are the "\u2581\u2581" pieces; merges
                                    derived from the vocabulary order, which Gemma's scores do not follow
        phi3                        the prefix "\u2581" comes from a normalizer, so every piece of text between
                                    special tokens gets one (text already starting with a space too)

Offers: `tokenizer_parts(meta, file_name, model_max_length)`, which GGUFCheckpoint.tokenizer_parts() calls.
"""

from __future__ import annotations

from typing import Any, Callable

from gpuformers.tokenizer import byte_level_alphabet

# general.architecture values whose "llama" vocabulary is Gemma's SentencePiece spelling
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# Pre-tokenizer regexes, by the name llama.cpp writes in tokenizer.ggml.pre.
# Llama 3: letters with one leading non-letter, numbers in groups of up to 3, contractions case-blind.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: the same, but every digit on its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's tekken (Nemo, Small 3): words split at lower -> upper case changes, every digit on its own,
# no contraction rule.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT}
_PRE_TOKENIZER_KINDS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "gpt2_digits",
    "starcoder": "gpt2_digits",
    "refact": "gpt2_digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
    "dbrx": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "tekken": "tekken",
}


def tokenizer_parts(meta: Callable[..., Any], file_name: str, model_max_length: int):
    """`(tokenizers.Tokenizer, tokenizer_config dict)` rebuilt from a GGUF file's tokenizer.* metadata.

    `meta(key, default=None)` reads one metadata field, `file_name` names the file in errors and
    `model_max_length` is the model's context length.

    The dict holds bos/eos/pad/unk tokens as strings, chat_template, add_bos_token, add_eos_token and
    model_max_length. The Tokenizer's post-processor already inserts BOS (and EOS) when those flags
    are set, as an HF tokenizer.json does, so callers must not add them a second time.
    """
    model = meta("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"tokenizer.ggml.model {model!r} in {file_name} is not supported; "
            "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
        )
    tokens = meta("tokenizer.ggml.tokens")
    token_types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    config = {}
    for name in ("bos", "eos", "pad", "unk"):
        key = {"pad": "padding", "unk": "unknown"}.get(name, name)
        token_id = meta(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise
    config["add_bos_token"] = bool(meta("tokenizer.ggml.add_bos_token", model == "llama"))
    config["add_eos_token"] = bool(meta("tokenizer.ggml.add_eos_token", False))
    config["chat_template"] = meta("tokenizer.chat_template")
    config["model_max_length"] = model_max_length

    specials = [config[f"{name}_token"] for name in ("bos", "eos", "unk", "pad") if config[f"{name}_token"]]
    if model == "gpt2":
        tokenizer = _byte_level_bpe(
            tokens, token_types, meta("tokenizer.ggml.merges"), meta("tokenizer.ggml.pre", "default"),
            specials,
        )
    else:
        tokenizer = _sentencepiece_bpe(
            tokens, token_types, meta("tokenizer.ggml.scores"), meta("tokenizer.ggml.merges"),
            bool(meta("tokenizer.ggml.add_space_prefix", True)), specials, meta("general.architecture"),
        )
    bos = config["bos_token"] if config["add_bos_token"] else None
    eos = config["eos_token"] if config["add_eos_token"] else None
    tokenizer.post_processor = _bos_eos_template(tokenizer, bos, eos)
    return tokenizer, config


def _byte_level_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    kind = _PRE_TOKENIZER_KINDS.get(pre)
    if kind is None:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported; supported pre-tokenizers: {', '.join(_PRE_TOKENIZER_KINDS)}"
        )
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2_digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLITS[kind]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_bpe(tokens, token_types, merges, pre, specials):
    """Byte-level BPE (tokenizer.ggml.model "gpt2"): GPT-2, Llama 3, Qwen2, SmolLM vocabularies."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    spelling = byte_level_alphabet()
    alphabet = set(spelling.values())
    # tokens are stored in the byte alphabet already; the odd added token spelled in plain UTF-8 is respelled
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    if merges is None:
        raise ValueError("a byte-level BPE GGUF tokenizer needs tokenizer.ggml.merges, and this file has none")
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokenizer = Tokenizer(BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    # a control token spelled outside the byte alphabet is a mislabelled ordinary token: not special
    _add_marked_tokens(tokenizer, tokens, token_types, specials, keep=lambda token: set(token) <= alphabet)
    return tokenizer


def _sentencepiece_bpe(tokens, token_types, scores, merges, add_space_prefix, specials, architecture):
    """SentencePiece-style BPE (tokenizer.ggml.model "llama"): "▁" for spaces, <0xNN> byte fallback; Gemma's and
    Phi-3's variants (module docstring) picked by `architecture`, as transformers picks them."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(index) for index in range(len(tokens))]  # earlier in the file = merged first
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    elif scores is not None:
        pairs = _merges_from_scores(tokens, scores, vocab)
    else:
        raise ValueError("a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores or tokenizer.ggml.merges")
    tokenizer = Tokenizer(BPE(vocab, pairs, dropout=None, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    elif architecture == "phi3":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
        )
        if add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_marked_tokens(tokenizer, tokens, token_types, specials, keep=lambda token: True)
    return tokenizer


def _merges_from_scores(tokens, scores, vocab) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two known pieces,
    best-scoring result first (ties: longer left part, then longer right part, then vocabulary order)."""
    candidates = []
    for index, (piece, score) in enumerate(zip(tokens, scores)):
        if vocab.get(piece) != index:
            continue  # a duplicate spelling; the first one wins, as in the vocab
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        splits = [s for s in splits if s[0] in vocab and s[1] in vocab]
        splits.sort(key=lambda s: (vocab[s[0]], vocab[s[1]]))
        candidates.extend((-score, -len(left), -len(right), index, order, left, right)
                          for order, (left, right) in enumerate(splits))
    candidates.sort(key=lambda c: c[:5])
    return [(left, right) for *_, left, right in candidates]


def _add_marked_tokens(tokenizer, tokens, token_types, specials, keep) -> None:
    """Keep control tokens (<|im_start|>) and user-defined ones (<think>) whole, as HF added tokens do."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    control = [t for t, kind in zip(tokens, token_types) if kind == _TOKEN_CONTROL and keep(t)]
    control += [t for t in specials if t not in control and t in vocab]
    user = [t for t, kind in zip(tokens, token_types) if kind == _TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _bos_eos_template(tokenizer, bos: str | None, eos: str | None):
    """A post-processor that wraps each sequence in BOS / EOS when the file asks for them."""
    from tokenizers import processors

    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    single = [*prefix, "$A:0", *suffix]
    pair = [*single, *prefix, "$B:1", *suffix]
    special = [(token, tokenizer.token_to_id(token)) for token in dict.fromkeys(prefix + suffix)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
