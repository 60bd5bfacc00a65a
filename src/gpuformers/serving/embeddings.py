"""The embedding model behind `gpuformers serve --task embed`: a bare decoder (AutoModel, returning last_hidden_state),
its tokenizer and its pooling, turning inputs into vectors in padded batches.

    texts / token ids -> token_ids (cut to truncate_prompt_tokens, else length checked; vocabulary checked)
    -> sorted by length, batches of at most BATCH_SIZE inputs and BATCH_TOKENS padded tokens, padded on the
    tokenizer's side -> last_hidden_state (batch, seq, hidden) -> pool -> (n, hidden) float32
    -> per request: the first `dimensions` values, L2-normalised when the pooling normalises

The longest input (`max_model_len`) is --max-model-len, else sentence_bert_config.json's max_seq_length, else the
model's max_position_embeddings; a longer one is refused unless the request truncates it, as vLLM does. Texts are
cut as sentence-transformers cuts them: the tokenizer truncates on its truncation side (the right: the start is
kept) and still adds its special tokens (Qwen3-Embedding's closing <|endoftext|>, the token pooled), so the vector
is sentence-transformers' with max_seq_length = N. `dimensions` needs a Matryoshka model, as in vLLM: config.json's
is_matryoshka or matryoshka_dimensions (the allowed values), or --hf-overrides setting them.
On the CPU the float32 matmuls run on oneDNN-packed weights where they are faster (kernels/cpu_linear.py), as in
generate(): vectors differ from F.linear's by rounding only.

Offers: BATCH_SIZE, BATCH_TOKENS, Embedder, load_embedder, parse_hf_overrides.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from gpuformers.engine.sampler import device_scope
from gpuformers.kernels.cpu_linear import cpu_matmuls
from gpuformers.serving.api_error import APIError
from gpuformers.serving.pooling import Pooling, max_seq_length, pool, read_checkpoint_json, resolve_pooling

BATCH_SIZE = 32  # inputs per forward pass: sorted by length first, so a batch pads little
BATCH_TOKENS = 16384  # padded tokens per forward pass (one longer input runs alone): bounds the activations' memory


class Embedder:
    """`model` (a bare decoder), `tokenizer`, `pooling`; inputs of at most `max_model_len` tokens (default:
    `max_seq_length`, else the model's context)."""

    def __init__(self, model, tokenizer, pooling: Pooling, max_model_len: int | None = None,
                 max_seq_length: int | None = None):
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        config = model.config
        context = getattr(config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > context:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens "
                             f"(config.json max_position_embeddings); give at most {context}")
        self.max_model_len = max_model_len or min(max_seq_length or context, context)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        # sentence-transformers' / vLLM's keys, which no model config class of ours or of transformers has: they stay
        # in `extra`, present only when a checkpoint's config.json (or --hf-overrides) sets them
        extra = getattr(config, "extra", None) or {}
        self.matryoshka_dimensions = _matryoshka_dimensions(extra.get("matryoshka_dimensions"), self.hidden_size)
        # vLLM's rule: a list of dimensions alone also marks the model as Matryoshka
        self.is_matryoshka = bool(self.matryoshka_dimensions) or bool(extra.get("is_matryoshka", False))
        self._lock = threading.Lock()  # one forward at a time: concurrent requests would only share the device

    def truncation_length(self, truncate_prompt_tokens: int | None) -> int | None:
        """The request's truncate_prompt_tokens as a number of tokens (-1: max_model_len), or None: no cutting."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if truncate_prompt_tokens > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens={truncate_prompt_tokens} is greater than this model's "
                                f"maximum input length of {self.max_model_len} tokens; give at most "
                                f"{self.max_model_len}, or -1 for the maximum", "truncate_prompt_tokens")
        return truncate_prompt_tokens

    def token_ids(self, inputs: list[str] | list[list[int]], truncate_to: int | None = None) -> list[list[int]]:
        """The token ids of each input (texts tokenized with the model's special tokens), cut to `truncate_to`
        tokens when given (truncation_length), else refused when longer than max_model_len; each checked against
        the vocabulary."""
        if isinstance(inputs[0], list):
            rows = inputs if truncate_to is None else [self._cut(ids, truncate_to) for ids in inputs]
        elif truncate_to is None:
            rows = [self.tokenizer.encode(text) for text in inputs]
        else:  # the tokenizer cuts the text and then adds its special tokens: sentence-transformers' ids
            rows = [self.tokenizer.encode(text, truncation=True, max_length=truncate_to) for text in inputs]
        for index, ids in enumerate(rows):
            if len(ids) > self.max_model_len:
                raise APIError(400, f"input[{index}] has {len(ids)} tokens, more than this model's maximum context "
                                    f"length of {self.max_model_len} tokens; shorten or split it, or send "
                                    f'"truncate_prompt_tokens": -1 to embed its first {self.max_model_len} tokens',
                               "input", code="context_length_exceeded")
            bad = next((token for token in ids if token >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"input[{index}] has token id {bad}, outside the vocabulary [0, "
                                    f"{self.vocab_size})", "input")
        return rows

    def check_dimensions(self, dimensions: int | None) -> None:
        """vLLM's checks of `dimensions` (>= 1 is the parser's), then the hidden size."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise APIError(400, f"dimensions={dimensions}: this model does not support matryoshka representation "
                                "(its config.json sets neither is_matryoshka nor matryoshka_dimensions), so "
                                "shortened vectors would lose quality; leave dimensions out for all "
                                f"{self.hidden_size} values, or, for a model trained with Matryoshka (Qwen3-Embedding "
                                "is), start the server with --hf-overrides '{\"is_matryoshka\": true}'",
                           "dimensions")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise APIError(400, f"dimensions={dimensions} is not one of this model's matryoshka dimensions: "
                                f"{', '.join(map(str, self.matryoshka_dimensions))}", "dimensions")
        if dimensions > self.hidden_size:
            raise APIError(400, f"dimensions={dimensions} exceeds the model's {self.hidden_size}; give 1 to "
                                f"{self.hidden_size} (or leave it out for all {self.hidden_size})", "dimensions")

    def _cut(self, ids: list[int], length: int) -> list[int]:
        """Token ids cut to `length` on the tokenizer's truncation side, as its texts are (right: keep the start)."""
        if getattr(self.tokenizer, "truncation_side", "right") == "left":
            return ids[-length:]
        return ids[:length]

    def embed(self, rows: list[list[int]], dimensions: int | None = None) -> torch.Tensor:
        """Token id lists -> (len(rows), dimensions or hidden) float32 on the CPU, in the order of `rows`."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        pooled = torch.empty(len(rows), self.hidden_size)
        # (cpu_matmuls: the CPU's faster matmuls, as generate() takes them; device_scope: this runs in a worker
        # thread, whose current CUDA device is cuda:0 whatever the model's, and Triton kernels launch on that one)
        with self._lock, torch.inference_mode(), cpu_matmuls(self.model), device_scope(self.model.device):
            for chosen in _batches(order, rows):
                input_ids, attention_mask = self._padded([rows[i] for i in chosen])
                hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False).last_hidden_state  # (batch, seq, hidden)
                pooled[chosen] = pool(hidden, attention_mask, self.pooling.mode).cpu()
        vectors = pooled[:, :dimensions] if dimensions else pooled
        if self.pooling.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        return vectors

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask (batch, longest) on the model's device, padded on the tokenizer's side
        (Qwen3-Embedding's is the left); the pad id's value never matters, being masked."""
        longest = max(map(len, rows))
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, ids in enumerate(rows):
            span = slice(longest - len(ids), longest) if left else slice(0, len(ids))
            input_ids[i, span] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, span] = 1
        return input_ids.to(self.model.device), attention_mask.to(self.model.device)


def _matryoshka_dimensions(value, hidden_size: int) -> list[int] | None:
    """config.json's matryoshka_dimensions checked: a list of sizes from 1 to the hidden size, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= hidden_size
                                              for d in value):
        raise ValueError(f"matryoshka_dimensions {value!r} must be a list of vector sizes from 1 to the hidden size "
                         f"{hidden_size}; fix config.json or --hf-overrides")
    return sorted(set(value))


def parse_hf_overrides(text: str | None) -> dict:
    """--hf-overrides (vLLM's flag): a JSON object of config.json fields set before the model loads, e.g.
    '{"is_matryoshka": true}' or '{"matryoshka_dimensions": [256, 512, 1024]}'."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--hf-overrides {text!r} is not JSON ({err}); give an object such as "
                         '\'{"is_matryoshka": true}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object of config.json fields, got {text!r}; e.g. "
                         '\'{"is_matryoshka": true}\'')
    return value


def _batches(order: list[int], rows: list[list[int]]):
    """Runs of `order` (indices of `rows` by ascending length) of at most BATCH_SIZE inputs and BATCH_TOKENS padded
    tokens; the input joining a batch is its longest, so the batch's padded size is its count times that length."""
    batch: list[int] = []
    for index in order:
        if batch and (len(batch) == BATCH_SIZE or (len(batch) + 1) * len(rows[index]) > BATCH_TOKENS):
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def load_embedder(model: str, dtype: str = "auto", device: str | None = None, quantization: str | None = None,
                  pooling: str | None = None, normalize: bool | None = None, max_model_len: int | None = None,
                  hf_overrides: dict | None = None) -> Embedder:
    """The Embedder of a Hub id, folder or .gguf path, placed as `gpuformers serve` places a causal LM; `pooling` and
    `normalize` override the checkpoint's sentence-transformers pooling (pooling.py), `max_model_len` its
    max_seq_length, and `hf_overrides` fields of its config.json (vLLM's --hf-overrides)."""
    from gpuformers.models.command_line import quantization_config_for
    from gpuformers.models.auto import AutoModel, AutoTokenizer
    from gpuformers.models.config import ModelConfig

    chosen = resolve_pooling(model, pooling, normalize)  # first: a refused pipeline fails before loading weights
    longest = max_seq_length(model)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(model)
    folder, kwargs = (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (model, {})
    loading = dict(kwargs)
    if hf_overrides:  # set before the model is built, as vLLM applies them
        checkpoint_config = read_checkpoint_json(model, "config.json")
        if checkpoint_config is None:
            raise ValueError(f"--hf-overrides changes config.json, which {model} does not have")
        loading["config"] = ModelConfig.from_dict({**checkpoint_config, **hf_overrides})
    config = quantization_config_for(quantization, dtype, device)
    if config is not None:
        loading["quantization_config"] = config
    decoder = AutoModel.from_pretrained(folder, dtype=dtype, device_map=device, **loading)
    decoder.eval()
    return Embedder(decoder, AutoTokenizer.from_pretrained(folder, **kwargs), chosen, max_model_len, longest)
