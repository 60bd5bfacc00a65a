"""Structured outputs in the engine: a request's output held to a grammar (any JSON object, JSON that matches a JSON
schema, a regular expression, one of a list of choices, or an EBNF grammar) by setting, before each sampling step,
the logits of the tokens the grammar does not allow to -inf. The grammars and their matchers are xgrammar's
(`pip install xgrammar`), imported when the first one is compiled.

    StructuredOutputCompiler(tokenizer, vocab_size, stop_token_ids).compile(spec) -> Grammar   (cached per spec)
    add_request(..., structured_output=grammar) -> Sequence.grammar_matcher: one xgrammar GrammarMatcher
    each step:   mask_logits: the matchers fill a (rows, ceil(vocab / 32)) int32 bitmask on the host, copied to
                 the device, where the logits whose bit is 0 become -inf (sampler.sample_on_device), through
                 generation/sampling_ops.py's mask_to_allowed: the masking of generate(prefix_allowed_tokens_fn=)
    each token:  Sequence.append_token feeds the matcher; the request ends at the eos the grammar allows (or
                 whenever the matcher terminates)

A matcher must have seen every sampled token before it makes the next mask, so with asynchronous batching a step
that samples for a constrained request is collected before the next step is scheduled (manager.step): those steps
lose the overlap, steps without one keep it. Preemption (recompute) keeps a request's sampled tokens, so its matcher
stays where it is: nothing to roll back or re-feed. Requests without a grammar pay one `is None` test per step.

Offers: StructuredOutputCompiler, Grammar, tokenizer_info, stop_token_ids_of, mask_logits, unpack_bitmask,
constrains, check_structured_output, json_schema_ebnf, INSTALL_HINT.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from gpuformers.generation import sampling_ops

INSTALL_HINT = "structured outputs (response_format json_object / json_schema, regex, choice, grammar) need the " \
               "xgrammar package: pip install xgrammar (or the extra: pip install \"gpuformers[structured]\")"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return xgrammar


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one model's vocabulary, shared by every request that uses it; each request gets its
    own matcher (the state of its output so far)."""

    name: str  # what the errors call it: "json_object", "json_schema 'person'"
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int  # the model's vocabulary (rows of its logits) the bitmask covers

    def matcher(self):
        """A fresh xgrammar GrammarMatcher at the start of the output."""
        return _xgrammar().GrammarMatcher(self.compiled)


def _vocab_type(tokenizer_json: dict):
    """xgrammar's VocabType and add_prefix_space from a tokenizer.json: byte-level BPE ("Ġ" for a space) when its
    decoder is ByteLevel, byte fallback ("<0x0A>", "▁" for a space) when a decoder is ByteFallback, else raw."""
    xgrammar = _xgrammar()
    decoder = tokenizer_json.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [])} | {decoder.get("type")}
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in kinds:
        # A SentencePiece-style tokenizer puts "▁" before the text: a Prepend normalizer or a Metaspace that prepends
        pieces = [tokenizer_json.get("normalizer") or {}, tokenizer_json.get("pre_tokenizer") or {}]
        pieces += [p for part in list(pieces) for p in part.get("normalizers", []) + part.get("pretokenizers", [])]
        prepends = any(p.get("type") == "Prepend" and p.get("prepend") == "▁" or
                       p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
                       and p.get("add_prefix_space", True) for p in pieces)
        return xgrammar.VocabType.BYTE_FALLBACK, prepends
    return xgrammar.VocabType.RAW, False


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's TokenizerInfo for a gpuformers tokenizer and a model whose logits have `vocab_size` rows (often
    more than the tokenizer's tokens: the padding rows are never allowed). Special tokens (<|im_start|>, ...) other
    than the stop tokens are left out too: as text they would be valid inside a JSON string, but the model would
    read them as control tokens."""
    xgrammar = _xgrammar()
    stop_token_ids = stop_token_ids_of(tokenizer, stop_token_ids)
    encoded = [""] * vocab_size  # xgrammar treats an empty token as special: never allowed
    special = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    vocab_type, add_prefix_space = _vocab_type(json.loads(tokenizer.backend_tokenizer.to_str()))
    return xgrammar.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                  add_prefix_space=add_prefix_space)


def stop_token_ids_of(tokenizer, eos_token_ids) -> list[int]:
    """The tokens that end a grammar's output: the model's eos tokens, else the tokenizer's eos token (xgrammar's
    own guess, "</s>" for Qwen3, would be plain text)."""
    stops = [int(t) for t in eos_token_ids or ()]
    if not stops and tokenizer.eos_token_id is not None:
        stops = [tokenizer.eos_token_id]
    if not stops:
        raise ValueError("structured output needs an eos token to end the output, but neither the model's "
                         "generation config nor its tokenizer names one; set eos_token_id in generation_config.json")
    return stops


def _error_text(error: Exception) -> str:
    """xgrammar's C++ message without its "[time] file.cc:line: " and "Check failed: ..." prefixes."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
    return re.sub(r"^Check failed: .*? is false: ", "", text).split(" The JSON string is:")[0]


class StructuredOutputCompiler:
    """Compiles structured-output specs into Grammars for one tokenizer and model, each distinct spec once
    (the last `cache_size` are kept). Thread-safe: a server compiles off its event loop.

        compiler = StructuredOutputCompiler(tokenizer, model.config.vocab_size, generation_config.eos_token_ids)
        grammar = compiler.compile({"type": "json_schema", "schema": {"type": "object", ...}})
        manager.add_request(ids, structured_output=grammar)
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        xgrammar = _xgrammar()
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.stop_token_ids = list(info.stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: dict) -> Grammar:
        """spec: {"type": "json_object"} (any JSON object), {"type": "json_schema", "schema": {...} (or its JSON
        text), "name": optional}, {"type": "regex", "regex": "..."} (the whole answer matches it),
        {"type": "choice", "choices": ["yes", "no"]} (the answer is one of them), {"type": "grammar", "grammar":
        "root ::= ..."} (EBNF, xgrammar's dialect of GBNF) or {"type": "structural_tag", "format": {...}} (xgrammar's
        structural tag format: sequences of tags, free text, schemas; the server's forced tool calls and answers
        after a think block). A schema is always enforced (OpenAI's strict=true;
        xgrammar's strict mode: no properties or items beyond those it lists). Raises ValueError naming what
        xgrammar could not compile."""
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "json_object":
            source, name = "", "json_object"
        elif kind == "json_schema":
            schema = spec.get("schema")
            if not isinstance(schema, (dict, str)):
                raise ValueError(f"json_schema needs a schema (a JSON object), got {type(schema).__name__}")
            source = schema if isinstance(schema, str) else json.dumps(schema)  # property order matters: kept
            name = f"json_schema {spec['name']!r}" if spec.get("name") else "json_schema"
        elif kind in ("regex", "grammar"):
            source, name = spec.get(kind), kind
            if not isinstance(source, str) or not source:
                raise ValueError(f"a {kind} structured output needs a non-empty string, got {source!r}")
        elif kind == "structural_tag":
            if not isinstance(spec.get("format"), dict):
                raise ValueError(f"a structural_tag structured output needs a format object, got {spec.get('format')!r}")
            source, name = json.dumps(spec["format"]), "structural tag"  # key order matters (schemas): kept
        elif kind == "choice":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"a choice structured output needs a list of non-empty strings, got {choices!r}")
            # one EBNF alternative per choice: literal strings, no regex escaping to get wrong
            source, name = "root ::= " + " | ".join(map(_ebnf_string, choices)), "choice"
        else:
            raise ValueError(f"structured output type {kind!r} is not one of: json_object, json_schema, regex, "
                             f"choice, grammar, structural_tag")
        key = f"{kind}\0{source}"
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(kind, source)
        except RuntimeError as error:  # xgrammar's C++ checks
            raise ValueError(f"{name} cannot be compiled into a grammar: {_error_text(error)}") from None
        grammar = Grammar(name, compiled, self.vocab_size)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


    def _compile(self, kind: str, source: str):
        if kind == "json_object":  # any object: a schema that allows every property
            return self.compiler.compile_json_schema('{"type": "object"}', **_JSON_STYLE, strict_mode=False)
        if kind == "json_schema":
            return self.compiler.compile_json_schema(source, **_JSON_STYLE, strict_mode=True)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(f'{{"type": "structural_tag", "format": {source}}}')
        return self.compiler.compile_grammar(source)  # grammar, choice


# JSON: whitespace only where compact JSON has it (", " and ": "); with any whitespace allowed, models are known to
# emit blank lines until max_tokens (vLLM's disable-any-whitespace)
_JSON_STYLE = {"any_whitespace": False}


def json_schema_ebnf(schema: dict | str, strict: bool = True) -> str:
    """The EBNF of the JSON a schema allows, as a json_schema spec compiles it (compact, and with `strict` no
    properties or items beyond those it lists), for a structural tag that embeds it (a grammar inside a tool call or
    after a think block). Raises ValueError naming what xgrammar could not read."""
    source = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return str(_xgrammar().Grammar.from_json_schema(source, **_JSON_STYLE, strict_mode=strict))
    except RuntimeError as error:
        raise ValueError(f"json_schema cannot be compiled into a grammar: {_error_text(error)}") from None


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal: in double quotes, with backslash, quote and control characters escaped."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(escapes.get(c) or (c if ord(c) >= 32 else f"\\x{ord(c):02x}") for c in text) + '"'


def check_structured_output(grammar, vocab_size: int, tensor_parallel: bool) -> None:
    """Raise if `grammar` (a request's structured_output) cannot run on this engine."""
    if grammar is None:
        return
    if not isinstance(grammar, Grammar):
        raise TypeError(f"structured_output must be a Grammar from StructuredOutputCompiler.compile(...), got "
                        f"{type(grammar).__name__}")
    if grammar.vocab_size != vocab_size:
        raise ValueError(f"structured_output {grammar.name} was compiled for a vocabulary of {grammar.vocab_size} "
                         f"tokens but the model's logits have {vocab_size}; compile it with "
                         f"StructuredOutputCompiler(tokenizer, model.config.vocab_size, ...)")
    if tensor_parallel:
        raise NotImplementedError("structured outputs under tensor parallelism (a matcher in every process) are not "
                                  "supported yet; serve the model on one device")


def constrains(sequences) -> bool:
    """Whether any of these sequences has a grammar (its next mask needs its last token on the host)."""
    return any(seq.grammar_matcher is not None for seq in sequences)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask (rows, ceil(vocab / 32)) int32, bit j of word w set when token 32 w + j is allowed ->
    (rows, vocab_size) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (rows, words, 32); the sign bit shifts in but & 1 drops it
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, matchers: list, rows: list[int]) -> torch.Tensor:
    """logits (n, vocab) with, in each of `rows`, the tokens its matcher does not allow next at -inf (out of place:
    the logits may be a CUDA graph's output buffer): sampling_ops.mask_to_allowed, generate()'s constrained
    decoding. The masks are made on the host while the device works and reach it without a sync (pinned memory)."""
    device = logits.device
    cuda = device.type == "cuda"
    bitmask = torch.empty((len(rows), (logits.shape[-1] + 31) // 32), dtype=torch.int32, pin_memory=cuda)
    for k, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, k)
        if not bitmask[k].any():
            # A grammar with no way on (it can never finish): masking every token would leave a sampled row all -inf,
            # whose NaN fails the whole step. Left unmasked, the token drawn fails this request alone when its
            # matcher refuses it, as a greedy row does.
            bitmask[k] = -1
    index = torch.tensor(rows, dtype=torch.long, pin_memory=cuda).to(device, non_blocking=True)
    masked = logits.index_select(0, index)  # (rows, vocab), a copy
    if cuda:  # elementwise on the device: no kernel to compile (xgrammar's is Triton)
        allowed = unpack_bitmask(bitmask.to(device, non_blocking=True), logits.shape[-1])
        masked = sampling_ops.mask_to_allowed(masked, allowed)
    else:
        # xgrammar's C++ loop, in place on the copy: mask_to_allowed's numbers (tests/test_sampling_rules_both_paths.py
        # compares them) in under half the time of unpacking the booleans (0.6 vs 1.4 ms for a row of 152k tokens)
        _xgrammar().apply_token_bitmask_inplace(masked, bitmask)
    return logits.index_copy(0, index, masked)
