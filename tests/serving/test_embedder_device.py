"""The embedding server's forward passes run in worker threads (asyncio.to_thread), whose current CUDA device is
cuda:0 whatever the model's: Embedder.embed makes the model's device current, as the engine's steps do, so that
Triton kernels (quantized linear layers) launch on the model's GPU."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch
from torch import nn

from gpuformers.serving import embeddings
from gpuformers.serving.embeddings import Embedder
from gpuformers.serving.pooling import Pooling


class Decoder(nn.Module):
    """A bare decoder's surface: last_hidden_state (batch, seq, 4), each token's hidden state its id."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=32, hidden_size=4, vocab_size=16, extra={})
        self.embed_tokens = nn.Embedding(16, 4)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, input_ids, attention_mask, use_cache):
        return SimpleNamespace(last_hidden_state=input_ids[..., None].float().expand(*input_ids.shape, 4))


def test_embed_runs_with_the_models_device_current_in_a_worker_thread(monkeypatch):
    entered = []

    def recording_scope(device):
        entered.append((device, threading.current_thread().name))
        return contextlib.nullcontext()

    monkeypatch.setattr(embeddings, "device_scope", recording_scope)
    embedder = Embedder(Decoder(), SimpleNamespace(pad_token_id=0, padding_side="right"), Pooling(normalize=False))
    result = []
    worker = threading.Thread(target=lambda: result.append(embedder.embed([[1, 2, 3], [5]])), name="worker")
    worker.start()
    worker.join()
    assert result[0][:, 0].tolist() == [3.0, 5.0]  # the last token of each input
    assert entered == [(torch.device("cpu"), "worker")]
