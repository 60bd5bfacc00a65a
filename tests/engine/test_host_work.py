"""The engine's host-side shortcuts (benchmarks/bench_engine_host.py) give what the plain versions give:
Sequence.tokens is token_ids[start:stop] (token_at its one item), host_tensor is torch.tensor,
ScheduledBatch.sampling is fixed when first asked, and scheduling many running requests keeps preemption order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.sampler import device_tensor, host_tensor
from gpuformers.engine.scheduler import Scheduler
from gpuformers.engine.sequence import SamplingParams, Sequence


def test_tokens_slices_like_token_ids_across_prompt_generated_and_placeholders():
    seq = Sequence("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=10))
    seq.append_token(9)
    seq.append_token(10)
    seq.add_placeholder()
    seq.add_placeholder()
    whole = seq.token_ids
    assert whole == [5, 6, 7, 8, 9, 10, -1, -1]
    for start in range(len(whole) + 2):
        for stop in range(start, len(whole) + 3):
            assert seq.tokens(start, stop) == whole[start:stop], (start, stop)
    assert seq.tokens(3, 1) == []
    assert [seq.token_at(position) for position in range(len(whole))] == whole  # a decode's one input token


def test_tokens_returns_a_new_list():
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
    seq.tokens(0, 3).append(99)
    assert seq.prompt_ids == [1, 2, 3]


@pytest.mark.parametrize("values, dtype", [
    ([3, -1, 2**40], torch.long), ([1, 2], torch.int32), ([0.5, 2.0], torch.float32), ([1, 2], torch.float32),
    ([0.25], torch.float64), ([], torch.long), ([True, False], torch.long), ([np.int64(7), 8], torch.long),
    ([[1, 2], [3, 4]], torch.long), ([1.7, -2.7], torch.long), ([1, 2], torch.bool)])
def test_host_tensor_equals_torch_tensor(values, dtype):
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_host_tensor_keeps_its_values_after_the_list_is_gone_and_can_be_written():
    values = list(range(300))
    tensor = host_tensor(values)
    del values
    tensor[0] = 42  # the model runner writes the async lookahead's tokens into the step's input ids
    assert tensor.tolist() == [42, *range(1, 300)]


def test_host_tensor_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="Overflow"):
        torch.tensor([2**70])
    with pytest.raises(ValueError, match="Overflow"):
        host_tensor([2**70])


def test_device_tensor_on_cpu_is_a_host_tensor():
    assert torch.equal(device_tensor([1, 2, 3], torch.device("cpu")), torch.tensor([1, 2, 3]))


def test_sampling_is_worked_out_once_before_the_counts_move():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=4))
    other = Sequence("s", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=4))
    scheduler = Scheduler(BlockManager(8, 4), max_batch_tokens=8, max_requests_per_batch=4)
    scheduler.add(seq)
    scheduler.add(other)
    batch = scheduler.schedule()  # all 4 of r (samples) and 4 of s's 6 (a partial chunk)
    assert batch.num_tokens == [4, 4]
    assert batch.sampling() == [True, False]
    scheduler.advance(batch)  # the counts move on; the answers stay those of the step
    assert batch.sampling() == [True, False] and batch.samples(0) and not batch.samples(1)


def test_many_running_requests_preempt_newest_first():
    # 40 requests of one block each; then every one needs a second block and only 10 are free
    manager = BlockManager(50, 4)
    scheduler = Scheduler(manager, max_batch_tokens=1000, max_requests_per_batch=64)
    seqs = [Sequence(f"r{i}", [i] * 4, SamplingParams(max_new_tokens=8)) for i in range(40)]
    for s in seqs:
        scheduler.add(s)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [(1, None)] * len(batch))  # 5 tokens each, 4 computed: the first block is full
    batch = scheduler.schedule()
    # The 10 oldest get the free blocks; for each further one the newest running request is preempted (its block
    # frees one), so of the 30 left the older half run and the newer half wait.
    assert [s.request_id for s in batch.sequences] == [f"r{i}" for i in range(25)]
    assert scheduler.preempted_ids == [f"r{i}" for i in range(39, 24, -1)]
    assert [s.request_id for s in scheduler.waiting] == [f"r{i}" for i in range(25, 40)]
