"""Which rows make each training batch of an epoch, in one process or split over data-parallel processes.

The order of an epoch is a permutation drawn from a generator seeded with (data_seed or seed) + epoch, never from
the global RNG, so a resumed run replays the same batches. Under torchrun each process takes every world_size-th
row of that order, the order padded by wrapping around so that all get as many:

    order 3 0 4 1 2, 2 processes    process 0: 3 4 2      process 1: 0 1 3 (3 again: the wrap-around)

so the processes' batches of step k together are the rows one process would take with batches world_size times
larger.

Offers: epoch_batches.
"""

from __future__ import annotations

import torch


def epoch_batches(dataset, batch_size: int, seed: int, shuffle: bool, world: int = 1, rank: int = 0,
                  drop_last: bool = False) -> list[list[int]]:
    """Index lists of one epoch for process `rank` of `world`: a permutation seeded by `seed` (or the rows in order
    without `shuffle`), cut into batches; with `drop_last` a last, smaller batch is left out."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the dataset ({type(dataset).__name__}) must have a length and indexing (a list of "
                        "rows or a datasets.Dataset); iterable datasets are not supported yet")
    n = len(dataset)
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(n))
    if world > 1:
        order = (order + order[:(-len(order)) % world])[rank::world]
        n = len(order)
    batches = [order[i: i + batch_size] for i in range(0, n, batch_size)]
    if batches and drop_last and len(batches[-1]) < batch_size:
        batches.pop()
    return batches
