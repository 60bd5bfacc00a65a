"""What the Trainer's evaluation shares out and brings back: each process's rows, and every row's logits and labels.

Under torchrun each data-parallel process scores every world_size-th row of the set (r, r + world, ...); the row
count is rounded up to a multiple of the world size by repeating the first rows, so that every process runs as many
forwards (FSDP2 gathers weights in each), and the repeated rows count for nothing:

    7 rows, 2 processes    process 0: rows 0 2 4 6     process 1: rows 1 3 5 (0, a repeat: no targets, not kept)

The logits and labels that compute_metrics and predict need are kept per row with the row's index (its own tokens
only, not its batch's padding), gathered from all processes and put back in dataset order, so that every process
gets the whole set's, exactly as one process would (`preprocess_logits_for_metrics` shrinks them per batch before
they are kept, e.g. to argmax ids).

A stream (an iterable evaluation set, streaming.py) is shared out as in training: process r scores the r-th batch of
each group of world_size batches, the last group completed with repeats of the first rows; a row's index is its
position in the stream.

The Evaluator, which the Trainer owns, gives its evaluate() and predict() over that: the token-weighted mean loss of
the set (each batch's summed token losses over all target tokens, in every process), its perplexity, and
compute_metrics' results. The Trainer gives it its batches and the forward of one batch (its compute_loss) as
callables, and keeps the logging and callbacks around it.

Offers: EvalPrediction, PredictionOutput, eval_batches, evaluation_batches, RowCollector, Evaluator.
"""

from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from gpuformers import distributed
from gpuformers.labels import IGNORE_INDEX
from gpuformers.training.streaming import StreamBatches, is_stream


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


def evaluation_batches(dataset, args, data_collator, loader, world: int, rank: int):
    """This process's evaluation batches of `dataset` as (row indices, positions in the batch of repeated rows,
    collated batch): a stream's as streaming.py numbers them, else eval_batches' through `loader` (dataset, index
    batches -> DataLoader)."""
    if is_stream(dataset):
        stream = StreamBatches(dataset, args.eval_batch_size, data_collator, world, rank,
                               args.dataloader_drop_last, args.dataloader_num_workers, device=args.device)
        return ((positions, [i for i, position in enumerate(positions) if position is None], batch)
                for positions, batch in stream.numbered())
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the evaluation dataset ({type(dataset).__name__}) must have a length and indexing, or "
                        "be iterable")
    batches, repeats = eval_batches(len(dataset), args.eval_batch_size, world, rank)
    if args.dataloader_drop_last and batches and len(batches[-1]) < args.eval_batch_size:
        batches.pop()  # (every process has as many batches, of the same sizes)
    return ((batches[index], repeats.get(index, []), batch) for index, batch in enumerate(loader(dataset, batches)))


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


class Evaluator:
    """The Trainer's evaluate() and predict() over the callables the Trainer gives it (see the module docstring):

        batches(dataset)          -> this process's (row indices, positions of repeated rows, collated batch)
        step(batch, keep_logits)  -> (its target tokens' summed loss, None without targets; their number; its
                                     logits or None): the Trainer's compute_loss (and preprocess_logits_for_metrics)
        on_prediction_step()      the Trainer's callbacks, after each batch
        shard()                   FSDP2: shards the model onto the device before it first runs (None: already there)
    """

    def __init__(self, model, device, world: int, batches: Callable, step: Callable,
                 on_prediction_step: Callable[[], None], shard: Callable[[], object] | None = None):
        self.model, self.device, self.world = model, device, world
        self.batches, self.step = batches, step
        self.on_prediction_step, self.shard = on_prediction_step, shard

    @torch.no_grad()
    def loss_and_rows(self, dataset, keep_logits: bool) -> tuple[float, RowCollector]:
        """Token-weighted mean loss over `dataset`, and every row's logits and labels (in dataset order, from every
        process: see the module docstring) when asked for."""
        if self.shard is not None:  # FSDP2: the model reaches the device only as shards (before the first train())
            self.shard()
        batches = self.batches(dataset)
        was_training = self.model.training
        self.model.eval()
        # the summed loss stays on the device (float64: the sums a Python float would give), read once at the end
        loss_sum, count, rows = torch.zeros((), dtype=torch.float64, device=self.device), 0, RowCollector()
        for indices, repeats, batch in batches:
            if repeats:  # rows repeated only to give every process as many batches: no targets
                batch["labels"] = batch["labels"].clone()
                batch["labels"][repeats] = IGNORE_INDEX
            summed, targets, logits = self.step(batch, keep_logits)
            if targets:
                loss_sum, count = loss_sum + summed, count + targets
            if keep_logits:
                rows.add(indices, logits, batch.get("labels"), batch.get("attention_mask"), skip=repeats)
            self.on_prediction_step()
        self.model.train(was_training)
        if self.world > 1:
            loss_sum = distributed.all_reduce_sum(loss_sum, self.device)
            count = int(distributed.all_reduce_sum(count, self.device))
        loss_sum = float(loss_sum)
        if keep_logits:
            rows.gather(self.world)
        return (loss_sum / count if count else float("nan")), rows

    def evaluate(self, dataset, metric_key_prefix: str, compute_metrics: Callable | None) -> dict[str, float]:
        """Loss and perplexity over `dataset` (plus compute_metrics' results when given)."""
        start = time.perf_counter()
        loss, rows = self.loss_and_rows(dataset, keep_logits=compute_metrics is not None)
        metrics = {f"{metric_key_prefix}_loss": loss,
                   f"{metric_key_prefix}_perplexity": math.exp(min(loss, 700.0)),
                   f"{metric_key_prefix}_runtime": round(time.perf_counter() - start, 4)}
        if compute_metrics is not None:
            extra = compute_metrics(EvalPrediction(*rows.arrays()))
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in (extra or {}).items()})
        return metrics

    def predict(self, dataset, metric_key_prefix: str, compute_metrics: Callable | None) -> PredictionOutput:
        """Logits (samples, longest seq, vocab, padded with -100), labels and metrics over `dataset`."""
        loss, rows = self.loss_and_rows(dataset, keep_logits=True)
        predictions, label_ids = rows.arrays()
        metrics = {f"{metric_key_prefix}_loss": loss}
        if compute_metrics is not None and label_ids is not None:
            extra = compute_metrics(EvalPrediction(predictions, label_ids))
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in (extra or {}).items()})
        return PredictionOutput(predictions, label_ids, metrics)


def _pad_rows(rows: list[torch.Tensor]) -> np.ndarray:
    """Rows (seq, ...) of different lengths -> one array (rows, longest seq, ...), padded with -100."""
    longest = max(row.shape[0] for row in rows)
    padded = [torch.nn.functional.pad(row, [0, 0] * (row.dim() - 1) + [0, longest - row.shape[0]], value=IGNORE_INDEX)
              for row in rows]
    return torch.stack(padded).numpy()
