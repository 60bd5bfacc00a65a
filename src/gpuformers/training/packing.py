"""Packing: several short examples in one row, with attention that never crosses from one example to another.

    row:          [a0 a1 a2 | b0 b1 | c0 c1 c2 c3 | pad]
    position_ids: [ 0  1  2 |  0  1 |  0  1  2  3 |  0 ]   restart at 0: each example keeps its own rotary positions
    labels:       [-100 a1 a2 | -100 b1 | -100 c1 c2 c3 | -100]  an example's first token is no one's target
    attention:    block-diagonal causal, one block per example (a new block wherever position_ids is 0)

With those three, the summed loss of a packed row equals the summed loss of its examples run one by one, and
padding shrinks to the tail of the last row. The Trainer hands the block-diagonal mask to every attention layer
through `document_attention(model, position_ids)`, so the model code needs no change.

Offers: PackedCollator, pack_examples, document_mask, document_attention.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from gpuformers.labels import IGNORE_INDEX
from gpuformers.training.data import token_ids_as_list


def pack_examples(rows: Sequence[dict[str, Any]], max_length: int) -> list[dict[str, list[int]]]:
    """Greedily fill rows of up to max_length tokens with whole examples, in order (longer ones are truncated)."""
    packed, current = [], {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        ids = token_ids_as_list(row["input_ids"], "input_ids")[:max_length]
        labels = token_ids_as_list(row["labels"], "labels")[:max_length] if row.get("labels") is not None else list(ids)
        if current["input_ids"] and len(current["input_ids"]) + len(ids) > max_length:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += ids
        current["labels"] += [IGNORE_INDEX] + labels[1:]
        current["position_ids"] += list(range(len(ids)))
    if current["input_ids"]:
        packed.append(current)
    return packed


class PackedCollator:
    """Rows -> one (1, total) packed batch: input_ids, labels, position_ids; no attention_mask (the Trainer
    builds the block-diagonal one from position_ids). With max_length, rows are packed into several rows of that
    length, padded at the tail."""

    def __init__(self, pad_token_id: int = 0, max_length: int | None = None):
        self.pad_token_id, self.max_length = pad_token_id, max_length

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        limit = self.max_length or sum(len(token_ids_as_list(r["input_ids"], "input_ids")) for r in rows)
        packed = pack_examples(rows, limit)
        width = self.max_length or max(len(p["input_ids"]) for p in packed)  # a fixed width suits torch.compile
        batch = {"input_ids": torch.full((len(packed), width), self.pad_token_id, dtype=torch.long),
                 "labels": torch.full((len(packed), width), IGNORE_INDEX, dtype=torch.long),
                 "position_ids": torch.zeros(len(packed), width, dtype=torch.long)}
        for row, p in enumerate(packed):
            n = len(p["input_ids"])
            for key in batch:
                batch[key][row, :n] = torch.tensor(p[key], dtype=torch.long)
            # Padding is its own example (positions from 0), attending only to itself.
            batch["position_ids"][row, n:] = torch.arange(width - n)
        return batch


def document_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """position_ids (batch, seq), restarting at 0 per example -> boolean (batch, 1, seq, seq), True = may attend."""
    # document index of each token: how many example starts (position 0) lie at or before it
    doc = (position_ids == 0).cumsum(dim=-1)  # (batch, seq)
    seq = position_ids.shape[-1]
    idx = torch.arange(seq, device=position_ids.device)
    causal = idx[None, :] <= idx[:, None]  # (q, k)
    if sliding_window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < sliding_window)
    same_doc = doc[:, :, None] == doc[:, None, :]  # (batch, q, k)
    return (same_doc & causal)[:, None]


@contextlib.contextmanager
def document_attention(model: torch.nn.Module, position_ids: torch.Tensor):
    """Within this block, every attention layer of `model` attends only inside each packed example.

    Each layer's `attention_fn` (the backend chosen by attn_implementation) is wrapped so that it receives the
    block-diagonal mask instead of the plain causal one; the originals are put back on exit.
    """
    masks: dict[int | None, torch.Tensor] = {}

    def wrap(fn):
        def attend(module, query, key, value, attention_mask, *, sliding_window=None, **kwargs):
            if sliding_window not in masks:
                masks[sliding_window] = document_mask(position_ids.to(query.device), sliding_window)
            return fn(module, query, key, value, masks[sliding_window], sliding_window=sliding_window, **kwargs)

        return attend

    layers = [m for m in model.modules() if hasattr(m, "attention_fn")]
    saved = [m.attention_fn for m in layers]
    try:
        for module, fn in zip(layers, saved):
            module.attention_fn = wrap(fn)
        yield
    finally:
        for module, fn in zip(layers, saved):
            module.attention_fn = fn
