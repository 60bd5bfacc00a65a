"""Scheduler and block manager against a mock model runner (no tensors): token budget, chunked prefill, block
accounting, prefix hits, preemption order, policies, and a request longer than the whole cache."""

from __future__ import annotations

import pytest

from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.scheduler import Scheduler
from gpuformers.engine.sequence import RequestStatus, SamplingParams, Sequence


class MockRunner:
    """Samples a token that depends only on the sequence's tokens so far, like a greedy model would."""

    def __init__(self):
        self.batches = []

    def run(self, batch):
        self.batches.append(list(zip([s.request_id for s in batch.sequences], batch.num_tokens)))
        return [((sum(seq.token_ids) * 31 + seq.num_tokens) % 97, None) if batch.samples(i) else None
                for i, seq in enumerate(batch.sequences)]


def make(num_blocks=64, block_size=4, max_batch_tokens=64, max_requests=16, policy="fifo", sharing=True):
    manager = BlockManager(num_blocks, block_size, allow_block_sharing=sharing)
    return Scheduler(manager, max_batch_tokens, max_requests, policy), MockRunner()


def seq(name, prompt, max_new_tokens=5):
    return Sequence(name, list(prompt), SamplingParams(max_new_tokens=max_new_tokens))


def drive(scheduler, runner, max_steps=1000):
    """The engine loop without a model; checks the budget and block invariants at every step."""
    done = []
    for _ in range(max_steps):
        if not scheduler.has_work:
            return done
        batch = scheduler.schedule()
        assert batch.total_tokens <= scheduler.max_batch_tokens
        assert len(batch) <= scheduler.max_requests_per_batch
        for s, n in zip(batch.sequences, batch.num_tokens):
            assert len(s.block_table) * scheduler.block_manager.block_size >= s.num_computed_tokens + n
        done += scheduler.postprocess(batch, runner.run(batch))
    raise AssertionError("the scheduler did not finish")


def assert_all_free(manager: BlockManager):
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_admission_respects_token_budget_and_chunks_prefill():
    scheduler, runner = make(max_batch_tokens=16)
    for i in range(4):
        scheduler.add(seq(f"r{i}", range(10 * i, 10 * i + 10)))
    batch = scheduler.schedule()
    # r0's whole prompt (10) and the first 6 tokens of r1: r2 and r3 wait.
    assert [s.request_id for s in batch.sequences] == ["r0", "r1"]
    assert batch.num_tokens == [10, 6]
    assert batch.samples(0) and not batch.samples(1)  # a partial prefill chunk samples nothing
    scheduler.postprocess(batch, runner.run(batch))
    assert [s.request_id for s in scheduler.waiting] == ["r2", "r3"]
    done = drive(scheduler, runner)
    assert sorted(s.request_id for s in done) == ["r0", "r1", "r2", "r3"]
    assert all(len(s.generated_ids) == 5 and s.status is RequestStatus.FINISHED for s in done)
    assert_all_free(scheduler.block_manager)


def test_max_requests_per_batch_caps_running():
    scheduler, runner = make(max_requests=2)
    for i in range(5):
        scheduler.add(seq(f"r{i}", [i + 1] * 3))
    batch = scheduler.schedule()
    assert len(batch) == 2 and len(scheduler.running) == 2
    scheduler.postprocess(batch, runner.run(batch))
    assert len(drive(scheduler, runner)) == 5


def test_blocks_all_free_after_cancel():
    scheduler, runner = make()
    for i in range(3):
        scheduler.add(seq(f"r{i}", range(i, i + 9), max_new_tokens=20))
    batch = scheduler.schedule()
    scheduler.postprocess(batch, runner.run(batch))
    assert scheduler.block_manager.num_free_blocks < 64
    cancelled = scheduler.cancel("r1")
    assert cancelled.status is RequestStatus.FAILED and cancelled.error == "cancelled"
    assert scheduler.cancel("nope") is None
    assert len(drive(scheduler, runner)) == 2
    assert_all_free(scheduler.block_manager)


def test_prefix_hits_counted_and_outputs_unchanged():
    prompt = list(range(1, 21))  # 20 tokens = 5 blocks of 4
    scheduler, runner = make()
    scheduler.add(seq("first", prompt))
    (first,) = drive(scheduler, runner)
    scheduler.add(seq("same", prompt))
    scheduler.add(seq("half", prompt[:8] + [99] * 8))
    done = {s.request_id: s for s in drive(scheduler, runner)}
    # "same" reuses 4 blocks (the 5th holds the last prompt token, which must be computed for its logits);
    # "half" reuses 2.
    assert done["same"].num_cached_tokens == 16 and done["half"].num_cached_tokens == 8
    assert scheduler.block_manager.prefix_hits == 6
    assert done["same"].generated_ids == first.generated_ids
    assert_all_free(scheduler.block_manager)

    scheduler, runner = make(sharing=False)
    scheduler.add(seq("first", prompt))
    drive(scheduler, runner)
    scheduler.add(seq("same", prompt))
    (same,) = drive(scheduler, runner)
    assert same.num_cached_tokens == 0 and scheduler.block_manager.prefix_hits == 0


def test_preemption_takes_newest_first_and_outputs_unchanged():
    prompts = {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    reference_scheduler, runner = make()
    for name, prompt in prompts.items():
        reference_scheduler.add(seq(name, prompt, max_new_tokens=9))
    reference = {s.request_id: s.generated_ids for s in drive(reference_scheduler, runner)}

    # 6 blocks of 2 = 12 slots; each request needs 10 alone, so all three cannot grow together.
    scheduler, runner = make(num_blocks=6, block_size=2)
    for name, prompt in prompts.items():
        scheduler.add(seq(name, prompt, max_new_tokens=9))
    done = {s.request_id: s.generated_ids for s in drive(scheduler, runner)}
    assert scheduler.num_preemptions > 0
    assert scheduler.preempted_ids[0] == "c"  # the newest goes first
    assert "a" not in scheduler.preempted_ids  # the oldest always makes progress
    assert done == reference  # recomputation gives the same tokens
    assert_all_free(scheduler.block_manager)


def test_request_longer_than_cache_fails_alone():
    scheduler, runner = make(num_blocks=4, block_size=4)  # 16 slots
    assert scheduler.add(seq("ok1", [1, 2, 3]))
    too_long = seq("long", list(range(15)), max_new_tokens=5)
    assert not scheduler.add(too_long)
    assert too_long.status is RequestStatus.FAILED
    assert "needs 19 cached tokens" in too_long.error and "holds 16" in too_long.error
    assert scheduler.add(seq("ok2", [4, 5, 6]))
    done = drive(scheduler, runner)
    assert sorted(s.request_id for s in done) == ["ok1", "ok2"]
    assert all(s.status is RequestStatus.FINISHED for s in done)
    assert_all_free(scheduler.block_manager)


@pytest.mark.parametrize("policy, expected", [("fifo", [("old", 1), ("new", 3)]), ("prefill_first", [("new", 4)])])
def test_policies(policy, expected):
    scheduler, runner = make(max_batch_tokens=4, policy=policy)
    scheduler.add(seq("old", [1, 2, 3], max_new_tokens=10))
    batch = scheduler.schedule()
    scheduler.postprocess(batch, runner.run(batch))  # "old" is decoding now
    scheduler.add(seq("new", list(range(10, 20))))
    batch = scheduler.schedule()
    assert list(zip([s.request_id for s in batch.sequences], batch.num_tokens)) == expected


def test_stop_sequences_and_eos():
    scheduler, runner = make()
    first = seq("probe", [7, 8, 9], max_new_tokens=6)
    scheduler.add(first)
    tokens = drive(scheduler, runner)[0].generated_ids
    stop_at = Sequence("stop", [7, 8, 9], SamplingParams(max_new_tokens=6, stop=[tokens[1:3]]))
    eos_at = Sequence("eos", [7, 8, 9], SamplingParams(max_new_tokens=6, eos_token_ids=(tokens[0],)))
    ignore = Sequence("ignore", [7, 8, 9], SamplingParams(max_new_tokens=6, eos_token_ids=(tokens[0],),
                                                          ignore_eos=True))
    for s in (stop_at, eos_at, ignore):
        scheduler.add(s)
    drive(scheduler, runner)
    assert stop_at.generated_ids == tokens[:3]
    assert eos_at.generated_ids == tokens[:1]
    assert ignore.generated_ids == tokens


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="block_size=24 must be a power of two"):
        BlockManager(8, 24)
    with pytest.raises(ValueError, match="scheduler_type 'lifo'"):
        Scheduler(BlockManager(8, 4), 16, 4, "lifo")
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("x", [], SamplingParams())


def test_sequences_get_consecutive_blocks_to_grow_into():
    """Concurrent requests decoding side by side each keep consecutive blocks (the CPU attends them in place)."""
    scheduler, runner = make(num_blocks=64, block_size=4, max_batch_tokens=64)
    for i in range(4):
        scheduler.add(seq(f"r{i}", range(10 * i, 10 * i + 6), max_new_tokens=12))  # 6 + 12 - 1 tokens: 5 blocks
    tables = {}
    while scheduler.has_work:
        batch = scheduler.schedule()
        for s in batch.sequences:
            tables[s.request_id] = list(s.block_table)
        scheduler.postprocess(batch, runner.run(batch))
    assert sorted(tables) == ["r0", "r1", "r2", "r3"]
    for table in tables.values():
        assert len(table) == 5
        assert table == list(range(table[0], table[0] + 5))
    assert_all_free(scheduler.block_manager)


def test_placement_off_takes_the_oldest_freed_blocks():
    """Without contiguous placement (the GPU), blocks come oldest-freed first: cached prefixes are kept longest."""
    manager = BlockManager(8, 4, allow_block_sharing=False, place_contiguously=False)
    first, second = seq("a", range(8)), seq("b", range(8))
    manager.allocate(first, 8)
    manager.allocate(second, 8)
    assert first.block_table == [0, 1] and second.block_table == [2, 3]
    manager.free_sequence(first)  # freed tail first: 1, then 0
    third = seq("c", range(24), max_new_tokens=1)
    manager.allocate(third, 24)
    assert third.block_table == [4, 5, 6, 7, 1, 0]


def test_full_cache_still_allocates_scattered_blocks():
    """Contiguity is a preference: with no free run left, any free block is used."""
    manager = BlockManager(8, 4, allow_block_sharing=False)
    holders = [seq(f"h{i}", range(4)) for i in range(8)]
    for h in holders:
        manager.allocate(h, 4)  # one block each: the whole cache
    assert sorted(h.block_table[0] for h in holders) == list(range(8))
    for h in holders:
        if h.block_table[0] % 2 == 0:
            manager.free_sequence(h)  # free blocks 0, 2, 4, 6: no two consecutive
    s = seq("s", range(12), max_new_tokens=1)
    manager.allocate(s, 12)
    assert sorted(s.block_table) == [0, 2, 4]
    manager.allocate(s, 16)
    assert sorted(s.block_table) == [0, 2, 4, 6] and manager.num_free_blocks == 0
