"""The embedding model behind `gpuformers serve --task embed`: a bare decoder (AutoModel, returning last_hidden_state),
its tokenizer and its pooling, turning inputs into vectors in padded batches.

    texts / token ids -> token_ids (length and vocabulary checks) -> sorted by length, batches of at most
    BATCH_SIZE inputs and BATCH_TOKENS padded tokens, padded on the tokenizer's side
    -> last_hidden_state (batch, seq, hidden) -> pool -> (n, hidden) float32
    -> per request: the first `dimensions` values, L2-normalised when the pooling normalises

Offers: BATCH_SIZE, BATCH_TOKENS, Embedder, load_embedder.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from gpuformers.serving.api_error import APIError
from gpuformers.serving.pooling import Pooling, pool, resolve_pooling

BATCH_SIZE = 32  # inputs per forward pass: sorted by length first, so a batch pads little
BATCH_TOKENS = 16384  # padded tokens per forward pass (one longer input runs alone): bounds the activations' memory


class Embedder:
    """`model` (a bare decoder), `tokenizer`, `pooling`; inputs of at most `max_model_len` tokens."""

    def __init__(self, model, tokenizer, pooling: Pooling, max_model_len: int | None = None):
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        config = model.config
        context = getattr(config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or context, context)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self._lock = threading.Lock()  # one forward at a time: concurrent requests would only share the device

    def token_ids(self, inputs: list[str] | list[list[int]]) -> list[list[int]]:
        """The token ids of each input (texts tokenized with the model's special tokens), each checked against the
        vocabulary and the context length."""
        rows = inputs if isinstance(inputs[0], list) else [self.tokenizer.encode(text) for text in inputs]
        for index, ids in enumerate(rows):
            if len(ids) > self.max_model_len:
                raise APIError(400, f"input[{index}] has {len(ids)} tokens, more than this model's maximum context "
                                    f"length of {self.max_model_len} tokens; shorten or split it", "input",
                               code="context_length_exceeded")
            bad = next((token for token in ids if token >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"input[{index}] has token id {bad}, outside the vocabulary [0, "
                                    f"{self.vocab_size})", "input")
        return rows

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and dimensions > self.hidden_size:
            raise APIError(400, f"dimensions={dimensions} exceeds the model's {self.hidden_size}; give 1 to "
                                f"{self.hidden_size} (or leave it out for all {self.hidden_size})", "dimensions")

    def embed(self, rows: list[list[int]], dimensions: int | None = None) -> torch.Tensor:
        """Token id lists -> (len(rows), dimensions or hidden) float32 on the CPU, in the order of `rows`."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        pooled = torch.empty(len(rows), self.hidden_size)
        with self._lock, torch.inference_mode():
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
                  pooling: str | None = None, normalize: bool | None = None,
                  max_model_len: int | None = None) -> Embedder:
    """The Embedder of a Hub id, folder or .gguf path, placed as `gpuformers serve` places a causal LM; `pooling` and
    `normalize` override the checkpoint's sentence-transformers pooling (pooling.py)."""
    from gpuformers.generation.cli import quantization_config_for
    from gpuformers.models.auto import AutoModel, AutoTokenizer

    chosen = resolve_pooling(model, pooling, normalize)  # first: a refused pipeline fails before loading weights
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(model)
    folder, kwargs = (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (model, {})
    config = quantization_config_for(quantization, dtype, device)
    decoder = AutoModel.from_pretrained(folder, dtype=dtype, device_map=device, **kwargs,
                                        **({"quantization_config": config} if config is not None else {}))
    decoder.eval()
    return Embedder(decoder, AutoTokenizer.from_pretrained(folder, **kwargs), chosen, max_model_len)
