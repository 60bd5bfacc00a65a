"""The engine's recurrent state, for models with mamba layers (Mamba2, Nemotron-H, Granite 4, Falcon-H1): a slot of
conv and SSM state per running sequence beside its paged KV blocks, prefix-cache snapshots of those states, and the
Cache the mamba layers talk to during an engine step.

A mamba layer's memory of a sequence is two fixed-size tensors, whatever its length: the conv state (conv_dim,
conv_kernel - 1) and the SSM state (heads, head_dim, state_size), float32. The pool keeps them for every mamba layer
in two tensors with one row per slot,

    conv (mamba_layers, rows, conv_dim, conv_kernel - 1)      ssm (mamba_layers, rows, heads, head_dim, state_size)
    rows = [live slots: one per running sequence (max_requests_per_batch)][snapshot slots: the prefix cache's][scratch]

The scratch row is never handed out: a CUDA graph's padding rows step it (engine/cuda_graphs.py), as their keys and
values go to the KV cache's scratch block.

A sequence takes a live slot when the block manager first gives it blocks and gives it back with them (finished,
cancelled, preempted); a sequence that starts from its first token starts from zeros, so a preempted one recomputes
exactly. Chunked prefill carries the state in the slot from chunk to chunk.

Prefix caching (HybridBlockManager): the attention layers' keys and values are shared by block hash as for every
model, but a mamba layer can only skip a prefix if its state at the prefix's end is known, and a state is as large
as hundreds of KV blocks, so it is not kept at every block boundary. It is kept where prompts were seen to diverge:
when a new request's prompt matches cached blocks for which no state snapshot exists (someone computed this prefix
before), its prefill is cut so that a chunk ends exactly at the last matched block, and the state there is copied to
a snapshot slot under that block's hash. From then on every request sharing that prefix restores the snapshot into
its live slot and computes only the rest of its prompt. Snapshots are evicted least recently used. A restore gives
the state the prefix's own computation left, so outputs are those of a run without the cache.

In a step (PagedStateCache.mix_states) the flattened tokens are mixed in runs: the step's decodes (its first
num_decodes sequences, one token each) as one batch of rows stepping their slots' rows of the pool in place (the
mixer's mix(rows=...): with use_kernels=True Triton kernels that read and write those rows where they lie, else a
gather, the step and a scatter), then each prefill chunk alone from its slot's state (or from zeros when it starts
the sequence). The decodes' slot index is a device tensor (StepStates.decode_rows): a CUDA graph replays a decode
step with it as a static buffer, padding rows pointing at the scratch row.

Offers: StatePool, HybridBlockManager, PagedStateCache, StepStates, plan_step, take_snapshots, has_mamba_layers,
attention_layer_indices, state_rows_bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.paged_attention import PagedContext, PagedKVCache
from gpuformers.engine.sampler import device_tensor
from gpuformers.engine.sequence import Sequence


def _mamba_mixers(model) -> list:
    from gpuformers.layers.mamba2 import Mamba2Mixer  # here: only models with mamba layers need the layer class

    return sorted((m for m in model.modules() if isinstance(m, Mamba2Mixer)), key=lambda m: m.layer_idx)


def has_mamba_layers(model) -> bool:
    """Whether the engine keeps per-sequence states for the model (a stateful model may have no mamba layer left:
    a Nemotron-H pattern of attention and MLP blocks only)."""
    return getattr(model, "is_stateful", False) and bool(_mamba_mixers(model))


def attention_layer_indices(model) -> list[int]:
    """The layers that keep keys and values: every layer of a transformer, only the attention layers of a hybrid
    model (none in Mamba2)."""
    if not getattr(model, "is_stateful", False):
        return list(range(model.config.num_hidden_layers))
    return sorted({m.layer_idx for m in model.modules() if hasattr(m, "attention_fn") and hasattr(m, "layer_idx")})


def state_rows_bytes(model, rows: int) -> int:
    """Bytes `rows` state slots take over all mamba layers (conv state in the model's dtype, SSM state float32); a
    pool of `rows` slots takes one more (the scratch row)."""
    return rows * sum(m.state_bytes(model.dtype) for m in _mamba_mixers(model))


class StatePool:
    """The state tensors of every mamba layer and which rows are whose (module doc)."""

    def __init__(self, model, live_slots: int, snapshot_slots: int):
        mixers = _mamba_mixers(model)
        if not mixers:
            raise ValueError(f"{type(model).__name__} has no mamba layers: it needs no state pool")
        shapes = {(m.conv_dim, m.conv1d.kernel_size[0], m.num_heads, m.head_dim, m.state_size) for m in mixers}
        if len(shapes) > 1:  # every family so far has one mixer shape per model
            raise NotImplementedError(f"mamba layers of different shapes in one model ({sorted(shapes)}) are not "
                                      f"supported by the engine's state pool")
        conv_dim, kernel, heads, head_dim, state = shapes.pop()
        self.layer_index = {m.layer_idx: i for i, m in enumerate(mixers)}  # model layer -> row of the tensors
        self.live_slots, self.snapshot_slots = live_slots, snapshot_slots
        self.scratch_row = live_slots + snapshot_slots  # stepped by CUDA-graph padding rows (module doc)
        rows, device = live_slots + snapshot_slots + 1, model.device
        # A row is read only after it was zeroed (a sequence's first step) or written (a restore, a snapshot): on the
        # CPU the memory is left untouched until then, as the KV cache's (no page of it taken before it is used)
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.conv = alloc(len(mixers), rows, conv_dim, kernel - 1, dtype=model.dtype, device=device)
        self.ssm = alloc(len(mixers), rows, heads, head_dim, state, dtype=torch.float32, device=device)
        self.zero_rows([self.scratch_row])  # read by padding rows without being written first: finite from the start
        self.free_live = list(range(live_slots))
        self.free_snapshots = list(range(live_slots, self.scratch_row))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> row, least recently used first
        self.snapshot_hits = 0  # admissions that restored a snapshot
        self.snapshots_taken = 0

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    # --- live slots ---------------------------------------------------------------------------------------------

    def take_live(self, seq: Sequence) -> None:
        if seq.state_row is None:
            if not self.free_live:  # the scheduler keeps running sequences <= max_requests_per_batch = live slots
                raise RuntimeError(f"no free state slot for request {seq.request_id!r} ({self.live_slots} slots)")
            seq.state_row = self.free_live.pop()

    def give_back(self, seq: Sequence) -> None:
        if seq.state_row is not None:
            self.free_live.append(seq.state_row)
            seq.state_row = None
        seq.state_restore = seq.snapshot_at = None

    # --- snapshots ----------------------------------------------------------------------------------------------

    def lookup(self, block_hash: int) -> int | None:
        row = self.snapshots.get(block_hash)
        if row is not None:
            self.snapshots.move_to_end(block_hash)
        return row

    def reserve_snapshot(self, block_hash: int) -> int | None:
        """A row for the state at the end of block `block_hash`: a free one or the least recently used (its snapshot
        forgotten); None when there are no snapshot slots."""
        if block_hash in self.snapshots:
            return self.lookup(block_hash)
        if self.free_snapshots:
            row = self.free_snapshots.pop()
        elif self.snapshots:
            _, row = self.snapshots.popitem(last=False)
        else:
            return None
        self.snapshots[block_hash] = row
        self.snapshots_taken += 1
        return row

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's states of rows `sources` into rows `targets` (on the device, in stream order)."""
        # (through pinned memory: a copy from a Python list would wait for the step in flight, async batching's)
        src, dst = device_tensor(sources, self.conv.device), device_tensor(targets, self.conv.device)
        self.conv.index_copy_(1, dst, self.conv.index_select(1, src))
        self.ssm.index_copy_(1, dst, self.ssm.index_select(1, src))

    def zero_rows(self, rows: list[int]) -> None:
        index = device_tensor(rows, self.conv.device)
        self.conv.index_fill_(1, index, 0)
        self.ssm.index_fill_(1, index, 0)


class HybridBlockManager(BlockManager):
    """The block manager of a model with mamba layers: blocks as for every model, plus each sequence's state slot
    (taken with its first blocks, given back with them) and the state snapshots of shared prefixes (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, pool: StatePool, allow_block_sharing: bool = True,
                 place_contiguously: bool = True):
        super().__init__(num_blocks, block_size, allow_block_sharing, place_contiguously)
        self.pool = pool

    def match_prefix(self, seq: Sequence) -> int:
        """The cached blocks the prompt starts with, cut back to the last one whose end has a state snapshot; when
        the blocks matched further than that, the sequence takes a snapshot at the last matched block's end."""
        super().match_prefix(seq)
        matched = len(seq.block_table)
        kept, restore = matched, None
        while kept and (restore := self.pool.lookup(seq.block_hashes[kept - 1])) is None:
            kept -= 1
        if kept < matched:
            if self.pool.snapshot_slots:
                seq.snapshot_at = (matched * self.block_size, seq.block_hashes[matched - 1])
            for block_id in seq.block_table[kept:]:  # the blocks stay cached; this sequence recomputes them
                self.release(block_id, seq)
            del seq.block_table[kept:], seq.block_hashes[kept:]
            self.prefix_hits -= matched - kept
            seq.num_cached_tokens -= (matched - kept) * self.block_size
            seq.num_computed_tokens = kept * self.block_size
        if kept:
            seq.state_restore = restore
            self.pool.snapshot_hits += 1
        return seq.num_computed_tokens

    def chunk_limit(self, seq: Sequence, num_tokens: int) -> int:
        if seq.snapshot_at is not None:
            boundary = seq.snapshot_at[0]
            if seq.num_computed_tokens < boundary:
                return min(num_tokens, boundary - seq.num_computed_tokens)
        return num_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        super().allocate(seq, num_tokens)
        self.pool.take_live(seq)

    def free_sequence(self, seq: Sequence) -> None:
        super().free_sequence(seq)
        self.pool.give_back(seq)


@dataclass
class StepStates:
    """Where each sequence of one step finds its states: the decodes' slots (one batch of one-token rows) and each
    prefill chunk's (start, end, slot, whether it starts the sequence from zeros). A CUDA graph's step has
    num_decodes rows of its batch bucket, decode_rows its static buffer (the padding rows' entries the scratch row)."""

    num_decodes: int
    decode_rows: torch.Tensor | None  # (num_decodes,) int64 on the device: each decode row's slot
    chunks: list[tuple[int, int, int, bool]] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (live row, snapshot row) to copy after the step


def plan_step(pool: StatePool, sequences: list[Sequence], num_tokens: list[int], context: PagedContext) -> StepStates:
    """The step's state layout, and before it runs: restored snapshots copied into their sequences' slots and the
    slots of sequences starting from their first token zeroed. Called before the scheduler advances the counts."""
    restores, fresh = [], []
    for seq in sequences:
        if seq.state_restore is not None:
            restores.append((seq.state_restore, seq.state_row))
            seq.state_restore = None
        elif seq.num_computed_tokens == 0:
            fresh.append(seq.state_row)
    if restores:
        pool.copy_rows([r[0] for r in restores], [r[1] for r in restores])
    if fresh:
        pool.zero_rows(fresh)
    nd = context.num_decodes
    device = pool.conv.device
    rows = device_tensor([seq.state_row for seq in sequences[:nd]], device) if nd else None
    plan = StepStates(nd, rows)
    starts = context.query_start
    for i in range(nd, len(sequences)):
        seq = sequences[i]
        plan.chunks.append((starts[i], starts[i + 1], seq.state_row, seq.num_computed_tokens == 0))
    for seq, n in zip(sequences, num_tokens):
        if seq.snapshot_at is not None and seq.num_computed_tokens + n == seq.snapshot_at[0]:
            row = pool.reserve_snapshot(seq.snapshot_at[1])
            if row is not None:
                plan.snapshots.append((seq.state_row, row))
            seq.snapshot_at = None
    return plan


def take_snapshots(pool: StatePool, plan: StepStates) -> None:
    """After the step's forward: the states at the snapshot boundaries it reached, into their snapshot slots."""
    if plan.snapshots:
        pool.copy_rows([s[0] for s in plan.snapshots], [s[1] for s in plan.snapshots])


class PagedStateCache(PagedKVCache):
    """The Cache of an engine step of a model with mamba layers: keys and values to their slots as PagedKVCache,
    and each mamba layer's sequence mixing run per decode batch and prefill chunk from the pool's states."""

    def __init__(self, context: PagedContext, pool: StatePool, plan: StepStates):
        super().__init__(context)
        self.pool, self.plan = pool, plan

    def mix_states(self, layer_idx: int, mix, xbc: torch.Tensor, dt: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> torch.Tensor:
        """xbc (1, total, conv_dim), dt (1, total, heads) of the flattened step -> y (1, total, heads, head_dim);
        the slots' states moved on (module doc). The engine has no padding: attention_mask is None."""
        layer = self.pool.layer_index[layer_idx]
        conv, ssm = self.pool.conv[layer], self.pool.ssm[layer]  # (rows, ...) views of the pool
        plan = self.plan
        outs = []
        if plan.num_decodes:
            nd, rows = plan.num_decodes, plan.decode_rows
            # the decodes as nd rows of one token, (nd, 1, conv_dim) and (nd, 1, heads), stepping their slots' rows of
            # the pool in place (the Triton kernels read and write those rows; torch gathers and scatters them)
            y = mix(xbc[0, :nd, None], dt[0, :nd, None], conv, ssm, rows=rows)[0]
            outs.append(y.reshape(nd, *y.shape[-2:]))  # (nd, heads, head_dim): the state step has no seq dim
        for start, end, row, fresh in plan.chunks:
            y, new_conv, new_ssm = mix(xbc[:, start:end], dt[:, start:end], None if fresh else conv[row:row + 1],
                                       None if fresh else ssm[row:row + 1])
            conv[row] = new_conv[0]
            ssm[row] = new_ssm[0]
            outs.append(y[0])  # (chunk, heads, head_dim)
        return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None]
