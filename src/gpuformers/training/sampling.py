"""Which rows make each training batch of an epoch, in one process or split over data-parallel processes.

The order of an epoch is a permutation drawn from a generator seeded with (data_seed or seed) + epoch, never from
the global RNG, so a resumed run replays the same batches. Under torchrun each process takes every world_size-th
row of that order, the order padded by wrapping around so that all get as many:

    order 3 0 4 1 2, 2 processes    process 0: 3 4 2      process 1: 0 1 3 (3 again: the wrap-around)

so the processes' batches of step k together are the rows one process would take with batches world_size times
larger.

With train_sampling_strategy="group_by_length" (transformers' LengthGroupedSampler) rows of similar length share a
batch, with less padding: a random permutation is cut into megabatches of min(50, rows // (4 g)) groups of g rows
(g = batch size x gradient accumulation steps), each sorted longest first, and the longest row of all is swapped to
the front, so that the first batch is the largest (a lack of memory shows at once). Under torchrun these batches are
dealt out whole, batch i to process i % world_size (accelerate's BatchSamplerShard), the order padded at its end
with its first rows so that every process gets as many full batches (with drop_last: only whole rounds).

That permutation of epoch e comes from a generator seeded with data_seed or seed and advanced through epochs 0..e,
each taking one 64-bit draw and then the permutation. transformers' Trainer draws it from the global generator it
has just seeded, right after its DataLoader draws its workers' seed: so epoch 0 is transformers' order, and so are
later epochs while training draws nothing from the CPU generator (no dropout on the CPU, no evaluation between
epochs). Ours never depends on what training draws: a resumed run replays the same batches.

Offers: epoch_batches, sequence_lengths, length_grouped_indices, length_grouped_batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def epoch_batches(dataset, batch_size: int, seed: int, shuffle: bool, world: int = 1, rank: int = 0,
                  drop_last: bool = False) -> list[list[int]]:
    """Index lists of one epoch for process `rank` of `world`: a permutation seeded by `seed` (or the rows in order
    without `shuffle`), cut into batches; with `drop_last` a last, smaller batch is left out."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the dataset ({type(dataset).__name__}) must have a length and indexing (a list of "
                        "rows or a datasets.Dataset), or yield its rows when iterated (a stream)")
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


def sequence_lengths(dataset, length_column_name: str = "length", model_input_name: str = "input_ids") -> list[int]:
    """Each row's length for group_by_length: the dataset's `length_column_name` column where it has one (a
    datasets.Dataset), else the length of each row's `model_input_name`."""
    if length_column_name in (getattr(dataset, "column_names", None) or ()):
        return [int(length) for length in dataset[length_column_name]]
    first = dataset[0] if len(dataset) else {}
    if not isinstance(first, Mapping) or model_input_name not in first:
        raise ValueError(f"group_by_length needs each row's length, but the rows ({type(first).__name__}) have no "
                         f'"{model_input_name}" and the dataset no "{length_column_name}" column; add that column '
                         "(or name yours with length_column_name), or use rows with input_ids")
    return [len(dataset[i][model_input_name]) for i in range(len(dataset))]


def length_grouped_indices(lengths: list[int], group_size: int, generator: torch.Generator) -> list[int]:
    """All row indices, in megabatches of rows of similar length (see the module docstring)."""
    count = len(lengths)
    size = max(1, min(count // (group_size * 4), 50)) * group_size
    order = torch.randperm(count, generator=generator).tolist()
    megabatches = [sorted(order[i:i + size], key=lengths.__getitem__, reverse=True) for i in range(0, count, size)]
    if megabatches:
        longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])  # the first, on ties
        megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [index for megabatch in megabatches for index in megabatch]


def length_grouped_batches(lengths: list[int], batch_size: int, group_size: int, seed: int, epoch: int,
                           world: int = 1, rank: int = 0, drop_last: bool = False) -> list[list[int]]:
    """Index lists of epoch `epoch` for process `rank` of `world`, grouped by length (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epoch + 1):
        # the draw transformers' DataLoader makes for its workers' seed, just before the sampler's permutation
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = length_grouped_indices(lengths, group_size, generator)
    if world > 1:  # whole batches dealt out in turn: as many full ones for every process
        round_size = batch_size * world
        if drop_last:
            order = order[:len(order) - len(order) % round_size]
        elif order and len(order) % round_size:
            start = order[:round_size]
            order = order + (start * (round_size // len(start) + 1))[:(-len(order)) % round_size]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if batches and drop_last and len(batches[-1]) < batch_size:
        batches.pop()
    return batches[rank::world]
