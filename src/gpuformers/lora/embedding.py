"""LoRA on an embedding layer (peft's lora.Embedding), and the LM head tied to it under ensure_weight_tying.

An embedding looks a token up, so its low-rank update is a lookup too: row `id` of A^T, times B^T.

    ids ──> base_layer (frozen W (vocab, hidden)) ─────────────────────> + ──> y
    └──> lookup in A^T (vocab, r) ──> @ B^T (r, hidden) ──> * scaling ──┘

    lora_embedding_A (r, vocab)     zeros at init (init_lora_weights True or "gaussian"): the model starts unchanged
    lora_embedding_B (hidden, r)    standard normal at init
    merge                           W += A^T B^T * scaling

As in peft: no dropout on the ids (lora_dropout applies to the linear targets only), the lookup takes the base
layer's padding_idx, max_norm, ... , and the tensors are saved as `...embed_tokens.lora_embedding_A` / `_B` (peft's
keys, no ".weight").

On a model whose LM head is the embedding (tie_word_embeddings) with ensure_weight_tying=True and an embedding layer
in target_modules, peft puts the LoRA on the embedding and gives the head the transposed pair (head lora_A =
lora_embedding_B^T, lora_B = lora_embedding_A^T). TiedLoraLinear is that head: it holds no tensors of its own and
computes with the embedding's, so head and embedding stay one adapter whatever the dtype or device (in peft they
share storage in float32 and come apart over a half-precision base); merging adds A^T B^T once to the one tied
weight, which serves both. peft_model.py saves the head's pair under peft's keys.

Offers: LoraEmbedding, TiedLoraLinear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.lora.config import LoraConfig
from gpuformers.lora.layers import LoraLayer, adapter_dtype_and_device


class LoraEmbedding(LoraLayer):
    """A frozen nn.Embedding plus a trainable low-rank update: y = base_layer(ids) + A^T[ids] @ B^T * scaling."""

    def __init__(self, base_layer: nn.Embedding, config: LoraConfig, autocast_adapter_dtype: bool = True):
        super().__init__()
        self.base_layer = base_layer
        self.num_embeddings, self.embedding_dim = base_layer.num_embeddings, base_layer.embedding_dim
        self.r, self.lora_alpha, self.scaling = config.r, config.lora_alpha, config.scaling
        dtype, device = adapter_dtype_and_device(base_layer, autocast_adapter_dtype)
        # peft's init_lora_weights=False keeps both at torch.randn (random adapters, for tests)
        self.lora_embedding_A = nn.Parameter(torch.randn(config.r, self.num_embeddings, dtype=dtype, device=device))
        self.lora_embedding_B = nn.Parameter(torch.randn(self.embedding_dim, config.r, dtype=dtype, device=device))
        if config.init_lora_weights is not False:
            with torch.no_grad():  # True and "gaussian" alike (peft): the pair of loralib's Embedding
                nn.init.zeros_(self.lora_embedding_A)
                nn.init.normal_(self.lora_embedding_B)
        self.merged = False
        self.disabled = False

    @property
    def padding_idx(self) -> int | None:
        return self.base_layer.padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(input_ids)
        if self.merged or self.disabled:
            return result
        base = self.base_layer
        after_a = F.embedding(input_ids, self.lora_embedding_A.T, base.padding_idx, base.max_norm, base.norm_type,
                              base.scale_grad_by_freq, base.sparse)  # (..., r)
        # Added in the adapter's precision (float32 over a bf16 base) and rounded once, as peft does.
        return (result + (after_a @ self.lora_embedding_B.T) * self.scaling).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """A^T B^T * scaling (vocab, hidden), computed in float32, in the base weight's dtype."""
        delta = (self.lora_embedding_A.float().T @ self.lora_embedding_B.float().T) * self.scaling
        return delta.to(self.base_layer.weight.dtype)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False) -> None:
        if self.merged:
            return
        self._add_to_base_weight(self.delta_weight(), safe_merge)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        self.base_layer.weight.sub_(self.delta_weight())
        self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}"


class TiedLoraLinear(LoraLayer):
    """An LM head tied to a LoRA embedding (ensure_weight_tying): y = base_layer(x) + dropout(x) @ B @ A * scaling with
    the embedding's A (r, vocab) and B (hidden, r); peft's head LoRA with lora_A = B^T, lora_B = A^T."""

    def __init__(self, base_layer: nn.Linear, embedding: LoraEmbedding, config: LoraConfig):
        super().__init__()
        if type(base_layer) is not nn.Linear or base_layer.weight is not embedding.base_layer.weight:
            raise ValueError(f"ensure_weight_tying ties an LM head to the embedding it shares its weight with; this "
                             f"{type(base_layer).__name__} does not share the embedding's weight: set "
                             f"ensure_weight_tying=False")
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.scaling = embedding.scaling
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        # Kept out of the module tree: the embedding's tensors are its own, saved and counted there once.
        self.__dict__["embedding"] = embedding
        self.merged = False
        self.disabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged or self.disabled:
            return result
        a, b = self.embedding.lora_embedding_A, self.embedding.lora_embedding_B  # (r, vocab), (hidden, r)
        update = F.linear(F.linear(self.lora_dropout(x.to(a.dtype)), b.T), a.T)  # (..., vocab)
        return (result + update * self.scaling).to(result.dtype)

    # The head's base weight is the embedding's: merging the embedding's update serves both, and once only.
    def merge(self, safe_merge: bool = False) -> None:
        self.embedding.merge(safe_merge)
        self.merged = True

    def unmerge(self) -> None:
        self.embedding.unmerge()
        self.merged = False

    def extra_repr(self) -> str:
        return f"tied to the embedding's LoRA, scaling={self.scaling:g}"
