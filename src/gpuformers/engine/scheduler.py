"""The scheduler: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (`max_batch_tokens`) and a cap on sequences (`max_requests_per_batch`). A running
sequence asks for its uncomputed tokens: one when decoding, a chunk of its prompt when prefilling (chunked prefill:
a long prompt is spread over several steps, mixed with other sequences' decode tokens, so decodes never stall
behind it). Waiting requests are admitted in arrival order while budget, sequence slots and free blocks last; an
admitted request first takes whatever prefix the block manager already holds.

When a running sequence needs a block and none is free, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed later (its prefix blocks often survive in the
prefix cache, which makes the recompute cheap).

After the step, `postprocess` advances each sequence and appends its sampled token. Asynchronous batching splits
it in two: `advance` when the step is launched (computed counts move on, each sampling sequence gets a
placeholder, so the next step can be scheduled at once) and `complete` when its tokens reach the host (real tokens
over the placeholders, stop rules, freeing). In between, a sequence may finish (eos, stop) after it was scheduled
again: `complete` drops that lookahead sample (`num_discarded_samples`). A preempted sequence keeps the token its
last step sampled, as in the synchronous engine.

Policies: "fifo" serves running sequences before admitting new ones (steady decode latency); "prefill_first"
admits new requests first (faster time to first token under load).

Offers: Scheduler, ScheduledBatch, SCHEDULER_TYPES.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gpuformers.engine.block_manager import BlockManager, CacheTooSmallError
from gpuformers.engine.sequence import RequestStatus, Sequence

SCHEDULER_TYPES = ("fifo", "prefill_first")


@dataclass
class ScheduledBatch:
    """One step's work: sequences and how many new tokens of each to compute, decodes (1 token) first."""

    sequences: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    _sampling: list[bool] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def sampling(self) -> list[bool]:
        """Per sequence, whether this step reaches its last token, so its logits give a new token. Worked out on the
        first call, which must come before `Scheduler.advance` moves the counts on (the model runner's prepare
        asks first); later calls give the same answers."""
        if self._sampling is None:
            self._sampling = [seq.num_computed_tokens + n == seq.num_tokens
                              for seq, n in zip(self.sequences, self.num_tokens)]
        return self._sampling

    def samples(self, index: int) -> bool:
        """Whether the sequence at `index` samples in this step (see `sampling`)."""
        return self.sampling()[index]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_requests_per_batch: int,
                 scheduler_type: str = "fifo"):
        if scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type {scheduler_type!r} is not one of: {', '.join(SCHEDULER_TYPES)}")
        if max_batch_tokens < 1 or max_requests_per_batch < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} and max_requests_per_batch="
                             f"{max_requests_per_batch} must both be >= 1")
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.scheduler_type = scheduler_type
        self.waiting: list[Sequence] = []  # kept in arrival order (a preempted sequence goes back to its place)
        self.running: list[Sequence] = []  # kept in arrival order: the newest is last, the first to be preempted
        self.num_preemptions = 0
        self.preempted_ids: list[str] = []  # in preemption order, for tests and logs
        self.num_discarded_samples = 0  # async lookahead samples of requests that had ended meanwhile

    # --- requests -----------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> bool:
        """Queue a request; returns False (and marks it FAILED with the reason) when it can never fit."""
        try:
            self.block_manager.check_fits(seq)
        except CacheTooSmallError as error:
            seq.fail(str(error))
            return False
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)
        return True

    def cancel(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.free_sequence(seq)
                    seq.fail("cancelled")
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = [self.max_batch_tokens]  # a cell, so the helpers can spend it
        if self.scheduler_type == "prefill_first":
            self._admit(batch, budget)
            self._continue_running(batch, budget)
        else:
            preemptions = self.num_preemptions
            self._continue_running(batch, budget)
            if self.num_preemptions == preemptions:  # memory is short right after a preemption: admit nobody
                self._admit(batch, budget)
        # Decodes first: the model runner batches their attention in one call. Within each kind, the sequences of
        # one LoRA adapter side by side: its rows are then one run, which the adapter layers slice (engine/lora.py).
        order = sorted(range(len(batch)), key=lambda i: (batch.num_tokens[i] != 1, batch.sequences[i].adapter_id or 0,
                                                         batch.sequences[i].arrival))
        return ScheduledBatch([batch.sequences[i] for i in order], [batch.num_tokens[i] for i in order])

    def _continue_running(self, batch: ScheduledBatch, budget: list[int]) -> None:
        # Sets of id(): membership in the lists would cost a scan per sequence, quadratic in the running requests.
        skipped = {id(seq) for seq in batch.sequences}  # admitted this step already (prefill_first)
        manager = self.block_manager
        chunk_limit, blocks_needed = manager.chunk_limit, manager.blocks_needed  # (once per step, not per request)
        sequences, counts = batch.sequences, batch.num_tokens
        for seq in list(self.running):
            if budget[0] == 0:
                break
            if skipped and id(seq) in skipped:
                continue  # preempted for an older sequence, or admitted this step already
            if seq.out_of_new_tokens:
                continue  # its last token is in flight (async batching): it finishes when that step is collected
            n = chunk_limit(seq, min(seq.num_uncomputed_tokens, budget[0]))
            if blocks_needed(seq, seq.num_computed_tokens + n):  # else its last block has room
                while not manager.can_allocate(seq, seq.num_computed_tokens + n):
                    victim = self.running[-1]
                    self._preempt(victim, batch, budget)
                    skipped.add(id(victim))
                    if victim is seq:
                        break
                if id(seq) in skipped:
                    continue
                manager.allocate(seq, seq.num_computed_tokens + n)
            sequences.append(seq)
            counts.append(n)
            budget[0] -= n

    def _admit(self, batch: ScheduledBatch, budget: list[int]) -> None:
        manager = self.block_manager
        while self.waiting and budget[0] > 0 and len(self.running) < self.max_requests_per_batch:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last step is in flight: admitted once that step's token is known
            if not seq.block_table:
                manager.match_prefix(seq)
            n = manager.chunk_limit(seq, min(seq.num_uncomputed_tokens, budget[0]))
            if not manager.can_allocate(seq, seq.num_computed_tokens + n):
                manager.free_sequence(seq)  # give the prefix blocks back; try again next step
                break
            manager.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.pop(0)
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            seq.status = RequestStatus.PREFILLING
            batch.sequences.append(seq)
            batch.num_tokens.append(n)
            budget[0] -= n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, budget: list[int]) -> None:
        if seq in batch.sequences:  # scheduled earlier in this step: take its tokens back out
            index = batch.sequences.index(seq)
            budget[0] += batch.num_tokens.pop(index)
            batch.sequences.pop(index)
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = RequestStatus.PENDING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_ids.append(seq.request_id)
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    # --- after the step -----------------------------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, sampled: list[tuple[int, float | None] | None]) -> list[Sequence]:
        """Advance each sequence by its computed tokens and append its sampled token (None for a prefill chunk
        that did not reach the end); free the finished ones and return them."""
        self.advance(batch)
        return [seq for seq in self.complete(batch, sampled) if seq.is_finished]

    def advance(self, batch: ScheduledBatch) -> None:
        """The step was launched: count its tokens as computed and give each sampling sequence a placeholder."""
        for seq, n, samples in zip(batch.sequences, batch.num_tokens, batch.sampling()):
            seq.num_computed_tokens += n
            if samples:
                seq.add_placeholder()

    def complete(self, batch: ScheduledBatch, sampled: list[tuple[int, float | None] | None]) -> list[Sequence]:
        """The step's tokens reached the host (after `advance`): register the blocks that became full, put each
        sampled token over its placeholder, free the sequences that finished. Returns the sequences that took a
        token (finished or not)."""
        updated, commit, pending = [], self.block_manager.commit, RequestStatus.PENDING
        for seq, sample in zip(batch.sequences, sampled):
            if seq.is_finished:  # it ended (eos, stop, cancel) after this step was launched: drop the sample
                self.num_discarded_samples += sample is not None
                continue
            preempted = seq.status is pending  # preempted while this step was in flight
            if sample is not None:
                seq.fill_placeholder(*sample)
                updated.append(seq)
            # Filled first: with the next step in flight, the computed tokens already include the one this step
            # sampled (as that step's input). The one the next step samples is never computed yet, so commit never
            # hashes a placeholder.
            commit(seq)
            if sample is None:
                continue
            if seq.is_finished:
                (self.waiting if preempted else self.running).remove(seq)
                self.block_manager.free_sequence(seq)
            elif preempted:
                seq.status = RequestStatus.PENDING
        return updated
