"""What the Trainer's evaluation shares out and brings back: each process's rows, and every row's logits and labels.

Under torchrun each data-parallel process scores every world_size-th row of the set (r, r + world, ...); the row
count is rounded up to a multiple of the world size by repeating the first rows, so that every process runs as many
forwards (FSDP2 gathers weights in each), and the repeated rows count for nothing:

    7 rows, 2 processes    process 0: rows 0 2 4 6     process 1: rows 1 3 5 (0, a repeat: no targets, not kept)

The logits and labels that compute_metrics and predict need are kept per row with the row's index (its own tokens
only, not its batch's padding), gathered from all processes and put back in dataset order, so that every process
gets the whole set's, exactly as one process would (`preprocess_logits_for_metrics` shrinks them per batch before
they are kept, e.g. to argmax ids).

Offers: EvalPrediction, PredictionOutput, eval_batches, RowCollector.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpuformers.training.data import IGNORE_INDEX


class EvalPrediction(NamedTuple):
    predictions: np.ndarray  # logits (samples, seq, vocab), padded with -100
    label_ids: np.ndarray  # (samples, seq), padded with -100


class PredictionOutput(NamedTuple):
    predictions: np.ndarray
    label_ids: np.ndarray | None
    metrics: dict[str, float]


def eval_batches(num_rows: int, batch_size: int, world: int, rank: int) -> tuple[list[list[int]], dict[int, list[int]]]:
    """This process's evaluation batches (dataset indices, in order) and {batch number: positions in that batch of
    rows that are repeats} (see the module doc); one process takes every row, in order."""
    positions = list(range(rank, num_rows + (-num_rows) % world, world))
    batches, repeats = [], {}
    for start in range(0, len(positions), batch_size):
        chunk = positions[start:start + batch_size]
        batches.append([p % num_rows for p in chunk])
        extra = [i for i, p in enumerate(chunk) if p >= num_rows]
        if extra:
            repeats[len(batches) - 1] = extra
    return batches, repeats


class RowCollector:
    """The logits (or what preprocess_logits_for_metrics made of them) and labels of each row, with its index."""

    def __init__(self):
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []

    def add(self, indices: list[int], logits: torch.Tensor, labels: torch.Tensor | None,
            attention_mask: torch.Tensor | None = None, skip=()) -> None:
        """One batch: logits (batch, seq, ...) and labels (batch, seq) or None; rows at positions `skip` are
        repeats and are not kept. With the attention_mask, each row keeps its own tokens only (not the batch's
        padding), so a row's values do not depend on the rows it was batched with."""
        logits = logits.float().cpu() if logits.is_floating_point() else logits.cpu()
        mask = None
        if attention_mask is not None and tuple(logits.shape[:2]) == tuple(attention_mask.shape):
            mask = attention_mask.cpu().bool()
        for position, index in enumerate(indices):
            if position in skip:
                continue
            row, row_labels = logits[position], None if labels is None else labels[position]
            if mask is not None:
                row = row[mask[position]]
                row_labels = None if row_labels is None else row_labels[mask[position]]
            self.rows.append((index, row, row_labels))

    def gather(self, world: int) -> None:
        """Every process's rows, in dataset order, in every process (a collective when world > 1)."""
        rows = self.rows
        if world > 1:
            everyone: list = [None] * world
            torch.distributed.all_gather_object(everyone, rows)
            rows = [row for part in everyone for row in part]
        self.rows = sorted(rows, key=lambda row: row[0])

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(predictions (rows, longest seq, ...), labels (rows, longest seq) or None when a row had none), padded
        with -100 past each row's own length."""
        logits = [row[1] for row in self.rows]
        labels = [row[2] for row in self.rows]
        return _pad_rows(logits), None if any(l is None for l in labels) else _pad_rows(labels)


def _pad_rows(rows: list[torch.Tensor]) -> np.ndarray:
    """Rows (seq, ...) of different lengths -> one array (rows, longest seq, ...), padded with -100."""
    longest = max(row.shape[0] for row in rows)
    padded = [torch.nn.functional.pad(row, [0, 0] * (row.dim() - 1) + [0, longest - row.shape[0]], value=IGNORE_INDEX)
              for row in rows]
    return torch.stack(padded).numpy()
