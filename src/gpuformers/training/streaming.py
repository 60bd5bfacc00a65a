"""Batches of a stream: an iterable training or evaluation set, read in its own order and shared out over processes.

A stream has no length and no indexing (a torch IterableDataset, a `datasets` IterableDataset, or any iterable such
as a class whose __iter__ yields rows), so it is read front to back and the number of its batches is not known until
it ends. Training on one needs max_steps; a pass that ends before max_steps starts the stream over as the next epoch
(after `dataset.set_epoch(epoch)` where the dataset has one), as transformers' Trainer does.

Under torchrun process 0 alone reads the stream and sends each group of world_size batches to every process, which
takes its own: the r-th batch of the group (accelerate's `dispatch_batches`, what transformers does with an
IterableDataset). The group that ends the stream is split evenly, completed where it does not split with the first
rows of the pass (repeats: evaluation counts them for nothing); with drop_last a short last group is left out:

    10 rows, batches of 2, 2 processes     groups  0 1 2 3 | 4 5 6 7 | 8 9
    process 0: 0 1, 4 5, 8                 process 1: 2 3, 6 7, 9

so the processes' batches of step k together hold the rows one process takes with batches world_size times larger.
A resumed run skips the batches already trained on by reading them again (process 0 only).

Offers: is_stream, StreamBatches.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


def is_stream(dataset) -> bool:
    """Whether `dataset` is read as a stream: a torch IterableDataset (a `datasets` IterableDataset is one), or an
    iterable without a length and indexing."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


class _Iterable(torch.utils.data.IterableDataset):
    """A plain iterable as a torch IterableDataset, so that a DataLoader (and its workers) can read it."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class StreamBatches:
    """One pass (epoch `epoch`) over a stream: this process's collated batches of `batch_size` rows, the first `skip`
    left out. Iterating yields the batches; numbered() yields (each row's position in the stream, or None for a
    repeat, the batch). Every process must iterate it in step: each batch is one broadcast from process 0."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable, world: int = 1, rank: int = 0,
                 drop_last: bool = False, num_workers: int = 0, epoch: int = 0, skip: int = 0,
                 device: torch.device | None = None):
        self.collate_fn, self.world, self.rank = collate_fn, world, rank
        self._name, self._epoch, self._skip = type(dataset).__name__, epoch, skip
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._device = device if device is not None and device.type == "cuda" else None  # NCCL sends from a GPU
        self._groups: Iterator | None = None
        if not self._distributed or dist.get_rank() == 0:
            self._groups = self._read(dataset, batch_size, drop_last, num_workers, epoch)
            for _ in range(skip):  # now, not at the first batch: what the skipped rows draw from the RNG comes before
                next(self._groups, None)  # the checkpoint's RNG state is restored

    def _read(self, dataset, batch_size: int, drop_last: bool, num_workers: int, epoch: int):
        """(Process 0) Each group of world batches as [(stream position or None, row)], world * k long."""
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        source = dataset if isinstance(dataset, torch.utils.data.IterableDataset) else _Iterable(dataset)
        # a DataLoader, as transformers: the same workers, and the same draw of their seed from the global RNG
        loader = iter(torch.utils.data.DataLoader(source, batch_size=batch_size, collate_fn=list,
                                                  num_workers=num_workers, drop_last=drop_last))
        first, position = None, 0
        while True:
            batches = list(itertools.islice(loader, self.world))
            rows = [row for batch in batches for row in batch]
            if not rows or (drop_last and len(batches) < self.world):
                return
            group = [(position + i, row) for i, row in enumerate(rows)]
            position += len(rows)
            first = first or group[:self.world]
            missing = (-len(group)) % self.world
            if missing:  # the last group: as many rows for each process, completed with the pass's first rows
                fill = [(None, row) for _, row in first]
                group += (fill * missing)[:missing]
            yield group

    def numbered(self) -> Iterator[tuple[list[int | None], Any]]:
        for count in itertools.count():
            group = next(self._groups, []) if self._groups is not None else None
            if self._distributed:
                box = [group]
                dist.broadcast_object_list(box, src=0, device=self._device)
                group = box[0]
            if not group:
                if count == 0 and not self._skip and self._groups is not None:
                    warnings.warn(f"pass {self._epoch} over the stream ({self._name}) gave no batch: it is empty, or an"
                                  " iterator already used up (pass an object whose __iter__ starts over)", stacklevel=2)
                return
            share = len(group) // self.world
            mine = group[self.rank * share:(self.rank + 1) * share]
            yield [position for position, _ in mine], self.collate_fn([row for _, row in mine])

    def __iter__(self):
        return (batch for _, batch in self.numbered())
